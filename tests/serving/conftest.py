"""Fixtures of the serving tests: the tiny checkpoint, one server for most tests (with an API key), an offline
LLM with the same settings as the reference, and an ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanovllm_testing import write_tiny_checkpoint  # noqa: E402
from serving_helpers import API_KEY, ENGINE, MODEL, ServerThread, start_server  # noqa: E402

from nanovllm_core import LLM, SamplingParams  # noqa: E402
from nanovllm_core.serving.api_server import ServerSettings  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serve-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def server(tiny_path) -> Iterator[ServerThread]:
    thread = start_server(tiny_path, ServerSettings(served_model_name=MODEL, api_key=API_KEY))
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def offline(tiny_path) -> LLM:
    return LLM(str(tiny_path), **ENGINE)


@pytest.fixture(scope="session")
def greedy(offline):
    """Memoised offline greedy completions: greedy(prompt, max_tokens) -> (text, token_ids)."""
    cache: dict = {}

    def get(prompt: str | list[int], max_tokens: int) -> tuple[str, list[int]]:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in cache:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            out = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            cache[key] = (out.text, list(out.token_ids))
        return cache[key]

    return get


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

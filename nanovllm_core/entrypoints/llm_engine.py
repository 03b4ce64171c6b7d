"""LLMEngine: vLLM's synchronous front-end, ``add_request`` then ``step`` until no request is unfinished."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.config_resolver import create_engine_config
from nanovllm_core.engine.core import EngineStats, Prompt
from nanovllm_core.engine_client.base import EngineClient
from nanovllm_core.engine_client.factory import make_engine_client
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.sampling_params import SamplingParams


class LLMEngine:
    """vLLM's ``LLMEngine``: ``add_request(request_id, prompt, params)``, then :meth:`step` returns the user's
    outputs (text, stop strings, logprob dicts) until :meth:`has_unfinished_requests` is false.

    The config is finished here, once (:func:`create_engine_config`); :func:`make_engine_client` then picks how the
    engines run (one engine core in this process, driven one step per :meth:`step`; with ``data_parallel_size`` > 1,
    replicas in processes of their own), and they all run that finished config. The client's pull path makes the
    text with the front-end's one ``OutputProcessor``; the engine cores make token ids only. What lives inside the
    engine core of this process (``runner``, ``scheduler``, ``block_manager``, ``step_stats``, ...) is reached as
    ``engine.<name>``. A context manager: ``with LLMEngine(...) as engine:`` shuts it down on exit.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        *,
        cli_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        client = make_engine_client(create_engine_config(model, config, cli_overrides=cli_overrides, **kwargs))
        self.engine_client: EngineClient = client
        self._finalizer = weakref.finalize(self, client.shutdown)
        try:
            self.config: EngineConfig = client.config
            self.tokenizer = client.tokenizer
            self.hf_config = client.hf_config
            self.eos_token_ids: set[int] = set(client.eos_token_ids)
        except BaseException:
            self._finalizer()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """vLLM's constructor: the engine of an :class:`EngineConfig` (vLLM's ``EngineArgs``), finished here unless it
        is already."""
        return cls(config=engine_args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "engine_client" not in self.__dict__:
            raise AttributeError(name)
        client = self.__dict__["engine_client"]
        for owner in (getattr(client, "engine", None), client):
            if owner is not None and hasattr(owner, name):
                return getattr(owner, name)
        if hasattr(client, "engine"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        raise AttributeError(
            f"{name!r} is not available with data_parallel_size > 1: the engines run in {type(client).__name__}'s "
            "replica processes"
        )

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int | None = None
    ) -> str:
        """Queue one request (vLLM's argument order); an invalid one raises InvalidRequestError and queues nothing.
        ``priority`` sets ``params.priority`` for this request."""
        return self.engine_client.add_request(prompt, params, request_id, priority)

    def step(self) -> list[RequestOutput]:
        """The outputs of one engine step (engines in other processes: those that arrived, waiting for one while
        requests are unfinished)."""
        return self.engine_client.step()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests wherever they are; :meth:`step` returns none of their outputs."""
        self.engine_client.abort_requests([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.engine_client.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_client.num_unfinished_requests

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats(self) -> EngineStats:
        """The engine's stats (data parallel: every replica's combined)."""
        return self.engine_client.stats()

    def shutdown(self) -> None:
        """Stop the engines and their processes (also done on garbage collection and at exit)."""
        self._finalizer()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

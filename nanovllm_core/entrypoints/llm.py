"""LLM: the offline batch API (vLLM's ``LLM.generate``)."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanovllm_core.engine.core import Prompt, tokenize_prompt
from nanovllm_core.engine_client.base import EngineClient
from nanovllm_core.entrypoints.chat import render_chat
from nanovllm_core.entrypoints.llm_engine import LLMEngine
from nanovllm_core.errors import InvalidRequestError
from nanovllm_core.generation_config import sampling_defaults
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.sampling_params import SamplingParams, with_priority

logger = logging.getLogger(__name__)


class LLM:
    """``LLM(model, config="nanovllm.toml", **overrides).generate(prompts, sampling_params)``.

    Built on an :class:`LLMEngine` (``llm.llm_engine``, vLLM's design), which resolves the config once and holds the
    engine client :func:`make_engine_client` picks: one engine in this process, or with ``data_parallel_size`` > 1
    (keyword, config file or command line) that many replicas in processes of their own, behind the same API
    (``replica_stats()`` and ``replica_processes`` are theirs). What lives inside the one engine of this process
    (``runner``, ``scheduler``, ``block_manager``, ...) is reached as ``llm.<name>``. A context manager:
    ``with LLM(...) as llm:`` shuts it down on exit.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        *,
        cli_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        engine = self.llm_engine = LLMEngine(model, config, cli_overrides=cli_overrides, **kwargs)
        self.engine_client: EngineClient = engine.engine_client
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        self.hf_config = engine.hf_config
        self.eos_token_ids: set[int] = engine.eos_token_ids
        self.max_model_len: int = self.config.max_model_len  # type: ignore[assignment]
        self._lock = threading.RLock()  # one generate at a time
        self._generate_calls = itertools.count()
        self._sampling_defaults: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:  # step, has_unfinished_requests, stats, get_tokenizer, the engine's
        if name.startswith("__") or "llm_engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["llm_engine"], name)

    # --- requests, with the arguments in LLM's order ----------------------------------------------------

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        priority: int | None = None,
    ) -> str:
        """Queue one request and return its id; drive it with :meth:`step` (an invalid one raises
        InvalidRequestError and queues nothing)."""
        return self.engine_client.add_request(prompt, sampling_params, request_id, priority)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.engine_client.abort_request(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine_client.num_unfinished_requests

    def shutdown(self) -> None:
        """Stop the engines and their processes (also done on garbage collection and at exit)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- generation -------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``priority`` (vLLM's argument): one integer per prompt, lower first under a priority policy; it sets
        each request's ``SamplingParams.priority``.

        A prompt that cannot be served (empty, too long, not tokenizable, token ids outside the vocabulary)
        gets an output with ``error`` set and ``finish_reason="error"``; the other prompts still complete. After
        any exception (Ctrl-C included) nothing of this call stays queued. Calls from several threads run one
        after the other (the engine serves one caller at a time).
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SequenceABC) and len(sampling_params) == len(prompts):
            params_list = list(sampling_params)
        else:
            raise InvalidRequestError(
                f"sampling_params must be one SamplingParams or a list with one per prompt ({len(prompts)} prompts)"
            )
        if priority is not None:
            if not isinstance(priority, SequenceABC) or isinstance(priority, str) or len(priority) != len(prompts):
                raise InvalidRequestError(
                    f"priority must be a list with one integer per prompt ({len(prompts)} prompts), got {priority!r}"
                )
            params_list = [with_priority(params, p) for params, p in zip(params_list, priority)]
        with self._lock:
            if self.num_unfinished_requests:
                raise InvalidRequestError(
                    f"{self.num_unfinished_requests} requests added with add_request() are still unfinished; "
                    "drive them with step() (or abort them) before calling generate()"
                )
            return self._generate(prompts, params_list, use_tqdm)

    def _generate(
        self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """All prompts go to the client at once (a data-parallel one places them together); only final outputs
        come back. The call's own request-id prefix keeps a late output of an earlier call from matching."""
        client = self.engine_client
        prefix = f"generate-{next(self._generate_calls)}-"
        results: list[RequestOutput | None] = [None] * len(prompts)
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            if isinstance(params, SamplingParams) and params.output_kind != "final":
                params = replace(params, output_kind="final")
            requests.append((prompt, params, f"{prefix}{i}"))
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        produced, start = 0, time.perf_counter()
        try:
            for i, (_, error) in enumerate(client.add_requests(requests)):
                if error is not None:
                    logger.warning("prompt %d rejected: %s", i, error)
                    results[i] = _error_output(f"generate-{i}", prompts[i], str(error))
                    bar.update(1)
            while client.has_unfinished_requests():
                for out in client.step():
                    if not out.finished or not out.request_id.startswith(prefix):
                        continue
                    i = int(out.request_id[len(prefix) :])
                    out.request_id = f"generate-{i}"
                    results[i] = out
                    produced += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                if use_tqdm:
                    bar.set_postfix_str(self._progress_text(produced, time.perf_counter() - start), refresh=False)
        except BaseException:
            unfinished = [f"{prefix}{i}" for i, r in enumerate(results) if r is None]
            try:  # leave the engines clean for the next call
                client.abort_requests(unfinished)
            except Exception:  # noqa: BLE001 - the original exception is what the caller must see
                logger.warning("aborting the rest of a generate call failed", exc_info=True)
            raise
        finally:
            bar.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _progress_text(self, produced: int, elapsed: float) -> str:
        engine = getattr(self.engine_client, "engine", None)
        if engine is None:  # the replicas' stats are a round trip away: the output rate only
            return f"output {produced / elapsed if elapsed else 0.0:,.0f} tok/s"
        stats = engine.stats()
        text = engine.step_stats.rates_text()
        if stats.prefix_cache_queries:
            text += f", prefix hits {100 * stats.prefix_cache_hit_rate:.0f}%"
        if stats.num_preemptions:
            text += f", {stats.num_preemptions} preemptions"
        return text

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` beams of each prompt (``beam_search``), one
        ``generate`` call a step; turn on ``enable_prefix_caching`` so that the beams' shared prefixes are not
        computed again each step."""
        token_prompts = [tokenize_prompt(self.tokenizer, p)[1] for p in _as_prompt_list(prompts)]
        generate = functools.partial(self.generate, use_tqdm=False)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return beam_search(generate, token_prompts, params, frozenset(self.eos_token_ids), decode)

    def embed(self, prompts: Prompt | list[Prompt], use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM's ``LLM.embed``: one output per prompt whose ``embedding`` is the prompt's last token's final hidden
        state, L2-normalised (last-token pooling: Qwen3-Embedding's; end the prompt as the model card says, for
        Qwen3-Embedding with its ``<|endoftext|>`` token). A rejected prompt's output has ``error`` set and no
        embedding."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, embed=True)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without sampling params (vLLM's): SamplingParams' defaults with those
        of the checkpoint's generation_config.json over them (``generation_config``), read once."""
        if self._sampling_defaults is None:
            self._sampling_defaults = sampling_defaults(self.config)
        return SamplingParams(**self._sampling_defaults)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (``[{"role": ..., "content": ...}, ...]``) or a list of them, through the
        tokenizer's chat template (or ``chat_template``), as vLLM's ``LLM.chat``; one output per conversation.
        ``continue_final_message`` (with ``add_generation_prompt=False``): the prompt ends inside the last message,
        so the reply continues it. ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts) go to the
        template, which describes them to the model; a tool parser reads the calls in a reply
        (``nanovllm_core.parsing.tool_calls.HermesToolParser().parse(text)``).

        Raises InvalidRequestError when the tokenizer has no chat template and none is given.
        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list: one conversation, or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        kwargs = chat_template_kwargs or {}
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("continue_final_message=True needs add_generation_prompt=False")
            kwargs = {**kwargs, "continue_final_message": True}
        if tools:
            kwargs = {**kwargs, "tools": tools}
        prompts = [
            render_chat(self.tokenizer, c, add_generation_prompt, chat_template, **kwargs) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a flat list of numbers: token ids, or a prompt dict) or a list of prompts, as a list
    of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"prompts must be a string, a list of token ids or a list of prompts, not {type(prompts).__name__}"
        )
    if prompts and not any(isinstance(p, (str, list, tuple, dict)) for p in prompts):
        return [list(prompts)]  # token ids; a non-integer among them is reported for this prompt
    return list(prompts)


def _error_output(request_id: str, prompt: Any, error: str) -> RequestOutput:
    token_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=token_ids,
        outputs=[CompletionOutput(0, "", [], "error")],
        finished=True,
        error=error,
    )

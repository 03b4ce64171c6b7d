"""LLMEngine: requests in, one scheduling step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.model_runner import ModelRunner, PendingStep, model_shape
from nanovllm_core.engine.options import instantiate
from nanovllm_core.engine.parallel import (
    RunnerSpec,
    TensorParallelGroup,
    launched_by_torchrun,
    local_device,
    worker_main,
)
from nanovllm_core.errors import ConfigError, InvalidRequestError, ModelLoadError
from nanovllm_core.interfaces import AttentionBackend, BlockManager, Scheduler, SchedulerOutput
from nanovllm_core.loader import load_hf_config
from nanovllm_core.outputs import CompletionOutput, RequestOutput
from nanovllm_core.plugins import PluginRegistry, get_registry
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class StepStats:
    """Token counts and time of the last step, for progress bars and benchmarks."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0
    totals: dict[str, float] = field(
        default_factory=lambda: {"prefill_tokens": 0, "decode_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
    )

    def rates_text(self) -> str:
        """``prefill N tok/s, decode M tok/s`` over everything run so far (what the progress bar shows)."""
        t = self.totals
        prefill = t["prefill_tokens"] / t["prefill_s"] if t["prefill_s"] else 0.0
        decode = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        return f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; allowed here: 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = getattr(torch, checkpoint, None)
    return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


def select_attention_backend(
    registry: PluginRegistry, name: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int
) -> type[AttentionBackend]:
    def problem(cls: type[AttentionBackend]) -> str | None:
        reason = cls.check_available(device, dtype, head_dim)
        if reason is None and cls.supported_block_sizes() is not None and block_size not in cls.supported_block_sizes():
            reason = f"kvcache_block_size {block_size} unsupported (supported: {cls.supported_block_sizes()})"
        return reason

    if name != "auto":
        cls = registry.get("attention", name).obj
        reason = problem(cls)
        if reason is not None:
            raise ConfigError(f"attention backend {name!r} cannot run here: {reason}")
        return cls
    candidates = sorted(registry.registrations["attention"].values(), key=lambda r: -getattr(r.obj, "priority", 0))
    reasons = []
    for reg in candidates:
        reason = problem(reg.obj)
        if reason is None:
            return reg.obj
        reasons.append(f"{reg.name}: {reason}")
    installed = ", ".join(r.name for r in candidates) or "none"
    raise ConfigError(
        f"no attention backend runs on {device} / {dtype} (installed: {installed}); " + "; ".join(reasons)
    )


class LLMEngine:
    """The engine: ``add_request`` then ``step`` until ``has_unfinished_requests()`` is false."""

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | None = None,
        *,
        cli_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        overrides = dict(kwargs)
        if model is not None:
            overrides["model"] = model
        self.config = EngineConfig.load(config, overrides, cli_overrides)
        cfg = self.config
        registry = get_registry()
        scheduler_cls = registry.get("scheduler", cfg.plugins.scheduler).obj
        block_manager_cls = registry.get("block_manager", cfg.plugins.block_manager).obj
        self.hf_config = load_hf_config(cfg.model)
        architectures = getattr(self.hf_config, "architectures", None) or []
        if not architectures:
            raise ModelLoadError(f"{cfg.model}/config.json names no architecture ('architectures' is empty)")
        arch = architectures[0]
        if arch not in registry.registrations["model"]:
            installed = ", ".join(registry.names("model")) or "none"
            raise ModelLoadError(
                f"architecture {arch!r} is not provided by any installed model plugin; installed: {installed}"
            )
        model_cls = registry.get("model", arch).obj
        max_positions = getattr(self.hf_config, "max_position_embeddings", None)
        if cfg.max_model_len is None:
            cfg.max_model_len = max_positions or 4096
        elif max_positions and cfg.max_model_len > max_positions:
            raise ConfigError(
                f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings ({max_positions})"
            )
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.hf_config)
        _, _, _, head_dim = model_shape(self.hf_config)
        backend_cls = select_attention_backend(
            registry, cfg.plugins.attention, self.device, self.dtype, head_dim, cfg.kvcache_block_size
        )
        self.attention_backend_name = backend_cls.name
        self.tokenizer = self._load_tokenizer(cfg.tokenizer or cfg.model)
        self.eos_token_ids = self._eos_token_ids()
        self.tp_group: TensorParallelGroup | None = None
        tp = cfg.tensor_parallel_size
        if tp > 1 or launched_by_torchrun():  # torchrun with one process: a one-rank NCCL/gloo group
            self._start_tensor_parallel(arch, backend_cls.name)
        try:
            self.runner = ModelRunner(cfg, self.hf_config, model_cls, backend_cls, self.device, self.dtype)
        except BaseException:
            self.shutdown()
            raise
        if self.tp_group is not None:
            self.runner.on_step = lambda host: self.tp_group.send("step", host)
        self.block_manager: BlockManager = instantiate(
            "block_manager",
            block_manager_cls,
            cfg.plugins.block_manager_options,
            self.runner.num_kvcache_blocks,
            cfg.kvcache_block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.scheduler: Scheduler = instantiate(
            "scheduler", scheduler_cls, cfg.plugins.scheduler_options, cfg, self.block_manager, self.check_stop
        )
        self._request_counter = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self.stats = StepStats()
        self.async_scheduling = self._use_async_scheduling()
        self._in_flight: PendingStep | None = None

    def _use_async_scheduling(self) -> bool:
        mode = self.config.async_scheduling
        if mode == "off":
            return False
        if self.tp_group is not None:
            # the workers would need the sampled ids from rank 0 on their devices each step
            if mode == "on":
                raise ConfigError("async_scheduling='on' needs tensor_parallel_size=1 (set it to 'auto' or 'off')")
            return False
        return mode == "on" or self.device.type == "cuda"

    # --- set-up helpers -------------------------------------------------------------------------------

    def _start_tensor_parallel(self, arch: str, attention: str) -> None:
        cfg = self.config
        tp = cfg.tensor_parallel_size
        if self.device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}"
            )
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) != tp:
            raise ConfigError(f"tensor_parallel_size={tp} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']}")
        spec = RunnerSpec(cfg.model_dump(), arch, attention, self.device.type, str(self.dtype).split(".")[-1])
        if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            worker_main(int(os.environ["RANK"]), tp, "env://", spec)
            raise SystemExit(0)  # a torchrun worker served until rank 0 shut down
        if self.device.type == "cuda":
            self.device = local_device("cuda", 0)
        self.tp_group = TensorParallelGroup(spec, tp)
        weakref.finalize(self, self.tp_group.close)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is garbage-collected or at exit)."""
        group = getattr(self, "tp_group", None)
        if group is not None:
            group.close()

    @staticmethod
    def _load_tokenizer(path: str) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"could not load a tokenizer from {path!r}: {exc}") from None

    def _eos_token_ids(self) -> set[int]:
        """EOS ids from config.json and generation_config.json (as transformers' generate uses them)."""
        ids: set[int] = set()

        def add(value: Any) -> None:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))

        add(getattr(self.hf_config, "eos_token_id", None))
        gen_file = Path(self.config.model) / "generation_config.json"
        if gen_file.is_file():
            try:
                add(json.loads(gen_file.read_text()).get("eos_token_id"))
            except json.JSONDecodeError:
                logger.warning("%s is not valid JSON; its eos_token_id is ignored", gen_file)
        if not ids and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests -------------------------------------------------------------------------------------

    def make_sequence(self, prompt: Prompt, sampling_params: SamplingParams | None, request_id: str | None) -> Sequence:
        """Validate a request and turn it into a Sequence (raises InvalidRequestError; queues nothing)."""
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, not {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len={max_len} allows at most {max_len - 1} "
                "(one position is needed for the first output token)"
            )
        if request_id is None:
            request_id = str(next(self._request_counter))
        elif request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return Sequence(token_ids, sampling_params, request_id=request_id, prompt=text)

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue one request and return its id. Invalid requests raise InvalidRequestError and queue nothing."""
        seq = self.make_sequence(prompt, sampling_params, request_id)
        self.scheduler.add(seq)
        self._requests[seq.request_id] = seq
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks are freed. Returns its partial output, or None."""
        seq = self.scheduler.abort(request_id)
        known = self._requests.pop(request_id, None)
        if seq is None:  # async scheduling: one that hit its length limit left the scheduler, awaiting its token
            seq = known
        if seq is None:
            return None
        while seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # a token the device is still producing: dropped
            seq.token_ids.pop()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # --- stepping -------------------------------------------------------------------------------------

    def check_stop(self, seq: Sequence) -> str | None:
        """The finish reason after ``seq`` got a new token, or None to go on (handed to the scheduler).

        While the new token is a placeholder (async scheduling) only the length can end the sequence; the
        token's own conditions are checked when it arrives.
        """
        if seq.token_ids[-1] != PLACEHOLDER_TOKEN:
            reason = self._token_stop(seq)
            if reason is not None:
                return reason
        num_tokens = len(seq.token_ids)
        max_tokens = seq.sampling_params.max_tokens
        if num_tokens - seq.num_prompt_tokens >= max_tokens or num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _token_stop(self, seq: Sequence) -> str | None:
        """``"stop"`` when the last token is an EOS, a stop token or completes a stop string, else None."""
        params = seq.sampling_params
        token = seq.token_ids[-1]
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if params.stop_strings:
            # Only the newest tokens can complete a stop string that was not there a step ago, so decode a
            # tail long enough to hold the longest one (every token decodes to at least one character, except
            # pieces of a multi-byte character: hence the margin) instead of the whole completion each step.
            window = max(map(len, params.stop_strings)) + 8
            tail = seq.token_ids[max(seq.num_prompt_tokens, len(seq.token_ids) - window) :]
            text = self.tokenizer.decode(tail, skip_special_tokens=params.skip_special_tokens)
            for stop in params.stop_strings:
                if stop in text:
                    seq.stop_reason = stop
                    return "stop"
        return None

    def _completion_text(self, seq: Sequence) -> str:
        return self.tokenizer.decode(
            seq.completion_token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens
        )

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._completion_text(seq)
        if isinstance(seq.stop_reason, str):
            text = text[: text.find(seq.stop_reason)]
        completion = CompletionOutput(0, text, seq.completion_token_ids, seq.finish_reason, seq.stop_reason)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_prompt_tokens,
        )

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the requests that finished in it.

        With async scheduling the step is launched and the previous step's tokens are read while the device
        runs it, so a request finishes one ``step()`` call after the step that sampled its last token.
        """
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs and self._in_flight is None:
            return []
        num_prefill, num_decode = self._token_counts(batch)
        if not self.async_scheduling:
            finished = self.scheduler.postprocess(batch, self.runner.execute(batch))
        else:
            launched = self.runner.launch(batch, self._in_flight) if batch.seqs else None
            finished = self._receive(self._in_flight) if self._in_flight is not None else []
            self._in_flight = launched
            if launched is not None:
                self._advance_optimistically(launched)
        self._count(num_prefill, num_decode, time.perf_counter() - start)
        outputs = []
        for seq in finished:
            self._requests.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _advance_optimistically(self, launched: PendingStep) -> None:
        """Postprocess a launched step before its tokens are known: each sampling sequence gets a placeholder.

        Sequences that reached their length limit finish here (their blocks are freed: the device works in
        stream order, so nothing reuses them before the step ends) and are returned once their token arrives.
        """
        batch = launched.batch
        placeholders: list[int | None] = [None] * len(batch.seqs)
        for row in launched.sample_rows:
            placeholders[row] = PLACEHOLDER_TOKEN
        if any(seq.is_finished for seq in batch.seqs):  # a stop token of the previous step ended them
            live = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
            batch = SchedulerOutput([batch.seqs[i] for i in live], [batch.num_new_tokens[i] for i in live])
            placeholders = [placeholders[i] for i in live]
        self.scheduler.postprocess(batch, placeholders)

    def _receive(self, pending: PendingStep) -> list[Sequence]:
        """Read a launched step's tokens (waits for it), put them in place of the placeholders, check stops."""
        finished = []
        for seq, token in zip(pending.batch.seqs, pending.tokens()):
            if token is None or self._requests.get(seq.request_id) is not seq:
                continue  # mid-prompt chunk, or aborted by the caller since
            seq.token_ids[-1] = token
            reason = self._token_stop(seq)
            if seq.is_finished:  # ended by its length when it was advanced: this is its last token
                if reason is not None:
                    seq.finish_reason = reason
            elif reason is not None:
                self.scheduler.abort(seq.request_id)  # drops it from the queues and frees its blocks
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
            else:
                continue
            finished.append(seq)
        return finished

    @staticmethod
    def _token_counts(batch: SchedulerOutput) -> tuple[int, int]:
        """(prompt tokens, decode tokens) of a scheduled step."""
        num_decode = sum(
            1
            for n, s in zip(batch.num_new_tokens, batch.seqs)
            if n == 1 and s.num_computed_tokens >= s.num_prompt_tokens
        )
        return batch.total_new_tokens - num_decode, num_decode

    def _count(self, num_prefill: int, num_decode: int, elapsed: float) -> None:
        self.stats.num_prefill_tokens, self.stats.num_decode_tokens, self.stats.seconds = (
            num_prefill,
            num_decode,
            elapsed,
        )
        totals = self.stats.totals
        if num_prefill:
            totals["prefill_tokens"] += num_prefill
            totals["prefill_s"] += elapsed * num_prefill / (num_prefill + num_decode)
        if num_decode:
            totals["decode_tokens"] += num_decode
            totals["decode_s"] += elapsed * num_decode / (num_prefill + num_decode)

"""ModelEngineCore: the engine core of one loaded model (vLLM v1's ``EngineCore`` with its executor): token ids out."""

from __future__ import annotations

import datetime
import gc
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
from nanovllm_core.engine.config_resolver import (
    finish_config,
    resolve_device,
    select_attention_backend,
    select_quantization,
)
from nanovllm_core.engine.core import EngineCore, EngineStats, Prompt
from nanovllm_core.engine.model_runner import ModelRunner
from nanovllm_core.engine.options import instantiate
from nanovllm_core.engine.parallel import (
    RunnerSpec,
    TensorParallelGroup,
    launched_by_torchrun,
    local_device,
    serve_torchrun,
)
from nanovllm_core.engine.structured_output import StructuredOutputManager, select_structured_output_backend
from nanovllm_core.errors import ConfigError, ModelLoadError
from nanovllm_core.generation_config import sampling_defaults
from nanovllm_core.interfaces import BlockManager, Scheduler, SchedulerOutput
from nanovllm_core.loader import load_hf_config
from nanovllm_core.plugins import get_registry, installed_architecture
from nanovllm_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# the resolver's choices stay importable from here, where they lived before it existed
__all__ = [
    "ModelEngineCore",
    "Prompt",
    "StepStats",
    "resolve_device",
    "select_attention_backend",
    "select_quantization",
]


WARMUP_DECODE_PROMPT = 3  # tokens of each warm-up request that is there to decode
WARMUP_MAX_TOKENS = 4


def warmup_prompt_lengths(
    budget: int, max_num_seqs: int, max_model_len: int, num_blocks: int, block_size: int
) -> tuple[list[int], int]:
    """The warm-up's prompts: (lengths of its prompt-sized requests, in the order they are added; how many 3-token
    requests decode beside them).

    First prompts of the longest size a step and the cache allow, and one remainder, that add up to ``budget``: a
    first-come first-served policy admits them as the first step, the largest a step gets. Then one of each
    smaller size (a third of the longest, 300, 33, 5 tokens), and 3-token requests up to ``max_num_seqs``. The
    prompts filling the budget stop early where the cache would have less than a quarter of its blocks free."""

    def blocks(n: int) -> int:
        return -(-(n + WARMUP_MAX_TOKENS) // block_size)

    longest = min(max_model_len - WARMUP_MAX_TOKENS, num_blocks * block_size // 4, budget)
    smaller = sorted({max(1, min(n, longest)) for n in (longest // 3, 300, 33, 5)} - {longest}, reverse=True)
    room = num_blocks - num_blocks // 4 - sum(blocks(n) for n in smaller) - blocks(longest)
    lengths = [longest]
    while sum(lengths) < budget and len(lengths) + len(smaller) < max_num_seqs:
        n = min(longest, budget - sum(lengths))
        if blocks(n) > room:
            break
        lengths.append(n)
        room -= blocks(n)
    lengths += smaller
    return lengths, max(1, min(max_num_seqs - len(lengths), room // blocks(WARMUP_DECODE_PROMPT)))


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

    def count(self, num_prefill: int, num_decode: int, elapsed: float) -> None:
        self.num_prefill_tokens, self.num_decode_tokens, self.seconds = num_prefill, num_decode, elapsed
        totals = self.totals
        if num_prefill:
            totals["prefill_tokens"] += num_prefill
            totals["prefill_s"] += elapsed * num_prefill / (num_prefill + num_decode)
        if num_decode:
            totals["decode_tokens"] += num_decode
            totals["decode_s"] += elapsed * num_decode / (num_prefill + num_decode)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load a tokenizer from {path!r}: {exc}") from None


def read_eos_token_ids(hf_config: Any, model: str, tokenizer: Any) -> set[int]:
    """EOS ids from config.json and generation_config.json (as transformers' generate uses them)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen_file = Path(model) / "generation_config.json"
    if gen_file.is_file():
        try:
            add(json.loads(gen_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            logger.warning("%s is not valid JSON; its eos_token_id is ignored", gen_file)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class ModelEngineCore(EngineCore):
    """The engine core of one model: ``add_request`` then ``step`` until ``has_unfinished_requests()`` is false.

    Takes a finished config (:func:`create_engine_config`'s: every entry point makes one) and loads the plugins, the
    tokenizer (to encode prompts) and the model, and runs :class:`EngineCore`'s
    request table and steps on a :class:`ModelRunner` (vLLM v1's ``EngineCore`` with its executor). Its outputs carry
    token ids only: the front-ends (``LLMEngine``, ``LLM``, ``AsyncLLM``) make the text. A context manager:
    ``with ModelEngineCore(...) as core:`` shuts it down on exit.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        if config.data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size={config.data_parallel_size}: a ModelEngineCore is one replica; use LLM(...) or "
                "LLMEngine(...) (offline), AsyncLLM.from_config(...) or nanovllm serve (online), which start them"
            )
        # an entry point's config (create_engine_config) comes back as it is; a Ray replica finishes it on its node
        cfg = self.config = finish_config(config)
        registry = get_registry()
        scheduler_cls = registry.get("scheduler", cfg.plugins.scheduler).obj
        block_manager_cls = registry.get("block_manager", cfg.plugins.block_manager).obj
        self.hf_config = load_hf_config(cfg.model)
        arch = installed_architecture(registry, cfg.model, getattr(self.hf_config, "architectures", None))
        model_cls = registry.get("model", arch).obj
        self.device = torch.device(cfg.device)
        self.dtype: torch.dtype = getattr(torch, cfg.dtype)
        backend_cls = registry.get("attention", cfg.plugins.attention).obj
        self.attention_backend_name = backend_cls.name
        structured_cls = select_structured_output_backend(registry, cfg.plugins.structured_output_backend)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.eos_token_ids = read_eos_token_ids(self.hf_config, cfg.model, self.tokenizer)
        defaults = sampling_defaults(cfg)  # a generation_config folder without the file fails here, early
        if defaults:
            logger.info(
                "requests that leave them out sample with %s from the checkpoint's generation_config.json "
                "(generation_config='vllm' turns this off)",
                ", ".join(f"{k}={v}" for k, v in defaults.items()),
            )
        self.step_stats = StepStats()
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
            self.runner.on_step = self.tp_group.send_step  # the group's method: no cycle through the engine
        self.block_manager: BlockManager = instantiate(
            "block_manager",
            block_manager_cls,
            cfg.plugins.block_manager_options,
            self.runner.num_kvcache_blocks,
            cfg.kvcache_block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        scheduler: Scheduler = instantiate(
            "scheduler", scheduler_cls, cfg.plugins.scheduler_options, cfg, self.block_manager
        )
        structured_output = StructuredOutputManager.build(
            structured_cls, cfg.plugins.structured_output_options, self.tokenizer, self.hf_config.vocab_size,
            frozenset(self.eos_token_ids),
        )  # fmt: skip
        super().__init__(
            cfg,
            scheduler,
            _StepTimer(self.runner, self.step_stats, self.tp_group),
            scheduler_name=cfg.plugins.scheduler,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.hf_config.vocab_size,
            async_scheduling=self._use_async_scheduling(),
            structured_output=structured_output,
        )
        warmup_s = self._warm_up()
        if cfg.step_records_file is not None and self.device.type == "cuda":
            self.runner.reset_step_tracking()  # the warm-up's steps are not the workload's
            self.runner.track_gpu_time = True
        # Start-up leaves many objects that survived into the oldest generation without a full collection ever
        # running; the first one would then come due during the first generate (a pause that grows with the
        # heap). Run it now, as part of start-up.
        collect_start = time.perf_counter()
        gc.collect()
        collect_s = time.perf_counter() - collect_start
        runner = self.runner
        graphs = ""
        if runner.graphs is not None:
            graphs = f", {len(runner.graphs.sizes)} CUDA graphs of decode steps"
            if runner.mixed_graphs is not None:
                graphs += f" and {len(runner.mixed_graphs.sizes)} of steps with prompt tokens"
            graphs += f" ({runner.graph_capture_s:.1f} s)"
        warmup = (
            f"a {warmup_s:.1f} s warm-up that compiled the kernels for prompt chunks, decode steps and sampling and "
            "ran a step of max_num_batched_tokens (the first generate allocates no larger activations)"
            if warmup_s
            else f"no warm-up (warmup={self.config.warmup!r})"
        )
        logger.info(
            "start-up took %.1f s: weights, KV cache%s, %s, and a %.2f s garbage collection",
            time.perf_counter() - started,
            graphs,
            warmup,
            collect_s,
        )

    def _warm_up(self) -> float:
        """Throw-away requests through every path a real step takes (prompt chunks of several sizes next to decode
        tokens, greedy and temperature sampling, async placeholders), so that Triton kernels and torch.compile
        shapes are compiled before the first real request; the engine's counters are reset afterwards.

        The requests admitted first fill a whole step's token budget (``max_num_batched_tokens``), as the first
        ``generate`` of a large batch does: the step's activations then reach their largest size here, and the
        allocators' growth for them (device segments, pinned host blocks) is part of start-up, not of that
        ``generate``."""
        mode = self.config.warmup
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return 0.0
        start = time.perf_counter()
        lengths, num_decode = warmup_prompt_lengths(
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.config.max_model_len,
            self.block_manager.num_blocks,
            self.block_manager.block_size,
        )
        vocab = self.hf_config.vocab_size
        for i, n in enumerate(lengths + [WARMUP_DECODE_PROMPT] * num_decode):
            temperature = 0.6 if i % 2 else 0.0
            params = SamplingParams(temperature=temperature, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True, seed=i)
            self.add_request([(7 * i + j) % vocab for j in range(n)], params, request_id=f"warmup-{i}")
        while self.has_unfinished_requests():
            self.step()
        self._totals = dict.fromkeys(self._totals, 0)
        self.scheduler.num_preemptions = 0
        self.step_stats.totals.update(prefill_tokens=0, decode_tokens=0, prefill_s=0.0, decode_s=0.0)
        return time.perf_counter() - start

    def _use_async_scheduling(self) -> bool:
        mode = self.config.async_scheduling
        # under tensor parallelism too: the workers get the in-flight step's sampled tokens from rank 0 with one
        # device-side broadcast in the step that needs them (model_runner.to_model_inputs)
        return mode == "on" or (mode == "auto" and self.device.type == "cuda")

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
        spec = RunnerSpec(cfg, arch, attention, self.device.type, str(self.dtype).split(".")[-1])
        if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            serve_torchrun(int(os.environ["RANK"]), tp, spec)
            raise SystemExit(0)  # a torchrun worker served until rank 0 shut down
        if self.device.type == "cuda":
            self.device = local_device("cuda", 0)
        self.tp_group = TensorParallelGroup(spec, tp)
        weakref.finalize(self, self.tp_group.close)

    def stats(self) -> EngineStats:
        stats = super().stats()
        runner = self.runner
        stats.num_cuda_graph_steps = sum(g.num_replays for g in (runner.graphs, runner.mixed_graphs) if g is not None)
        return stats

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is garbage-collected or at exit); write the
        step records (``step_records_file``)."""
        self._write_step_records()
        structured_output = getattr(self, "structured_output", None)
        if structured_output is not None:
            structured_output.shutdown()
        group = getattr(self, "tp_group", None)
        if group is not None:
            runner = getattr(self, "runner", None)
            healthy = group.failure is None and all(p.is_alive() for p in group.processes)
            if runner is not None and not group.closed and healthy:  # (a stuck collective would never sync)
                runner.release_cuda_graphs()  # before the NCCL group is left (see there)
            group.close()

    def _write_step_records(self) -> None:
        """The steps timed since start-up, as ``nanovllm bench --json`` writes them (``nanovllm simulate
        --calibrate`` reads either); once, at the first shutdown."""
        runner = getattr(self, "runner", None)
        path = self.config.step_records_file
        if path is None or runner is None or not runner.track_gpu_time:
            return
        runner.track_gpu_time = False
        try:
            result = {
                "model": self.config.model,
                "device": torch.cuda.get_device_name(self.device),
                "attention": self.attention_backend_name,
                "dtype": str(self.dtype),
                "kv_cache_dtype": self.config.kv_cache_dtype,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "num_kvcache_blocks": runner.num_kvcache_blocks,
                "cuda_graph_max_mixed_tokens": self.config.cuda_graph_max_mixed_tokens,
                "date": datetime.date.today().isoformat(),
                "steps": runner.num_steps,
                "step_records": runner.step_records(),
            }
            Path(path).write_text(json.dumps(result) + "\n")
            logger.info("wrote %d step records to %s", len(result["step_records"]), path)
        except Exception:  # noqa: BLE001 - a failed device or an unwritable path: shutdown goes on
            logger.warning("could not write the step records to %s", path, exc_info=True)

    def __enter__(self) -> ModelEngineCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class _StepTimer:
    """Wraps the runner's ``launch`` to count each step's prompt and decode tokens and time (progress bar); under
    tensor parallelism a step cut off by a shutdown from another thread is reported as that."""

    def __init__(self, runner: ModelRunner, stats: StepStats, tp_group: TensorParallelGroup | None = None) -> None:
        self.runner = runner
        self.stats = stats
        self.tp_group = tp_group
        self._last_end = 0.0

    def launch(self, batch: SchedulerOutput, in_flight: Any | None = None, **options: Any) -> Any:
        start = time.perf_counter()
        try:
            launched = self.runner.launch(batch, in_flight, **options)
        except Exception:
            # shut down from another thread mid-step: the step's collectives fail on the group being left
            # (gloo: "Default process group has not been initialized"); say what happened instead
            if self.tp_group is not None and self.tp_group.closed:
                self.tp_group.check()  # raises the "engine was shut down" error
            raise
        end = time.perf_counter()
        # a step's time is the whole cycle since the previous launch (the device and the reads included),
        # unless the engine sat idle in between
        elapsed = end - self._last_end if end - self._last_end < 1.0 else end - start
        self._last_end = end
        num_decode = sum(
            1
            for n, s in zip(batch.num_new_tokens, batch.seqs)
            if n == 1 and s.num_computed_tokens >= s.num_prompt_tokens
        )
        self.stats.count(batch.total_new_tokens - num_decode, num_decode, elapsed)
        return launched

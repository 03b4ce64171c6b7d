"""``flashinfer``: paged attention with FlashInfer's kernels (``flashinfer-python`` 0.7.4).

Decode-only steps run ``BatchDecodeWithPagedKVCacheWrapper``, steps with prompt tokens (prompts, chunks over a
cached prefix, decode tokens beside them) one ``BatchPrefillWithPagedKVCacheWrapper`` over every row; the new
keys and values are stored by ``nanovllm-attention-flash``'s Triton store kernel, which also writes its FP8
cache. Nothing here imports ``flashinfer`` (or ``triton``) at module import time: the plugin loads without them
and ``check_available`` says what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any, Literal

import torch
from nanovllm_attention_flash.fp8_cache import Fp8CacheSupport
from nanovllm_attention_flash.triton_backend import triton_import_error
from pydantic import BaseModel, ConfigDict, Field

from nanovllm_attention_flashinfer.layout import GraphLayout, PagedKVLayout, paged_kv_views, step_layout
from nanovllm_core import AttentionBackend, AttentionBatch, ConfigError

INSTALL_HINT = "pip install 'nanovllm-attention-flashinfer[flashinfer]'"
FLASHINFER_API = (0, 7, 4)  # the version whose wrappers' plan()/run() this module is written against
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def load_flashinfer() -> ModuleType:
    import flashinfer

    return flashinfer


def flashinfer_import_error() -> str | None:
    """``None`` if ``flashinfer`` imports and is recent enough, else why not (one line)."""
    try:
        flashinfer = load_flashinfer()
    except Exception as exc:  # noqa: BLE001 - any import failure makes the backend unavailable
        reason = str(exc).splitlines()[0] if str(exc) else ""
        return f"flashinfer is not importable ({type(exc).__name__}: {reason}); {INSTALL_HINT}"
    version = getattr(flashinfer, "__version__", "0")
    if tuple(int(x) for x in re.findall(r"\d+", version)[:3]) < FLASHINFER_API:
        api = ".".join(map(str, FLASHINFER_API))
        return f"flashinfer {version} is older than the {api} API this backend uses; {INSTALL_HINT}"
    return None


@dataclass
class FlashInferMetadata:
    """What ``forward`` needs beyond the runner's batch.

    ``wrapper``: the FlashInfer wrapper this step runs. An eager step carries its ``layout``; the wrapper is planned
    by the first layer's ``forward``, which knows the cache's type (``kv_fp8``: what it was planned for, ``None``
    before). A decode step replayed from a CUDA graph carries ``graph`` instead: its wrapper was planned once at
    capture, and the first layer of every pass refreshes the layout buffers the wrapper reads (``refreshed_by``:
    the address of that layer's cache).
    """

    batch: AttentionBatch
    wrapper: Any
    decode: bool
    layout: PagedKVLayout | None = None
    graph: GraphLayout | None = None
    kv_fp8: bool | None = None
    refreshed_by: int | None = None


class FlashInferBackend(Fp8CacheSupport, AttentionBackend):
    """Paged attention with FlashInfer's batch prefill and decode wrappers on the core's default cache layout.

    ``kv_cache[0]``/``kv_cache[1]`` are FlashInfer's ``NHD`` pages ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; each step's block tables become FlashInfer's page table (``layout``). Decode runs FlashInfer's
    tensor-core decode (its prefill kernel with one query a row), so the same kernels serve every step.

    FP8 cache (``kv_cache_dtype = "fp8"``, ``nanovllm_attention_flash.fp8_cache``): e4m3 values with one float32
    scale per token and KV head, read through FlashInfer's per-(token, head) scale path (``use_token_head_sf`` at
    ``plan()``, the scales as ``kv_cache_sf`` at ``run()``; ``k_scale``/``v_scale`` stay unset, i.e. 1).

    CUDA graphs (decode): one decode wrapper per captured batch size, built with ``use_cuda_graph=True`` over
    fixed buffers (``GraphLayout``) and planned once at capture with ``disable_split_kv=True``. With the KV split
    off, FlashInfer 0.7.4's plan for a fixed batch of one-token rows does not depend on the lengths (one work item
    a row; its kernel reads each row's length from the buffers), so the captured step stays right when the
    buffers, refreshed inside the graph from the static batch, describe another step. Steps with prompt tokens
    are not captured: FlashInfer plans them on the host from their query lengths.
    """

    name = "flashinfer"
    priority = 10  # below triton (30) and flash_attn (20): not faster than triton (docs/performance.md)
    supports_cuda_graph = True
    fp8_kernels_on_cuda = True

    class Options(BaseModel):
        """``[plugins] attention_options`` understood by this backend (all optional)."""

        model_config = ConfigDict(extra="forbid")

        workspace_mib: int = Field(
            128,
            ge=16,
            le=4096,
            description="FlashInfer's float workspace (split-KV partial results), shared by every wrapper; "
            "128 MiB is FlashInfer's recommendation.",
        )
        prefill_backend: Literal["auto", "fa2", "fa3"] = Field(
            "auto",
            description="FlashInfer's implementation for steps with prompt tokens ('auto': FlashInfer's choice "
            "for the GPU; an FP8 cache always takes 'fa2').",
        )

    @classmethod
    def check_available(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type != "cuda" or torch.version.hip is not None:
            got = "a ROCm build of PyTorch" if device.type == "cuda" else device.type
            return f"needs a CUDA device (got {got}): FlashInfer's kernels run on NVIDIA GPUs only"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {dtype} is not supported (float16, bfloat16)"
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {head_dim} is not supported (supported: {list(SUPPORTED_HEAD_DIMS)})"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"needs compute capability 8.0 or newer, not {major}.{minor}"
        return flashinfer_import_error() or triton_import_error()

    @classmethod
    def supported_block_sizes(cls) -> list[int] | None:
        return [16, 32, 64, 128, 256]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionBackend``'s arguments; it checks the options against ``Options`` into ``self.options``."""
        super().__init__(*args, **kwargs)
        reason = flashinfer_import_error()
        if reason is not None:
            raise ConfigError(f"the flashinfer attention backend cannot start: {reason}")
        self._flashinfer = load_flashinfer()
        self.device = torch.device(self.device)
        # FlashInfer's float workspace must be zero before its first use; every wrapper shares it (one step runs
        # at a time, and the captured decode wrappers, with the KV split off, never use it)
        self._workspace = torch.zeros(self.options.workspace_mib * 2**20, dtype=torch.uint8, device=self.device)
        self._decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend="fa2"
        )
        self._prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=self.options.prefill_backend
        )
        self._planned_for: dict[int, FlashInferMetadata] = {}  # id(eager wrapper) -> the step its plan is for
        self._graph_layouts: list[GraphLayout] = []
        self._graph_wrappers: dict[tuple[int, int], Any] = {}  # (rows, table width) -> planned decode wrapper
        self._kv_fp8 = False  # the cache type warmup() saw: what captured decode steps are planned for
        self._fp8_views: dict[tuple[int, tuple[int, ...]], tuple] = {}

    @cached_property
    def _store(self) -> Any:
        from nanovllm_attention_flash.triton_kernels import store_kv

        return store_kv

    # --- metadata -----------------------------------------------------------------------------------------

    def build_metadata(self, batch: AttentionBatch) -> FlashInferMetadata:
        decode = batch.max_query_len <= 1
        # a CUDA-graph decode bucket: the runner's static batch, whose host lengths stay 0 (a real step's are >= 1)
        if decode and batch.num_seqs and not any(batch.seq_lens_cpu):
            return self._graph_metadata(batch)
        layout = step_layout(batch, pin_memory=self.device.type == "cuda")
        return FlashInferMetadata(batch, self._decode if decode else self._prefill, decode, layout=layout)

    def _graph_metadata(self, batch: AttentionBatch) -> FlashInferMetadata:
        rows, width = batch.block_tables.shape
        layout = next((g for g in self._graph_layouts if g.fits(rows, width)), None)
        if layout is None:  # the runner builds its largest bucket first, which then serves every other
            layout = GraphLayout(rows, width, self.device)
            self._graph_layouts.append(layout)
        wrapper = self._graph_wrappers.get((rows, width))
        if wrapper is None:
            indptr, indices, last = layout.buffers(rows, width)
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last,
                backend="fa2",
            )
            planned = step_layout(batch)  # every row empty: the plan must not depend on lengths, see the class doc
            self._plan_decode(wrapper, planned, self._kv_fp8, disable_split_kv=True)
            self._graph_wrappers[(rows, width)] = wrapper
        return FlashInferMetadata(batch, wrapper, True, graph=layout, kv_fp8=self._kv_fp8)

    def _plan_args(self, kv_fp8: bool) -> dict[str, Any]:
        return dict(
            pos_encoding_mode="NONE",  # the model applies RoPE before attention
            q_data_type=self.dtype,
            kv_data_type=torch.float8_e4m3fn if kv_fp8 else self.dtype,
            sm_scale=self.scale,
            use_token_head_sf=kv_fp8,
        )

    def _paged_args(self, layout: PagedKVLayout) -> tuple[Any, ...]:
        """The positional arguments both wrappers' ``plan()`` take after the prefill's ``qo_indptr``."""
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        return (layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len, *heads)

    def _plan_decode(self, wrapper: Any, layout: PagedKVLayout, kv_fp8: bool, **extra: Any) -> None:
        wrapper.plan(*self._paged_args(layout), **self._plan_args(kv_fp8), **extra)

    def _plan(self, metadata: FlashInferMetadata, kv_fp8: bool) -> None:
        layout = metadata.layout
        assert layout is not None
        if metadata.decode:
            self._plan_decode(metadata.wrapper, layout, kv_fp8)
        else:
            # causal is bottom-right aligned: each row's queries are the last of its context
            metadata.wrapper.plan(layout.qo_indptr, *self._paged_args(layout), causal=True, **self._plan_args(kv_fp8))
        metadata.kv_fp8 = kv_fp8
        self._planned_for[id(metadata.wrapper)] = metadata

    # --- the step ---------------------------------------------------------------------------------------

    def warmup(self, kv_cache: torch.Tensor) -> None:
        """Record the cache's type (captured decode steps are planned for it) and, on CUDA, run a decode and a
        prefill step so that FlashInfer loads or JIT-compiles their kernels now. The steps store nothing (slot -1)
        and read block 0's first rows: the cache is unchanged."""
        self._kv_fp8 = self._cache_views(kv_cache)[2] is not None
        if self.device.type != "cuda":
            return
        with torch.inference_mode():
            for query_len in (1, 2):
                batch = AttentionBatch.build([0, query_len], [query_len], [[0]], [-1] * query_len,
                                             self.block_size, self.device)  # fmt: skip
                q = torch.zeros((query_len, self.num_heads, self.head_dim), dtype=self.dtype, device=self.device)
                kv = torch.zeros((query_len, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
                self.forward(q, kv, kv, kv_cache, self.build_metadata(batch))
        torch.cuda.synchronize(self.device)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any, dict[str, Any]]:
        """``paged_kv_views`` and the store kernel's scale arguments; an FP8 cache's views are made once per layer
        cache (keyed by address and shape, which no other tensor shares while the views keep it alive)."""
        if kv_cache.dtype != torch.uint8:
            return kv_cache[0], kv_cache[1], None, {}
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        views = self._fp8_views.get(key)
        if views is None:
            k_cache, v_cache, sf = paged_kv_views(kv_cache, self.block_size, self.num_kv_heads, self.head_dim)
            assert sf is not None
            store = {"key_scales": sf[0].transpose(1, 2), "value_scales": sf[1].transpose(1, 2)}
            views = self._fp8_views[key] = (k_cache, v_cache, sf, store)
        return views

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: FlashInferMetadata
    ) -> torch.Tensor:
        k_cache, v_cache, sf, store_scales = self._cache_views(kv_cache)
        self._store(k, v, k_cache, v_cache, metadata.batch.slot_mapping, **store_scales)
        kv_fp8 = sf is not None
        if metadata.graph is not None:
            if metadata.kv_fp8 != kv_fp8:
                raise RuntimeError(
                    f"a captured decode step was planned for {'an FP8' if metadata.kv_fp8 else 'a 16-bit'} cache "
                    "but runs on another; warmup() must see the engine's KV cache before the capture"
                )
            if metadata.refreshed_by is None or metadata.refreshed_by == kv_cache.data_ptr():
                batch = metadata.batch
                metadata.graph.refresh(batch.seq_lens, batch.block_tables, self.block_size)
                metadata.refreshed_by = kv_cache.data_ptr()
        elif metadata.kv_fp8 != kv_fp8 or self._planned_for.get(id(metadata.wrapper)) is not metadata:
            self._plan(metadata, kv_fp8)
        return metadata.wrapper.run(q, (k_cache, v_cache), kv_cache_sf=sf)

"""The ``flashinfer`` backend on the CPU, where neither flashinfer nor a GPU exists.

- Registration, the one-line reasons ``check_available`` gives (no CUDA device, flashinfer missing or too old),
  the ``ConfigError`` of building it without flashinfer, options, the FP8 cache's spec.
- The backend's glue (what it plans, with which arguments and buffers, what it hands ``run()``, the store, the
  captured decode path's buffers refreshed every pass) against a stand-in ``flashinfer`` module: wrappers with the
  0.7.4 wrappers' ``__init__``/``plan``/``run`` signatures (so a misspelt or missing keyword fails here as it would
  there) that keep what ``plan`` gets as FlashInfer does (copied into the fixed buffers under
  ``use_cuda_graph``) and answer ``run`` with the oracle over the arrays they hold. The stand-in says nothing
  about FlashInfer's kernels; ``test_flashinfer_gpu.py`` runs those.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from flashinfer_oracle import paged_attention
from nanovllm_attention_flash import TorchAttentionBackend
from nanovllm_attention_flash.fp8_cache import fp8_cache_shape, to_fp8_cache
from nanovllm_attention_flashinfer import FlashInferBackend
from nanovllm_attention_flashinfer.backend import INSTALL_HINT
from nanovllm_testing.conformance import AttentionBackendConformance

from nanovllm_core import AttentionBatch, ConfigError, get_registry
from nanovllm_core.engine.config_resolver import select_attention_backend
from nanovllm_core.engine.cuda_graph import MixedStepBuffers
from nanovllm_core.plugins import check_registration

CPU = torch.device("cpu")

# --- the stand-in flashinfer ---------------------------------------------------------------------------------


class _Wrapper:
    """What both stand-in wrappers share: the planned arrays and ``run`` through the oracle."""

    graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _keep(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              causal, q_data_type, kv_data_type, sm_scale, use_token_head_sf, call) -> None:  # fmt: skip
        assert num_qo_heads % num_kv_heads == 0
        self.plans.append(call)
        if self.graph_buffers is not None:  # as FlashInfer: copy into the caller's buffers, which run() reads
            buf_indptr, buf_indices, buf_last = self.graph_buffers
            assert len(last_page_len) == len(buf_last), "the batch size is fixed in cudagraph mode"
            assert len(indices) <= len(buf_indices)
            buf_indptr.copy_(indptr)
            buf_last.copy_(last_page_len)
            buf_indices[: len(indices)].copy_(indices)
            self.qo_indptr, self.indptr, self.indices, self.last = qo_indptr, buf_indptr, buf_indices, buf_last
        else:
            self.qo_indptr, self.indptr, self.indices, self.last = qo_indptr, indptr, indices, last_page_len
        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.causal, self.q_dtype, self.kv_dtype = causal, q_data_type, kv_data_type
        self.sm_scale, self.token_head_sf = sm_scale, use_token_head_sf

    def _run(self, q, paged_kv_cache, kv_cache_sf) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        num_qo_heads, num_kv_heads, head_dim, page_size = self.shape
        assert q.dtype == self.q_dtype and k_cache.dtype == v_cache.dtype == self.kv_dtype
        assert q.shape[1:] == (num_qo_heads, head_dim) and k_cache.shape[1:] == (page_size, num_kv_heads, head_dim)
        if self.token_head_sf:
            assert isinstance(kv_cache_sf, tuple) and len(kv_cache_sf) == 2
            for sf in kv_cache_sf:  # FlashInfer's check for the NHD layout
                assert sf.dtype == torch.float32 and sf.shape == (k_cache.shape[0], page_size, num_kv_heads)
        else:
            assert kv_cache_sf is None
        assert q.shape[0] == int(self.qo_indptr[-1])
        if not self.causal:
            assert bool((self.qo_indptr.diff() == 1).all()), "non-causal here means one query a row"
        out = paged_attention(q, self.qo_indptr, self.indptr, self.indices, self.last, k_cache, v_cache,
                              self.sm_scale, kv_cache_sf)  # fmt: skip
        return out.to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    instances: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None, jit_kwargs=None):  # fmt: skip
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.use_cuda_graph, self.use_tensor_cores, self.backend = use_cuda_graph, use_tensor_cores, backend
        self.plans: list[dict] = []
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            assert all(torch.is_tensor(b) for b in buffers)
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.graph_buffers = buffers
        self.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1, is_causal=None, use_token_head_sf=False) -> None:  # fmt: skip
        assert pos_encoding_mode == "NONE" and indptr.device.type == "cpu" and last_page_len.device.type == "cpu"
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        call = dict(disable_split_kv=disable_split_kv, use_token_head_sf=use_token_head_sf, kv_data_type=kv_data_type)
        self._keep(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, False,
                   q_data_type, kv_data_type or q_data_type, sm_scale, use_token_head_sf, call)  # fmt: skip

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None) -> torch.Tensor:  # fmt: skip
        assert k_scale is None and v_scale is None
        return self._run(q, paged_kv_cache, kv_cache_sf)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    instances: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False, max_total_num_rows=None):  # fmt: skip
        assert kv_layout == "NHD" and not use_cuda_graph
        self.backend, self.plans = backend, []
        self.instances.append(self)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
             uniform_q_len=None, use_token_head_sf=False) -> None:  # fmt: skip
        assert causal and pos_encoding_mode == "NONE" and qo_indptr.device.type == "cpu"
        call = dict(use_token_head_sf=use_token_head_sf, kv_data_type=kv_data_type)
        self._keep(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, True, q_data_type, kv_data_type or q_data_type, sm_scale,
                   use_token_head_sf, call)  # fmt: skip

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None, window_left=None, sinks=None,
            kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None) -> torch.Tensor:  # fmt: skip
        assert k_scale is None and v_scale is None
        return self._run(q, paged_kv_cache, kv_cache_sf)


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__version__ = "0.7.4"
    # fresh subclasses: each test counts its own wrappers
    module.BatchDecodeWithPagedKVCacheWrapper = type("D", (BatchDecodeWithPagedKVCacheWrapper,), {"instances": []})
    module.BatchPrefillWithPagedKVCacheWrapper = type("P", (BatchPrefillWithPagedKVCacheWrapper,), {"instances": []})
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


class CpuFlashInfer(FlashInferBackend):
    """The backend with its CUDA requirement lifted, so that the stand-in runs it on the CPU."""

    @classmethod
    def check_available(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        return None


def make_backend(num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16):
    return CpuFlashInfer(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
                         block_size=block_size, dtype=torch.float32, device=CPU, workspace_mib=16)  # fmt: skip


# --- availability, registration, options ---------------------------------------------------------------------


def test_registered_under_its_name() -> None:
    assert get_registry().get("attention", "flashinfer").obj is FlashInferBackend
    assert check_registration("attention", FlashInferBackend) is None


def test_cpu_is_refused_in_one_line() -> None:
    reason = FlashInferBackend.check_available(CPU, torch.bfloat16, 128)
    assert reason is not None and "needs a CUDA device" in reason and "\n" not in reason
    with pytest.raises(ConfigError) as info:
        select_attention_backend(get_registry(), "flashinfer", CPU, torch.float32, 128, 16)
    assert "needs a CUDA device" in str(info.value) and "\n" not in str(info.value)


def test_missing_flashinfer_is_one_line_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = FlashInferBackend.check_available(torch.device("cuda"), torch.bfloat16, 128)
    assert reason is not None and INSTALL_HINT in reason and "not importable" in reason and "\n" not in reason
    with pytest.raises(ConfigError, match="cannot start: flashinfer is not importable") as info:
        make_backend()
    assert INSTALL_HINT in str(info.value) and "\n" not in str(info.value)


def test_too_old_flashinfer_is_refused(fake_flashinfer: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_flashinfer, "__version__", "0.2.14.post1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = FlashInferBackend.check_available(torch.device("cuda"), torch.bfloat16, 128)
    assert reason is not None and "0.2.14.post1 is older than the 0.7.4 API" in reason


def test_shapes_dtypes_and_options(fake_flashinfer: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    assert "float32" in FlashInferBackend.check_available(cuda, torch.float32, 128)
    assert "head_dim 96" in FlashInferBackend.check_available(cuda, torch.bfloat16, 96)
    assert "8.9+" in FlashInferBackend.check_kv_cache_dtype("fp8", cuda)
    assert FlashInferBackend.check_kv_cache_dtype("fp8", CPU) is None
    assert FlashInferBackend.check_kv_cache_dtype("fp8_e5m2", CPU) is not None
    spec = FlashInferBackend.kv_cache_spec("fp8", 10, 16, 2, 128, torch.bfloat16)
    assert spec == (fp8_cache_shape(10, 16, 2, 128), torch.uint8)
    spec = FlashInferBackend.kv_cache_spec("auto", 10, 16, 2, 128, torch.bfloat16)
    assert spec == ((2, 10, 16, 2, 128), torch.bfloat16)
    common = dict(num_heads=8, num_kv_heads=2, head_dim=32, scale=1.0, block_size=16, dtype=torch.float32, device=CPU)
    with pytest.raises(ConfigError, match="workspace_mib"):
        CpuFlashInfer(**common, workspace_mib=1)
    with pytest.raises(ConfigError, match="num_kv_spilts"):
        CpuFlashInfer(**common, num_kv_spilts=2)
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        CpuFlashInfer(**(common | dict(num_kv_heads=3)))
    backend = make_backend()
    assert backend._decode.use_tensor_cores and backend._decode.backend == "fa2" and not backend._decode.use_cuda_graph
    assert backend._prefill.backend == "auto"


# --- the glue, through the stand-in --------------------------------------------------------------------------


class TestConformanceThroughTheStandIn(AttentionBackendConformance):
    """The kit's ragged steps (prompts; chunks over cached context beside decode tokens and a new prompt; decode),
    float32, against dense float64 attention: the backend's layout, plans, store and cache views."""

    backend_cls = CpuFlashInfer

    @pytest.fixture(autouse=True)
    def _stand_in(self, fake_flashinfer: types.ModuleType) -> None:
        pass


def random_step(query_lens: list[int], context_lens: list[int], tables: list[list[int]], block_size: int,
                num_heads: int, num_kv_heads: int, head_dim: int, seed: int):  # fmt: skip
    """A step over ``tables`` (the context before it is whatever the cache holds) and its q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    spans = [(c, c + n) for c, n in zip(context_lens, query_lens)]
    batch = AttentionBatch.from_spans(tables, spans, block_size, CPU)
    n = batch.num_tokens
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    return batch, q, k, v


def kv_dtype(kv_fp8: bool) -> torch.dtype:
    return torch.float8_e4m3fn if kv_fp8 else torch.float32


def new_caches(kv_fp8: bool, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(num_layers)]
    return [to_fp8_cache(c) for c in caches] if kv_fp8 else caches


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["16bit", "fp8"])
def test_captured_decode_steps(fake_flashinfer: types.ModuleType, kv_fp8: bool) -> None:
    """The runner's CUDA-graph decode path without a GPU: ``build_metadata`` once per bucket of the static batch,
    then steps of other sizes and lengths loaded into it and ``forward`` over two layers on the bucket's metadata
    (what a replay runs). Each bucket's wrapper is a ``use_cuda_graph`` decode wrapper over views of one
    ``GraphLayout``, planned once, with the KV split off; each step matches the ``torch`` backend, stores the
    same cache contents, and padding rows' NaN inputs reach nothing."""
    heads, kv_heads, d, bs, max_len = 8, 2, 32, 16, 160
    backend, torch_backend = make_backend(heads, kv_heads, d, bs), TorchAttentionBackend(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=d, scale=d**-0.5, block_size=bs, dtype=torch.float32,
        device=CPU)  # fmt: skip
    num_blocks = 12 * (max_len // bs) + 1
    caches = new_caches(kv_fp8, 2, num_blocks, bs, kv_heads, d)
    expected_caches = [c.clone() for c in caches]
    backend.warmup(caches[0])
    buffers = MixedStepBuffers(12, 12, max_len, bs, CPU, decode=True)
    metadata = {size: backend.build_metadata(buffers.bucket(size)) for size in reversed(buffers.sizes)}
    wrappers = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.instances[1:]  # [0]: the eager decode wrapper
    assert len(wrappers) == len(buffers.sizes) and all(w.use_cuda_graph and w.use_tensor_cores for w in wrappers)
    planned = dict(disable_split_kv=True, use_token_head_sf=kv_fp8, kv_data_type=kv_dtype(kv_fp8))
    assert all(w.plans == [planned] for w in wrappers)
    assert len({w.graph_buffers[1].data_ptr() for w in wrappers}) == 1, "one GraphLayout serves every bucket"
    free = list(range(1, num_blocks))
    for step, rows in enumerate([5, 12, 1, 9, 3]):
        gen = torch.Generator().manual_seed(step)
        order = torch.randperm(len(free), generator=gen).tolist()
        contexts = torch.randint(0, max_len - 1, (rows,), generator=gen).tolist()
        tables, used = [], 0
        for c in contexts:
            nb = -(-(c + 1) // bs)
            tables.append([free[i] for i in order[used : used + nb]])
            used += nb
        batch, q, k, v = random_step([1] * rows, contexts, tables, bs, heads, kv_heads, d, seed=step)
        ids = torch.zeros(rows, dtype=torch.int64)
        size = buffers.load(ids, ids, batch)
        pad = [torch.full((size - rows, *x.shape[1:]), float("nan")) for x in (q, k, v)]
        for layer in range(2):
            got = backend.forward(*(torch.cat([x, p]) for x, p in zip((q, k, v), pad)), caches[layer], metadata[size])
            want = torch_backend.forward(q, k, v, expected_caches[layer], batch)
            torch.testing.assert_close(got[:rows], want, atol=2e-5, rtol=1e-5)
            assert torch.equal(caches[layer], expected_caches[layer])
    assert all(len(w.plans) == 1 for w in wrappers), "a captured step is never planned again"


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["16bit", "fp8"])
def test_eager_steps(fake_flashinfer: types.ModuleType, kv_fp8: bool) -> None:
    """Steps that run eagerly: a mixed step (chunks over cached prefixes, a prompt, decode tokens) on the prefill
    wrapper, a decode step on the decode wrapper, each planned once for both layers with the cache's type
    (``use_token_head_sf`` and e4m3 for the FP8 cache); a step's metadata used again after another step's
    (the wrapper planned anew); outputs and stored caches as the ``torch`` backend's."""
    heads, kv_heads, d, bs = 4, 4, 32, 32
    backend = make_backend(heads, kv_heads, d, bs)
    torch_backend = TorchAttentionBackend(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, scale=d**-0.5,
                                          block_size=bs, dtype=torch.float32, device=CPU)  # fmt: skip
    caches = new_caches(kv_fp8, 2, 24, bs, kv_heads, d)
    expected_caches = [c.clone() for c in caches]
    backend.warmup(caches[0])
    mixed = random_step([40, 1, 17, 1, 5], [64, 70, 0, 31, 33], [[3, 9, 4, 14], [5, 6, 7], [8], [10, 11], [12, 13]],
                        bs, heads, kv_heads, d, seed=0)  # fmt: skip
    decode = random_step([1, 1, 1], [104, 71, 32], [[3, 9, 4, 14], [5, 6, 7], [10, 11]], bs, heads, kv_heads, d,
                         seed=1)  # fmt: skip
    decode_again = random_step([1, 1], [105, 72], [[3, 9, 4, 14], [5, 6, 7]], bs, heads, kv_heads, d, seed=2)
    metadata = {name: (step, backend.build_metadata(step[0])) for name, step in
                [("mixed", mixed), ("decode", decode), ("decode_again", decode_again)]}  # fmt: skip
    for name in ["mixed", "decode", "decode_again", "decode"]:  # the last: planned again after decode_again's plan
        (batch, q, k, v), meta = metadata[name]
        for layer in range(2):
            got = backend.forward(q, k, v, caches[layer], meta)
            want = torch_backend.forward(q, k, v, expected_caches[layer], batch)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            assert torch.equal(caches[layer], expected_caches[layer])
    assert backend._prefill.plans == [dict(use_token_head_sf=kv_fp8, kv_data_type=kv_dtype(kv_fp8))]
    planned = dict(disable_split_kv=False, use_token_head_sf=kv_fp8, kv_data_type=kv_dtype(kv_fp8))
    assert backend._decode.plans == [planned] * 3

"""GPU checks of the ``flashinfer`` backend against the ``torch`` backend (computed in float32).

Skipped without a CUDA device or without ``flashinfer`` (``python -m pytest plugins/attention_flashinfer -m gpu``).
These tests have not been run in this repository yet: no machine it ran on had both.

- Ragged steps with shuffled block tables: decode (with CUDA-graph style padding rows), prompts, prefix-cache hits,
  chunked prefill over a cached context, mixed steps; GQA ratios 1/2/4/8, block sizes 16/64/128/256, head sizes
  64/128/256, bfloat16 and float16; on the 16-bit cache and on the FP8 cache (both backends reading the same e4m3
  values and scales, written by the reference store). Cache slots no token owns hold NaN, to catch unmasked reads.
- The stored cache equals the ``torch`` backend's (bit for bit, both cache types).
- Decode captured in a ``torch.cuda.CUDAGraph`` over the runner's static batch (``MixedStepBuffers``) and replayed
  on steps of other sizes and lengths than at capture: the check that the captured plan does not depend on them.
- The conformance kit, in bfloat16 at block sizes 16 and 128.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from nanovllm_attention_flash import TorchAttentionBackend  # noqa: E402
from nanovllm_attention_flash.testing import GPU_CASES as CASES  # noqa: E402
from nanovllm_attention_flash.testing import PagedCase, case_id, make_case, reference  # noqa: E402
from nanovllm_attention_flash.testing import step_lengths as lengths  # noqa: E402
from nanovllm_attention_flashinfer import FlashInferBackend  # noqa: E402
from nanovllm_testing.conformance import AttentionBackendConformance  # noqa: E402

from nanovllm_core.engine.cuda_graph import MixedStepBuffers  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: dict(atol=1e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
CUDA = torch.device("cuda")


def skip_unless_available(dtype: torch.dtype, head_dim: int, kv_cache_dtype: str) -> None:
    reason = FlashInferBackend.check_available(CUDA, dtype, head_dim) or FlashInferBackend.check_kv_cache_dtype(
        kv_cache_dtype, CUDA
    )
    if reason is not None:
        pytest.skip(reason)


def build(c, kv_cache_dtype: str) -> PagedCase:
    kind, h, kvh, d, bs, dtype = c
    seed = zlib.crc32(case_id(c).encode()) % 1000
    query_lens, context_lens, pads = lengths(kind, bs, seed)
    case = make_case(query_lens, context_lens, num_heads=h, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype=dtype,
                     device="cuda", num_pad_rows=pads, seed=seed)  # fmt: skip
    return case.fp8() if kv_cache_dtype == "fp8" else case


def real_tokens(case: PagedCase) -> int:
    """The tokens of the rows that are no padding (``make_case`` puts padding rows last)."""
    return case.batch.query_start_loc_cpu[sum(1 for s in case.batch.seq_lens_cpu if s)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_matches_torch_backend(c, kv_cache_dtype: str) -> None:
    skip_unless_available(c[5], c[3], kv_cache_dtype)
    case = build(c, kv_cache_dtype)
    if kv_cache_dtype == "fp8":  # the attention alone, on the same cache bytes (the store has its own check)
        case = case.prestored()
    backend = case.backend(FlashInferBackend)
    out = case.run(backend)
    torch.cuda.synchronize()
    n = real_tokens(case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out[:n]).all(), "non-finite output"
    torch.testing.assert_close(out[:n].float(), reference(case, TorchAttentionBackend)[:n], **TOLERANCE[c[5]])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_stores_what_the_torch_backend_stores(kind: str, kv_cache_dtype: str) -> None:
    c = (kind, 16, 8, 128, 64, torch.bfloat16)
    skip_unless_available(torch.bfloat16, 128, kv_cache_dtype)
    case = build(c, kv_cache_dtype)
    ours, theirs = case.kv_cache.clone(), case.kv_cache.clone()
    case.run(case.backend(FlashInferBackend), ours)
    case.run(case.backend(TorchAttentionBackend), theirs)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_cuda_graph_replays_steps_of_other_lengths(kv_cache_dtype: str) -> None:
    """The runner's decode graph: metadata built once on the static batch of a 48-row bucket (host lengths 0),
    ``forward`` of two layers captured, then steps of 40, 33 and 47 rows with long, short and mixed contexts
    copied in and replayed; each against the ``torch`` backend on that step."""
    heads, kv_heads, d, bs, max_len = 16, 8, 128, 64, 4096
    skip_unless_available(torch.bfloat16, d, kv_cache_dtype)
    num_blocks = 48 * (max_len // bs) + 1
    common = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=bs, dtype=torch.bfloat16,
                  device="cuda", num_blocks=num_blocks)  # fmt: skip
    rnd = random.Random(0)
    contexts = [
        [rnd.randint(0, max_len - 1) for _ in range(40)],
        [rnd.randint(0, 100) for _ in range(33)],
        [max_len - 1] * 3 + [rnd.randint(0, 50) for _ in range(44)],
    ]
    steps = [make_case([1] * len(ctx), ctx, seed=i, **common) for i, ctx in enumerate(contexts)]
    if kv_cache_dtype == "fp8":
        steps = [step.fp8() for step in steps]
    caches = [torch.zeros_like(steps[0].kv_cache) for _ in range(2)]
    backend = steps[0].backend(FlashInferBackend)
    backend.warmup(caches[0])
    buffers = MixedStepBuffers(48, 48, max_len, bs, CUDA, decode=True)
    assert buffers.sizes[-1] == 48
    metadata = backend.build_metadata(buffers.bucket(48))
    q = torch.zeros((48, heads, d), dtype=torch.bfloat16, device=CUDA)
    k, v = (torch.zeros((48, kv_heads, d), dtype=torch.bfloat16, device=CUDA) for _ in range(2))
    outs: list[torch.Tensor] = []

    def layers() -> None:
        outs[:] = [backend.forward(q, k, v, cache, metadata) for cache in caches]

    with torch.inference_mode():
        layers()  # warm-up outside the capture, as the runner does
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        for step in steps:
            rows = step.batch.num_seqs
            for cache in caches:
                cache.copy_(step.kv_cache)
            for dst, src in ((q, step.q), (k, step.k), (v, step.v)):
                dst[:rows].copy_(src)
                dst[rows:].fill_(float("nan"))  # padding rows: stored nowhere, attend to nothing
            ids = torch.zeros(rows, dtype=torch.int64, device=CUDA)
            assert buffers.load(ids, ids, step.batch) == 48
            graph.replay()
            torch.cuda.synchronize()
            expected = reference(step, TorchAttentionBackend)
            for out in outs:
                torch.testing.assert_close(out[:rows].float(), expected, **TOLERANCE[torch.bfloat16])


class OnGpu(AttentionBackendConformance):
    pytestmark = pytest.mark.gpu
    backend_cls = FlashInferBackend
    device = "cuda"
    dtype = torch.bfloat16
    atol = 1e-2
    rtol = 1e-2


class TestFlashInferBlock16(OnGpu):
    block_size = 16


class TestFlashInferBlock128(OnGpu):
    block_size = 128

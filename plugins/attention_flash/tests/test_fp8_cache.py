"""The FP8 KV cache (``kv_cache_dtype = "fp8"``) on CPU: quantisation, layout, the ``torch`` backend against a
float32 cache on ragged batches, the runner's allocation and refusal, and the engine end to end."""

from __future__ import annotations

import pytest
import torch
from nanovllm_attention_flash import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from nanovllm_attention_flash.fp8_cache import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_cache_shape,
    fp8_views,
    gather_fp8,
    quantize_fp8,
    store_fp8,
)
from nanovllm_attention_flash.testing import bf16_rows, e4m3_reference, make_case, reference
from nanovllm_testing import tiny_checkpoint_fixture

from nanovllm_core import LLM, AttentionBackend, ConfigError, SamplingParams
from nanovllm_core.engine.model_runner import ModelRunner

CPU = torch.device("cpu")
# (query_lens, context_lens, padding rows) of each step kind: ragged, straddling 16-token blocks
KINDS = {
    "decode": ([1] * 6, [1, 15, 16, 40, 77, 130], 2),
    "prefill": ([1, 7, 20, 45, 130], [0] * 5, 0),
    "prefix_hit": ([3, 17, 5], [16, 32, 64], 0),
    "chunked": ([9, 16, 30], [13, 37, 50], 0),
    "mixed": ([1, 12, 1, 5, 1], [30, 0, 7, 21, 64], 0),
}


def e4m3_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the distance between neighbouring e4m3 values around ``y`` (3 mantissa bits, subnormal step 2**-9)."""
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    return 2.0 ** (exponent - 4)


def assert_e4m3_rounded(read: torch.Tensor, x: torch.Tensor) -> None:
    """``read`` is ``x`` ``[..., head_dim]`` rounded to e4m3 with one scale per row (amax / 448)."""
    scale = (x.abs().amax(-1) / FP8_MAX).unsqueeze(-1)
    bound = scale * e4m3_half_step(x / scale)
    assert ((read - x).abs() <= bound * (1 + 1e-5)).all()


def test_quantize_error_is_within_half_an_e4m3_step() -> None:
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, plus an outlier: scales are per row
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-4, 3, 64).view(64, 1, 1)
    x[3, 2, 7] = 1e4
    values, scales = quantize_fp8(x)
    assert values.dtype == FP8_DTYPE and scales.dtype == torch.float32 and scales.shape == (64, 4)
    torch.testing.assert_close(scales, x.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    assert values.float().abs().amax(-1).eq(FP8_MAX).all(), "each row's largest element maps to 448"
    y = x / scales.unsqueeze(-1)  # the exact scaled row
    err = (values.float() - y).abs()
    assert (err <= e4m3_half_step(y)).all()
    rel = ((values.float() * scales.unsqueeze(-1) - x).norm() / x.norm()).item()
    assert 0.005 < rel < 0.04, rel  # about 2.5% for Gaussian rows


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_quantize_is_correctly_rounded_on_every_device(device: str) -> None:
    """``quantize_fp8`` equals the exact float64 reference bit for bit on the CPU and on CUDA: the scale is
    ``amax / 448`` correctly rounded, ties round to even. (CUDA PyTorch computes ``tensor / 448.0`` as a
    multiplication by float32(1/448); this data tells that scale apart, as checked last.)"""
    x = bf16_rows(2048, 128, seed=3)
    values, scales = quantize_fp8(x.to(device))
    ref_values, ref_scales, ties = e4m3_reference(x)
    assert 0.002 < ties.float().mean().item() < 0.02, "the data should put values exactly on midpoints"
    assert torch.equal(scales.cpu(), ref_scales)
    read = values.cpu().float()
    assert torch.equal(read, ref_values) and torch.equal(read.signbit(), ref_values.signbit())
    nonzero = ref_scales > 0
    reciprocal_scale = x[nonzero].abs().amax(-1, keepdim=True) * torch.tensor(1 / FP8_MAX)
    moved = (x[nonzero] / reciprocal_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() != ref_values[nonzero]
    assert moved.sum() > 50, "amax * float32(1/448) should round some values differently"


@pytest.mark.parametrize("fp8", [False, True], ids=["float32-cache", "fp8-cache"])
def test_prestored_case_reads_what_forward_would_store(fp8: bool) -> None:
    """``PagedCase.prestored``: the step's keys/values in the cache, every slot -1; the torch backend's output on
    it equals its output on the original step (which stores them itself)."""
    case = make_case(*KINDS["mixed"][:2], num_heads=4, num_kv_heads=2, seed=5)
    case = case.fp8() if fp8 else case
    stored = case.prestored()
    assert stored.batch.slot_mapping.eq(-1).all() and case.batch.slot_mapping.ge(0).all()
    after_forward = case.kv_cache.clone()
    backend = case.backend(TorchAttentionBackend)
    out = case.run(backend, after_forward)
    assert torch.equal(stored.kv_cache.view(torch.uint8), after_forward.view(torch.uint8))
    unchanged = stored.kv_cache.clone()
    assert torch.equal(stored.run(backend, unchanged), out)
    assert torch.equal(unchanged.view(torch.uint8), stored.kv_cache.view(torch.uint8)), "slots -1 store nothing"


def test_zero_row_reads_back_as_zeros() -> None:
    values, scales = quantize_fp8(torch.zeros(2, 3, 64))
    assert scales.eq(0).all() and values.float().eq(0).all()


def test_views_share_the_cache_and_check_its_shape() -> None:
    cache = torch.zeros(fp8_cache_shape(5, 16, 2, 64), dtype=torch.uint8)
    values, scales = fp8_views(cache, 16, 2, 64)
    assert values.shape == (2, 5, 16, 2, 64) and values.dtype == FP8_DTYPE
    assert scales.shape == (2, 5, 2, 16) and scales.dtype == torch.float32
    values[1, 4, 15, 1, 63] = 1.0
    scales[1, 4, 1, 15] = 2.0
    # the last value byte of the values' half and the high byte of its last float32 scale (2.0 = 0x40000000)
    assert cache.shape[1] == 5 * 16 * 2 * (64 + 4)
    assert cache[1].nonzero().flatten().tolist() == [5 * 16 * 2 * 64 - 1, cache.shape[1] - 1]
    assert cache[0].eq(0).all()
    with pytest.raises(ValueError, match="not an FP8 KV cache"):
        fp8_views(cache, 32, 2, 64)


def test_store_skips_padding_and_gathers_dequantised_rows() -> None:
    cache = fp8_views(torch.zeros(fp8_cache_shape(4, 16, 2, 64), dtype=torch.uint8), 16, 2, 64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    store_fp8(k, v, cache, torch.tensor([17, -1, 18]))
    keys = gather_fp8(cache, 0, torch.tensor([1]), 3, torch.float32)  # block 1 holds slots 16..31
    assert keys[0].eq(0).all()
    assert_e4m3_rounded(keys[1:], k[[0, 2]])
    assert cache.values[:, [0, 2, 3]].float().eq(0).all() and cache.scales[:, [0, 2, 3]].eq(0).all()
    values = gather_fp8(cache, 1, torch.tensor([1]), 3, torch.float32)
    assert_e4m3_rounded(values[1:], v[[0, 2]])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_torch_backend_fp8_cache_against_float32_cache(kind: str, num_heads: int, num_kv_heads: int) -> None:
    """The same step with an FP8 and a float32 cache: outputs within e4m3's precision of each other (a few
    percent of the output's norm; every cached and new key/value goes through e4m3)."""
    query_lens, context_lens, pad = KINDS[kind]
    case = make_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, num_pad_rows=pad, seed=len(kind)
    )
    exact = reference(case, TorchAttentionBackend)
    fp8_case = case.fp8()
    cache = fp8_case.kv_cache.clone()
    out = fp8_case.run(fp8_case.backend(TorchAttentionBackend), cache)
    assert not torch.isnan(out).any()
    real = sum(case.query_lens[: len(case.query_lens) - pad])
    torch.testing.assert_close(out[real:], torch.zeros_like(out[real:]))  # padding rows
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 0.003 < rel < 0.05, rel
    # the step's new keys/values were stored, quantised (padding rows stored nothing)
    values, scales = fp8_views(cache, 16, num_kv_heads, 64)
    slots = case.batch.slot_mapping[case.batch.slot_mapping >= 0]
    blocks, rows = slots // 16, slots % 16
    stored = values[0][blocks, rows].float() * scales[0][blocks, :, rows].unsqueeze(-1)
    assert_e4m3_rounded(stored, case.k[:real])


def test_kv_cache_dtype_support_per_backend() -> None:
    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        assert cls.check_kv_cache_dtype("fp8", CPU) is None
        assert cls.kv_cache_spec("fp8", 3, 16, 2, 64, torch.bfloat16) == ((2, 3 * 16 * 2 * 68), torch.uint8)
        assert cls.kv_cache_spec("auto", 3, 16, 2, 64, torch.bfloat16) == ((2, 3, 16, 2, 64), torch.bfloat16)
        assert "'int4'" in cls.check_kv_cache_dtype("int4", CPU)
    for cls in (FlashAttnBackend, AttentionBackend):
        assert cls.check_kv_cache_dtype("auto", CPU) is None
        assert "not supported" in cls.check_kv_cache_dtype("fp8", CPU)
    assert "flash-attn-4" in FlashAttnBackend.check_kv_cache_dtype("fp8", CPU)


head64_path = tiny_checkpoint_fixture("qwen3", scope="module", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [7, 8, 9] * 6 + [30, 31], list(range(100, 133))]


def generate(path, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        str(path),
        device="cpu",
        kvcache_block_size=16,
        max_model_len=128,
        num_kvcache_blocks=24,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_engine_fp8_cache_greedy_agrees_with_float32_cache(head64_path) -> None:
    """Greedy decoding with an FP8 cache completes and follows the float32 cache's tokens. Random weights give
    near-tied logits, so one flipped token changes everything after it in a free run; agreement is therefore
    counted teacher-forced: the FP8 engine's next token after each prefix of the float32 run's output."""
    llm, fp8_tokens = generate(head64_path, plugins={"attention": "torch"}, kv_cache_dtype="fp8")
    runner = llm.runner
    assert runner.kv_cache.dtype == torch.uint8
    assert runner.kv_cache.shape == (runner.num_layers, *fp8_cache_shape(24, 16, 2, 64))
    assert runner.kv_block_bytes() * 24 == runner.kv_cache.numel()
    _, exact_tokens = generate(head64_path, plugins={"attention": "torch"})
    assert [len(t) for t in fp8_tokens] == [24] * len(PROMPTS)
    assert [t[0] for t in fp8_tokens] == [t[0] for t in exact_tokens]
    prefixes = [prompt + out[:i] for prompt, out in zip(PROMPTS, exact_tokens) for i in range(len(out))]
    outs = llm.generate(prefixes, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    predicted = [o.outputs[0].token_ids[0] for o in outs]
    expected = [token for out in exact_tokens for token in out]
    agree = sum(a == b for a, b in zip(predicted, expected)) / len(expected)
    assert agree >= 0.85, agree  # 0.95 measured


def test_engine_sizes_an_fp8_cache_from_memory(head64_path) -> None:
    """``cpu_kvcache_gib`` buys 3.8x the blocks of a float32 cache with an FP8 one (68 bytes per row of 64 values
    instead of 256)."""
    kwargs = dict(device="cpu", kvcache_block_size=16, max_model_len=128, cpu_kvcache_gib=0.001)
    runners = {dt: LLM(str(head64_path), kv_cache_dtype=dt, **kwargs).runner for dt in ("auto", "fp8")}
    rows = runners["auto"].num_layers * 2 * 16 * 2  # (key, value) x tokens x KV heads per block
    budget = int(0.001 * 2**30)
    assert runners["auto"].num_kvcache_blocks == budget // (rows * 64 * 4)
    assert runners["fp8"].num_kvcache_blocks == budget // (rows * 68)


def test_backend_without_fp8_is_refused_naming_those_with_it(head64_path, monkeypatch) -> None:
    monkeypatch.setattr(TorchAttentionBackend, "check_kv_cache_dtype", AttentionBackend.check_kv_cache_dtype)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes triton available on this CPU
    monkeypatch.setattr(ModelRunner, "__init__", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(ConfigError, match=r"'torch' cannot run here: kv_cache_dtype 'fp8'.*backends that can: triton"):
        LLM(str(head64_path), device="cpu", plugins={"attention": "torch"}, kv_cache_dtype="fp8")


def test_invalid_kv_cache_dtype_is_a_config_error(head64_path) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(head64_path), device="cpu", kv_cache_dtype="int8")

"""Programmatic dependent launch (``programmatic_dependent_launch``): off the GPU it changes nothing; on a GPU
that has it, the kernels give the same bits with it as without, in a CUDA graph as a decode step runs them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm_testing import GPU_TEST_SHAPE, PARITY_PROMPTS, write_tiny_checkpoint  # noqa: E402

from nanovllm_core import LLM, SamplingParams  # noqa: E402
from nanovllm_core.config import EngineConfig  # noqa: E402
from nanovllm_core.layers import launch_options  # noqa: E402
from nanovllm_core.layers.fused import set_compile  # noqa: E402
from nanovllm_core.layers.linear import linear  # noqa: E402
from nanovllm_core.layers.rms_norm_kernel import rms_norm  # noqa: E402
from nanovllm_core.layers.silu_and_mul_kernel import silu_and_mul  # noqa: E402
from nanovllm_core.layers.skinny_gemm_kernel import skinny_norm_linear  # noqa: E402
from nanovllm_core.layers.triton_jit import set_pdl  # noqa: E402


@pytest.fixture
def pdl_on():
    set_pdl(True)
    yield
    set_pdl(False)


def test_it_is_on_by_default_and_never_for_a_cpu_tensor(pdl_on):
    assert EngineConfig.model_fields["programmatic_dependent_launch"].default is True
    assert launch_options(torch.empty(1)) == {"PDL": False}


def _has_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _layers(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """A decode step's chain: norm (reading the residual written a few kernels back), projection, SiLU-and-mul,
    projection, for every layer; ``linear`` takes the skinny kernel up to four rows and cuBLAS above, so PDL
    kernels follow cuBLAS kernels and the other way round."""
    residual = x
    for norm_weight, gate_up, down in weights:
        h, residual = rms_norm(x, norm_weight, 1e-6, residual)
        x = linear(silu_and_mul(linear(h, gate_up)), down)
    return rms_norm(x, weights[0][0], 1e-6, residual)[0]


def _norm_gemm_layers(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The same chain with each norm in the gate-up projection's prologue (``skinny_norm_linear``, at most four
    rows): the fused kernel reads the residual another fused kernel wrote two launches back."""
    residual = None
    for norm_weight, gate_up, down in weights:
        h, residual = skinny_norm_linear(x, gate_up, norm_weight, 1e-6, residual, silu_mul=True)
        x = linear(h, down)
    return rms_norm(x, weights[0][0], 1e-6, residual)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_pdl(), reason="needs a GPU of compute capability 9.0 or newer")
@pytest.mark.parametrize(
    "chain,rows", [(_layers, 1), (_layers, 4), (_layers, 64), (_norm_gemm_layers, 1), (_norm_gemm_layers, 4)]
)
def test_a_graph_of_pdl_kernels_gives_the_same_bits(chain, rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, layers = 1024, 3072, 8
    weights = [
        (
            1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen).bfloat16(),
            0.02 * torch.randn(2 * inter, hidden, device="cuda", generator=gen).bfloat16(),
            0.02 * torch.randn(hidden, inter, device="cuda", generator=gen).bfloat16(),
        )
        for _ in range(layers)
    ]
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    set_compile(True)
    try:
        outputs = {}
        for pdl in (False, True):
            set_pdl(pdl)
            assert launch_options(x) == ({"PDL": True, "launch_pdl": True} if pdl else {"PDL": False})
            chain(x, weights)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(x, weights)
            results = []
            for _ in range(3):
                graph.replay()
                results.append(out.clone())
            torch.cuda.synchronize()
            assert all(torch.equal(r, results[0]) for r in results)
            outputs[pdl] = results[0]
        assert torch.equal(outputs[True], outputs[False])
    finally:
        set_pdl(False)
        set_compile(False)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_pdl(), reason="needs a GPU of compute capability 9.0 or newer")
def test_the_engine_gives_the_same_greedy_tokens_with_and_without_it(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for pdl in (True, False):
        llm = LLM(
            str(path),
            plugins={"attention": "triton"},
            programmatic_dependent_launch=pdl,
            kvcache_block_size=64,
            max_model_len=1024,
            num_kvcache_blocks=64,
            max_num_seqs=32,
        )
        tokens[pdl] = [o.outputs[0].token_ids for o in llm.generate(PARITY_PROMPTS, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens[True] == tokens[False]

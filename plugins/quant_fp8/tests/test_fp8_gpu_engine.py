"""FP8 weights on a GPU, end to end (CUDA graphs, the triton backend): each way in against ``transformers`` in
float32 on the weights the method computes with.

A forward of at most ``kernels.MAX_ROWS`` tokens takes the weight-only kernel, whose activations stay bf16: its
logits are held to the bf16 engine's tolerance and its greedy tokens must start the same. A longer prompt takes the
W8A8 path, which rounds every linear layer's input to FP8: its error is the rounding's, held to a bound a wrong scale
or block layout breaks by far. A reference that rounds the same inputs in float32 is no closer on a random-weight
model, because the engine's bf16 inputs land on the other side of an FP8 rounding boundary often enough."""

from __future__ import annotations

import pytest
import torch
from nanovllm_quant_fp8.checkpoints import (
    write_dequantized_checkpoint,
    write_fake_quantized_checkpoint,
    write_fp8_checkpoint,
)
from nanovllm_testing import GPU_TEST_SHAPE, PARITY_PROMPTS, write_tiny_checkpoint

from nanovllm_core import LLM, SamplingParams, SchedulerOutput, Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WAYS = ["quantized at load", "fp8", "compressed-tensors"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per way in: (checkpoint, engine settings, reference checkpoint)."""
    root = tmp_path_factory.mktemp("fp8-gpu")
    src = write_tiny_checkpoint(root / "bf16", "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)
    found = {"quantized at load": (src, {"quantization": "fp8"}, write_fake_quantized_checkpoint(src, root / "ref"))}
    for fmt in ("fp8", "compressed-tensors"):
        stored = write_fp8_checkpoint(src, root / fmt, fmt)
        found[fmt] = (stored, {}, write_dequantized_checkpoint(stored, root / f"ref-{fmt}"))
    return found


def last_token_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(prompt, SamplingParams(temperature=0))
    assert llm.block_manager.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = 0
    try:
        return llm.runner.compute_logits(llm.runner.prepare(SchedulerOutput([seq], [seq.num_tokens]))).float()[0]
    finally:
        llm.block_manager.free(seq)


@pytest.mark.parametrize("way", WAYS)
def test_fp8_engine_against_transformers_on_the_dequantized_weights(checkpoints, way):
    from nanovllm_quant_fp8 import kernels  # imports triton
    from transformers import AutoModelForCausalLM

    path, settings, reference = checkpoints[way]
    llm = LLM(str(path), plugins={"attention": "triton"}, kvcache_block_size=64, max_model_len=1024,
              num_kvcache_blocks=64, max_num_seqs=32, **settings)  # fmt: skip
    assert llm.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    few_rows = PARITY_PROMPTS[0]
    assert len(few_rows) <= kernels.MAX_ROWS
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = llm.generate([few_rows], greedy, use_tqdm=False)[0].outputs[0].token_ids  # every step weight-only
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).cuda().eval()

    def error(prompt: list[int]) -> float:
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        return ((last_token_logits(llm, prompt) - ref).norm() / ref.norm()).item()

    with torch.no_grad():
        weight_only_error = error(few_rows)
        w8a8_errors = [error(p) for p in PARITY_PROMPTS[1:4]]  # more than MAX_ROWS rows each
        want = hf.generate(torch.tensor([few_rows], device="cuda"), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(few_rows):].tolist()  # fmt: skip
    agree = sum(a == b for a, b in zip(ours, want)) / len(want)
    print(f"\n{way}: logits rel. error against float32 on the dequantized weights: weight-only {weight_only_error}, "
          f"W8A8 {w8a8_errors}; greedy tokens equal {agree}")  # fmt: skip
    assert weight_only_error < 0.05, weight_only_error  # bf16 activations and accumulation only
    assert ours[:2] == want[:2], (ours, want)
    assert max(w8a8_errors) < 0.25, w8a8_errors  # FP8 activations; a wrong scale or block layout gives about 1

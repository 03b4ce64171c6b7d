"""FP8 weights on a GPU, end to end (CUDA graphs, the triton backend): each way in against ``transformers`` in
float32 on the weights the method computes with. The activations of the FP8 GEMMs are rounded to FP8 too (the
CPU path does not round them), so the logits are compared with a tolerance and the first tokens exactly."""

from __future__ import annotations

import pytest
import torch
from nanovllm_quant_fp8.checkpoints import (
    write_dequantized_checkpoint,
    write_fake_quantized_checkpoint,
    write_fp8_checkpoint,
)

from nanovllm_core import LLM, SamplingParams, SchedulerOutput, Sequence
from nanovllm_core.testing import GPU_TEST_SHAPE, PARITY_PROMPTS, write_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WAYS = ["quantized at load", "fp8", "compressed-tensors"]
PROMPTS_SHORT = PARITY_PROMPTS[:3]


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
    from transformers import AutoModelForCausalLM

    path, settings, reference = checkpoints[way]
    llm = LLM(str(path), plugins={"attention": "triton"}, kvcache_block_size=64, max_model_len=1024,
              num_kvcache_blocks=64, max_num_seqs=32, **settings)  # fmt: skip
    assert llm.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS_SHORT, greedy, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).cuda().eval()
    errors = []
    with torch.no_grad():
        for prompt in PARITY_PROMPTS[1:4]:
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            errors.append(((last_token_logits(llm, prompt) - ref).norm() / ref.norm()).item())
        want = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS_SHORT]  # fmt: skip
    agree = [sum(a == b for a, b in zip(o, w)) / 16 for o, w in zip(ours, want)]
    print(f"\n{way}: logits rel. error against float32 on the dequantized weights {errors}; tokens equal {agree}")
    assert max(errors) < 0.1, errors  # bf16 activations alone: about 0.01-0.02; FP8 activations add a few percent
    assert all(o[:2] == w[:2] for o, w in zip(ours, want)), (ours, want)


from __future__ import annotations

from pathlib import Path

import torch

from nanovllm_core.demo import TINY_CHAT_TEMPLATE, TINY_CORPUS, build_tokenizer, write_tiny_checkpoint

__all__ = [
    "GPU_TEST_SHAPE", "PARITY_PROMPTS", "TINY_CHAT_TEMPLATE", "TINY_CORPUS", "build_tokenizer", "hf_greedy",
    "write_tiny_checkpoint",
]

# The GPU tests' checkpoint shape: Qwen3-0.6B's attention (16 query / 8 KV heads of 128, which the GPU kernels
# and their CUDA graphs take) on two small layers:
# ``write_tiny_checkpoint(path, dtype=torch.bfloat16, **GPU_TEST_SHAPE)``.
GPU_TEST_SHAPE: dict[str, int] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
)

# The GPU parity prompts (5 to 511 tokens of that vocabulary), compared token for token across backends and ranks.
PARITY_PROMPTS: list[list[int]] = [
    [(7 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 33, 130, 260, 511])
]


def hf_greedy(path: str | Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: ``transformers`` greedy ``generate`` (float32, CPU, EOS ignored), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=None,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs

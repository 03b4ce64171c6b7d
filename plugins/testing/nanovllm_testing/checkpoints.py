from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanovllm_core.demo import TINY_CHAT_TEMPLATE, TINY_CORPUS, build_tokenizer, write_tiny_checkpoint

__all__ = [
    "GPU_TEST_SHAPE", "PARITY_PROMPTS", "TINY_CHAT_TEMPLATE", "TINY_CORPUS", "build_tokenizer", "hf_greedy",
    "hf_greedy_tokens", "rewrite_checkpoint", "tiny_checkpoint_fixture", "write_tiny_checkpoint",
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
    return [hf_greedy_tokens(model, ids, max_new_tokens) for ids in prompts]


def hf_greedy_tokens(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """The ``max_new_tokens`` greedy tokens a ``transformers`` model generates after ``ids`` on its own device,
    EOS ignored."""
    prompt = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def tiny_checkpoint_fixture(arch: str = "qwen3", scope: str = "session", **options: Any) -> Any:
    """A pytest fixture giving a tiny checkpoint (``write_tiny_checkpoint(path, arch, **options)``) written once
    per ``scope``; the name it is assigned to is the fixture's: ``qwen2_path = tiny_checkpoint_fixture("qwen2")``."""
    import pytest

    @pytest.fixture(scope=scope)
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return write_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **options)

    return checkpoint


def rewrite_checkpoint(
    src: str | Path,
    dst: str | Path,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    config_update: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with every tensor replaced by what ``convert(name, tensor)``
    returns (``{}`` drops it; several entries add tensors, e.g. a weight and its scale), into one safetensors
    file, and ``config.json`` edited in place by ``config_update``: how a quantization plugin's tests write
    quantized checkpoints and their dequantized references from a tiny 16-bit one."""
    from safetensors.torch import save_file

    from nanovllm_core.loader import iter_safetensors

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(src):
        tensors.update(convert(name, tensor))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config_update is not None:
        config = json.loads((dst / "config.json").read_text())
        config_update(config)
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

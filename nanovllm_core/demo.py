"""Random-weight checkpoints written with ``transformers`` and a ``tokenizers`` tokenizer trained on a small
built-in corpus: the embedded demo (``nanovllm generate --demo``) and ``nanovllm bench``'s random weights need no
download. The test kits build on the same writer (``nanovllm_testing``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

if TYPE_CHECKING:
    import torch

TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "To be or not to be, that is the question. All that glitters is not gold. "
    "Knowledge is power; time is money; practice makes perfect. Hello world! "
    "In the beginning the universe was created. This has made a lot of people very angry. "
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" "
)

# ChatML-style, as Qwen's (without its tool and thinking parts): enough for LLM.chat and /v1/chat/completions.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in corpus, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def write_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    max_shard_size: str | None = None,
    chat_template: str | None = TINY_CHAT_TEMPLATE,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` ("qwen3", "qwen2" or "qwen3_moe") and its tokenizer into
    ``path``. ``config_overrides`` go to the HF config, e.g. for "qwen3_moe": ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
    ``mlp_only_layers``.

    ``init_std`` is larger than HF's default so that greedy decoding of random weights is not a run of one
    repeated token, which would make a parity test weak. ``max_shard_size`` (e.g. ``"50KB"``) writes
    several safetensors shards with an index. ``chat_template`` is saved with the tokenizer (a ChatML-style
    one by default; None writes a tokenizer without a chat template).
    """
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; allowed: {', '.join(ARCHITECTURES)}")
    config_name, model_name = ARCHITECTURES[arch]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[model_name],
        **config_overrides,
    )
    import torch  # here: the CLI imports this module for the demo's path, and torch loads only to write weights

    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype or torch.float32)
    with torch.no_grad():  # norms start at 1.0; jitter them so a wrong norm wiring cannot pass
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("bias"):
                param.normal_(0, init_std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.chat_template = chat_template  # None: a tokenizer without one
    tokenizer.save_pretrained(path)
    return path


DEMO_MAX_MODEL_LEN = 512
"""``max_model_len`` of the demo checkpoint unless set: its KV cache then fits the CPU default comfortably."""


def demo_checkpoint_dir() -> Path:
    cache = Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))
    return cache / "demo-qwen3-tiny"


def write_once(path: Path, write: Callable[[Path], object]) -> Path:
    """``path``, a checkpoint folder made by ``write(folder)`` unless it is whole already (its ``config.json``).
    One process writes it, holding a lock beside it (the others wait, then find it whole), into a temporary
    sibling renamed to ``path`` when done, so that no process ever reads a half-written checkpoint. What a writer
    stopped midway left (its temporary folder, or a ``path`` without ``config.json``) is removed by the next."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.parent / f".{path.name}.lock"):
        if (path / "config.json").is_file():
            return path
        partial = f".{path.name}.partial-"
        for leftover in [*path.parent.glob(partial + "*"), path]:
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=partial, dir=path.parent))
        try:
            write(tmp)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_demo_checkpoint() -> Path:
    """The embedded demo: a tiny random-weight Qwen3 written on first use (no download is possible)."""
    path = demo_checkpoint_dir()
    if not (path / "config.json").is_file():
        print(f"writing the demo checkpoint (tiny random-weight Qwen3) to {path}", file=sys.stderr)
    return write_once(path, lambda to: write_tiny_checkpoint(to, "qwen3", hidden_size=128, intermediate_size=256,
                                                            num_layers=4))  # fmt: skip

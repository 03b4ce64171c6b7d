"""Structured output's cost: nano-vllm's workload free, then the same workload with every request constrained by
one JSON schema, back to back in one engine.

    python benchmarks/structured_output.py [--shape qwen3-0.6b] [--backend xgrammar] [--attention triton]
                                           [--num-seqs 256] [--tokenizer-vocab 151669] [--json PATH]

The constraint is a JSON array of at least ``--min-items`` short strings: no output can complete it within its
``max_tokens``, so every constrained request runs to its length like the free ones (``ignore_eos``) and both runs
do the same work; only the grammar's per-step cost differs (the bitmask filled on the host, masked on the device).
Each run draws its own prompts (nano-vllm's lengths, fresh token ids: the prefix cache has seen neither). Also
timed: the first token of one request alone, free, with its schema compiled (the cache warm) and with a schema
never seen (compilation included).

The random-weight checkpoint's tokenizer is the tiny built-in one, whose few hundred tokens make a grammar's
masks cheap. ``--tokenizer-vocab N`` puts a synthetic byte-level BPE tokenizer of N tokens in its place (151669:
Qwen3's count), built from random merges of letters, digits, spaces and JSON's punctuation, so that the grammar
engine works through a vocabulary of a real model's size.

``--mask-cost`` runs no model: it times the host's part of a constrained step (the backend's masks for
``--num-seqs`` rows, then advancing each grammar over a random allowed token), for xgrammar with its
``max_threads`` at 1, 8 and 16.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="random-weight shape of `nanovllm bench --shape`")
    parser.add_argument("--model", help="a checkpoint folder instead of the random-weight shape")
    parser.add_argument("--backend", default="xgrammar", help="structured-output backend (default: xgrammar)")
    parser.add_argument("--attention", default="triton", help="attention backend (default: triton)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--min-items", type=int, default=1100, help="the schema's minItems (above every max_tokens)")
    parser.add_argument("--tokenizer-vocab", type=int, default=0, metavar="N",
                        help="a synthetic BPE tokenizer of N tokens in place of the checkpoint's (0: the checkpoint's)")
    parser.add_argument("--mask-cost", action="store_true", help="time the host's masks and advances, no model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser


def schema(min_items: int, tag: str = "") -> dict:
    return {"type": "array", "items": {"type": "string", "maxLength": 6, "description": tag}, "minItems": min_items}


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> object:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens: ``<|endoftext|>`` and ``<|pad|>`` first (the ids of the
    checkpoint's own), the 256 byte symbols, then tokens of up to 12 characters, each a merge of a token before
    it and one character drawn mostly from letters, then spaces, digits and JSON's punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1}
    for symbol in alphabet:
        vocab[symbol] = len(vocab)
    weighted = [(c, 8) for c in "etaoinshrdlucmfwypvbgkqjxz"] + [(c, 2) for c in "ETAOINSHRDLUCMFWYPVBGKQJXZ"]
    weighted += [("Ġ", 20), ("Ċ", 2), ("ĉ", 1)] + [(c, 2) for c in "0123456789"] + [(c, 2) for c in '{}[]":,._-']
    chars, weights = zip(*weighted)
    rng = random.Random(seed)
    tokens: list[str] = []
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        left = rng.choice(tokens) if tokens and rng.random() < 0.7 else rng.choices(chars, weights)[0]
        right = rng.choices(chars, weights)[0]
        token = left + right
        if len(token) > 12 or token in vocab:
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        tokens.append(token)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def with_tokenizer(checkpoint: Path, vocab_size: int) -> Path:
    """A folder beside ``checkpoint`` with its files (linked) and :func:`synthetic_tokenizer` in place of its own."""
    path = checkpoint.with_name(f"{checkpoint.name}-vocab{vocab_size}")
    if not (path / "tokenizer.json").is_file():
        path.mkdir(exist_ok=True)
        for file in checkpoint.iterdir():
            if not file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (path / file.name).unlink(missing_ok=True)
                (path / file.name).symlink_to(file.resolve())
        synthetic_tokenizer(vocab_size).save_pretrained(path)
    return path


def mask_cost(args: argparse.Namespace, model: str) -> None:
    """Per step: the backend's masks for ``args.num_seqs`` rows, then each grammar advanced over a random allowed
    token (a step of constrained decoding without the model), by the backend's thread count."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from nanovllm_core import StructuredOutputsParams
    from nanovllm_core.engine.structured_output import StructuredOutputManager, select_structured_output_backend
    from nanovllm_core.plugins import get_registry

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    backend_cls = select_structured_output_backend(get_registry(), args.backend)
    constraint = StructuredOutputsParams(json=schema(args.min_items))
    for threads in (1, 8, 16) if args.backend == "xgrammar" else (None,):  # the others choose their own threads
        options = {"max_threads": threads} if threads else {}
        manager = StructuredOutputManager.build(backend_cls, options, tokenizer, vocab_size,
                                                frozenset({tokenizer.eos_token_id}))  # fmt: skip
        compiled = manager.compile(constraint).result()
        seqs = [argparse.Namespace(grammar=manager.new_grammar(compiled)) for _ in range(args.num_seqs)]
        rows, rng, fill, advance, steps = list(range(len(seqs))), random.Random(0), 0.0, 0.0, 0
        for step in range(60):
            start = time.perf_counter()
            bitmask = manager.bitmask(seqs, rows)
            filled = time.perf_counter()
            tokens = []
            for row in bitmask:  # a random allowed token per row (not timed)
                words = torch.nonzero(row).flatten().tolist()
                word = rng.choice(words)
                bits = int(row[word]) & 0xFFFFFFFF
                tokens.append(32 * word + rng.choice([b for b in range(32) if bits >> b & 1]))
            begun = time.perf_counter()
            for seq, token in zip(seqs, tokens):
                seq.grammar.accept_tokens("mask-cost", [token])
            if step >= 10:  # the first steps fill xgrammar's caches
                fill, advance, steps = fill + filled - start, advance + time.perf_counter() - begun, steps + 1
        manager.shutdown()
        print(f"{args.backend}, {len(tokenizer)} tokens, threads {threads or 'its own'}: masks "
              f"{fill / steps * 1e3:.2f} ms a step, advancing {advance / steps * 1e3:.2f} ms a step ({len(seqs)} rows)")


def fresh_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, 10000) for _ in range(n)] for n in lengths]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_seqs < 1 or min(args.max_input_len, args.max_output_len) < 100:
        raise SystemExit("error: --num-seqs at least 1, --max-input-len and --max-output-len at least 100")
    import torch
    from nanovllm_bench.offline import random_checkpoint, workload

    from nanovllm_core import LLM, SamplingParams, StructuredOutputsParams

    model = args.model or str(random_checkpoint(args.shape, torch.bfloat16))
    if args.tokenizer_vocab:
        model = str(with_tokenizer(Path(model), args.tokenizer_vocab))
    if args.mask_cost:
        mask_cost(args, model)
        return 0
    plugins = {"attention": args.attention, "structured_output_backend": args.backend}
    llm = LLM(model, plugins=plugins, device=args.device)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)  # nano-vllm's draws
    lengths = [len(p) for p in prompts]
    constraint = StructuredOutputsParams(json=schema(args.min_items))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, structured_outputs=constraint), use_tqdm=False)
    result: dict = {"model": model, "backend": args.backend, "attention": args.attention, "num_seqs": args.num_seqs,
                    "tokenizer_size": len(llm.get_tokenizer())}  # fmt: skip
    for seed, name, so in ((1, "free", None), (2, "constrained", constraint)):
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, structured_outputs=so)
                  for n in max_tokens]  # fmt: skip
        start = time.time()
        outputs = llm.generate(fresh_prompts(lengths, seed), params, use_tqdm=False)
        seconds = time.time() - start
        total = sum(len(out.outputs[0].token_ids) for out in outputs)
        reasons = sorted({out.outputs[0].finish_reason for out in outputs})
        result[name] = {"output_tokens": total, "seconds": seconds, "output_tok_per_s": total / seconds,
                        "finish_reasons": reasons}  # fmt: skip
        print(f"{name}: {total} tok in {seconds:.2f} s, {total / seconds:.0f} tok/s (finish reasons {reasons})")
    result["constrained_over_free"] = result["constrained"]["output_tok_per_s"] / result["free"]["output_tok_per_s"]
    print(f"constrained / free throughput: {result['constrained_over_free']:.3f}")
    single = [[7] * 512]
    ttft = {}
    for i, (name, so) in enumerate((("free", None), ("warm grammar", constraint),
                                    ("new grammar", None)) * 3):  # fmt: skip
        if name == "new grammar":  # a schema no request used: compiled before this request's first step
            so = StructuredOutputsParams(json=schema(3, f"new {i}"))
        start = time.perf_counter()
        out = llm.generate([[p + 17 * i for p in single[0]]], SamplingParams(max_tokens=1, structured_outputs=so),
                           use_tqdm=False)[0]  # fmt: skip
        ttft.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        assert len(out.outputs[0].token_ids) == 1
    result["first_token_ms"] = {name: min(ms) for name, ms in ttft.items()}
    print("one request alone, prompt of 512, first token (best of 3):",
          ", ".join(f"{k} {v:.1f} ms" for k, v in result["first_token_ms"].items()))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Accuracy of FP8 beside 16 bits: the FP8 KV cache (``kv_cache_dtype = "fp8"``) against the model-dtype cache, or
FP8 weights (``quantization = "fp8"``, nanovllm-quant-fp8) against the checkpoint's bf16 weights (``--compare
weights``).

    python benchmarks/fp8_accuracy.py [--shape test-tiny|tiny|qwen3-0.6b|...] [--model PATH] [--device cuda|cpu]
                                      [--attention triton|torch|...] [--num-tokens 256] [--json PATH]
                                      [--compare kv-cache|weights]

On a random-weight checkpoint (or ``--model``), with the same engine settings for both variants (``auto``, the
16-bit one, and ``fp8``):

1. logit error against float32 ``transformers``: the relative L2 error of the last prompt token's logits, for
   prompts 2-4 of the parity prompts, the metric ``tests/gpu/test_gpu_engine.py`` uses; ``transformers`` in the
   model's dtype is measured the same way, as the yardstick of 16-bit rounding;
2. greedy agreement over ``--num-tokens`` generated tokens on the parity prompts (``PROMPTS`` of
   ``tests/gpu/test_gpu_engine.py``): the fraction of positions with the same token and each prompt's first
   divergence (``--num-tokens`` when none), fp8 against auto and each against float32
   ``transformers``. Random weights give near-tied logits, so one flipped token changes all that follows: a free
   run's agreement is a pessimistic measure, the logit error the direct one.

Shapes: ``test-tiny`` is the GPU tests' checkpoint (2 layers, hidden 256, Qwen3-0.6B's attention: 16 query and 8 KV
heads of 128); the others are the random-weight shapes of ``nanovllm bench --shape`` (HF-like ``init_std=0.02``;
``tiny`` has head_dim 32, which only the ``torch`` backend runs). Defaults: CUDA when available with the ``triton``
backend and bfloat16, else the CPU with the ``torch`` backend (bfloat16 too: ``--dtype``). Without ``--json`` the
results go to RESULTS_DIR/fp8_accuracy/SHAPE.json (SHAPE-weights.json with ``--compare weights``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import out_dir, write_json
from nanovllm_bench.offline import SHAPES, random_checkpoint
from nanovllm_testing import GPU_TEST_SHAPE, PARITY_PROMPTS, hf_greedy_tokens, write_tiny_checkpoint

from nanovllm_core import LLM, SamplingParams, SchedulerOutput, Sequence

PROMPTS = PARITY_PROMPTS  # the GPU parity tests' prompts (tests/gpu/test_gpu_engine.py, the FP8 engine test)
LOGIT_PROMPTS = slice(1, 4)  # the prompts whose last-token logits the GPU tests compare
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VARIANTS = {  # --compare: the engine settings of the 16-bit variant (auto) and the FP8 one
    "kv-cache": {"auto": {"kv_cache_dtype": "auto"}, "fp8": {"kv_cache_dtype": "fp8"}},
    "weights": {"auto": {}, "fp8": {"quantization": "fp8"}},
}
CACHES = ("auto", "fp8")


def checkpoint(shape: str, dtype: torch.dtype) -> Path:
    """A random-weight checkpoint of ``shape`` in ``dtype``, written once under /tmp."""
    if shape != "test-tiny":
        return Path(random_checkpoint(shape, dtype))
    path = Path("/tmp") / f"nanovllm-fp8-accuracy-test-tiny-{str(dtype).split('.')[-1]}"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, "qwen3", dtype=dtype, **GPU_TEST_SHAPE)
    return path


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref).norm() / ref.norm()).item()


def agreement(ours: list[list[int]], ref: list[list[int]], num_tokens: int) -> dict[str, Any]:
    """Fraction of equal tokens position by position, and each prompt's first differing position."""
    same = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), num_tokens) for x, y in zip(ours, ref)]
    return {"fraction_equal": same / (num_tokens * len(ref)), "first_divergence": first}


def transformers_reference(
    path: Path, device: torch.device, dtype: torch.dtype, num_tokens: int
) -> tuple[list[torch.Tensor], list[list[int]], list[torch.Tensor]]:
    """float32 ``transformers``: last-token logits of the logit prompts and ``num_tokens`` greedy tokens per
    prompt; and the last-token logits of ``transformers`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p], device=device)).logits[0, -1].float() for p in PROMPTS[LOGIT_PROMPTS]]
    tokens = [hf_greedy_tokens(model, p, num_tokens) for p in PROMPTS]
    del model
    low = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        low_logits = [low(torch.tensor([p], device=device)).logits[0, -1].float() for p in PROMPTS[LOGIT_PROMPTS]]
    del low
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return logits, tokens, low_logits


def engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """One prefill of ``prompt`` through the runner (as ``tests/gpu/test_gpu_engine.py`` does): last-token logits."""
    seq = Sequence(prompt, SamplingParams(temperature=0))
    if not llm.block_manager.allocate(seq, seq.num_uncomputed_tokens):
        raise RuntimeError(f"no KV blocks for a {len(prompt)}-token prompt")
    seq.num_computed_tokens = 0  # compute every position, even if the prefix cache holds some
    try:
        return llm.runner.compute_logits(llm.runner.prepare(SchedulerOutput([seq], [seq.num_tokens]))).float()[0]
    finally:
        llm.block_manager.free(seq)


def run_engine(
    path: Path, settings: dict[str, str], args: argparse.Namespace, num_tokens: int
) -> tuple[list[torch.Tensor], list[list[int]], str]:
    """Last-token logits of the logit prompts, greedy tokens of every prompt, and the KV cache's storage type."""
    block = args.block_size
    longest = max(map(len, PROMPTS)) + num_tokens
    llm = LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        plugins={"attention": args.attention},
        kvcache_block_size=block,
        max_model_len=longest,
        num_kvcache_blocks=len(PROMPTS) * -(-longest // block) + 1,
        max_num_seqs=len(PROMPTS),
        enforce_eager=args.enforce_eager,
        **settings,
    )
    try:
        cache = f"{llm.runner.kv_cache.dtype}".removeprefix("torch.")
        if llm.config.kv_cache_dtype == "fp8":
            cache += " (e4m3 values + float32 scales)"
        logits = [engine_logits(llm, p) for p in PROMPTS[LOGIT_PROMPTS]]
        greedy = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return logits, tokens, cache


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    path = Path(args.model) if args.model else checkpoint(args.shape, dtype)
    n = args.num_tokens
    start = time.perf_counter()
    ref_logits, ref_tokens, low_logits = transformers_reference(path, device, dtype, n)
    engines = {name: run_engine(path, VARIANTS[args.compare][name], args, n) for name in CACHES}
    logits_error = {
        name: [relative_error(ours, ref) for ours, ref in zip(engines[name][0], ref_logits)] for name in CACHES
    }
    logits_error[f"transformers_{args.dtype}"] = [relative_error(a, b) for a, b in zip(low_logits, ref_logits)]
    tokens = {name: engines[name][1] for name in CACHES}
    return {
        "model": str(path) if args.model else args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "attention": args.attention,
        "compare": args.compare,
        "variants": VARIANTS[args.compare],
        "enforce_eager": args.enforce_eager,
        "kvcache_block_size": args.block_size,
        "kv_cache": {name: engines[name][2] for name in CACHES},
        "prompt_lengths": [len(p) for p in PROMPTS],
        "logit_prompt_lengths": [len(p) for p in PROMPTS[LOGIT_PROMPTS]],
        "num_tokens": n,
        "logits_rel_l2_error_vs_float32_transformers": logits_error,
        "greedy_agreement": {
            "fp8_vs_auto": agreement(tokens["fp8"], tokens["auto"], n),
            "auto_vs_transformers": agreement(tokens["auto"], ref_tokens, n),
            "fp8_vs_transformers": agreement(tokens["fp8"], ref_tokens, n),
        },
        "tokens": {**tokens, "transformers": ref_tokens},
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
    }


def report(result: dict[str, Any]) -> str:
    errors = result["logits_rel_l2_error_vs_float32_transformers"]
    lines = [
        f"{result['model']} on {result['device']}, {result['dtype']}, attention {result['attention']}; "
        f"auto = {result['variants']['auto']}, fp8 = {result['variants']['fp8']}; "
        f"KV caches: auto = {result['kv_cache']['auto']}, fp8 = {result['kv_cache']['fp8']}",
        f"last-token logits, relative L2 error against float32 transformers "
        f"(prompts of {result['logit_prompt_lengths']} tokens):",
    ]
    for name, values in errors.items():
        lines.append(f"  {name:22s} " + "  ".join(f"{v:.4f}" for v in values))
    lines.append(f"greedy agreement over {result['num_tokens']} tokens, prompts of {result['prompt_lengths']} tokens:")
    for pair, a in result["greedy_agreement"].items():
        lines.append(f"  {pair:22s} {a['fraction_equal']:.3f} equal, first divergence {a['first_divergence']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["test-tiny", *sorted(SHAPES)], default="test-tiny")
    parser.add_argument("--model", help="a checkpoint directory instead of a random-weight --shape")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the model's (and default cache's)")
    parser.add_argument("--attention", help="attention backend (default: triton on CUDA, torch on the CPU)")
    parser.add_argument("--block-size", type=int, default=256, help="kvcache_block_size")
    parser.add_argument("--num-tokens", type=int, default=256, help="greedy tokens generated per prompt (default 256)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--compare", choices=sorted(VARIANTS), default="kv-cache",
        help="kv-cache: the fp8 KV cache against the model-dtype one (default); weights: FP8 weights "
        "(quantization fp8, nanovllm-quant-fp8) against the checkpoint's",
    )
    parser.add_argument("--json", help="write the results as JSON to this file (default: in --results-dir)")
    parser.add_argument(
        "--results-dir", default="results", help="without --json: RESULTS_DIR/fp8_accuracy/ (default results)"
    )
    args = parser.parse_args(argv)
    if args.num_tokens < 1:
        parser.error(f"--num-tokens must be at least 1, got {args.num_tokens}")
    if args.attention is None:
        args.attention = "triton" if torch.device(args.device).type == "cuda" else "torch"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = measure(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    else:
        name = Path(args.model).name if args.model else args.shape
        suffix = "-weights" if args.compare == "weights" else ""
        write_json(out_dir(args.results_dir, "fp8_accuracy") / f"{name}{suffix}.json", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

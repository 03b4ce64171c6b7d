"""nano-vllm's ``bench.py``, run on this engine through its public API: a harness outside ``nanovllm bench``.

    python benchmarks/nano_bench.py [--shape qwen3-0.6b|qwen3-8b|tiny] [--model PATH] [--attention triton]
                                    [--kv-cache-dtype auto|fp8] [--num-seqs 256] [--json PATH]

What nano-vllm's script does, step for step: ``random.seed(0)``, ``--num-seqs`` prompts of ``randint(100,
--max-input-len)`` token ids ``randint(0, 10000)``, each with ``SamplingParams(temperature=0.6, ignore_eos=True,
max_tokens=randint(100, --max-output-len))``; one warm-up request; then one ``LLM.generate`` of the whole batch
timed with the wall clock, and the output tokens over that time. Nothing of ``nanovllm bench`` runs: no device
probes, no step records, no bound; only the model's checkpoint is shared (``--shape`` writes the same random-weight
one, ``--model`` takes any). Its throughput is the one to compare with ``nanovllm bench``'s first run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="random-weight shape of `nanovllm bench --shape`")
    parser.add_argument("--model", help="a checkpoint folder instead of the random-weight shape")
    parser.add_argument("--attention", default="triton", help="attention backend (default: triton)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_seqs < 1 or min(args.max_input_len, args.max_output_len) < 100:
        raise SystemExit("error: --num-seqs at least 1, --max-input-len and --max-output-len at least 100")
    import torch
    from nanovllm_bench.offline import random_checkpoint, workload

    from nanovllm_core import LLM, SamplingParams

    model = args.model or str(random_checkpoint(args.shape, torch.bfloat16))
    llm = LLM(model, plugins={"attention": args.attention}, kv_cache_dtype=args.kv_cache_dtype)
    prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)  # nano-vllm's draws
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.time() - start
    total = sum(len(out.outputs[0].token_ids) for out in outputs)  # nano-vllm sums max_tokens: the same here
    print(f"Total: {total}tok, Time: {seconds:.2f}s, Throughput: {total / seconds:.2f}tok/s")
    if args.json:
        result = {"model": model, "attention": args.attention, "kv_cache_dtype": args.kv_cache_dtype,
                  "num_seqs": args.num_seqs, "output_tokens": total, "seconds": seconds,
                  "output_tok_per_s": total / seconds}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

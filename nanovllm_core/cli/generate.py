"""``nanovllm generate``: completions for prompts, offline."""

from __future__ import annotations

import argparse
import sys
import time

from nanovllm_core.cli.engine_flags import add_engine_flags, add_model_flags, model_overrides

DEMO_PROMPTS = ["Hello world!", "The quick brown fox", "To be or not to be, that is the question."]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``nanovllm generate`` to the command's subparsers."""
    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions for prompts. Exits 1 when every prompt failed.",
    )
    add_model_flags(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--seed-request", type=int, default=None, help="sampling seed of every request")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm_core import LLM, SamplingParams

    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed_request,
    )
    llm = LLM(config=args.config, cli_overrides=model_overrides(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    num_out = 0
    for out in outputs:
        completion = out.outputs[0]
        num_out += len(completion.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        if out.error:
            print(f"    error: {out.error}")
        else:
            print(f"    output: {completion.text!r}  ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    if outputs and all(out.error for out in outputs):
        print(f"error: every prompt failed ({len(outputs)} of {len(outputs)})", file=sys.stderr)
        return 1
    if llm.config.data_parallel_size > 1:  # the engines run in replica processes: only their stats are here
        details = (
            f"{llm.config.data_parallel_size} data-parallel replicas; KV cache {llm.stats().num_kv_blocks} blocks of "
            f"{llm.config.kvcache_block_size} tokens in all"
        )
    else:
        details = (
            f"{llm.step_stats.rates_text()}; attention backend {llm.attention_backend_name!r}, device {llm.device}, "
            f"KV cache {llm.runner.num_kvcache_blocks} blocks of {llm.config.kvcache_block_size} tokens"
        )
    print(f"{num_out} output tokens in {elapsed:.2f} s: {num_out / elapsed:,.1f} tok/s ({details})")
    return 0


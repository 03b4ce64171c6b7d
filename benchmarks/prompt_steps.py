"""Steps of prompts alone, through the public API: the wall time of ``LLM.generate`` for a few prompts at once,
each one output token, with and without a shared prefix the prefix cache holds. It shows where prompt steps leave
the CUDA graphs (``cuda_graph_max_mixed_tokens``) for eager launches:

    python benchmarks/prompt_steps.py                                    # the engine's default graph limit
    python benchmarks/prompt_steps.py --cuda-graph-max-mixed-tokens 2048 --profile

Each prompt is ``--prefix`` tokens (fresh, or one prefix shared by every prompt and already cached) then ``--new``
fresh tokens; each count of prompts is timed ``--runs`` times after one untimed run, the median kept. One JSON line
a case; ``--profile`` adds ``torch.profiler``'s table for one step of two fresh prompts. Results go to
RESULTS_DIR/prompt_steps/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from _common import add_common_arguments, out_dir, parse_ints, random_checkpoint, require_positive, user_command


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from nanovllm_core import LLM, SamplingParams

    start = time.perf_counter()
    given = (
        {}
        if args.cuda_graph_max_mixed_tokens is None
        else {"cuda_graph_max_mixed_tokens": args.cuda_graph_max_mixed_tokens}
    )
    llm = LLM(
        str(random_checkpoint(args.shape)),
        plugins={"attention": args.attention},
        max_model_len=args.max_model_len,
        **given,
    )
    start_s = time.perf_counter() - start
    graph_limit = llm.config.cuda_graph_max_mixed_tokens
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randint(0, 10000) for _ in range(n)]

    prefix = fresh(args.prefix)
    llm.generate([prefix + fresh(args.new)], params, use_tqdm=False)  # caches the prefix; the warm-up
    rows = []
    for n in args.prompt_counts:
        for cached in (False, True):
            times = []
            for _ in range(args.runs + 1):
                prompts = [(prefix if cached else fresh(args.prefix)) + fresh(args.new) for _ in range(n)]
                begin = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times.append(1e3 * (time.perf_counter() - begin))
            row = {
                "cuda_graph_max_mixed_tokens": graph_limit,
                "prompts": n,
                "prefix_cached": cached,
                "tokens_computed": n * (args.new if cached else args.prefix + args.new),
                "ms_median": statistics.median(times[1:]),
                "ms_all": [round(t, 2) for t in times],
                "start_s": round(start_s, 1),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prompts = [fresh(args.prefix + args.new) for _ in range(2)]
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape (default qwen3-0.6b)")
    parser.add_argument("--attention", default="triton", help="attention backend (default triton)")
    parser.add_argument(
        "--cuda-graph-max-mixed-tokens", type=int, help="the engine setting (default: the engine's default)"
    )
    parser.add_argument("--prompts", default="2,3,5,8,12", help="counts of prompts a step (default 2,3,5,8,12)")
    parser.add_argument("--prefix", type=int, default=512, help="tokens of each prompt's prefix (default 512)")
    parser.add_argument("--new", type=int, default=700, help="fresh tokens after it (default 700)")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the engine's (default 8192)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs a case, after one untimed (default 5)")
    parser.add_argument("--profile", action="store_true", help="print a profile of one eager-sized step")
    add_common_arguments(parser, dry_run=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_positive(args, "prefix", "new", "runs")
    args.prompt_counts = parse_ints(args.prompts, "prompts")
    rows = measure(args)
    path = out_dir(args.results_dir, "prompt_steps") / f"graphs_{rows[0]['cuda_graph_max_mixed_tokens']}.json"
    command = user_command("benchmarks/prompt_steps.py", argv if argv is not None else sys.argv[1:])
    path.write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

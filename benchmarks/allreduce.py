"""Decode-sized all-reduce on N GPUs of one host: NCCL against PyTorch symmetric memory, eager and in CUDA graphs.

    python benchmarks/allreduce.py [--world-size 2] [--hidden 1024,4096,8192] [--batch 1,2,4,...,256]
                                   [--dtype bfloat16] [--iters 100] [--repeats 5] [--json PATH]
                                   [--results-dir results]

Spawns ``--world-size`` processes itself (no torchrun), one per GPU, in one NCCL group. For every message of
``batch x hidden`` elements (a decode step's activations: each row-parallel layer sums one over the ranks) it
times three all-reduces, each the way ``nanovllm_core.distributed.all_reduce`` runs it:

- ``nccl``: ``torch.distributed.all_reduce`` in place;
- ``one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` (the message copied into a symmetric
  buffer and every peer's copy read and summed, in one kernel);
- ``two_shot``: a copy into the symmetric buffer, then ``torch.ops.symm_mem.two_shot_all_reduce_out``
  (reduce-scatter and all-gather through peer memory);

eagerly (``--iters`` calls in a row: launch cost included, as in prefill steps) and replayed from a CUDA graph
holding ``--graph-ops`` calls (as in decode steps, which replay graphs). A time is the median over
``--repeats`` runs of the mean per call, the slowest rank's. Each path's result is checked against the exact
sum once per size. Prints a table, the environment-variable settings that the graph times support (the engine
takes them from ``NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES`` / ``NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES``), and
writes everything as JSON to ``--json PATH`` (``-`` for stdout), by default RESULTS_DIR/allreduce.json.

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set when
unset, and the script refuses to run with either set to another value; no multimem operation is called.
GPUs only: on a machine without enough CUDA devices it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import parse_ints

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
METHODS = ("nccl", "one_shot", "two_shot")
MODES = ("eager", "graph")
DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"
DEFAULT_HIDDEN = "1024,4096,8192"


def keep_multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        current = os.environ.setdefault(name, value)
        if current != value:
            raise SystemExit(
                f"{name}={current}: this benchmark keeps NVLink multicast off (it can take a shared host's GPUs "
                f"out of service); unset {name} or set it to {value}"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_calls(torch: Any, fn: Any, count: int) -> float:
    """Seconds per call of ``fn`` over ``count`` calls, on the device clock."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count


def worker(
    rank: int, world: int, port: int, shapes: list[tuple[int, int]], args: argparse.Namespace, out_path: str
) -> None:
    import torch
    import torch.distributed as dist

    from nanovllm_core.distributed import SymmMemAllReduce, SymmMemLimits, set_tensor_parallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    set_tensor_parallel(rank, world)
    dtype = getattr(torch, args.dtype)
    warm = torch.ones(1024, dtype=dtype, device=device)
    dist.all_reduce(warm)  # the NCCL communicator exists before any capture
    largest = max(b * h for b, h in shapes) * dtype.itemsize
    symm, symm_error = None, None
    try:
        symm = SymmMemAllReduce(SymmMemLimits(largest, largest if world in (2, 4, 8) else 0), device, dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - measured without it, and the reason is reported
        symm_error = f"{type(exc).__name__}: {exc}"
    available = ["nccl"] + ([] if symm is None else ["one_shot"] + (["two_shot"] if world in (2, 4, 8) else []))

    def op(method: str, x: torch.Tensor) -> Any:
        if method == "nccl":
            return lambda: dist.all_reduce(x)
        return lambda: symm(x, method)

    rows = []
    for batch, hidden in shapes:
        x = torch.empty((batch, hidden), dtype=dtype, device=device)
        row: dict[str, Any] = {"batch": batch, "hidden": hidden, "numel": batch * hidden}
        row["bytes"] = batch * hidden * dtype.itemsize
        times = torch.full((len(METHODS), len(MODES)), -1.0, dtype=torch.float64)  # -1: not run
        correct = {}
        for m, method in enumerate(METHODS):
            if method not in available:
                continue
            run = op(method, x)
            x.fill_(rank + 1)
            run()
            torch.cuda.synchronize()
            correct[method] = bool((x == world * (world + 1) // 2).all().item())
            x.zero_()  # timing on zeros: repeated sums stay finite
            dist.barrier(device_ids=[rank])
            eager = []
            for _ in range(args.repeats):
                dist.barrier(device_ids=[rank])
                eager.append(_time_calls(torch, run, args.iters))
            times[m, 0] = statistics.median(eager)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(args.graph_ops):
                    run()
            torch.cuda.synchronize()
            replays = max(1, args.iters // args.graph_ops)
            replayed = []
            for _ in range(args.repeats):
                dist.barrier(device_ids=[rank])
                replayed.append(_time_calls(torch, graph.replay, replays) / args.graph_ops)
            times[m, 1] = statistics.median(replayed)
            del graph
        slowest = times.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        flags = torch.tensor([int(correct.get(m, True)) for m in METHODS], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        slowest = slowest.cpu()
        row["us"] = {
            method: {
                mode: (None if slowest[m, k].item() < 0 else round(slowest[m, k].item() * 1e6, 2))
                for k, mode in enumerate(MODES)
            }
            for m, method in enumerate(METHODS)
        }
        row["correct"] = {m: bool(flags[i].item()) for i, m in enumerate(METHODS) if m in available}
        rows.append(row)
    if rank == 0:
        summary = {
            "rows": rows,
            "symm_mem_error": symm_error,
            "torch": torch.__version__,
            "nccl": str(torch.cuda.nccl.version()),
            "device": torch.cuda.get_device_name(device),
            "p2p": all(torch.cuda.can_device_access_peer(0, peer) for peer in range(1, world)),
        }
        with open(out_path, "w") as f:
            json.dump(summary, f)
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def suggest(rows: list[dict[str, Any]], mode: str = "graph") -> dict[str, int]:
    """The largest message sizes up to which one-shot, then two-shot, beat the other paths in every measured
    size, in ``mode`` (0: never). Sizes are taken from smallest up; the first size a path loses ends its range."""
    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        for method, t in row["us"].items():
            if t[mode] is not None and row["correct"].get(method, False):
                entry = by_size.setdefault(row["bytes"], {})
                entry[method] = max(entry.get(method, 0.0), t[mode])  # two shapes of one size: the slower
    limits = {"one_shot": 0, "two_shot": 0}
    current = "one_shot"  # the range being extended: one-shot's first, then two-shot's
    for nbytes in sorted(by_size):
        times = by_size[nbytes]
        best = min(times, key=times.get)
        if current == "one_shot" and best == "one_shot":
            limits["one_shot"] = nbytes
            continue
        current = "two_shot"
        if best == "two_shot":
            limits["two_shot"] = nbytes
        elif best == "nccl":
            break
    if limits["two_shot"] and limits["two_shot"] < limits["one_shot"]:
        limits["two_shot"] = 0
    return limits


def print_table(result: dict[str, Any]) -> None:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    head = ["batch x hidden", "KiB"] + [f"{m} {mode}" for mode in MODES for m in METHODS] + ["best graph"]
    lines = [head]
    for row in result["rows"]:
        us = row["us"]
        graph = {m: us[m]["graph"] for m in METHODS if us[m]["graph"] is not None}
        best = min(graph, key=graph.get) if graph else "-"
        wrong = [m for m, ok in row["correct"].items() if not ok]
        lines.append(
            [f"{row['batch']} x {row['hidden']}", f"{row['bytes'] / 1024:g}"]
            + [cell(us[m][mode]) for mode in MODES for m in METHODS]
            + [best + (f" (WRONG SUM: {', '.join(wrong)})" if wrong else "")]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print(
        f"all-reduce, microseconds per call, {result['world_size']} x {result['device']}, {result['dtype']}, "
        f"torch {result['torch']}, NCCL {result['nccl']}, peer access {result['p2p']}"
    )
    for line in lines:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))
    if result["symm_mem_error"]:
        print(f"symmetric memory unavailable ({result['symm_mem_error']}): NCCL only")
    s = result["suggested"]
    print(
        f"graph times support: NANOVLLM_ALLREDUCE_ONE_SHOT_MAX_BYTES={s['one_shot']} "
        f"NANOVLLM_ALLREDUCE_TWO_SHOT_MAX_BYTES={s['two_shot']} (0: NCCL for every size)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", default=DEFAULT_HIDDEN, help=f"hidden sizes (default {DEFAULT_HIDDEN})")
    parser.add_argument("--batch", default=DEFAULT_BATCHES, help=f"rows per message (default {DEFAULT_BATCHES})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=100, help="calls per timed run")
    parser.add_argument("--graph-ops", type=int, default=10, help="calls captured in one CUDA graph")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path (the median is kept)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here ('-': stdout; default: in "
                        "--results-dir)")
    parser.add_argument("--results-dir", default="results", help="without --json: RESULTS_DIR/ (default results)")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        raise SystemExit(f"--world-size {args.world_size}: an all-reduce needs at least 2 GPUs")
    if min(args.iters, args.graph_ops, args.repeats) < 1:
        raise SystemExit("--iters, --graph-ops and --repeats must be at least 1")
    shapes = [(b, h) for h in parse_ints(args.hidden, "hidden") for b in parse_ints(args.batch, "batch")]
    keep_multicast_off()

    import torch
    import torch.multiprocessing as mp

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args.world_size:
        print(
            f"benchmarks/allreduce.py measures GPU all-reduce and needs {args.world_size} CUDA devices; this machine "
            f"has {found} (torch {torch.__version__}). Run it on a machine with {args.world_size} GPUs.",
            file=sys.stderr,
        )
        return 2
    ctx = mp.get_context("spawn")
    out_path = os.path.join(tempfile.mkdtemp(prefix="allreduce-"), "rank0.json")
    port = free_port()
    started = time.perf_counter()
    procs = [
        ctx.Process(target=worker, args=(r, args.world_size, port, shapes, args, out_path), name=f"allreduce-rank{r}")
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode != 0]
    if failed or not os.path.exists(out_path):
        print(f"the benchmark failed: {', '.join(failed) or 'rank 0 sent no result'}", file=sys.stderr)
        return 1
    with open(out_path) as f:
        result = json.load(f)
    shutil.rmtree(os.path.dirname(out_path))
    result.update(
        world_size=args.world_size,
        dtype=args.dtype,
        iters=args.iters,
        graph_ops=args.graph_ops,
        repeats=args.repeats,
        seconds=round(time.perf_counter() - started, 1),
        env={name: os.environ.get(name) for name in MULTICAST_OFF},
    )
    result["suggested"] = suggest(result["rows"])
    result["suggested_eager"] = suggest(result["rows"], "eager")
    print_table(result)
    if args.json == "-":
        print(json.dumps(result, indent=1))
        return 0
    path = args.json or os.path.join(args.results_dir, "allreduce.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

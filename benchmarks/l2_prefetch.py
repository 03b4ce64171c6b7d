"""Does prefetching the next GEMM's weights into L2 shorten a decode step's kernel chain? (GPU only)

A stand-in for the Qwen3-0.6B decode step: 28 layers, each four cuBLAS GEMMs (qkv, o, gate_up, down) with
distinct weights (840 MB in all, so nothing stays in the 50 MB L2 from one replay to the next) and, between
them, the small kernels of a layer (norms, rotary, KV store, SiLU: elementwise kernels on ``[M, hidden]``) and
optionally a KV read of ``M x context`` tokens (the decode attention's bytes). Captured in one CUDA graph and
replayed; variants:

- ``none``: the chain as is.
- ``side``: at each GEMM, a one-program kernel on a side stream issues ``cp.async.bulk.prefetch.L2`` for the
  next GEMM's weights, so they load while this GEMM and the small kernels after it run.
- ``side2``: the same, two GEMMs ahead.
- ``inline``: the prefetch kernel on the main stream (its launch is on the critical path).

Prints one JSON line per (rows, context, variant): microseconds per replayed step.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

HIDDEN, QKV, INTER, Q_SIZE, LAYERS = 1024, 4096, 3072, 2048, 28
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16


@triton.jit
def _prefetch_l2(PTR, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.where(offs < nbytes, tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [PTR + offs, size], dtype=tl.int32, is_pure=False, pack=1,
    )


def prefetch(weight: torch.Tensor, chunk: int, block: int) -> None:
    data = weight.view(torch.uint8).view(-1)
    grid = (triton.cdiv(triton.cdiv(data.numel(), chunk), block),)
    _prefetch_l2[grid](data, data.numel(), CHUNK=chunk, BLOCK=block, num_warps=max(1, block // 32))


def build(rows: int, context: int, variant: str, chunk: int, block: int):
    dev = torch.device("cuda")
    shapes = [(QKV, HIDDEN), (HIDDEN, Q_SIZE), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [[torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for s in shapes] for _ in range(LAYERS)]
    order = [w for layer in weights for w in layer]
    x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    small = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    kv_tokens = rows * context
    # four slices used in turn, so that a small batch's KV does not stay in L2 from one layer to the next
    kv = None
    if kv_tokens:
        kv = torch.randn(4, rows, context * KV_BYTES_PER_TOKEN // 2, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=0)
    main = torch.cuda.current_stream()
    ahead = {"side": 1, "side2": 2, "inline": 1}.get(variant, 0)

    def fillers(n: int) -> None:
        for _ in range(n):
            small.mul_(1.0001)

    def step() -> None:
        if variant.startswith("side"):
            side.wait_stream(main)
        g = 0
        for li, layer in enumerate(weights):
            outs = []
            for i, w in enumerate(layer):
                nxt = g + ahead
                if ahead and nxt < len(order):
                    if variant == "inline":
                        prefetch(order[nxt], chunk, block)
                    else:
                        ev = torch.cuda.Event()
                        ev.record(main)
                        side.wait_event(ev)
                        with torch.cuda.stream(side):
                            prefetch(order[nxt], chunk, block)
                inp = x if i != 1 and i != 3 else None
                if i == 0:
                    fillers(1)  # input norm
                    outs.append(torch.nn.functional.linear(inp, w))
                    fillers(2)  # q/k norm + rotary, KV store
                    if kv is not None:
                        kv[li % 4].sum(dim=1, dtype=torch.float32)  # the attention's KV bytes
                    else:
                        fillers(1)
                elif i == 1:
                    outs.append(torch.nn.functional.linear(outs[0][:, :Q_SIZE], w))
                    fillers(1)  # post-attention norm
                elif i == 2:
                    outs.append(torch.nn.functional.linear(inp, w))
                    fillers(1)  # SiLU and mul
                else:
                    outs.append(torch.nn.functional.linear(outs[2][:, :INTER], w))
                g += 1
        if variant.startswith("side"):
            main.wait_stream(side)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def time_graph(graph, reps: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--contexts", default="0,560")
    ap.add_argument("--variants", default="none,side,side2,inline")
    ap.add_argument("--chunk", type=int, default=16384, help="bytes per prefetch instruction")
    ap.add_argument("--block", type=int, default=128, help="prefetch instructions per program")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="times the whole set of variants is repeated")
    args = ap.parse_args()
    for rnd in range(args.rounds):
        for rows in map(int, args.rows.split(",")):
            for context in map(int, args.contexts.split(",")):
                for variant in args.variants.split(","):
                    graph = build(rows, context, variant, args.chunk, args.block)
                    us = time_graph(graph, args.reps)
                    del graph
                    torch.cuda.empty_cache()
                    print(json.dumps({"round": rnd, "rows": rows, "context": context, "variant": variant,
                                      "chunk": args.chunk, "block": args.block, "us_per_step": round(us, 1)}),
                          flush=True)


if __name__ == "__main__":
    main()

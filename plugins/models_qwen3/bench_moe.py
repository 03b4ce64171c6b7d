"""Benchmark: a Qwen3-30B-A3B-shaped stack of MoE blocks, fused Triton path against plain PyTorch.

Each layer is a router plus 128 experts, top-8 (renormalised), hidden 2048, moe_intermediate 768, bf16,
random weights; a layer's output is added to its input (a residual) before the next layer. For each batch
size the script times the stack with the fused path, the same fused path replayed from a CUDA graph, and
the plain PyTorch path, checks that fused and plain agree on the first layer (``max |fused - plain| /
max |plain|``; over the whole stack bf16 rounding can flip a near-tie in routing, so the stack's outputs
are not compared), and prints a markdown table::

    python plugins/models_qwen3/bench_moe.py --out moe.md

Needs CUDA and Triton; no network. ``weights GB/s`` counts the bytes of the experts that received tokens
(each read once) over the time of the whole stack, router and routing included; ``TFLOP/s`` counts the
expert GEMMs only (``6 * tokens * top_k * hidden * moe_intermediate`` per layer).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

try:
    from nanovllm_models_qwen3 import moe
except ImportError:  # run from a checkout where the packages are not installed
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
    from nanovllm_models_qwen3 import moe

from nanovllm_testing import cuda_median_ms


def qwen3_30b_a3b_moe_config() -> SimpleNamespace:
    """The MoE fields of Qwen3-30B-A3B's config.json."""
    return SimpleNamespace(
        hidden_size=2048,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        hidden_act="silu",
    )


class MoeStack(nn.Module):
    """``num_layers`` sparse MoE blocks with residual connections."""

    def __init__(self, config: SimpleNamespace, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(moe.Qwen3MoeSparseBlock(config) for _ in range(num_layers))
        with torch.no_grad():
            for block in self.blocks:
                h, i = config.hidden_size, config.moe_intermediate_size
                block.gate.weight.normal_(0, h**-0.5)
                block.experts.gate_up.weight.normal_(0, h**-0.5)
                block.experts.down.weight.normal_(0, i**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each timed with CUDA events."""
    return cuda_median_ms(fn, iters, warmup)


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``fn(x)`` captured in a CUDA graph; the returned callable replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph.replay


def routed_expert_bytes(stack: MoeStack, x: torch.Tensor) -> int:
    """Bytes of expert weights that the tokens of ``x`` reach, summed over the layers (plain path)."""
    total = 0
    with torch.no_grad():
        for block in stack.blocks:
            _, ids = moe.route(block.gate(x), block.top_k, block.norm_topk_prob)
            w13, w2 = block.experts.gate_up.weight, block.experts.down.weight
            per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
            total += per_expert * torch.unique(ids).numel()
            x = x + block(x)
    return total


def bench(num_layers: int, batch_sizes: list[int], iters: int) -> str:
    """Run the benchmark and return it as a markdown table (with a heading line)."""
    config = qwen3_30b_a3b_moe_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        stack = MoeStack(config, num_layers).to(torch.bfloat16).eval()
    h, i, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    rows = [
        "| tokens | fused ms | fused tok/s | fused+graph ms | fused+graph tok/s | plain ms | plain tok/s "
        "| fused+graph vs plain | weights GB/s (graph) | TFLOP/s (graph) | max rel diff, layer 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens in batch_sizes:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            moe.USE_FUSED_MOE = True
            fused_out = stack.blocks[0](x)
            fused_ms = time_ms(functools.partial(stack, x), iters)
            replay = graphed(stack, x)
            graph_ms = time_ms(replay, iters)
            moe.USE_FUSED_MOE = False
            plain_out = stack.blocks[0](x)
            plain_ms = time_ms(functools.partial(stack, x), max(3, iters // 4))
            moe.USE_FUSED_MOE = True
            nbytes = routed_expert_bytes(stack, x)
        diff = ((fused_out.float() - plain_out.float()).abs().max() / plain_out.float().abs().max()).item()
        flops = 6 * tokens * k * h * i * num_layers
        rows.append(
            f"| {tokens} | {fused_ms:.3f} | {tokens / fused_ms * 1e3:,.0f} | {graph_ms:.3f} "
            f"| {tokens / graph_ms * 1e3:,.0f} | {plain_ms:.3f} | {tokens / plain_ms * 1e3:,.0f} "
            f"| {plain_ms / graph_ms:.1f}x | {nbytes / graph_ms / 1e6:,.0f} | {flops / graph_ms / 1e9:.1f} "
            f"| {diff:.1e} |"
        )
        del replay
    name = torch.cuda.get_device_name()
    head = (
        f"Qwen3-30B-A3B MoE stack: {num_layers} layers x (router + {config.num_experts} experts, top-{k}, "
        f"hidden {h}, moe_intermediate {i}), bf16, {name}; median of {iters} runs (plain: {max(3, iters // 4)})."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--layers", type=int, default=4, help="MoE layers in the stack (default 4)")
    parser.add_argument("--batch-sizes", default="1,64,256,4096", help="comma-separated token counts")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per measurement (default 20)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device")
    if not moe.fused_moe_available():
        sys.exit("bench_moe.py needs Triton (pip install triton)")
    table = bench(args.layers, [int(b) for b in args.batch_sizes.split(",")], args.iters)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()

"""Launch shapes of the Triton decode GEMM (:mod:`nanovllm_core.layers.gemm_kernel`), without importing Triton."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHORT = re.compile(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)")


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the kernel: output tile, K step, K slices, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name}={value}: a power of two of at least 16")
        if self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k={self.split_k}: at least 1")

    def short(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"
        )


def parse_config(text: str) -> GemmConfig:
    """``"m64n32k128s4w4p3"`` (as :meth:`GemmConfig.short` writes it) as a :class:`GemmConfig`."""
    match = _SHORT.fullmatch(text)
    if match is None:
        raise ValueError(f"GEMM config {text!r}: expected m<block_m>n<block_n>k<block_k>s<split_k>w<warps>p<stages>")
    bm, bn, bk, split, warps, stages = map(int, match.groups())
    return GemmConfig(bm, bn, bk, split, num_warps=warps, num_stages=stages)

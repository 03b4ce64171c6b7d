"""The two device rates the bound divides by, measured on the GPU the benchmark runs on."""

from __future__ import annotations

import time

import torch


def measure_device(device: torch.device, sustained_gemm_s: float = 0.0) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 GEMM FLOP/s of ``device``; empty off CUDA.

    The GEMM rate is a short burst's (10 products). With ``sustained_gemm_s``, the same product also runs back to
    back for that many seconds, and the rate of the second half is ``gemm_flop_per_s_sustained``: a GPU whose power
    limit holds its clock down keeps up less than the burst's rate."""
    if device.type != "cuda":
        return {}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 2 * n * 20 / (start.elapsed_time(end) / 1e3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * m**3 * 10 / (start.elapsed_time(end) / 1e3)
    rates = {"copy_bytes_per_s": bandwidth, "gemm_flop_per_s": flops}
    if sustained_gemm_s > 0:
        rates["gemm_flop_per_s_sustained"] = sustained_gemm_rate(a, b, sustained_gemm_s)
    return rates


def sustained_gemm_rate(a: torch.Tensor, b: torch.Tensor, seconds: float, per_batch: int = 20) -> float:
    """FLOP/s of ``a @ b`` over the second half of ``seconds`` of back-to-back products (batches of ``per_batch``,
    each timed by device events; the first half lets the clock settle)."""
    batches: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            a @ b
        end.record()
        end.synchronize()  # keeps the host's clock in step with the device's
        batches.append((time.perf_counter() - began, start, end))
    late = [(s, e) for t, s, e in batches if t >= seconds / 2] or [(s, e) for _, s, e in batches[-1:]]
    device_ms = sum(s.elapsed_time(e) for s, e in late)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * per_batch * len(late) / (device_ms / 1e3)

"""On a CUDA device: the device rates ``nanovllm bench`` bounds a run with."""

from __future__ import annotations

import pytest
import torch
from nanovllm_bench.device import measure_device

# tests/conftest.py skips ``gpu`` tests without CUDA for the core's tests only: the plugin's skip themselves too
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_sustained_gemm_rate_is_measured_over_the_second_half():
    """``nanovllm bench --sustained-gemm-s``: a positive rate, at most a little over the short burst's (the clock
    can only fall once the power limit holds it), from products timed on the device."""
    rates = measure_device(torch.device("cuda"), sustained_gemm_s=1.0)
    burst, sustained = rates["gemm_flop_per_s"], rates["gemm_flop_per_s_sustained"]
    print(f"bf16 GEMM: burst {burst / 1e12:.0f} TFLOP/s, sustained (1 s) {sustained / 1e12:.0f} TFLOP/s")
    assert 0.3 * burst < sustained < 1.1 * burst

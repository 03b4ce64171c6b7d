"""Where the urgent lane's GPU tokens part from the lane-less run: the lane on its own stream, on the main
stream (no overlap), and off, driven alike (tests/gpu/test_gpu_urgent_lane.py's scenario)."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests/gpu")
from test_gpu_urgent_lane import drive, engine  # noqa: E402

from nanovllm_core.testing import GPU_TEST_SHAPE, write_tiny_checkpoint  # noqa: E402

path = write_tiny_checkpoint("/tmp/lane-diag", "qwen3", dtype=torch.bfloat16, **GPU_TEST_SHAPE)
runs = {}
for name in ("off", "main-stream", "lane-stream"):
    llm = engine(path, lane=name != "off")
    if name == "main-stream":
        llm.runner.lane_stream = None
    runs[name] = drive(llm)
    print(name, "lane steps", llm.stats().num_urgent_lane_steps, flush=True)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
for name in ("main-stream", "lane-stream"):
    for key, want in runs["off"].items():
        got = runs[name][key]
        same = sum(a == b for a, b in zip(got[:16], want[:16]))
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(f"{name} {key}: {same}/16 equal, first difference at {first}")

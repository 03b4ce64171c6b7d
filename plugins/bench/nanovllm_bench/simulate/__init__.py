"""``nanovllm simulate``: judge a scheduler policy on hours of traffic in seconds, without a GPU.

The real engine core runs the installed scheduler and block-manager plugins unchanged; only the model is gone:
each step's duration comes from a step-time model calibrated on a GPU (:mod:`.cost`), and time is simulated.
"""

from nanovllm_bench.simulate.cost import Calibration, calibrate, load_calibration, shipped_calibrations
from nanovllm_bench.simulate.engine import RequestTimes, TraceRequest, TraceSimulator

__all__ = [
    "Calibration",
    "RequestTimes",
    "TraceRequest",
    "TraceSimulator",
    "calibrate",
    "load_calibration",
    "shipped_calibrations",
]

"""``nanovllm bench --profile``'s kernel table (``probes.print_kernels``), on a stand-in profile: the GPU time a step
against the span of the steps, and, where the kernels' listed times add up to more than the span (kernels launched
early by programmatic dependent launch count their wait), by how much they overlap and how to list each kernel's
own time."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm_bench.probes import print_kernels


@dataclass
class Kernel:
    key: str
    self_device_time_total: float  # microseconds over the profile, as torch.profiler's averages give them
    count: int

    @property
    def device_time_total(self) -> float:
        return self.self_device_time_total


class Profile:
    def __init__(self, kernels: list[Kernel]) -> None:
        self.kernels = kernels

    def key_averages(self) -> list[Kernel]:
        return self.kernels


class Event:
    """A CUDA event stand-in: ``elapsed_time`` in milliseconds from this one to ``end``."""

    def __init__(self, ms: float = 0.0) -> None:
        self.ms = ms

    def elapsed_time(self, end: Event) -> float:
        return end.ms - self.ms


KERNELS = [Kernel("_decode_split_kernel", 4000.0, 4), Kernel("gemm", 2000.0, 8), Kernel("unused", 0.0, 1)]


def test_kernels_that_overlap_say_by_how_much_and_how_to_list_their_own_times(capsys) -> None:
    print_kernels(Profile(KERNELS), "profile", 2, Event(), Event(4.0))  # 3 ms of kernels a step in a 2 ms span each
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("profile: GPU kernel time 3.00 ms/step in 6 kernels and copies a step; 2.00 ms/step")
    assert "overlap by 1.00 ms/step" in first and "--no-programmatic-dependent-launch" in first


def test_gaps_between_kernels_are_reported_as_such(capsys) -> None:
    print_kernels(Profile(KERNELS), "profile", 2, Event(), Event(8.0))
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("4.00 ms/step from first to last, so 1.00 ms/step between them")
    assert [line.split()[-1] for line in out[1:]] == ["_decode_split_kernel", "gemm"]  # the kernels, longest first

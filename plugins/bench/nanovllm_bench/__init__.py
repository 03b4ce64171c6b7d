"""nanovllm's measuring tools, the ``nanovllm bench`` and ``nanovllm simulate`` commands.

``nanovllm bench``'s measurement code: the offline workload and its report (``offline``), the bound of a
configuration and the decode-step fit (``bound``, pure arithmetic), the device rates (``device``) and the per-run
probes and kernel profiler (``probes``); ``nanovllm bench serve``'s load client and datasets (``serve``); the
simulator (``simulate``). Only the commands (``commands``) and the benchmark scripts import it; the engine never
does."""

__version__ = "0.1.0"

"""``nanovllm bench``'s measurement code: the offline workload and its report (``offline``), the bound of a
configuration and the decode-step fit (``bound``, pure arithmetic), the device rates (``device``) and the per-run
probes and kernel profiler (``probes``). Only the CLI imports it; the engine never does."""

"""Conformance kits: pytest base classes that check a plugin keeps the invariants of its interface.

Subclass one in your plugin's tests, name the subclass ``Test...`` and set the class attribute that names your
class; pytest collects every check::

    from nanovllm_testing.conformance import SchedulerConformance
    from my_package.scheduler import MyScheduler

    class TestMyScheduler(SchedulerConformance):
        scheduler_cls = MyScheduler

- :class:`SchedulerConformance` and :class:`BlockManagerConformance` drive the plugin through a
  :class:`SimulatedEngine` (a fake model and a simulated KV cache that knows which token every slot holds), so
  they run in milliseconds, then run the real engine core
  (:class:`~nanovllm_core.engine.model_core.ModelEngineCore`) on a tiny checkpoint.
- :class:`AttentionBackendConformance` compares the backend with dense float64 attention on ragged batches
  (prompt chunks over cached context next to decode tokens, MHA and GQA).
- :class:`ModelConformance` compares the engine's greedy output with ``transformers``.
- :class:`StructuredOutputConformance`: random walks through a grammar backend's bitmasks and the engine's
  constrained outputs (random weights, so every output is a walk) satisfy their JSON schema, regex or choice.
- :class:`QuantizationConformance`: a quantization method's tiny checkpoints of each model family, greedy against
  ``transformers`` on the dequantized weights, every linear layer quantized, tensor-parallel shards of the scales.
- :class:`ToolParserConformance` and :class:`ReasoningParserConformance` cut replies in every way a stream can
  and compare with the whole reply's parse.

The other roles come from the installed plugins, by name (``prefix_cache``, ``fifo``, ``torch``,
``Qwen3ForCausalLM``); a class under test that is not installed is registered in-process for the run.

Each kit has its own module (``scheduler``, ``scheduler_parity``, ``block_manager``, ``attention``, ``model``,
``parsers``, ``structured_output``, ``quantization``) and ``_shared`` holds what they share; import the kits from
this package.
"""

from nanovllm_testing.conformance._shared import registered_for_test, shared_tiny_checkpoint
from nanovllm_testing.conformance.attention import AttentionBackendConformance, dense_attention
from nanovllm_testing.conformance.block_manager import BlockManagerConformance
from nanovllm_testing.conformance.model import ModelConformance
from nanovllm_testing.conformance.parsers import ReasoningParserConformance, ToolParserConformance
from nanovllm_testing.conformance.quantization import QuantizationConformance
from nanovllm_testing.conformance.scheduler import SchedulerConformance, simulate_policy
from nanovllm_testing.conformance.scheduler_parity import SchedulerParity
from nanovllm_testing.conformance.structured_output import StructuredOutputConformance
from nanovllm_testing.simulated import SimulatedEngine

__all__ = [
    "AttentionBackendConformance",
    "BlockManagerConformance",
    "ModelConformance",
    "QuantizationConformance",
    "ReasoningParserConformance",
    "SchedulerConformance",
    "SchedulerParity",
    "StructuredOutputConformance",
    "SimulatedEngine",
    "ToolParserConformance",
    "dense_attention",
    "registered_for_test",
    "shared_tiny_checkpoint",
    "simulate_policy",
]

"""The ``guidance`` structured-output backend: JSON schema, regex, choice and Lark constraints on llguidance."""

from nanovllm_structured_llguidance.backend import CompiledGuidance, GuidanceBackend, GuidanceGrammar

__version__ = "0.1.0"
__all__ = ["CompiledGuidance", "GuidanceBackend", "GuidanceGrammar"]

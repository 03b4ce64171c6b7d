"""The ``xgrammar`` structured-output backend: JSON schema, regex, choice and EBNF constraints on xgrammar."""

from nanovllm_structured_xgrammar.backend import XgrammarBackend, XgrammarGrammar

__version__ = "0.1.0"
__all__ = ["XgrammarBackend", "XgrammarGrammar"]

"""The ``decode_first`` scheduler plugin for nanovllm."""

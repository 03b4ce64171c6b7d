"""Online serving: :class:`AsyncLLM` (the engine behind an asyncio API) and, with the ``[serve]`` extra, the
OpenAI-compatible server (``nanovllm serve``, :mod:`nanovllm_core.serving.api_server`). Its load client,
``nanovllm bench serve``, ships in ``nanovllm-bench``. See docs/serving.md."""

from nanovllm_core.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

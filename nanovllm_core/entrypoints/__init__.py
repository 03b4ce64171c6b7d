"""Entry points: the offline ``LLM`` (:mod:`.llm`) and chat rendering (:mod:`.chat`). ``AsyncLLM``, the OpenAI
server and their load client are in :mod:`nanovllm_core.serving`; the command line in :mod:`nanovllm_core.cli`."""

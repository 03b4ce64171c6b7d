"""Engine clients: how the entry points (``LLM``, ``AsyncLLM``) reach the engines, wherever they run.

:mod:`.base` holds the :class:`EngineClient` interface; :mod:`.step_loop` the step loop and the in-process and
engine-process clients; :mod:`.factory` picks one from the config, the data-parallel ones from the
``data_parallel_backend`` plugins (``mp`` and ``ray`` ship in ``nanovllm-data-parallel``).
"""

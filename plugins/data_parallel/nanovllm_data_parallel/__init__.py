"""nanovllm-data-parallel: ``data_parallel_size`` engine replicas behind one engine client, as processes on this
host (``mp``, :class:`~nanovllm_data_parallel.client.DataParallelClient`) or Ray actors anywhere in a cluster
(``ray``, :class:`~nanovllm_data_parallel.ray_client.RayDataParallelClient`), with prefix-aware routing
(:class:`~nanovllm_data_parallel.router.Router`)."""

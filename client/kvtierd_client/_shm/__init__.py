"""The client's private shared-memory helpers: a region's descriptor from the daemon
(``region_fd``) and the CUDA runtime calls for registering a region (``cuda_runtime``).

Not a public API: ``kvtierd_client.region`` is. May import ``kvtierd_client.wire`` and
``kvtierd_client.errors`` only.
"""

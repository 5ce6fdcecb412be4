"""The client's private shared-memory helpers: a region's descriptor, CUDA registration
and the copy engine's row copies.

- ``region_fd``: a region's descriptor from the daemon (``SCM_RIGHTS``);
- ``cuda_runtime``: the CUDA runtime calls for registering a region;
- ``copies``: how the copy engine moves rows (runs, row views, the CPU and CUDA copies).

Invariants: a job's (source, destination) pairs are checked before a byte moves; a
region descriptor from a process that does not run as the daemon's uid (its
``SO_PEERCRED``) is refused (``RegionSocketImpostor``).

Not a public API: ``kvtierd_client.region`` and ``kvtierd_client.copy_engine`` are. May
import ``kvtierd_client.wire`` and ``kvtierd_client.errors`` only.
"""

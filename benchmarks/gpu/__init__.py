"""The GPU check (issue #22): ``make gpu-check`` / ``python -m benchmarks.gpu``.

One self-contained run for a machine with a CUDA GPU, which prints a table and
writes it as markdown. Sections (``--sections`` picks some):

* ``environment``: torch, CUDA, the GPU, cores, the shm directory's free bytes.
* ``correctness``: a real daemon; worker processes attach its region and store and
  load shuffled block ids between KV tensors in vLLM's canonical layout (one int8
  ``(num_blocks, page_bytes)`` tensor per layer, several layers) and region rows
  with ``CopyEngine``; every byte compared, including blocks that must not change;
  loads run while another process stores.
* ``cuda-tests``: the CUDA tests of ``make test`` (they skip without CUDA).
* ``bandwidth``: ``CopyEngine`` H2D (load) and D2H (store) GB/s for 64 KiB, 2 MiB
  and 16 MiB rows, one layer and vLLM's many, next to a plain pinned-tensor
  ``copy_`` per block and one ``copy_`` of a contiguous pinned buffer (a single
  ``cudaMemcpyAsync``) in the same run.
* ``candidates``: a copy method the engine does not use yet (per-layer gather and
  scatter kernels through a UVA view of the registered region) against the engine,
  bytes checked: the data for choosing the engine's CUDA method.
* ``register``: what ``cudaHostRegister`` of 4 / 16 / 64 GiB regions costs, what
  a failed registration looks like, and what unregistered (pageable) copies give.
* ``fs``: the fs tier benchmark (``python -m benchmarks fs``) on this machine's cores.

Without CUDA it says so and runs the CPU parts: correctness and bandwidth with
CPU tensors (the same ``CopyEngine`` API), the fs tier, no registration.

Every section is isolated: one that fails adds a FAILED row with its error, the
others still run, the markdown is rewritten after each section (a run cut short
keeps what it measured), and the exit status is 1 when any section failed.
"""

"""What the client needs of the CUDA runtime beyond torch's wrappers.

``torch.cuda.cudart()`` wraps ``cudaHostRegister`` and returns its error code, but
leaves the error set as the thread's *last* CUDA error: torch's next kernel launch
check (``cudaGetLastError``) would then report it as that kernel's failure, far
from its cause. :func:`clear_last_error` resets it through the runtime library
torch already loaded; :func:`error_text` names a code. Both are best-effort and
never raise: without CUDA there is nothing to clear.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

RUNTIME_LIBRARY = "libcudart.so"


def error_text(code: int) -> str:
    """The runtime's description of ``code`` ("unknown" when it cannot be had)."""
    try:
        import torch

        return str(torch.cuda.cudart().cudaGetErrorString(code))
    except Exception:  # no CUDA build, or an old torch
        return "unknown"


def clear_last_error() -> bool:
    """Resets the calling thread's last CUDA runtime error; True if the runtime was found."""
    for path in loaded_libraries(RUNTIME_LIBRARY):
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError) as error:
            log.debug("cannot call cudaGetLastError in %s: %s", path, error)
            continue
        return True
    return False


def loaded_libraries(name: str, maps: str | None = None) -> list[str]:
    """Paths of the mapped files of this process whose name starts with ``name``
    (``/proc/self/maps``, or ``maps`` when given), in order of first mapping."""
    if maps is None:
        try:
            with open("/proc/self/maps") as handle:
                maps = handle.read()
        except OSError:
            return []
    paths: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.rsplit("/", 1)[-1].startswith(name) and path not in paths:
            paths.append(path)
    return paths

"""Futures that other threads complete on an event loop.

A thread that finished something a coroutine on the loop awaits calls the
function :func:`completer` made: the future completes on the loop (never from
the thread itself: asyncio futures are not thread-safe), once, and not at all
when the loop closed meanwhile (nobody is left to wait). Completing a future that
is done already (cancelled, say) does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


def complete(future: asyncio.Future[None]) -> None:
    """Completes ``future`` unless it is done (on its loop)."""
    if not future.done():
        future.set_result(None)


def completer(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> Callable[[], None]:
    """A function any thread may call to complete ``future`` on ``loop``."""

    def done() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(complete, future)

    return done

"""Calls that block, run off the event loop on a daemon thread of their own
(:func:`off_loop`): region files, snapshots, a worker's first answer."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def off_loop(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``function(*args, **kwargs)`` on a new daemon thread; its result or error.

    Not the loop's default executor: its threads are joined when the loop
    closes, so a call stuck in the kernel would hold the daemon's exit. A daemon
    thread is never waited for; if the awaiting task is cancelled, the call runs
    on and its outcome is dropped. For rare, slow calls (regions: seconds per GiB).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def body() -> None:
        try:
            result = function(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task
            report = functools.partial(settle, functools.partial(future.set_exception, exc))
        else:
            report = functools.partial(settle, functools.partial(future.set_result, result))
        try:
            loop.call_soon_threadsafe(report)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    name = getattr(function, "__qualname__", "call")
    threading.Thread(target=body, name=f"kvtierd-off-loop-{name}", daemon=True).start()
    return await future

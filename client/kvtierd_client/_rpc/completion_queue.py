"""The queue of a sync session's completions (``queue_completions``).

``CompleteStore`` / ``CompleteLoad`` / ``Touch`` of a session that queues its
completions are not sent when called: they wait here until the session's next
call that needs an answer carries them in the same ``Batch``, or until the
:class:`~kvtierd_client._rpc.flusher.FlushDeadline` sends them alone ``flush_after``
seconds after the oldest was queued. Their failures cannot be raised by the call
that queued them: they are logged and kept in :attr:`CompletionQueue.deferred_errors`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtierd_client._rpc.flusher import FlushDeadline, FlushStatistics
from kvtierd_client.errors import KvtierError
from kvtierd_client.wire.proto import pb2

__all__ = ["DEFAULT_FLUSH_AFTER", "DEFERRED_ERRORS_KEPT", "CompletionQueue"]

log = logging.getLogger(__name__)

DEFAULT_FLUSH_AFTER = 0.005  # seconds a queued completion may wait for a carrier call
DEFERRED_ERRORS_KEPT = 100  # the most recent failures of queued ops kept


class CompletionQueue:
    """Completions of one session not yet sent, in call order.

    ``flush`` is the session's (weakly held) flush: run by the deadline's thread
    (named after ``session_id``) when no call carried the queue in time; it
    returns False once the session is gone.

    Locking: ``lock`` (re-entrant) guards the queue; a session holds it across
    taking the queue *and* sending it, so no two batches of one session overtake
    each other. Lock order: ``lock``, then the deadline's own lock.

    Invariant: ``_ops`` holds the completions not yet sent, in call order; the
    deadline is armed exactly while ``_ops`` is non-empty (armed when it becomes
    non-empty, disarmed when it is taken).
    """

    def __init__(self, session_id: str, flush: Callable[[], bool], flush_after: float) -> None:
        self.session_id = session_id
        self.lock = threading.RLock()
        self._ops: list[pb2.BatchOp] = []  # guarded by lock
        self._deadline = FlushDeadline(flush, flush_after, f"kvtierd-flush-{session_id[:12]}")
        self.deferred_errors: list[KvtierError] = []  # failures of queued ops (most recent)

    def put(self, op: pb2.BatchOp) -> None:
        """Queues ``op`` behind the others; starts the flush deadline if it was empty."""
        with self.lock:
            self._ops.append(op)
            if len(self._ops) == 1:
                self._deadline.arm()

    def take(self) -> list[pb2.BatchOp]:
        """Empties the queue and returns its ops in call order. Call holding ``lock``
        until they are sent."""
        ops, self._ops = self._ops, []
        if ops:
            self._deadline.disarm()
        return ops

    def __len__(self) -> int:
        return len(self._ops)

    def record_failure(self, err: KvtierError) -> None:
        """A queued op failed on the daemon (the ops after it ran anyway)."""
        log.warning("session %s: a queued completion failed: %s", self.session_id, err)
        self.deferred_errors.append(err)
        del self.deferred_errors[:-DEFERRED_ERRORS_KEPT]

    def stop(self) -> None:
        """No more deadline flushes (the session closed or is gone). Idempotent."""
        self._deadline.stop()

    def statistics(self) -> FlushStatistics:
        """The flush deadline's counts (how often it had to send the queue alone)."""
        return self._deadline.statistics()

"""Which nodes of one redis tier failed lately, and the log lines about them
(docs/design/tiers.md): a node that timed out is skipped, a node's fault is logged
once, and a node that flaps is one fault.

A node's fault is logged once: a WARNING at its first failure since it last
answered (naming it and why), an INFO when it answers again; the calls it fails
meanwhile are the tiers' DEBUG lines (:meth:`NodeFaults.node_down`). A node that
flaps -- fails again within :data:`NODE_FAULT_LOG_S` of its last WARNING, as one
that trickles its answers does (a small call gets through, the next times out) --
is the same fault: DEBUG lines, its end not announced, and the number of such
failures in its next WARNING.

A node that timed out is **skipped** (:class:`NodeSkipped`, at once, no I/O) for
``max(timeout, 1 s)``; then one call at a time tries it (the others keep skipping
it) and its success takes it back, as does an answered health check.

Thread-safe: ``_lock`` guards every map below and is never held across I/O or a
log call. At most one entry per node of the server in each map.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from redis.exceptions import ClusterDownError

log = logging.getLogger(__name__)

NODE_FAULT_LOG_S = 60.0  # a node's fault is logged at most once in this long (it flaps)


class NodeSkipped(redis.ConnectionError):
    """The call was not sent: its node failed lately and is skipped (module doc)."""


class NodeFaults:
    """The fault state of the nodes of one redis tier (module doc).

    ``tier_name`` names the tier in log lines; ``timeout`` is the tier's socket
    timeout (a trial call's own); ``node_text`` turns a node's name into what the
    log shows; ``clock``: monotonic seconds."""

    def __init__(
        self,
        tier_name: str,
        timeout: float,
        node_text: Callable[[str], str],
        clock: Callable[[], float],
    ) -> None:
        self.tier_name = tier_name
        self._timeout = timeout
        self._node_text = node_text
        self._clock = clock
        self._lock = threading.Lock()
        self._skip_for = max(timeout, 1.0)
        # node name -> monotonic time until which its calls are skipped; a node is in
        # it from a connection error or timeout to a success
        self._skip_until: dict[str, float] = {}
        # node name -> why it failed, from its first failure to its next answer: a
        # fault is logged once, when the node enters it, and its end once
        self._down: dict[str, str] = {}
        # node name -> when its last fault was logged and the failures since that were
        # not (it flapped); and the nodes whose current fault was logged (its end will be)
        self._fault_logged: dict[str, tuple[float, int]] = {}
        self._announced: set[str] = set()

    def check(self, name: str) -> None:
        """Raises NodeSkipped when node ``name`` failed lately; past its skip time,
        lets this call through as the one trial (the others keep skipping it for
        the trial's own timeout)."""
        if not self._skip_until:  # the usual case: no lock
            return
        now = self._clock()
        with self._lock:
            until = self._skip_until.get(name)
            if until is None:
                return
            if now < until:
                raise NodeSkipped(
                    f"redis node {name} did not answer lately; skipped (one call tries it "
                    f"every {self._skip_for:g}s)"
                )
            self._skip_until[name] = now + self._timeout + self._skip_for

    def failed(self, name: str, exc: BaseException) -> None:
        """Skips node ``name`` after a timeout (a refused connection fails fast by
        itself: a node restarted on its address is used at the very next call).
        The node's first failure since it last answered is logged, once."""
        timed_out = isinstance(exc, (redis.TimeoutError, TimeoutError))
        quiet: int | None = None
        with self._lock:
            if timed_out:
                self._skip_until[name] = self._clock() + self._skip_for
            first = name not in self._down
            if first:
                self._down[name] = f"{type(exc).__name__}: {exc}"
                quiet = self._announce(name)
        if not first:
            return
        if quiet is None:
            log.debug(
                "redis tier %s: node %s failed again (%s: %s); it flaps, logged at most "
                "once in %gs", self.tier_name, self._node_text(name), type(exc).__name__, exc,
                NODE_FAULT_LOG_S,
            )  # fmt: skip
            return
        log.warning(
            "redis tier %s: node %s failed (%s: %s); its keys answer MISS and its "
            "writes fail until it answers again%s%s",
            self.tier_name, self._node_text(name), type(exc).__name__, exc,
            f" (skipped; one call tries it every {self._skip_for:g}s)" if timed_out else "",
            f"; it failed {quiet} more times since the last such line, answering in between"
            if quiet else "",
        )  # fmt: skip

    def _announce(self, name: str) -> int | None:
        """Under ``_lock``, at a node's new fault: None when its last fault was logged
        within :data:`NODE_FAULT_LOG_S` (it flaps: counted, not logged), else the
        failures not logged since its last line (and this one is logged)."""
        now = self._clock()
        logged_at, quiet = self._fault_logged.get(name, (None, 0))
        if logged_at is not None and now - logged_at < NODE_FAULT_LOG_S:
            self._fault_logged[name] = (logged_at, quiet + 1)
            return None
        self._fault_logged[name] = (now, 0)
        self._announced.add(name)
        return quiet

    def answered(self, name: str) -> None:
        if name in self._skip_until or name in self._down:
            with self._lock:
                self._skip_until.pop(name, None)
                was = self._down.pop(name, None)
                announced = name in self._announced
                self._announced.discard(name)
            if was is not None and announced:
                log.info(
                    "redis tier %s: node %s answers again", self.tier_name, self._node_text(name)
                )
            elif was is not None:
                log.debug(
                    "redis tier %s: node %s answers again", self.tier_name, self._node_text(name)
                )

    def replied(self, name: str, error: redis.ResponseError | None) -> None:
        """Node ``name`` answered a call (``error``: the last error reply, if any). A
        ``CLUSTERDOWN`` reply (a node that restarted and has not rejoined yet, a
        cluster that lost its majority) is the node's fault, not an answer: logged
        once with the node's other faults rather than once per kind of call."""
        if isinstance(error, ClusterDownError):
            self.failed(name, error)
        else:
            self.answered(name)

    @staticmethod
    def node_down(error: BaseException | None) -> bool:
        """Whether ``error`` is a node's (or the server's) fault the link has logged:
        a connection failure, a timeout or ``CLUSTERDOWN`` (the tier logs its own part
        at DEBUG)."""
        return isinstance(
            error, (redis.ConnectionError, redis.TimeoutError, TimeoutError, ClusterDownError)
        )

    @staticmethod
    def outage(error: BaseException) -> str | None:
        """Why a call failed for now, when ``error`` says the server could not answer it
        (a timeout, a lost connection, a skipped node, ``CLUSTERDOWN``): the value it
        asked for is not in question (:mod:`kvtierd.tiers.failures`, transient). None
        otherwise, refused credentials included (those fail until the configuration is
        fixed)."""
        if isinstance(error, (redis.TimeoutError, TimeoutError)):
            return "the Redis server did not answer within the tier's timeout"
        if isinstance(error, NodeSkipped):
            return "the Redis node timed out lately and is skipped for a moment"
        if isinstance(error, ClusterDownError):
            return "the Redis cluster is down (CLUSTERDOWN)"
        if isinstance(error, redis.ConnectionError) and not isinstance(
            error, redis.AuthenticationError
        ):
            return "the connection to the Redis server failed"
        return None

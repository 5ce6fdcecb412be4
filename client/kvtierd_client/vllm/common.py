"""Types shared by the plug-in's scheduler side (manager) and worker side.

A :class:`KvtierdLoadStoreSpec` is what the manager hands vLLM for a load or a
store: vLLM's own ``CPULoadStoreSpec`` (row ids of the pool's region, in the
order of the keys) plus the :class:`RegionIdentity` of the region those ids
belong to. The worker copies only when its mapping *is* that region (same
device and inode): after a daemon restart the region file at the same path is a
new file, and row ids of the new daemon must never be applied to the old
mapping, nor the reverse.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtierd_client.client import Client, Session
from kvtierd_client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KvtierError,
    Unavailable,
)
from kvtierd_client.region import announced_identity
from kvtierd_client.vllm.settings import PluginSettings, PoolPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegionIdentity:
    """One region file of one daemon instance: its path, device and inode, and geometry.

    ``fd_socket`` is how to reach it, not part of what it is (not compared): the
    daemon's region descriptor socket (``Region.fd_socket``), "" when the daemon
    serves none (an older daemon: workers attach by path); ``daemon_uid`` neither:
    who must own the file mapped.
    """

    path: str
    device: int
    inode: int
    num_blocks: int
    block_bytes: int
    fd_socket: str = field(default="", compare=False)
    # the uid of the daemon that announced it (``Session.daemon_uid``): the file mapped
    # must be that uid's; None: the placed owner of the socket or file (wire.trust)
    daemon_uid: int | None = field(default=None, compare=False)

    @classmethod
    def of_session(cls, session: Session) -> RegionIdentity:
        """The identity of ``session``'s region: the one the daemon announced
        (read from the file system now when the daemon is older and announced none).

        Raises OSError when the file is gone (the daemon that created it stopped).
        """
        st = os.stat(session.region.path)
        device, inode = announced_identity(session.region) or (st.st_dev, st.st_ino)
        return cls(
            path=session.region.path,
            device=device,
            inode=inode,
            num_blocks=int(session.region.num_blocks),
            block_bytes=int(session.region.block_bytes),
            fd_socket=session.region.fd_socket,
            daemon_uid=session.daemon_uid,
        )

    def still_current(self) -> bool:
        """True while the file at ``path`` is this region (not removed, not replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (self.device, self.inode)


class KvtierdLoadStoreSpec(CPULoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` of region row ids, tagged with the region they index.

    ``block_ids[i]`` is the row of the i-th key the manager was asked about (for a
    store: of ``keys_to_store[i]``); ``lease_beacon`` names the scheduler session's
    lease proof, which the worker checks before it copies.
    ``region`` is None only for a load the manager could not pin (``valid``
    False): the worker fails that job loudly instead of copying bytes nobody
    protects.
    """

    def __init__(
        self,
        block_ids: Sequence[int],
        region: RegionIdentity | None,
        valid: bool = True,
        lease_beacon: str | None = None,
        session_id: str | None = None,
    ) -> None:
        super().__init__(list(block_ids))
        self.region = region
        self.valid = valid and region is not None
        # the path of the scheduler session's lease beacon: the worker copies only
        # while it proves the lease that holds these rows (kvtierd_client.lease_beacon)
        self.lease_beacon = lease_beacon
        self.session_id = session_id  # the session holding the rows (worker's fallback proof)

    def __repr__(self) -> str:
        where = self.region.path if self.region else "no region"
        return f"KvtierdLoadStoreSpec({self.block_ids!r} in {where}, valid={self.valid})"


def default_client_name(role: str) -> str:
    """The ``client_name`` a plug-in session reports to the daemon (its logs, stats)."""
    return f"vllm-{role}/pid{os.getpid()}"


class DaemonStartError(RuntimeError):
    """The engine cannot start: the daemon is unreachable or refuses the pool."""


def open_session_on(
    client: Client,
    settings: PluginSettings,
    plan: PoolPlan,
    client_name: str,
    *,
    queue_completions: bool = False,
    timeout: float | None = None,
) -> Session:
    """One ``OpenSession`` on ``plan``'s pool. With ``queue_completions`` the session
    queues its completions (see ``Client.open_session``) and sends them alone after
    ``settings.flush_after`` seconds at the latest (instead of the client's 5 ms).
    ``timeout``: the call's deadline (None: the client's, at least 120 s, for an
    engine start that may wait for a big pool's region; a reopen on the scheduler
    thread passes the plug-in's per-call timeout and retries later instead)."""
    return client.open_session(
        plan.name,
        block_bytes=plan.block_bytes,
        num_blocks=plan.num_blocks,
        layout=plan.layout,
        eviction_policy=settings.eviction_policy,
        client_name=client_name,
        queue_completions=queue_completions,
        flush_after=settings.flush_after,
        timeout=timeout,
    )


def open_pool_session(
    settings: PluginSettings, plan: PoolPlan, client_name: str, *, queue_completions: bool = False
) -> tuple[Client, Session]:
    """Opens a session on ``plan``'s pool (see :func:`open_session_on`), retrying
    ``settings.start_timeout`` seconds while the daemon is unreachable. The caller
    owns both and closes them.

    Raises DaemonStartError naming the address, the pool and what to do.
    """
    client = Client(settings.address, timeout=settings.timeout, token=settings.token)
    deadline = time.monotonic() + settings.start_timeout
    while True:
        try:
            session = open_session_on(
                client, settings, plan, client_name, queue_completions=queue_completions
            )
            return client, session
        except (Unavailable, DeadlineExceeded) as err:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            client.close()
            raise DaemonStartError(
                f"kvtierd is not reachable at {settings.address} (waited "
                f"{settings.start_timeout:g}s: {err}); start the daemon or set "
                "kv_connector_extra_config.kvtierd_address"
            ) from err
        except FailedPrecondition as err:
            client.close()
            raise DaemonStartError(
                f"kvtierd pool {plan.name!r} exists with another block size or layout than "
                f"this engine needs (block_bytes={plan.block_bytes}, layout={plan.layout!r}): "
                f"{err}; use another kvtierd_pool name or restart the daemon"
            ) from err
        except KvtierError as err:
            client.close()
            raise DaemonStartError(
                f"kvtierd at {settings.address} refused pool {plan.name!r}: {err}"
            ) from err

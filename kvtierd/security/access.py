"""Access errors and the checks that raise them.

Every refusal names the principal and, where there is one, the pool, so a
person reading the client's error knows what to change; the audit log records
the same fields (``kvtierd.security.audit``).
"""

from __future__ import annotations

from kvtierd.errors import PermissionDenied, Unauthenticated
from kvtierd.security.identity import Caller


class AccessDenied(PermissionDenied):
    """A known caller asked for something its principal may not reach.

    ``principal`` and ``pool`` ("" when the call names no pool) are kept for
    the audit log; the message carries them too."""

    def __init__(self, message: str, *, principal: str, pool: str = "") -> None:
        super().__init__(message)
        self.principal = principal
        self.pool = pool


class NotAuthenticated(Unauthenticated):
    """The call carries no identity the daemon accepts (no token, no peer ticket,
    or one it does not know)."""


def check_pool(caller: Caller, pool: str, action: str) -> None:
    """Raises ``AccessDenied`` unless ``caller``'s principal may reach ``pool``;
    ``action`` ("open", "flush", "watch", "stat", "explain") is for the message."""
    principal = caller.principal
    if principal.may_reach(pool):
        return
    raise AccessDenied(
        f"principal {principal.name!r} may not {action} pool {pool!r}: its pools are "
        f"{principal.describe_pools()} ([[security.principals]] pools)",
        principal=principal.name,
        pool=pool,
    )


def session_not_owned(session_id: str, pool: str, owner: str, caller: str) -> AccessDenied:
    """The error for a call on a session opened by another principal."""
    return AccessDenied(
        f"session {session_id[:64]!r} of pool {pool!r} belongs to principal {owner!r}; "
        f"principal {caller!r} may not use it (open a session of your own)",
        principal=caller,
        pool=pool,
    )

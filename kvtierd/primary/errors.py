"""Why a primary-tier call refused a key: the key is not in the state the call needs.
Each names the key; the call that raised changed nothing."""

from __future__ import annotations

from kvtierd.contract import BlockKey, LookupResult


class PrimaryStateError(KeyError):
    """A key is not in the state a call needs; ``key`` names it. Nothing changed."""

    def __init__(self, key: BlockKey, message: str) -> None:
        super().__init__(key)
        self.key = key
        self.message = message

    def __str__(self) -> str:
        return self.message


class NotLoadableError(PrimaryStateError):
    """``prepare_load`` of a key that is not HIT (absent or write in flight)."""

    def __init__(self, key: BlockKey, state: LookupResult = LookupResult.MISS) -> None:
        super().__init__(key, f"key {key!r} is {state.name}, not HIT; it cannot be loaded")
        self.state = state


class NotPinnedError(PrimaryStateError):
    """``complete_load`` of a key that holds fewer pins than the call releases."""

    def __init__(self, key: BlockKey) -> None:
        super().__init__(key, f"key {key!r} is not pinned (complete_load without prepare_load)")

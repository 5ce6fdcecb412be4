"""The write-budget gate of one pool's cascades to one tier (``max_write_bytes_per_s``:
:mod:`kvtierd.tiers.budget`), after admission: only a block the tier admitted asks
the budget.

A cascade's blocks ask the tier's budget in their order (a prefix chain: the front
blocks are the most reused); each block the tier does not hold yet costs what the
tier writes for it (``bytes_per_block``, header included). A block the tier holds
already costs nothing (storing it rewrites nothing) and always goes through. From
the first block the budget refuses, the job's blocks the tier lacks are not written
to this tier (dropped at once: never queued, never pinned, nothing
waits), counted under reason ``budget`` and recorded in the pool's history, so
Explain says why the tier lacks them.

Counters are this pool's (the budget is the tier's, shared by every pool):
:meth:`BudgetGate.rejected` gives blocks and bytes per reason, as the tier's
admission counters count theirs. Event loop only; O(1) per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey
from kvtierd.records.history import RemovalLog
from kvtierd.tiers.base import SecondaryTier
from kvtierd.tiers.budget import WRITE_BUDGET_OPTION, WriteBudget

BUDGET = "budget"
"""The reason a block over the write budget is counted under."""
OVER_BUDGET = f"not admitted: the tier's write budget ({WRITE_BUDGET_OPTION}) was spent"
"""What the history (Explain) says of a block the budget dropped."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """Blocks (and their bytes on the tier) not written for one reason (cumulative)."""

    blocks: int = 0
    bytes: int = 0


class BudgetGate:
    """What one pool's cascades may write to one tier under the tier's budget."""

    def __init__(
        self,
        tier: SecondaryTier,
        budget: WriteBudget | None,
        history: RemovalLog,
        bytes_per_block: int,
    ) -> None:
        """``budget``: the tier's (None: no budget, every block passes, nothing is
        counted). ``bytes_per_block``: what the tier writes per block."""
        self._tier = tier
        self._budget = budget
        self._history = history
        self.bytes_per_block = bytes_per_block
        self._rejected_blocks = 0
        self._rejected_bytes = 0

    def admit(self, keys: Sequence[BlockKey]) -> Sequence[BlockKey]:
        """The ``keys`` to write to the tier, in order: all of them without a budget;
        with one, those it holds already and those the budget lets through before it
        first refuses one. The others are counted and recorded (reason ``budget``)."""
        budget = self._budget
        if budget is None or not keys:
            return keys
        cost = self.bytes_per_block
        passed: list[BlockKey] = []
        dropped: list[BlockKey] = []
        spent = False  # refused once: the rest of this job finds no tokens either
        for key, held in zip(keys, self._tier.presence(keys), strict=True):
            if held is True or (not spent and budget.take(cost)):  # held: costs nothing
                passed.append(key)
            else:
                spent = True
                dropped.append(key)
        if dropped:
            self._rejected_blocks += len(dropped)
            self._rejected_bytes += len(dropped) * cost
            self._history.record(dropped, self._tier.name, OVER_BUDGET)
        return passed

    def rejected(self, reason: str = BUDGET) -> Rejected:
        """This pool's blocks not written to the tier for ``reason`` (only ``budget``
        is counted here; any other reason: none)."""
        if reason != BUDGET:
            return Rejected()
        return Rejected(self._rejected_blocks, self._rejected_bytes)

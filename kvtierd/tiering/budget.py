"""The write-budget gate of one pool's cascades to one tier (``max_write_bytes_per_s``:
:mod:`kvtierd.tiers.budget`), after admission: only a block the tier's admission
policy admitted asks the budget.

A job's blocks ask the tier's budget in their order (a prefix chain: the front blocks
are the most reused); each block the tier does not hold yet costs what the tier
writes for it (``bytes_per_block``, header included). A block the tier holds already
costs nothing (storing it rewrites nothing) and always goes through. From the first
block the budget refuses, the job's blocks the tier lacks are not written to this tier:
dropped at once (never queued, never pinned, nothing waits), counted by the tier's
admission as rejected for reason ``budget`` (:data:`~kvtierd.tiering.admission.BUDGET`:
moved from admitted to rejected) and recorded in the pool's history, so Explain says
"not admitted: over the tier's write budget".

The budget is the configured tier's, shared by every pool; the counters are this
pool's. Event loop only; O(1) per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.contract import BlockKey
from kvtierd.records.history import RemovalLog
from kvtierd.tiering.admission import BUDGET, TierAdmission
from kvtierd.tiers.base import SecondaryTier
from kvtierd.tiers.budget import WriteBudget


class BudgetGate:
    """What one pool's cascades may write to one tier under the tier's budget."""

    def __init__(
        self,
        tier: SecondaryTier,
        budget: WriteBudget | None,
        admission: TierAdmission,
        history: RemovalLog,
        bytes_per_block: int,
    ) -> None:
        """``budget``: the tier's (None: no budget, every block passes). ``admission``:
        the tier's for this pool, which counts the drops. ``bytes_per_block``: what
        the tier writes per block."""
        self._tier = tier
        self._budget = budget
        self._admission = admission
        self._history = history
        self.bytes_per_block = bytes_per_block

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
            self._admission.reject(dropped, BUDGET)
            self._history.record(dropped, self._tier.name, BUDGET.record)
        return passed

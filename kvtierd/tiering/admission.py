"""Admission to a secondary tier: which completed blocks are written to it
(docs/design/admission.md; a tier's ``admission`` option).

Without it every block a session completes is cascaded to every tier. In a
KV-cache trace most blocks are never read again: each costs a disk write (wear,
bandwidth that promotions need) or a network write and server memory, and evicts
a block that might have been read. A policy decides, per block and tier, at three
occasions (:class:`Occasion`):

* ``STORED``: a session completed the block (CompleteStore): the cascade;
* ``READ``: a session loaded the block from the primary (CompleteLoad) and the
  tier does not hold it: write it now?
* ``PROMOTED``: the block was promoted from a later tier (it is being reused):
  write it to the tiers before that one?

Policies (:data:`POLICIES`, by the option's value):

* ``always`` (:class:`AlwaysAdmit`): every stored and promoted block, as before
  admission existed; a read writes nothing.
* ``reused`` (:class:`ReusedAdmit`): no stored block; a block is written once it
  is read again from the primary (its first load), or promoted. Written at that
  read, a read block is in the tier when the primary evicts it: an eviction never
  waits for a write.
* ``tinylfu`` (:class:`TinyLfuAdmit`): a :class:`~kvtierd.tiering.sketch.FrequencySketch`
  counts every store and load of the pool's blocks; a block is admitted while the
  tier has room, and then only if its estimated frequency beats that of the block
  it would displace (the tier's :meth:`~kvtierd.tiers.base.SecondaryTier.victim`),
  a block the tier holds counting as seen at least once. A tier that cannot name
  its victim (a fleet's LRU lives in the server) admits what was seen at least twice.
  After a restart the sketch starts empty, from what the tier holds: every held
  block counts as seen once, so one-shot blocks do not displace them until the
  sketch has learnt again (no state file).

Counters (:class:`AdmissionStats`): per tier of a pool, blocks and bytes admitted,
and rejected by reason (:data:`REASONS`: ``not_reused``, ``infrequent``, and
``budget`` for a write budget's drops, counted through :meth:`TierAdmission.reject`).
A block rejected is simply not in that tier: no job, no stored event, a MISS there;
the tiering records "not admitted: <why>" in the pool's history for Explain.

Every decision is O(1) per block and runs on the event loop without I/O.
"""

from __future__ import annotations

import abc
import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtierd.contract import BlockKey
from kvtierd.tiering.sketch import FrequencySketch, sketch_for
from kvtierd.tiers.base import UNKNOWN_VICTIM
from kvtierd.tiers.options import ADMISSION_POLICIES

ALWAYS, REUSED, TINYLFU = "always", "reused", "tinylfu"
NOT_ADMITTED = "not admitted: "  # how the history's record of a rejection starts
DEFAULT_POLICY = ALWAYS
UNKNOWN_CAPACITY_BLOCKS = 1 << 16  # what a sketch is sized for when the tier's is unknown


class Occasion(enum.Enum):
    """When a block is offered to a tier (module doc)."""

    STORED = "stored"
    READ = "read"
    PROMOTED = "promoted"


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a block was not written to a tier: its counter label and Explain's words."""

    reason: str  # the ``reason`` label of the rejected counters
    why: str  # what follows "not admitted: " in Explain

    @property
    def record(self) -> str:
        """The history's line for a block rejected so (one shared string)."""
        return f"{NOT_ADMITTED}{self.why}"


NOT_REUSED = Rejection(
    "not_reused",
    "not read again from the primary yet (admission = reused writes it at its first load)",
)
INFREQUENT = Rejection(
    "infrequent",
    "seen too rarely to displace what the tier holds (admission = tinylfu)",
)
BUDGET = Rejection("budget", "over the tier's write budget (max_write_bytes_per_s)")
REASONS: tuple[str, ...] = (NOT_REUSED.reason, INFREQUENT.reason, BUDGET.reason)

VictimOf = Callable[[], "BlockKey | None"]
"""A tier's :meth:`~kvtierd.tiers.base.SecondaryTier.victim`: the key one more block
would displace, None when it fits, :data:`UNKNOWN_VICTIM` when the tier cannot tell."""


class AdmissionPolicy(abc.ABC):
    """Decides which blocks one tier of one pool takes. Event-loop only; every
    method is O(1) per key and never blocks."""

    name: ClassVar[str]

    def seen(self, keys: Sequence[BlockKey]) -> None:  # noqa: B027 - optional hook
        """``keys`` were stored or loaded (each once per call): called before the
        decisions about them."""

    @abc.abstractmethod
    def admit(self, key: BlockKey, occasion: Occasion) -> Rejection | None:
        """None: write ``key`` to the tier now; else why not. For ``READ`` a policy
        that writes nothing at reads answers :data:`NOT_ON_READ` (not counted)."""

    def decide(self, keys: Sequence[BlockKey], occasion: Occasion) -> list[Rejection | None]:
        """:meth:`admit` of each key of one batch, in order (a policy may share work
        between them: nothing is written until the batch is decided)."""
        return [self.admit(key, occasion) for key in keys]

    @property
    def sketch_bytes(self) -> int:
        """Bytes of the policy's own state (0: none)."""
        return 0


NOT_ON_READ = Rejection("", "")  # a read is no occasion for this policy: nothing counted


class AlwaysAdmit(AdmissionPolicy):
    """Every stored and promoted block (the behaviour before admission existed)."""

    name = ALWAYS

    def admit(self, key: BlockKey, occasion: Occasion) -> Rejection | None:
        return NOT_ON_READ if occasion is Occasion.READ else None


class ReusedAdmit(AdmissionPolicy):
    """A block once it is read again from the primary, or promoted from a later tier."""

    name = REUSED

    def admit(self, key: BlockKey, occasion: Occasion) -> Rejection | None:
        return NOT_REUSED if occasion is Occasion.STORED else None


class TinyLfuAdmit(AdmissionPolicy):
    """TinyLFU: a block whose estimated frequency beats its victim's (module doc)."""

    name = TINYLFU

    def __init__(self, sketch: FrequencySketch, victim: VictimOf) -> None:
        self.sketch = sketch
        self._victim = victim

    def seen(self, keys: Sequence[BlockKey]) -> None:
        add = self.sketch.add
        for key in keys:
            add(key)
        self.sketch.age_if_due()

    def admit(self, key: BlockKey, occasion: Occasion) -> Rejection | None:
        return self.decide((key,), occasion)[0]

    def decide(self, keys: Sequence[BlockKey], occasion: Occasion) -> list[Rejection | None]:
        """One victim for the batch: the tier writes none of it before it is decided."""
        victim = self._victim()
        if victim is None:
            return [None] * len(keys)  # room: nothing is displaced
        # a held block was admitted, so seen at least once (also: a restarted sketch)
        floor = 1 if victim is UNKNOWN_VICTIM else max(1, self.sketch.estimate(victim))
        no = NOT_ON_READ if occasion is Occasion.READ else INFREQUENT
        estimate = self.sketch.estimate
        return [None if estimate(key) > floor else no for key in keys]

    @property
    def sketch_bytes(self) -> int:
        return self.sketch.nbytes


POLICIES: tuple[str, ...] = (ALWAYS, REUSED, TINYLFU)
assert POLICIES == ADMISSION_POLICIES, "the admission option's choices are these policies"


def make_policy(name: str, victim: VictimOf, capacity_blocks: int) -> AdmissionPolicy:
    """The policy called ``name`` for a tier of ``capacity_blocks`` blocks (0:
    unknown) whose victim ``victim`` names; ValueError naming the choices."""
    if name == ALWAYS:
        return AlwaysAdmit()
    if name == REUSED:
        return ReusedAdmit()
    if name == TINYLFU:
        return TinyLfuAdmit(sketch_for(capacity_blocks or UNKNOWN_CAPACITY_BLOCKS), victim)
    raise ValueError(f"unknown admission policy {name!r}; expected one of {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """What one tier of one pool admitted and rejected (cumulative), a snapshot."""

    policy: str
    admitted_blocks: int
    admitted_bytes: int
    rejected_blocks: dict[str, int]  # by reason, every one of REASONS
    rejected_bytes: dict[str, int]
    sketch_bytes: int  # the policy's fixed state (tinylfu's sketch), 0 for others


class TierAdmission:
    """One tier's admission for one pool: its policy and its counters.

    Invariant: ``admitted + sum(rejected.values())`` is the number of blocks
    offered at ``STORED`` and ``PROMOTED`` plus those admitted at ``READ`` plus those
    counted through :meth:`reject`. Event-loop only.
    """

    def __init__(self, policy: AdmissionPolicy, block_bytes: int) -> None:
        self.policy = policy
        self._block_bytes = block_bytes
        self._admitted = 0
        self._rejected: Counter[str] = Counter(dict.fromkeys(REASONS, 0))

    @property
    def writes_on_read(self) -> bool:
        """The policy may write a block at its load (so the tiering offers loads)."""
        return not isinstance(self.policy, AlwaysAdmit)

    def offer(
        self, keys: Sequence[BlockKey], occasion: Occasion
    ) -> tuple[list[BlockKey], dict[Rejection, list[BlockKey]]]:
        """The keys to write now, and the rest grouped by why not (READ's
        non-occasions left out). Counts both. The caller told :meth:`seen` first
        about the stores and loads among them."""
        admitted: list[BlockKey] = []
        rejected: dict[Rejection, list[BlockKey]] = {}
        for key, rejection in zip(keys, self.policy.decide(keys, occasion), strict=True):
            if rejection is None:
                admitted.append(key)
            elif rejection is not NOT_ON_READ:
                rejected.setdefault(rejection, []).append(key)
        self._admitted += len(admitted)
        for rejection, those in rejected.items():
            self._rejected[rejection.reason] += len(those)
        return admitted, rejected

    def seen(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` were stored or loaded, once each (a policy counting accesses
        counts them), before any of them is offered."""
        self.policy.seen(keys)

    def reject(self, keys: Sequence[BlockKey], rejection: Rejection) -> None:
        """Counts ``keys`` as admitted by the policy but dropped afterwards for
        ``rejection`` (a write budget): moved from admitted to rejected."""
        self._admitted -= len(keys)
        self._rejected[rejection.reason] += len(keys)
        assert self._admitted >= 0, "rejected more than was admitted"

    def statistics(self) -> AdmissionStats:
        size = self._block_bytes
        return AdmissionStats(
            policy=self.policy.name,
            admitted_blocks=self._admitted,
            admitted_bytes=self._admitted * size,
            rejected_blocks=dict(self._rejected),
            rejected_bytes={reason: n * size for reason, n in self._rejected.items()},
            sketch_bytes=self.policy.sketch_bytes,
        )

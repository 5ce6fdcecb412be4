"""The router's view against the truth: what the indexer credits each engine with, and
what that engine could really load at that moment (pure counting, no I/O).

Both sides are prefixes of a request's blocks, per engine, at three depths:

* ``gpu``: the indexer's ``gpu`` against the engine's GPU cache;
* ``local``: its ``cpu`` (GPU or host memory) against the GPU cache or the node's
  primary tier;
* ``all``: its ``disk`` (anywhere) against the GPU cache or any tier of the node's pool,
  the shared Redis tier included.

For claimed ``c`` and true ``t`` blocks the overlap is ``min(c, t)`` (both prefixes);
precision = overlap / claimed and recall = overlap / true, summed over samples and
engines. The issue's ``view`` is the ``all`` depth: what each engine can load.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from benchmarks.routing_blocks import Chain
from benchmarks.routing_indexer import Holding

DEPTHS = ("gpu", "local", "all")


@dataclass(frozen=True)
class Placement:
    """Where one block of a node's pool is: its primary tier, or any tier at all."""

    primary: bool
    anywhere: bool


@dataclass(frozen=True)
class Truth:
    """An engine's loadable prefix at each depth, in blocks."""

    gpu: int
    local: int
    all: int


def loadable(chain: Chain, gpu: Container[bytes], pool: Sequence[Placement]) -> Truth:
    """``chain``'s leading blocks an engine with ``gpu`` on a node whose pool holds
    ``pool`` (per block, possibly shorter than the chain: the rest absent) can load."""

    def prefix(held: Sequence[bool]) -> int:
        count = 0
        for block in held:
            if not block:
                break
            count += 1
        return count

    at = [pool[i] if i < len(pool) else Placement(False, False) for i in range(len(chain))]
    on_gpu = [h in gpu for h in chain.hashes]
    return Truth(
        gpu=prefix(on_gpu),
        local=prefix([g or p.primary for g, p in zip(on_gpu, at, strict=True)]),
        all=prefix([g or p.anywhere for g, p in zip(on_gpu, at, strict=True)]),
    )


@dataclass
class Depth:
    claimed: int = 0
    true: int = 0
    overlap: int = 0

    def add(self, claimed: int, true: int) -> None:
        self.claimed += claimed
        self.true += true
        self.overlap += min(claimed, true)

    @property
    def precision(self) -> float:
        return self.overlap / self.claimed if self.claimed else 1.0

    @property
    def recall(self) -> float:
        return self.overlap / self.true if self.true else 1.0


@dataclass
class View:
    samples: int = 0
    depths: dict[str, Depth] = field(default_factory=lambda: {d: Depth() for d in DEPTHS})

    def add(self, held: dict[int, Holding], truths: Sequence[Truth]) -> None:
        """One sample: the indexer's answer (by instance id = engine + 1) and each
        engine's truth, in engine order."""
        self.samples += 1
        for engine, truth in enumerate(truths):
            claim = held.get(engine + 1, Holding())
            self.depths["gpu"].add(claim.gpu, truth.gpu)
            self.depths["local"].add(claim.cpu, truth.local)
            self.depths["all"].add(claim.disk, truth.all)

    def merge(self, other: View) -> None:
        self.samples += other.samples
        for name, depth in other.depths.items():
            mine = self.depths[name]
            mine.claimed += depth.claimed
            mine.true += depth.true
            mine.overlap += depth.overlap

    @property
    def precision(self) -> float:
        return self.depths["all"].precision

    @property
    def recall(self) -> float:
        return self.depths["all"].recall

    def describe(self) -> str:
        return ", ".join(
            f"{name} precision {d.precision:.3f} recall {d.recall:.3f} "
            f"({d.claimed:,} claimed, {d.true:,} true)"
            for name, d in self.depths.items()
        )

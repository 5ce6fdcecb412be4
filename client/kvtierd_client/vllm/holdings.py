"""What the manager's session holds on the daemon: load pins, reservations, graves.

* **load pins**: taken by ``prepare_load`` (claimed lookup pins, or a
  ``PrepareLoad``), released by ``complete_load`` after every worker copied the
  rows;
* **reservations**: rows reserved by ``prepare_store``, completed by
  ``complete_store`` (success makes them readable, failure frees them);
* **graves**: ``reset_cache`` makes vLLM ignore completions of the jobs in
  flight, so what they hold is *buried*: released once the workers have flushed
  those jobs (until then ``has_pending_work`` is True), and only against the
  generation (session) that took them: pins of a session the daemon forgot died
  with it. vLLM 0.33 says when (``on_reset_flushed``: :meth:`Holdings.flushed`);
  with vLLM 0.32, which does not, they are released :data:`GRAVE_STEPS`
  scheduler steps later (:meth:`Holdings.due`).

Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["GRAVE_STEPS", "Grave", "Holdings"]

GRAVE_STEPS = 2
"""Scheduler steps after ``reset_cache`` before abandoned pins/reservations are
released, when vLLM does not call ``on_reset_flushed`` (0.32)."""


@dataclass
class Grave:
    """Pins and reservations vLLM forgot at ``reset_cache``; released at
    ``release_step``, or when vLLM says the workers flushed (``release_step`` None)."""

    release_step: int | None
    generation: int
    load_pins: Counter[bytes]
    reserved: list[bytes]

    def pins(self) -> list[bytes]:
        """The buried load pins, one entry per pin."""
        return [k for k, n in self.load_pins.items() for _ in range(n)]


class Holdings:
    """Load pins and reservations of the current generation, and the graves.

    Invariant: ``load_pins`` and ``reserved`` hold keys of the current generation
    only (``forget`` empties them when it changes); ``load_pins`` counts are > 0.
    """

    def __init__(self) -> None:
        self.load_pins: Counter[bytes] = Counter()
        self.reserved: set[bytes] = set()
        self._graves: list[Grave] = []

    def pinned(self, keys: Iterable[bytes]) -> None:
        """``keys`` were pinned for loading (one pin each; a mapping counts its keys)."""
        for key in keys:
            self.load_pins[key] += 1  # load pin n -> n + 1

    def unpin(self, keys: Iterable[bytes]) -> list[bytes]:
        """Releases one load pin of each of ``keys`` this generation holds (unique,
        in order); returns those keys (the others died with an older session)."""
        mine = [k for k in dict.fromkeys(keys) if self.load_pins[k] > 0]
        for key in mine:
            self.load_pins[key] -= 1  # load pin n -> n - 1
            if self.load_pins[key] == 0:
                del self.load_pins[key]
        return mine

    def reserve(self, keys: Iterable[bytes]) -> None:
        self.reserved.update(keys)

    def complete(self, keys: Iterable[bytes]) -> list[bytes]:
        """Ends the reservations among ``keys`` this generation holds; returns them."""
        mine = [k for k in dict.fromkeys(keys) if k in self.reserved]
        self.reserved.difference_update(mine)
        return mine

    def bury(self, release_step: int | None, generation: int) -> None:
        """``reset_cache``: everything held now is released at ``release_step``
        (None: when :meth:`flushed` is called)."""
        if self.load_pins or self.reserved:
            self._graves.append(
                Grave(release_step, generation, self.load_pins, sorted(self.reserved))
            )
        self.forget()

    def forget(self) -> None:
        """Drops the pins and reservations (buried, or their session is gone)."""
        self.load_pins = Counter()
        self.reserved = set()

    def due(self, step: int) -> list[Grave]:
        """Removes and returns the graves with a release step, due at ``step``."""
        due: list[Grave] = []
        kept: list[Grave] = []
        for grave in self._graves:
            ready = grave.release_step is not None and grave.release_step <= step
            (due if ready else kept).append(grave)
        self._graves = kept
        return due

    def flushed(self) -> list[Grave]:
        """vLLM's workers flushed every job in flight at the resets so far: removes
        and returns every grave."""
        graves, self._graves = self._graves, []
        return graves

    @property
    def has_graves(self) -> bool:
        return bool(self._graves)

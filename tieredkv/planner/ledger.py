"""The store ledger: per request and KV group, which chunks are stored, waiting or never storable.

Primitives:

- :class:`ChunkLedger` -- one group of one request: a status byte per chunk (unseen, waiting,
  done, dead), the scan position, the sorted waiting list and the store cursor.
- :class:`RequestStore` -- one request: a ledger per group, the chunks of its latest store
  plan (``offers``), the bound on the chunks its next plan may visit, and the group planned first.

No vLLM import, no I/O: :mod:`tieredkv.planner.store` decides with these what to offer,
:mod:`tieredkv.planner.lookup` feeds lookup misses back into them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tieredkv.planner.plans import ChunkToStore

__all__ = ["DEAD", "DONE", "UNSEEN", "WAITING", "ChunkLedger", "RequestStore"]

# Per-chunk status bytes. WAITING chunks are also listed in ChunkLedger.waiting.
UNSEEN, WAITING, DONE, DEAD = 0, 1, 2, 3
_DONE_RUN = bytes((DONE,))
_NOT_DONE = (UNSEEN, WAITING, DEAD)


class ChunkLedger:
    """Store progress of one request's chunks in one KV group.

    The rules every tieredkv planner shares (``OffloadScheduler``, so the demo and
    ``store.planner()``, and the vLLM connector ``TieredKVConnector``): a chunk is
    *unseen*, *waiting* (offered, not yet accepted: offered again), *done* (stored or
    present) or *dead* (can never become whole). The cursor -- the lowest chunk not done or dead --
    moves only over done and dead chunks, so a refused or partially accepted
    chunk is never skipped. Waiting chunks are kept sorted, so a plan that takes
    the oldest ``n`` of them costs O(n), not O(backlog).
    """

    __slots__ = ("first_dead", "scan", "status", "waiting")

    def __init__(self) -> None:
        self.status = bytearray()
        # Every chunk below `scan` is DONE, DEAD or WAITING (then in `waiting`).
        self.scan = 0
        self.waiting: list[int] = []  # sorted
        self.first_dead: int | None = None

    def status_of(self, k: int) -> int:
        return self.status[k] if k < len(self.status) else UNSEEN

    def _set(self, k: int, value: int) -> None:
        if k >= len(self.status):
            self.status.extend(bytes(k + 1 - len(self.status)))
        if value == DEAD and (self.first_dead is None or k < self.first_dead):
            # Also when k is already dead: a rewind cleared first_dead but kept the status, and
            # a chunk passed as dead again must be reconsidered by the next rewind too.
            self.first_dead = k
        old = self.status[k]
        if old == value:
            return
        if old == WAITING:
            i = bisect.bisect_left(self.waiting, k)
            del self.waiting[i]
        self.status[k] = value
        if value == WAITING:
            bisect.insort(self.waiting, k)

    def mark_waiting(self, k: int) -> None:
        """Chunk ``k`` was offered (or cannot be offered yet): offer it again later."""
        self._set(k, WAITING)

    def mark_done(self, k: int) -> None:
        """Chunk ``k`` is stored or present; the scan moves over a done run."""
        self._set(k, DONE)
        while self.status_of(self.scan) == DONE:
            self.scan += 1

    def mark_done_range(self, lo: int, hi: int) -> None:
        """Chunks ``lo .. hi - 1`` are stored or present (e.g. a loaded hit): :meth:`mark_done` of
        each, with the status bytes set and the waiting ones dropped in a few C calls."""
        if hi <= lo:
            return
        if hi > len(self.status):
            self.status.extend(bytes(hi - len(self.status)))
        w = self.waiting
        if w and w[0] < hi and w[-1] >= lo:
            del w[bisect.bisect_left(w, lo) : bisect.bisect_left(w, hi)]
        self.status[lo:hi] = _DONE_RUN * (hi - lo)
        self.settle_scan()

    def mark_dead(self, k: int) -> None:
        """Chunk ``k`` can never become whole (left the window, request over)."""
        self._set(k, DEAD)

    def is_done(self, k: int) -> bool:
        return self.status_of(k) == DONE

    def forget(self, k: int) -> None:
        """The store lost chunk ``k`` (a lookup missed it): store it again."""
        if k < len(self.status) and self.status[k] != UNSEEN:
            self._set(k, UNSEEN)
            self.scan = min(self.scan, k)

    def missed(self, k: int, *, full: bool) -> int:
        """A lookup found chunk ``k`` missing: if the ledger counted it stored, it was evicted.

        The chunk is forgotten, so the request stores it again once it is whole (after a
        preemption, when it is recomputed). With ``full`` (a full-attention group, whose lookup
        stops at its first miss) every later chunk counted as stored is forgotten too: the lookup
        did not confirm them, and a re-offered chunk the store still holds is only answered
        "present". Returns the number of chunks forgotten.
        """
        if not full:
            if self.is_done(k):
                self.forget(k)
                return 1
            return 0
        n = 0
        k = self.status.find(DONE, k)
        while k != -1:
            self.forget(k)
            n += 1
            k = self.status.find(DONE, k + 1)
        return n

    def rewind_dead(self) -> None:
        """Reconsider chunks passed as never storable (e.g. after a preemption)."""
        if self.first_dead is not None:
            self.scan = min(self.scan, self.first_dead)
            self.first_dead = None

    def reset(self) -> None:
        """The store was emptied: everything is unseen again."""
        self.status = bytearray()
        self.scan = 0
        self.waiting.clear()
        self.first_dead = None

    def candidates(self, limit: int, budget: int | None = None) -> list[int]:
        """Chunks below ``limit`` to visit now: the oldest waiting ones, then new ones.

        At most ``budget`` chunks (None: no bound). The scan position moves to
        the last new chunk returned, so chunks past a bound are visited by a
        later call; call :meth:`settle_scan` after classifying them.
        """
        out: list[int] = []
        for k in self.waiting:
            if k >= limit or (budget is not None and len(out) >= budget):
                break
            out.append(k)
        k = self.scan
        while k < limit and (budget is None or len(out) < budget):
            if self.status_of(k) in (UNSEEN, DEAD):
                out.append(k)
            k += 1
        self.scan = max(self.scan, k)
        return out

    def pass_never_storable(self, limit: int, never_storable: Callable[[int], bool]) -> None:
        """Move the scan over the run of chunks below ``limit`` that need no visit: done,
        waiting (listed), or never storable (``never_storable(k)``: marked dead).

        Amortized O(1) per chunk; lets a bounded :meth:`candidates` spend its budget on
        chunks that may be offered, not on a long run of dead ones (e.g. the sliding-window
        chunks before a loaded hit).
        """
        k = self.scan
        while k < limit:
            if self.status_of(k) in (UNSEEN, DEAD):
                if not never_storable(k):
                    break
                self._set(k, DEAD)
            k += 1
        self.scan = k

    def settle_scan(self) -> None:
        """Move the scan over a run of done chunks (e.g. loaded ones). The run's end is found by C
        searches of the status bytes in windows that double from 16, each search bounded by the
        nearest end found so far: the cost grows with the run, not with the ledger."""
        st, k = self.status, self.scan
        n = len(st)
        if k >= n or st[k] != DONE:
            return
        k += 1
        width = 16
        while k < n:
            end = min(n, k + width)
            stop = end
            for status in _NOT_DONE:
                i = st.find(status, k, stop)
                if i >= 0:
                    stop = i
            if stop < end:
                k = stop
                break
            k, width = end, width * 2
        self.scan = k

    @property
    def cursor(self) -> int:
        """Lowest chunk not yet stored, present or never storable."""
        return min(self.scan, self.waiting[0]) if self.waiting else self.scan

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class RequestStore:
    """The store state of one request: a :class:`ChunkLedger` per group and its latest plan.

    Attributes:
        ledgers: One ledger per group, in the layout's (or the connector's group) order.
        offers: The latest plan's chunks, per group (None: none since the last answer).
        budget: Chunks the next plan may visit (None: no bound).
        rotation: The group the next bounded plan starts its remainder at.
    """

    __slots__ = ("budget", "ledgers", "offers", "rotation")

    def __init__(self, num_groups: int, budget: int | None) -> None:
        self.ledgers = tuple(ChunkLedger() for _ in range(num_groups))
        self.offers: list[list[ChunkToStore]] | None = None
        self.budget = budget
        self.rotation = 0

    @property
    def num_waiting(self) -> int:
        """Chunks offered and not taken yet, over every group."""
        return sum(len(led.waiting) for led in self.ledgers)

    def cursors(self) -> list[int]:
        """Each group's store cursor."""
        return [led.cursor for led in self.ledgers]

    def resume(self) -> None:
        """The request runs again (a preemption, a resume): chunks passed as never storable are
        reconsidered, since recomputation may make them whole."""
        for led in self.ledgers:
            led.rewind_dead()

    def loaded(self, first_tokens: int, end_tokens: int, tokens_per_chunk: Sequence[int]) -> None:
        """Tokens ``first_tokens .. end_tokens`` of every group are held by the store (a loaded
        hit): their chunks are done, never offered again. ``tokens_per_chunk``: per group."""
        for led, tpc in zip(self.ledgers, tokens_per_chunk):
            led.mark_done_range(first_tokens // tpc, end_tokens // tpc)

    def reset(self, budget: int | None) -> None:
        """The store was emptied: every chunk is unseen again; outcomes of earlier plans are ignored."""
        self.offers = None
        self.budget = budget
        for led in self.ledgers:
            led.reset()

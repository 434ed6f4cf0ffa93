"""Retention: chunks pinned against eviction for a time, or until displaced, with a priority.

What a retention hint (:mod:`tieredkv.integrations.vllm.controls`) or a library caller
(:meth:`TieredStore.retain <tieredkv.store.TieredStore.retain>`) asks for: the chunks of a
request's prefix are pinned in every tier of the store (:meth:`Tier.pin_many
<tieredkv.backends.base.Tier.pin_many>`, counted pins: a retention and a load's own pin of the
same chunk add up), so no eviction of this process takes them, for ``seconds`` (a *retention*) or
with no time (a *pin*). A :class:`RetentionBook` keeps them, bounded so a flood of hints cannot
pin a tier:

* at most ``max_chunks`` chunks and ``max_bytes`` bytes at once; a new chunk that does not fit
  displaces the retained chunks of strictly lower priority, lowest first (of equal priority, the
  one that would expire first; pins last); if that is not enough it is not retained (counted in
  ``refused``), and nothing of equal or higher priority is ever displaced;
* a retention time is cut to ``max_seconds``; a chunk retained again keeps the later expiry and
  the higher priority;
* :meth:`RetentionBook.expire` releases what is due; its owner calls it as it goes (vLLM: every
  scheduler step), so a retention ends at the first call after its time, not before; a pin ends
  only when displaced, at :meth:`RetentionBook.release_all` (a cache reset) or when the store closes.

Limits, as they are: a pin protects a chunk from this process's evictions (the CPU slab, LMDB's
and the fs tier's caps, a Redis tenant's quota); another process sharing an LMDB or fs directory,
and a Redis server's own ``maxmemory`` / TTL, do not know it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["RetentionBook"]

_PIN = math.inf


@dataclass(slots=True)
class _Entry:
    until: float  # monotonic time it ends (inf: a pin)
    priority: int
    nbytes: int
    seq: int  # the version of this entry its heap items carry (older items are stale)


class RetentionBook:
    """Retained chunks, bounded. Not thread-safe: one owner thread (vLLM's scheduler).

    Args:
        pin / unpin: protect / release keys (``TieredStore.pin`` / ``unpin``).
        max_chunks / max_bytes: what may be retained at once.
        max_seconds: longest retention; longer asks are cut to it.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        pin: Callable[[Sequence[bytes]], None],
        unpin: Callable[[Sequence[bytes]], None],
        *,
        max_chunks: int,
        max_bytes: int,
        max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pin, self._unpin = pin, unpin
        self.max_chunks = max(0, int(max_chunks))
        self.max_bytes = max(0, int(max_bytes))
        self.max_seconds = float(max_seconds)
        self.clock = clock
        self._entries: dict[bytes, _Entry] = {}
        self._expiry: list[tuple[float, int, bytes]] = []  # (until, seq, key), finite untils only
        self._rank: list[tuple[int, float, int, bytes]] = []  # (priority, until, seq, key): displacement order
        self._seq = itertools.count()
        self.bytes = 0
        #: chunks retained (newly), extended (already retained), refused (no room), displaced,
        #: expired, released (reset / close)
        self.counts = dict.fromkeys(("retained", "extended", "refused", "displaced", "expired", "released"), 0)
        #: Moves whenever :attr:`counts` did (a cheap "anything new?" for per-step readers).
        self.changes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def priority(self, key: bytes) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.priority

    def until(self, key: bytes) -> float | None:
        """When ``key``'s retention ends (``math.inf``: a pin); None when not retained."""
        e = self._entries.get(key)
        return None if e is None else e.until

    def retain(self, keys: Sequence[bytes], nbytes: int, *, seconds: float | None, priority: int = 0) -> int:
        """Retain ``keys`` (each ``nbytes``) for ``seconds`` (None: a pin) at ``priority`` (higher
        wins room). Returns how many are retained now (new or extended); the rest did not fit."""
        now = self.clock()
        until = _PIN if seconds is None else now + min(max(0.0, float(seconds)), self.max_seconds)
        released: list[bytes] = []
        pinned: list[bytes] = []
        held = 0
        for key in dict.fromkeys(keys):
            e = self._entries.get(key)
            if e is not None:
                if until > e.until or priority > e.priority:
                    self._push(key, _Entry(max(until, e.until), max(priority, e.priority), e.nbytes, 0))
                self.counts["extended"] += 1
                held += 1
                continue
            if not self._make_room(nbytes, priority, released):
                self.counts["refused"] += 1
                continue
            self._push(key, _Entry(until, priority, nbytes, 0))
            self.bytes += nbytes
            pinned.append(key)
            self.counts["retained"] += 1
            held += 1
        if released:
            self._unpin(released)
        if pinned:
            self._pin(pinned)
        self.changes += 1
        return held

    def expire(self) -> int:
        """Release every retention whose time has come; how many."""
        heap = self._expiry
        if not heap or heap[0][0] > self.clock():
            return 0
        now = self.clock()
        gone: list[bytes] = []
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            e = self._entries.get(key)
            if e is not None and e.seq == seq:
                self._drop(key, e)
                gone.append(key)
        if gone:
            self.counts["expired"] += len(gone)
            self.changes += 1
            self._unpin(gone)
        return len(gone)

    def release_all(self) -> int:
        """Release everything (a cache reset, a close); how many."""
        keys = list(self._entries)
        self._entries.clear()
        self._expiry.clear()
        self._rank.clear()
        self.bytes = 0
        if keys:
            self.counts["released"] += len(keys)
            self.changes += 1
            self._unpin(keys)
        return len(keys)

    # ---- plumbing ------------------------------------------------------------------------------

    def _push(self, key: bytes, e: _Entry) -> None:
        e.seq = next(self._seq)
        self._entries[key] = e
        if e.until != _PIN:
            heapq.heappush(self._expiry, (e.until, e.seq, key))
        heapq.heappush(self._rank, (e.priority, e.until, e.seq, key))
        if len(self._rank) > 4 * len(self._entries) + 64:  # stale items: rebuild (amortised)
            self._rank = [(x.priority, x.until, x.seq, k) for k, x in self._entries.items()]
            heapq.heapify(self._rank)
            self._expiry = [(x.until, x.seq, k) for k, x in self._entries.items() if x.until != _PIN]
            heapq.heapify(self._expiry)

    def _drop(self, key: bytes, e: _Entry) -> None:
        del self._entries[key]
        self.bytes -= e.nbytes

    def _make_room(self, nbytes: int, priority: int, released: list[bytes]) -> bool:
        """Room for one more chunk of ``nbytes``, displacing lower-priority ones; False if none."""
        if nbytes > self.max_bytes or self.max_chunks == 0:
            return False
        rank = self._rank
        while len(self._entries) + 1 > self.max_chunks or self.bytes + nbytes > self.max_bytes:
            while rank:
                _, _, seq, key = rank[0]
                e = self._entries.get(key)
                if e is not None and e.seq == seq:
                    break
                heapq.heappop(rank)  # stale
            if not rank or rank[0][0] >= priority:
                return False
            _, _, _, key = heapq.heappop(rank)
            self._drop(key, self._entries[key])
            released.append(key)
            self.counts["displaced"] += 1
        return True

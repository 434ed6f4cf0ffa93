"""Admission per KV group: store a chunk on its Nth sighting (``PolicyRule.admit_after``).

A *sighting* of a chunk is one request offering it for storing (it computed the chunk), counted
once per request however often the request's planner offers it again. A group whose rule says
``admit_after: 1`` (the default) stores every chunk it is offered, as before; ``admit_after: N``
declines a chunk until its Nth sighting, so a prefix one request computed and no other shares
costs no write. vLLM's own CPU tier has the same gate (``store_threshold``, counting every offer).

Sightings are counted in a bounded LRU (:class:`SightingCounter`: an ``OrderedDict`` of stored key
-> count, ``admission.tracked_keys`` entries, about 200 bytes each), not a count-min sketch: the
counts are exact for the keys it holds, a key is forgotten only when ``tracked_keys`` newer keys
came after it, and forgetting only ever *under*-counts (a chunk is declined once more, never
stored on fewer sightings than asked); a sketch of the same memory over-counts colliding keys,
admitting chunks seen once, and cannot forget old traffic without a decay scheme of its own.

:class:`Admission` is what :class:`~tieredkv.store.TieredStore` holds (``store.admission``;
``store.admit(keys)``); its callers are the planners' store paths: the demo, vLLM's
``TieredKVManager.prepare_store`` (a declined key is left out of ``keys_to_store``) and
``TieredKVSecondaryTier.submit_store`` (a declined key is not written). Declined chunks and their
bytes are counted per group (``GroupStats.admission_declined`` / ``admission_declined_bytes``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, MutableSet, Sequence

from tieredkv.keys import GROUP_SUFFIX, key_group

__all__ = ["Admission", "SightingCounter"]


class SightingCounter:
    """Sightings per key in a bounded LRU: the ``capacity`` most recently sighted keys."""

    __slots__ = ("_counts", "capacity", "forgotten")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"SightingCounter: capacity={capacity!r} is invalid: expected >= 1")
        self.capacity = capacity
        self._counts: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        #: Keys pushed out to keep within ``capacity`` (their counts start again at 0).
        self.forgotten = 0

    def sight(self, key: bytes) -> int:
        """Count one sighting of ``key``; its count now."""
        counts = self._counts
        n = counts.get(key)
        if n is None:
            if len(counts) >= self.capacity:
                counts.popitem(last=False)
                self.forgotten += 1
            counts[key] = 1
            return 1
        counts[key] = n + 1
        counts.move_to_end(key)
        return n + 1

    def count(self, key: bytes) -> int:
        """Sightings of ``key`` remembered (0: never, or forgotten)."""
        return self._counts.get(key, 0)

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)


class _Counts:
    """What admission did in one group."""

    __slots__ = ("admitted", "declined", "declined_bytes")

    def __init__(self) -> None:
        self.admitted = 0
        self.declined = 0
        self.declined_bytes = 0


class Admission:
    """Per-group admission over one :class:`SightingCounter`.

    Args:
        admit_after: a group's ``admit_after`` (its route's).
        tracked_keys: the counter's capacity.
        chunk_bytes: a group's chunk bytes, for the bytes a declined chunk did not write (0 if
            unknown).
        on_decline: called with ``(group, chunks, bytes)`` after each call that declined some
            (the store counts them in its group stats).
    """

    def __init__(
        self,
        admit_after: Callable[[int], int],
        tracked_keys: int,
        chunk_bytes: Callable[[int], int] = lambda g: 0,
        on_decline: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self._admit_after = admit_after
        self._chunk_bytes = chunk_bytes
        self._on_decline = on_decline
        self.sightings = SightingCounter(tracked_keys)
        self.counts: dict[int, _Counts] = collections.defaultdict(_Counts)
        self._thresholds: dict[bytes, int] = {}  # group suffix -> admit_after (a route never changes)

    def threshold(self, key: bytes) -> int:
        """``admit_after`` of ``key``'s group."""
        suffix = key[GROUP_SUFFIX]
        n = self._thresholds.get(suffix)
        if n is None:
            n = self._thresholds[suffix] = int(self._admit_after(key_group(key)))
        return n

    def admit(
        self, keys: Sequence[bytes], seen: MutableSet[bytes] | None = None, *, chunk_bytes: int | None = None
    ) -> list[bool]:
        """Whether to store each of ``keys`` (stored keys; any groups) now: a key of a group with
        ``admit_after`` 1 always; else on its ``admit_after``-th sighting or later. ``seen``: the
        keys this request was already counted for (updated), so a request's re-offers are not
        sightings. ``chunk_bytes``: the bytes of each chunk, when the caller knows them better
        than the group (a vLLM primary row)."""
        out: list[bool] = []
        declined: dict[int, list[int]] = {}
        for key in keys:
            n = self.threshold(key)
            if n <= 1:
                out.append(True)
                continue
            if seen is None or key not in seen:
                if seen is not None:
                    seen.add(key)
                count = self.sightings.sight(key)
            else:
                count = self.sightings.count(key)
            ok = count >= n
            out.append(ok)
            group = key_group(key)
            if ok:
                self.counts[group].admitted += 1
            else:
                d = declined.setdefault(group, [0, 0])
                d[0] += 1
                d[1] += self._chunk_bytes(group) if chunk_bytes is None else chunk_bytes
        for group, (chunks, nbytes) in declined.items():
            c = self.counts[group]
            c.declined += chunks
            c.declined_bytes += nbytes
            if self._on_decline is not None:
                self._on_decline(group, chunks, nbytes)
        return out

    def active(self, groups: Iterable[int]) -> bool:
        """Whether any of ``groups`` admits on a later sighting than the first."""
        return any(self._admit_after(g) > 1 for g in groups)

    def clear(self) -> None:
        """Forget every sighting (a cache reset: a new generation's keys are new chunks)."""
        self.sightings.clear()

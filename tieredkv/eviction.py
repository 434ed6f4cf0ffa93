"""Eviction policies: which records leave a tier first.

One seam shared by every place that evicts:

* **online**, inside a tier that enforces its own capacity (the CPU slab, LMDB's size cap):
  the tier reports ``insert`` / ``touch`` / ``remove`` and walks :meth:`EvictionPolicy.victims`
  (oldest first), skipping what it must keep (pinned or being read);
* **offline**, in ``tieredkv evict --to-size / --older-than``: :meth:`EvictionPolicy.rank` orders
  the :class:`~tieredkv.backends.base.RecordInfo` of a scan (``stamp`` = last access), and
  :func:`plan_eviction` picks the records to delete.

A tier that evicts locally builds one with :func:`make_policy` from its config's
``eviction_policy`` field (``"lru"`` by default; the CPU slab keeps one per slot class, LMDB one
per process, fed from the shared access stamps at open). LRU is the only built-in policy; ARC or
S3-FIFO would be another :class:`EvictionPolicy` subclass registered in :data:`policies`, after
which ``eviction_policy: <name>`` validates and takes effect. A policy sees sizes and accesses,
never pins: the tier skips pinned keys while it walks :meth:`EvictionPolicy.victims`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from tieredkv.backends.base import RecordInfo

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy", "plan_eviction", "policies"]


class EvictionPolicy(ABC):
    """Eviction order over a set of keys with sizes. Not thread-safe: the owning tier locks."""

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def insert(self, key: bytes, size: int) -> None:
        """A record was written (or overwritten) with ``size`` bytes."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A record was read. Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: bytes) -> int:
        """A record left the tier; returns its size (0 when unknown)."""

    @abstractmethod
    def victims(self) -> Iterator[bytes]:
        """Keys in eviction order (first = evict first). The caller must not mutate while iterating."""

    @abstractmethod
    def rank(self, infos: Iterable[RecordInfo]) -> list[RecordInfo]:
        """Offline order of a scan's records, first = evict first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @property
    @abstractmethod
    def total_bytes(self) -> int:
        """Sum of the sizes of the keys the policy knows."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first (an ``OrderedDict``; O(1) per operation)."""

    name = "lru"

    def __init__(self, entries: Iterable[tuple[bytes, int]] = ()) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict(entries)
        self._bytes = sum(self._order.values())

    def insert(self, key: bytes, size: int) -> None:
        self._bytes += size - self._order.pop(key, 0)
        self._order[key] = size

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> int:
        size = self._order.pop(key, 0)
        self._bytes -= size
        return size

    def victims(self) -> Iterator[bytes]:
        return iter(self._order)

    def rank(self, infos: Iterable[RecordInfo]) -> list[RecordInfo]:
        # records without a stamp (the medium cannot tell) count as oldest
        return sorted(infos, key=lambda i: (i.stamp is not None, i.stamp or 0.0, i.key))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    @property
    def total_bytes(self) -> int:
        return self._bytes


#: name -> policy class; a config names one of these.
policies: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str = "lru") -> EvictionPolicy:
    """A fresh policy by name (``ValueError`` naming the known ones otherwise)."""
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(policies)}") from None


def plan_eviction(
    infos: list[RecordInfo],
    *,
    now: float,
    older_than: float | None = None,
    to_size: int | None = None,
    record_bytes: Callable[[RecordInfo], int] = lambda i: i.size,
    policy: EvictionPolicy | None = None,
) -> list[RecordInfo]:
    """The records ``tieredkv evict`` deletes.

    Without ``older_than`` and ``to_size`` every record goes (a namespace / group selection).
    ``older_than`` (seconds) takes every record last accessed longer ago; ``to_size`` then takes
    more, in the policy's order, until the rest (``record_bytes`` each) fits in ``to_size``.
    """
    if older_than is None and to_size is None:
        return list(infos)
    victims: dict[bytes, RecordInfo] = {}
    if older_than is not None:
        victims = {i.key: i for i in infos if i.stamp is not None and now - i.stamp > older_than}
    if to_size is not None:
        left = sum(record_bytes(i) for i in infos if i.key not in victims)
        ranked = (policy if policy is not None else LRUPolicy()).rank(infos)  # an empty policy is falsy
        for i in ranked:
            if left <= to_size:
                break
            if i.key not in victims:
                victims[i.key] = i
                left -= record_bytes(i)
    return list(victims.values())

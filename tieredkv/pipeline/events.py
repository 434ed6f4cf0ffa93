"""Tier events: the keys each tier came to hold or stopped holding, in the order it happened, for
an engine's KV events (vLLM's ``take_events``, :mod:`tieredkv.integrations.vllm.events`).

Off until :meth:`Pipeline.record_tier_events <tieredkv.pipeline.Pipeline.record_tier_events>`
(``TieredStore.record_tier_events``); then:

* **stored** — a tier's writer lane wrote a batch (a store, a put of host buffers, a write-back
  one tier down, a promotion into a route's first tier), or a store's slots were published in the
  CPU tier (the slot path, :mod:`~tieredkv.pipeline.transfer`): one entry per batch, on the loop
  thread, once the tier has the records;
* **removed** — what a tier reported to its removal listener
  (:meth:`~tieredkv.backends.base.Tier.set_removal_listener`: its eviction policy, its server's
  evictions and expiries, a record dropped as corrupt), from whichever thread removed them.

A tier's evictions to make room for a batch are reported before that batch's stored entry (both
happen inside its put), so the entries replay in order into what each tier holds. Entries are
kept until taken (:meth:`TierEvents.take`): the consumer takes them every engine step.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from tieredkv.backends.base import RemovalListener

__all__ = ["TierEvent", "TierEvents"]


class TierEvent(NamedTuple):
    """``keys`` (stored keys) written to (``removed`` False) or gone from (True) tier ``tier``."""

    tier: str
    removed: bool
    keys: list[bytes]


class TierEvents:
    """The entries, oldest first (a deque: appended from any thread, taken from another)."""

    def __init__(self) -> None:
        self._q: collections.deque[TierEvent] = collections.deque()

    def stored(self, tier: str, keys: list[bytes]) -> None:
        self._q.append(TierEvent(tier, False, keys))

    def removed(self, tier: str, keys: list[bytes]) -> None:
        self._q.append(TierEvent(tier, True, keys))

    def listener(self, tier: str) -> RemovalListener:
        """Tier ``tier``'s removal listener: its removals as entries."""
        append = self._q.append

        def removed(keys: list[bytes]) -> None:
            append(TierEvent(tier, True, keys))

        return removed

    def take(self) -> list[TierEvent]:
        """Every entry so far, oldest first (those appended meanwhile stay for the next call)."""
        q = self._q
        return [q.popleft() for _ in range(len(q))]

    def __len__(self) -> int:
        return len(self._q)

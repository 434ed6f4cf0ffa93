"""Write-back and promotion: moving chunks between a route's tiers after the job that stored or
found them.

* **Write-back** (a route with ``write: back``): a store is acknowledged once its first tier,
  an in-process one (the CPU slab), holds it; the chunk is *dirty* until it is sent one tier
  down — when the first tier evicts it (:meth:`WriteBack.on_evict`) or at close
  (:meth:`WriteBack.flush`, bounded by its timeout; what cannot be written is counted in
  ``write_back_lost`` and logged).
* **Promotion** (a route with ``promote``): chunks a load found below the route's first tier
  are copied into it (:meth:`WriteBack.promote`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tieredkv.backends.base import Tier
from tieredkv.errors import TieredKVError
from tieredkv.keys import key_group
from tieredkv.pipeline.jobs import InFlight
from tieredkv.pipeline.lanes import Lanes, Outcome
from tieredkv.policy import GroupRoute, TierPolicy

__all__ = ["WriteBack"]

log = logging.getLogger(__name__)


class WriteBack:
    """Dirty chunks of write-back routes and promotions (loop thread only, but for counters)."""

    def __init__(
        self,
        lanes: Lanes,
        tiers: Mapping[str, Tier],
        policy: TierPolicy,
        inflight: InFlight,
        counters: collections.Counter[str],
    ) -> None:
        self.lanes = lanes
        self.tiers = tiers
        self.policy = policy
        self.inflight = inflight
        self.counters = counters
        #: Chunks a write-back route acknowledged in its first tier and not yet sent down.
        self.dirty: dict[bytes, GroupRoute] = {}
        self._queued: set[asyncio.Future[Outcome]] = set()  # eviction write-backs in flight

    async def write(self, route: GroupRoute, keys: list[bytes], views: list[Any]) -> tuple[list[bytes], dict[str, int]]:
        """Write items along ``route`` (every write tier at once); keys held by at least one tier,
        and per-tier counts. On a write-back route the written keys become dirty."""
        done, written = await self.lanes.write_items(route.write_tiers, keys, views)
        self.mark_dirty(route, done)
        return done, written

    def mark_dirty(self, route: GroupRoute, keys: Sequence[bytes]) -> None:
        """Record chunks a write-back route just acknowledged in its in-process first tier (they
        live only there)."""
        if route.write == "back" and len(route.tiers) > 1 and self.tiers[route.tiers[0]].capabilities.in_process:
            for k in keys:
                self.dirty[k] = route

    def on_evict(self, key: bytes, payload: bytes) -> None:
        """First-tier eviction (loop thread): write-back groups send the chunk one tier down."""
        route = self.dirty.pop(key, None) or self.policy.get(key_group(key))
        if route.write != "back" or len(route.tiers) < 2:
            return
        self.inflight.begin([key])  # pending for lookups, in flight for drain(), until written
        fut = self.lanes[route.tiers[1]].write(key, memoryview(payload))
        self._queued.add(fut)
        self.counters["write_backs"] += 1

        def done(f: Any) -> None:
            self._queued.discard(f)
            self.inflight.unpend([key])
            self.inflight.end()

        fut.add_done_callback(done)

    async def promote(self, route: GroupRoute, keys: list[bytes], views: list[Any], found_in: dict[int, str]) -> None:
        """Copy items found below the route's first tier into it (waits, since ``views`` are reused after)."""
        first = route.tiers[0]
        if not route.promote:
            return
        up = [i for i, n in found_in.items() if n != first]
        if up:
            for _, fut in self.lanes[first].write_many([keys[i] for i in up], [views[i] for i in up]):
                await fut
            self.counters["promotions"] += len(up)

    async def flush(self, timeout: float) -> None:
        """Write every dirty chunk to its route's next tier, in writer-sized batches, and wait for
        eviction write-backs already queued, all within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        dirty, self.dirty = self.dirty, {}
        todo: dict[tuple[str, str], list[bytes]] = collections.defaultdict(list)
        for key, route in dirty.items():
            todo[(route.tiers[0], route.tiers[1])].append(key)
        flushed = lost = gone = 0
        for (top, down), keys in todo.items():
            lane = self.lanes[down]
            for start in range(0, len(keys), lane.max_items):
                batch = keys[start : start + lane.max_items]
                left = deadline - loop.time()
                if left <= 0:
                    lost += len(batch)
                    continue
                try:
                    payloads = await self.tiers[top].get_many(batch)
                except TieredKVError as e:
                    log.error("close: cannot read %d write-back chunks from tier %s: %s", len(batch), top, e)
                    lost += len(batch)
                    continue
                held = [(k, v) for k, v in zip(batch, payloads) if v is not None]
                gone += len(batch) - len(held)  # deleted from the first tier meanwhile: nothing to keep
                if not held:
                    continue
                parts = {
                    fut: count for count, fut in lane.write_many([k for k, _ in held], [memoryview(v) for _, v in held])
                }
                done, pending = await asyncio.wait(list(parts), timeout=left)
                ok = sum(parts[f] for f in done if f.result() is Outcome.OK)
                flushed += ok
                lost += len(held) - ok
        queued = [f for f in self._queued if not f.done()]
        if queued:
            left = max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(queued, timeout=left) if left > 0 else (set(), set(queued))
            lost += len(pending) + sum(1 for f in done if f.result() is not Outcome.OK)
        self.counters["write_back_flushed"] += flushed
        self.counters["write_back_lost"] += lost
        if lost:
            log.error(
                "close: %d write-back chunks acknowledged in the CPU tier could not be written to"
                " the next tier (tier down, full, or past the %.1fs close timeout): they are lost;"
                " %d were written",
                lost,
                timeout,
                flushed,
            )
        elif flushed:
            log.info("close: %d write-back chunks written to the next tier", flushed)
        if gone:
            log.debug("close: %d write-back chunks were deleted before the flush", gone)

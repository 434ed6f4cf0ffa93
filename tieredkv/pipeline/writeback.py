"""Write-back and promotion: moving chunks between a route's tiers after the job that stored or
found them.

* **Write-back** (a route with ``write: back``): a store is acknowledged once its first tier,
  an in-process one (the CPU slab), holds it; the chunk is *dirty* until it is sent one tier
  down — when the first tier evicts it (:meth:`WriteBack.on_evict`) or at close
  (:meth:`WriteBack.flush`, bounded by its timeout; what cannot be written is counted in
  ``write_back_lost`` and logged). It goes down as a record of its own tenant.
* **Promotion** (a route with ``promote``): chunks a load found below the route's first tier
  are copied into it (:meth:`WriteBack.promote`), as records of the loading tenant.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping, Sequence
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
        #: Chunks a write-back route acknowledged in its first tier and not yet sent down: their
        #: route and tenant.
        self.dirty: dict[bytes, tuple[GroupRoute, int]] = {}
        #: Eviction write-backs in flight -> whether the chunk was dirty (acknowledged, held by
        #: no other tier): its loss is counted when the write's outcome is known.
        self._queued: dict[asyncio.Future[Outcome], bool] = {}
        self.lost_at_eviction = 0  # dirty chunks the next tier did not take when they were evicted

    async def write(
        self, route: GroupRoute, keys: list[bytes], views: list[Any], tenant: int = 0
    ) -> tuple[list[bytes], dict[str, int]]:
        """Write items (of ``tenant``) along ``route`` (every write tier at once); keys held by at
        least one tier, and per-tier counts. On a write-back route the written keys become dirty."""
        done, written = await self.lanes.write_items(route.write_tiers, keys, views, tenant)
        self.mark_dirty(route, done, tenant)
        return done, written

    def mark_dirty(self, route: GroupRoute, keys: Sequence[bytes], tenant: int = 0) -> None:
        """Record chunks (of ``tenant``) a write-back route just acknowledged in its in-process
        first tier (they live only there)."""
        if route.write == "back" and len(route.tiers) > 1 and self.tiers[route.tiers[0]].capabilities.in_process:
            entry = (route, tenant)
            for k in keys:
                self.dirty[k] = entry

    def sends_evictions_down(self, tier: str) -> bool:
        """Whether a record ``tier`` evicts can go down a route (:meth:`on_evict` does something):
        some rule writes back, with ``tier`` first among two or more. Every route a job takes is
        one of the rules' or narrower (:meth:`GroupRoute.among`: write-back only where the
        rule's is), and a group no rule names writes through."""
        for rule in self.policy.rules:
            tiers = tuple(rule.tiers) or self.policy.tier_names
            if rule.write == "back" and len(tiers) > 1 and tiers[0] == tier:
                return True
        return False

    def evict_listener(self, tier: str) -> Callable[[bytes, memoryview, int], None]:
        """The eviction listener of tier ``tier`` (``set_evict_listener``): :meth:`on_evict` of
        the records it evicts."""

        def listener(key: bytes, payload: memoryview, tenant: int) -> None:
            self.on_evict(key, payload, tenant, tier=tier)

        return listener

    def on_evict(self, key: bytes, payload: bytes | memoryview, tenant: int = 0, *, tier: str | None = None) -> None:
        """First-tier eviction (loop thread) of a record of ``tenant``: write-back groups send the
        chunk one tier down, as that tenant's record. A dirty chunk (acknowledged, held only by the
        first tier) that the next tier does not take is lost: counted in ``write_back_lost`` when
        its write's outcome is known. An eviction from another tier than the route's first
        (``tier``, when known: a slab lower on the route) sends nothing anywhere."""
        route = self.policy.get(key_group(key))
        if tier is not None and route.tiers and tier != route.tiers[0]:
            return
        dirty = self.dirty.pop(key, None)
        if dirty is not None:
            route = dirty[0]
        if route.write != "back" or len(route.tiers) < 2:
            return
        self.inflight.begin([key])  # pending for lookups, in flight for drain(), until written
        fut = self.lanes[route.tiers[1]].write(key, memoryview(bytes(payload)), tenant)  # (a view: the slot is reused)
        self._queued[fut] = dirty is not None
        self.counters["write_backs"] += 1

        def done(f: asyncio.Future[Outcome]) -> None:
            self.inflight.unpend([key])
            self.inflight.end()
            # (flush pops a write it gave up on at close and counts it there, once)
            if self._queued.pop(f, False) and (f.cancelled() or f.result() is not Outcome.OK):
                self._lose(1)

        fut.add_done_callback(done)

    def _lose(self, n: int, at_close: bool = False) -> None:
        self.counters["write_back_lost"] += n
        if not at_close:
            self.lost_at_eviction += n
            log.debug("write-back: %d acknowledged chunks evicted from the first tier were not written down", n)

    async def promote(
        self, route: GroupRoute, keys: list[bytes], views: list[Any], found_in: dict[int, str], tenant: int = 0
    ) -> None:
        """Copy items found below the route's first tier into it, as records of ``tenant`` (the
        loader's: a promotion counts against its quota there); waits, since ``views`` are reused
        after."""
        first = route.tiers[0]
        if not route.promote:
            return
        up = [i for i, n in found_in.items() if n != first]
        if up:
            for _, fut in self.lanes[first].write_many([keys[i] for i in up], [views[i] for i in up], tenant):
                await fut
            self.counters["promotions"] += len(up)

    async def flush(self, timeout: float) -> None:
        """At close: write every dirty chunk to its route's next tier, in writer-sized batches,
        and wait for eviction write-backs already queued, all within ``timeout`` seconds (0:
        nothing is written, only counted). Every acknowledged chunk that is not persisted in the
        next tier by then is counted in ``write_back_lost``, once, whatever the path: refused or
        dropped there, past the deadline, or lost at an eviction earlier (see :meth:`on_evict`);
        the closing log line gives the total."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        flushed = lost = gone = 0
        # A chunk leaves ``dirty`` only once this flush holds its bytes (no await in between): one
        # evicted meanwhile is written down (and counted) by on_evict instead. Chunks that became
        # dirty during the flush (a store still in flight) are taken in the next round.
        while self.dirty and deadline - loop.time() > 0:
            todo: dict[tuple[str, str, int], list[bytes]] = collections.defaultdict(list)
            for key, (route, tenant) in self.dirty.items():
                todo[(route.tiers[0], route.tiers[1], tenant)].append(key)
            for (top, down, tenant), keys in todo.items():
                lane = self.lanes[down]
                for start in range(0, len(keys), lane.max_items):
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    batch = keys[start : start + lane.max_items]
                    try:
                        async with asyncio.timeout(left):
                            payloads = await self.tiers[top].get_many(batch)
                    except (TieredKVError, TimeoutError) as e:
                        log.error("close: cannot read %d write-back chunks from tier %s: %s", len(batch), top, e)
                        for k in batch:
                            if self.dirty.pop(k, None) is not None:
                                lost += 1
                        continue
                    held: list[tuple[bytes, bytes]] = []
                    for k, v in zip(batch, payloads, strict=True):
                        if k not in self.dirty:
                            continue  # evicted (on_evict writes it) or flushed since the snapshot
                        del self.dirty[k]
                        if v is None:
                            gone += 1  # deleted from the first tier: nothing to keep
                        else:
                            held.append((k, v))
                    if not held:
                        continue
                    parts = {
                        fut: count
                        for count, fut in lane.write_many(
                            [k for k, _ in held], [memoryview(v) for _, v in held], tenant
                        )
                    }
                    done, _ = await asyncio.wait(list(parts), timeout=max(0.0, deadline - loop.time()))
                    ok = sum(parts[f] for f in done if f.result() is Outcome.OK)
                    flushed += ok
                    lost += len(held) - ok
        lost += len(self.dirty)  # past the deadline: never written
        self.dirty.clear()
        queued = [f for f in self._queued if not f.done()]
        if queued:
            left = max(0.0, deadline - loop.time())
            _, pending = await asyncio.wait(queued, timeout=left) if left > 0 else (set(), set(queued))
            lost += sum(self._queued.pop(f, False) for f in pending)  # (done ones: counted by on_evict)
        self.counters["write_back_flushed"] += flushed
        self._lose(lost, at_close=True)
        total = self.counters["write_back_lost"]
        if total:
            log.error(
                "close: %d write-back chunks acknowledged in the first tier were never written to the next"
                " tier (tier down, full, or past the %.1fs close timeout): they are lost (%d at close, %d"
                " when evicted earlier); %d were written at close",
                total,
                timeout,
                lost,
                self.lost_at_eviction,
                flushed,
            )
        elif flushed:
            log.info("close: %d write-back chunks written to the next tier", flushed)
        if gone:
            log.debug("close: %d write-back chunks were deleted before the flush", gone)

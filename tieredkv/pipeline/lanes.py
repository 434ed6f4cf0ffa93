"""Tier lanes: per tier, one writer task that batches queued chunks, and one circuit breaker.

A lane is the only place the pipeline calls a tier's data operations. Writes are queued and
sent in batches (one LMDB transaction or one Redis pipeline per batch), each item with its
tenant (a batch may mix tenants; one refused for its quota never takes another's records down
with it: a refused batch of several tenants is sent again per tenant); reads and existence
checks go straight through. What reaches a lane was checked when it was submitted (stored keys,
flat byte ``memoryview``s), so lanes use the tiers' ``put_checked`` / ``get_checked``. Every call is guarded by the tier's
:class:`~tieredkv.policy.CircuitBreaker`: a dead tier means dropped (counted) stores and
misses, never an exception into the engine, and it heals through half-open probes.
:class:`Lanes` routes items over several lanes (write to every write tier, read tier by tier).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import chain
from typing import Any

from tieredkv.backends.base import Tier
from tieredkv.config import PipelineConfig
from tieredkv.errors import TieredKVError, TierFullError
from tieredkv.pipeline.events import TierEvents
from tieredkv.pipeline.stats import LaneStats
from tieredkv.policy import CircuitBreaker

__all__ = ["Lanes", "Outcome", "TierLane"]

log = logging.getLogger(__name__)


class Outcome(Enum):
    OK = 1
    FULL = 2
    DROPPED = 3


@dataclass(slots=True)
class _WriteItem:
    """Consecutive items of one caller (one tenant), written in one batch and sharing its outcome."""

    keys: list[bytes]
    payloads: list[Any]
    nbytes: int
    fut: asyncio.Future[Outcome]
    tenant: int = 0


class TierLane:
    """One tier on the loop: its writer queue, writer task and breaker."""

    def __init__(self, tier: Tier, cfg: PipelineConfig) -> None:
        self.tier = tier
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self.queue: deque[_WriteItem] = deque()
        self._wake = asyncio.Event()
        self.max_bytes = int(cfg.max_batch_bytes)
        self.max_items = cfg.max_batch_items
        self.dropped = 0
        self.batches = 0
        self.task: asyncio.Task[None] | None = None
        #: Where each batch written is recorded (KV events), once asked for; None: nowhere.
        self.events: TierEvents | None = None

    def stats(self) -> LaneStats:
        return LaneStats(self.breaker.state.value, self.breaker.opens, self.dropped, self.batches)

    def write(self, key: bytes, payload: Any, tenant: int = 0) -> asyncio.Future[Outcome]:
        """Queue one item (of ``tenant``); its outcome once its batch is written."""
        return self._queue([key], [payload], len(payload), tenant)

    def write_many(
        self, keys: list[bytes], payloads: list[Any], tenant: int = 0
    ) -> list[tuple[int, asyncio.Future[Outcome]]]:
        """Queue items (of ``tenant``) as slices of at most one batch each (``max_batch_items``, and
        bytes until ``max_batch_bytes`` is reached); per slice, its length and its outcome. The
        per-item work on the loop is a size sum: a job's chunks travel together (no future or
        queue entry each)."""
        parts: list[tuple[int, asyncio.Future[Outcome]]] = []
        n, start = len(keys), 0
        while start < n:
            end, nbytes = start + 1, len(payloads[start])
            while end < n and end - start < self.max_items and nbytes < self.max_bytes:
                nbytes += len(payloads[end])
                end += 1
            parts.append((end - start, self._queue(keys[start:end], payloads[start:end], nbytes, tenant)))
            start = end
        return parts

    def _queue(self, keys: list[bytes], payloads: list[Any], nbytes: int, tenant: int = 0) -> asyncio.Future[Outcome]:
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.queue.append(_WriteItem(keys, payloads, nbytes, fut, tenant))
        self._wake.set()
        return fut

    async def run(self) -> None:
        """Send queued items in batches, up to the tier's ``writes_in_flight`` batches at once
        (each formed when it can be sent, from everything queued by then)."""
        queue = self.queue
        slots = asyncio.Semaphore(self.tier.capabilities.writes_in_flight)
        sending: set[asyncio.Task[None]] = set()

        def sent(task: asyncio.Task[None]) -> None:
            sending.discard(task)
            slots.release()

        try:
            while True:
                while not queue:
                    self._wake.clear()
                    await self._wake.wait()
                await slots.acquire()
                first = queue.popleft()
                batch, items, nbytes = [first], len(first.keys), first.nbytes
                while queue and items + len(queue[0].keys) <= self.max_items and nbytes < self.max_bytes:
                    item = queue.popleft()
                    batch.append(item)
                    items += len(item.keys)
                    nbytes += item.nbytes
                task = asyncio.get_running_loop().create_task(self._write_batch(batch))
                sending.add(task)
                task.add_done_callback(sent)
        finally:
            for task in sending:
                task.cancel()
            await asyncio.gather(*sending, return_exceptions=True)  # nothing left writing at close

    async def _write_batch(self, batch: list[_WriteItem]) -> None:
        tenanted = any(it.tenant for it in batch)  # per batch, not per item: without tenants, one test
        outcome = await self._put(batch)
        if outcome is Outcome.FULL and tenanted and len({it.tenant for it in batch}) > 1:
            # Refused, with several tenants in it: perhaps for one tenant's quota. Each tenant's
            # part again, so no tenant's records are refused for another's.
            parts: dict[int, list[_WriteItem]] = defaultdict(list)
            for it in batch:
                parts[it.tenant].append(it)
            for part in parts.values():
                self._answer(part, await self._put(part))
            return
        self._answer(batch, outcome)

    async def _put(self, batch: list[_WriteItem]) -> Outcome:
        """One ``put_checked`` of ``batch``'s items (with their tenants, if any has one)."""
        items = sum(len(it.keys) for it in batch)
        outcome = Outcome.OK
        if not self.breaker.allow():
            outcome = Outcome.DROPPED
        else:
            tenants = [it.tenant for it in batch for _ in it.keys] if any(it.tenant for it in batch) else None
            try:
                await self.tier.put_checked([kv for it in batch for kv in zip(it.keys, it.payloads)], tenants)
                self.breaker.success()
                self.batches += 1
                if self.events is not None:
                    keys = batch[0].keys if len(batch) == 1 else list(chain.from_iterable(it.keys for it in batch))
                    self.events.stored(self.tier.name, keys)
            except TierFullError:
                self.breaker.success()  # the tier answered: it is alive, just full
                outcome = Outcome.FULL
            except TieredKVError as e:
                self.breaker.failure()
                log.warning("tier %s: store of %d chunks dropped: %s", self.tier.name, items, e)
                outcome = Outcome.DROPPED
            except Exception:  # a bug, not a tier's failure: logged whole, and the batch still answered
                self.breaker.failure()
                log.exception("tier %s: store of %d chunks dropped", self.tier.name, items)
                outcome = Outcome.DROPPED
        if outcome is Outcome.DROPPED:
            self.dropped += items
        return outcome

    @staticmethod
    def _answer(batch: list[_WriteItem], outcome: Outcome) -> None:
        for it in batch:
            if not it.fut.done():
                it.fut.set_result(outcome)

    async def read(self, keys: list[bytes], into: list[Any]) -> list[Any] | None:
        """``get_many`` guarded by the breaker; ``None`` when the tier is skipped or failed."""
        if not self.breaker.allow():
            return None
        try:
            got = await self.tier.get_checked(keys, into)
        except TieredKVError as e:
            self.breaker.failure()
            log.warning("tier %s: load of %d chunks failed (misses): %s", self.tier.name, len(keys), e)
            return None
        self.breaker.success()
        return got

    async def contains(self, keys: list[bytes]) -> list[bool] | None:
        if not self.breaker.allow():
            return None
        try:
            got = await self.tier.contains_many(keys)
        except TieredKVError:
            self.breaker.failure()
            return None
        self.breaker.success()
        return got


class Lanes(dict[str, TierLane]):
    """Every tier's lane by name, with the multi-tier write and read the jobs share."""

    async def write_items(
        self, tiers: Sequence[str], keys: list[bytes], views: list[Any], tenant: int = 0
    ) -> tuple[list[bytes], dict[str, int]]:
        """Write every item (of ``tenant``) to each of ``tiers``; keys held by at least one tier,
        and per-tier counts."""
        lanes = [self[n] for n in tiers]
        queued = [lane.write_many(keys, views, tenant) for lane in lanes]  # every tier's writer gets them at once
        results: list[list[Outcome]] = []
        for parts in queued:
            res: list[Outcome] = []
            for count, fut in parts:
                res += [await fut] * count
            results.append(res)
        written = {lane.tier.name: res.count(Outcome.OK) for lane, res in zip(lanes, results)}
        if len(results) == 1 and written[lanes[0].tier.name] == len(keys):
            return list(keys), written
        done = [k for i, k in enumerate(keys) if any(res[i] is Outcome.OK for res in results)]
        return done, written

    async def read_items(
        self,
        tiers: Sequence[str],
        keys: list[bytes],
        views: list[Any],
        nbytes: int | None,
        todo: Sequence[int] | None = None,
    ) -> dict[int, str]:
        """Read items (all, or indices ``todo``, increasing) tier by tier; ``{index: tier}`` of
        those found (of exactly ``nbytes`` when given)."""
        found_in: dict[int, str] = {}
        todo = range(len(keys)) if todo is None else todo
        for name in tiers:
            if not todo:
                break
            whole = len(todo) == len(keys)  # every item: the caller's lists as they are
            got = await self[name].read(
                keys if whole else [keys[i] for i in todo], views if whole else [views[i] for i in todo]
            )
            if got is None:
                continue
            if (got.count(nbytes) == len(got)) if nbytes is not None else (None not in got):
                found_in.update(dict.fromkeys(todo, name))  # all found (the common case): C loops
                break
            for i, n in zip(todo, got):
                if n is not None and (nbytes is None or n == nbytes):
                    found_in[i] = name
                elif n:  # a verified record of another length: not this chunk, and none of it stays
                    views[i][:n] = bytes(n)
            todo = [i for i in todo if i not in found_in]
        return found_in

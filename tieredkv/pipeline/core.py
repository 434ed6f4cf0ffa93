"""The :class:`Pipeline`: admission, the two job families, lookups and stats, over the loop
bridge, the tier lanes, the transfer strategies and write-back (see :mod:`tieredkv.pipeline`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Container, Coroutine, Sequence
from typing import Any, Self

from tieredkv.backends.base import Tier, check_items
from tieredkv.config import PipelineConfig
from tieredkv.errors import TieredKVError, TierUnavailableError
from tieredkv.format import as_readable, as_writable
from tieredkv.groups import GroupSpec
from tieredkv.keys import GROUP_SUFFIX, key_group
from tieredkv.pipeline.events import TierEvents
from tieredkv.pipeline.jobs import InFlight, JobResult, JobRun, KeyState, LoadJob, StoreJob, by_group
from tieredkv.pipeline.lanes import Lanes, TierLane
from tieredkv.pipeline.loop import LoopThread
from tieredkv.pipeline.route import RoutePlan, RouteWalker
from tieredkv.pipeline.stats import GroupStats, LaneStats, PipelineStats, StagingStats
from tieredkv.pipeline.transfer import GroupBinding, Transfers, tiers_read
from tieredkv.pipeline.writeback import WriteBack
from tieredkv.policy import GroupRoute, TierPolicy
from tieredkv.staging import Copier, KVGroupTensors, StagingBuffer, StagingPool

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)

#: What :meth:`Pipeline.close` may take past its timeout: cancelling the tasks and closing the
#: tiers (together), then at most 0.75 s more to hand the loop back and join its thread.
CLOSE_GRACE_S = 1.0

# Enum members as module constants: ``probe`` runs once per key per engine step.
_HIT, _MISS, _PENDING = KeyState.HIT, KeyState.MISS, KeyState.PENDING


class Pipeline:
    """Moves chunks between KV tensors and tiers on a private event loop thread."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: TierPolicy,
        cfg: PipelineConfig | None = None,
        *,
        staging: StagingPool | None = None,
    ) -> None:
        self.cfg = cfg or PipelineConfig()
        self.tiers = {t.name: t for t in tiers}
        self.policy = policy
        self.staging = staging or StagingPool(int(self.cfg.staging_bytes))
        self.copier = Copier(threads=self.cfg.copy_threads)
        self.loop = LoopThread(use_uvloop=self.cfg.uvloop)
        self.inflight = InFlight()
        self.counters: collections.Counter[str] = collections.Counter()
        #: Per KV group: lookups' hits and misses, chunks and bytes stored and loaded, drops.
        self.group_stats: dict[int, GroupStats] = collections.defaultdict(GroupStats)
        self.latencies: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=100_000)
        )
        self._lanes = Lanes()
        self.writeback = WriteBack(self._lanes, self.tiers, policy, self.inflight, self.counters)
        self.transfers = Transfers(self.copier, self._lanes, self.writeback)
        self._groups: dict[int, GroupBinding] = {}
        #: Every lookup's walk over a key's route (plans resolved once per group: ``probe`` runs
        #: once per key per engine step).
        self.routes = RouteWalker(self._lanes, policy, self.group_stats.__getitem__, self._live)
        self._plans = self.routes.plans  # group suffix -> its plan (read directly by probe)
        self._lookup_lock = threading.Lock()  # lookup counts: from the loop and from engine threads
        # See activity(). Bumped from engine threads and the loop without a lock: a lost bump
        # still leaves a value the reader has not seen, or one read after the change it covers.
        self._events = 0
        self._finished: collections.deque[JobResult] = collections.deque()
        self._closed = False
        #: The tiers' stored / removed keys, once :meth:`record_tier_events` asked for them.
        self.events: TierEvents | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        """Start the loop thread and open every tier (raises what opening raises)."""
        if self.loop.running:
            return self
        self.loop.start()
        try:
            self.loop.run(self._open(), timeout=60)
        except BaseException:
            try:  # cancel the writers already started and close the tiers already open
                self.loop.run(self._shutdown(), timeout=10)
            except Exception:
                log.debug("cleanup after a failed start failed", exc_info=True)
            self.loop.stop()
            raise
        return self

    async def _open(self) -> None:
        for tier in self.tiers.values():
            lane = TierLane(tier, self.cfg)
            try:
                await tier.open()
            except TierUnavailableError as e:  # a dead tier at start is a tier with an open breaker
                log.warning("tier %s unavailable at start (misses and dropped stores until it heals): %s", tier.name, e)
                lane.breaker.trip()
            lane.task = asyncio.get_running_loop().create_task(lane.run(), name=f"tieredkv-writer-{tier.name}")
            self._lanes[tier.name] = lane
            if self.writeback.sends_evictions_down(tier.name):  # else an eviction's bytes go nowhere
                tier.set_evict_listener(self.writeback.evict_listener(tier.name))

    def record_tier_events(self) -> TierEvents:
        """From now on, record what each tier comes to hold and stops holding
        (:mod:`~tieredkv.pipeline.events`; for an engine's KV events): sets every tier's removal
        listener and the writers' records. Idempotent; the pipeline must be started."""
        if self.events is None:
            self.loop.run(self._record_events(TierEvents()), timeout=30)
        assert self.events is not None
        return self.events

    async def _record_events(self, events: TierEvents) -> None:
        for lane in self._lanes.values():
            lane.events = events
        self.transfers.events = events
        for tier in self.tiers.values():
            tier.set_removal_listener(events.listener(tier.name))
        self.events = events

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout`` passed first."""
        return self.inflight.wait_idle(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Drain, flush write-backs, cancel what is left, close the tiers, join the thread, all
        within ``timeout`` seconds plus a small constant (:data:`CLOSE_GRACE_S`): the drain and the
        flush share one deadline. Never hangs on a dead tier: chunks a write-back route
        acknowledged that were not written down are counted (``counters["write_back_lost"]``,
        ``write_back_flushed`` for those written at close) and logged as an error.

        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.routes.clear()
        if not self.loop.running:
            return
        deadline = time.monotonic() + max(timeout, 0.0)
        self.drain(timeout)
        left = max(0.0, deadline - time.monotonic())
        try:
            self.loop.run(self._shutdown(flush_s=left, grace_s=CLOSE_GRACE_S), timeout=left + CLOSE_GRACE_S + 0.25)
        except TimeoutError:
            log.error("close: the pipeline's shutdown ran past its %.1fs deadline; stopping its loop", timeout)
        finally:
            self.loop.stop(join_s=0.5)
            self.copier.close()  # moves still queued end (or are taken off) before the memory goes
            self.staging.free()  # do not wait for the garbage collector to return the pool

    async def _shutdown(self, flush_s: float = 0.0, grace_s: float = 10.0) -> None:
        """Flush write-backs (within ``flush_s``; 0 counts what is dirty as lost), then cancel the
        tasks and close the tiers, those two within ``grace_s`` together (a tier that does not
        close by then is left behind, logged)."""
        try:
            await self.writeback.flush(flush_s)
        except Exception:
            log.exception("write-back flush at close failed")
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        tasks = [*self.loop.tasks(), *(lane.task for lane in self._lanes.values() if lane.task)]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for tier in self.tiers.values():
            try:
                async with asyncio.timeout_at(max(end, loop.time() + 0.05)):
                    await tier.close()
            except TimeoutError:
                log.error("close: tier %s did not close within the close timeout; left behind", tier.name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        """Run ``coro`` (e.g. a tier call) on the pipeline loop and wait for its result."""
        return self.loop.run(coro, timeout)

    def run_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the pipeline loop until it ends or the pipeline closes (then cancelled)."""
        self.loop.spawn(coro)

    # ---- groups --------------------------------------------------------------------------

    def register_group(
        self,
        group: int | GroupSpec,
        tensors: Sequence[Any],
        *,
        blocks_per_chunk: int = 1,
        kind: str = "full",
        null_block: int | None = None,
    ) -> GroupRoute:
        """Declare a KV group: its spec (or index, chunk size in blocks and kind), its tensors
        (block id first) and its null block (see :class:`~tieredkv.pipeline.LoadJob`)."""
        kv = KVGroupTensors(tensors)
        spec = (
            group
            if isinstance(group, GroupSpec)
            else GroupSpec.by_index(group, kind, blocks_per_chunk, kv.bytes_per_block)
        )
        route = self.policy.route(spec, kv.chunk_bytes(spec.blocks_per_chunk))
        unknown = [n for n in route.tiers if n not in self.tiers]
        if unknown:
            raise TieredKVError(f"group {spec.index} routes to unknown tiers {unknown}")
        self._groups[spec.index] = GroupBinding(spec, kv, route, null_block)
        self._events += 1  # its series exist from now on
        return route

    # ---- engine-block jobs: submit (engine thread) ---------------------------------------------

    def submit_store(self, job: StoreJob) -> bool:
        """Queue a store; returns at once whether it was admitted. Back-pressure (staging full),
        a closed pipeline or an empty job refuses it: False (counted), and no result will come.
        A job larger than the whole staging pool is staged in parts (see :meth:`_admit`)."""
        admitted = self._admit(job, "store")
        if admitted is None:
            self.group_stats[job.group].dropped_stores += len(job.chunks)
            self._events += 1
            return False
        grp, buf = admitted
        self.copier.wake(grp.tensors)
        ready = self.copier.record_ready(grp.tensors)
        self.inflight.begin([c.key for c in job.chunks])
        self.loop.spawn(self._store(job, grp, buf, ready, time.perf_counter()))
        return True

    def submit_load(self, job: LoadJob) -> bool:
        """Queue a load; returns at once whether it was admitted (False: back-pressure, closed or
        empty; no result will come). The result says which keys were loaded. A job larger than the
        whole staging pool is staged in parts (see :meth:`_admit`); if a chunk is missing, the
        parts before it may already be copied (the job fails all the same)."""
        admitted = self._admit(job, "load")
        if admitted is None:
            return False
        grp, buf = admitted
        self.copier.wake(grp.tensors)
        self.inflight.begin()
        self.loop.spawn(self._load(job, grp, buf, time.perf_counter()))
        return True

    def _admit(self, job: StoreJob | LoadJob, kind: str) -> tuple[GroupBinding, StagingBuffer] | None:
        """Staging for a job's chunks (it also bounds the bytes in flight), or None when refused.

        A job that fits the pool gets room for all its chunks or waits (back-pressure: refused
        now). One larger than the whole pool could never get that: it gets as many whole chunks
        as the largest free range holds now (at least one, counted in ``{kind}_in_parts``) and
        moves through that buffer part by part. Only a single chunk larger than the pool is
        refused for good."""
        grp = self._group(job.group)
        if not job.chunks or self._refused(kind):
            return None
        cb = grp.chunk_bytes
        need = len(job.chunks) * cb
        if need <= self.staging.capacity:
            buf = self.staging.try_acquire(need)
        else:
            buf = self.staging.try_acquire_part(cb, need)
            if buf is not None:
                self.counters[f"{kind}_in_parts"] += 1
            elif cb > self.staging.capacity:
                log.warning(
                    "group %d: a chunk of %d bytes is larger than the staging pool (%d bytes)",
                    job.group,
                    cb,
                    self.staging.capacity,
                )
        if buf is None:
            self.counters[f"{kind}_backpressure"] += 1
        return None if buf is None else (grp, buf)

    # ---- engine-block jobs: run (loop thread) --------------------------------------------------

    async def _store(self, job: StoreJob, grp: GroupBinding, buf: StagingBuffer, ready: Any, t0: float) -> None:
        keys = [c.key for c in job.chunks]
        run = JobRun("store", job.job_id, self.cfg.job_timeout_s)
        done: list[bytes] = []
        written: dict[str, int] = {}
        try:
            async with run.guard():
                done, written = await self.transfers.store(job, grp, buf, ready)
                if len(done) < len(keys):
                    run.error = "some chunks were refused or dropped by every tier"
        finally:
            self.staging.release(buf)
            self.inflight.unpend(keys)
            nbytes = len(done) * grp.chunk_bytes
            gs = self.group_stats[job.group]
            gs.stores += len(done)
            gs.stored_bytes += nbytes
            gs.dropped_stores += len(keys) - len(done)
            done_set = set(done) if len(done) < len(keys) else None
            failed = () if done_set is None else tuple(k for k in keys if k not in done_set)
            self._finish(run, t0, nbytes, tuple(done), failed, written)

    async def _load(self, job: LoadJob, grp: GroupBinding, buf: StagingBuffer, t0: float) -> None:
        keys = [c.key for c in job.chunks]
        run = JobRun("load", job.job_id, self.cfg.job_timeout_s)
        found_in: dict[int, str] = {}
        try:
            async with run.guard():
                await self.transfers.load(job, grp, buf, found_in)
                if len(found_in) < len(keys):
                    run.error = f"{len(keys) - len(found_in)} of {len(keys)} chunks not found in any tier"
        finally:
            self.staging.release(buf)
            ok_keys = tuple(keys) if not run.error else ()
            gs = self.group_stats[job.group]
            gs.loads += len(ok_keys)
            gs.loaded_bytes += len(ok_keys) * grp.chunk_bytes
            gs.load_missing += len(keys) - len(found_in)
            missing = () if len(found_in) == len(keys) else tuple(k for i, k in enumerate(keys) if i not in found_in)
            self._finish(run, t0, len(ok_keys) * grp.chunk_bytes, ok_keys, missing, tiers_read(found_in))

    # ---- host-buffer jobs (a caller that already holds the bytes in host memory) ---------------

    def submit_put(
        self, job_id: int, items: Sequence[tuple[bytes, Any]], tenant: int = 0, tiers: Container[str] | None = None
    ) -> bool:
        """Store ``(key, host buffer)`` items (records of ``tenant``, a tenant id), each routed by
        its key's group (over only its tiers in ``tiers``, when given). Returns at once; the caller
        keeps the buffers unchanged until the job's result is polled (kind "put"). A bad item
        raises here (``ValueError`` / ``TypeError`` naming it), before anything is queued."""
        if self._refused("put"):
            return False
        items = check_items("put", items, as_readable)
        self.inflight.begin([k for k, _ in items])
        self.loop.spawn(self._put_buffers(job_id, items, time.perf_counter(), tenant, tiers))
        return True

    def submit_get(
        self, job_id: int, items: Sequence[tuple[bytes, Any]], tenant: int = 0, tiers: Container[str] | None = None
    ) -> bool:
        """Read ``(key, writable host buffer)`` items, each buffer filled completely by its record
        (result kind "get": ``done`` found and copied, ``failed`` missing), from its route's tiers
        (only those in ``tiers``, when given); what is promoted into a route's first tier is
        ``tenant``'s record there."""
        if self._refused("get"):
            return False
        items = check_items("get", items, as_writable)
        self.inflight.begin()
        self.loop.spawn(self._get_buffers(job_id, items, time.perf_counter(), tenant, tiers))
        return True

    def _route(self, group: int, tiers: Container[str] | None) -> GroupRoute:
        route = self.policy.get(group)
        return route if tiers is None else route.among(tiers)

    async def _put_buffers(
        self, job_id: int, items: list[tuple[bytes, Any]], t0: float, tenant: int = 0, tiers: Any = None
    ) -> None:
        run = JobRun("put", job_id, self.cfg.job_timeout_s)
        done: list[bytes] = []
        written: collections.Counter[str] = collections.Counter()
        try:
            async with run.guard():
                for group, idx in by_group(items).items():
                    keys = [items[i][0] for i in idx]
                    got, w = await self.writeback.write(
                        self._route(group, tiers), keys, [items[i][1] for i in idx], tenant
                    )
                    done += got
                    written.update(w)
                    got_set = set(got)
                    gs = self.group_stats[group]
                    gs.stores += len(got)
                    gs.stored_bytes += sum(_nbytes(items[i][1]) for i in idx if items[i][0] in got_set)
                    gs.dropped_stores += len(idx) - len(got)
                if len(done) < len(items):
                    run.error = "some items were refused or dropped by every tier"
        finally:
            self.inflight.unpend([k for k, _ in items])
            done_set = set(done)
            nbytes = sum(_nbytes(b) for k, b in items if k in done_set)
            failed = tuple(k for k, _ in items if k not in done_set)
            self._finish(run, t0, nbytes, tuple(done), failed, dict(written))

    async def _get_buffers(
        self, job_id: int, items: list[tuple[bytes, Any]], t0: float, tenant: int = 0, tiers: Any = None
    ) -> None:
        run = JobRun("get", job_id, self.cfg.job_timeout_s)
        found: dict[int, str] = {}
        try:
            async with run.guard():
                for group, idx in by_group(items).items():
                    route = self._route(group, tiers)
                    keys = [items[i][0] for i in idx]
                    views = [items[i][1] for i in idx]
                    sizes = {_nbytes(v) for v in views}
                    got = await self._lanes.read_items(
                        route.tiers, keys, views, sizes.pop() if len(sizes) == 1 else None
                    )
                    found.update({idx[j]: t for j, t in got.items()})
                    await self.writeback.promote(route, keys, views, got, tenant)
                    gs = self.group_stats[group]
                    gs.loads += len(got)
                    gs.loaded_bytes += sum(_nbytes(views[j]) for j in got)
                    gs.load_missing += len(idx) - len(got)
                if len(found) < len(items):
                    run.error = f"{len(items) - len(found)} of {len(items)} items not found in any tier"
        finally:
            nbytes = sum(_nbytes(items[i][1]) for i in found)
            done = tuple(items[i][0] for i in sorted(found))
            missing = tuple(k for i, (k, _) in enumerate(items) if i not in found)
            self._finish(run, t0, nbytes, done, missing, tiers_read(found))

    # ---- results (engine thread) -----------------------------------------------------------------

    def poll_finished(self) -> list[JobResult]:
        """Every job finished since the last call (never blocks)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def is_pending(self, key: bytes) -> bool:
        return self.inflight.is_pending(key)

    # ---- lookups (any thread) ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], timeout: float | None = 5.0) -> list[tuple[KeyState, str | None]]:
        """Per key: (HIT, tier) / (PENDING, None) / (MISS, None), searching each key's route in order."""
        return self.loop.run(self._lookup(list(keys)), timeout=timeout)

    def lookup_future(self, keys: Sequence[bytes], tiers: Container[str] | None = None) -> Any:
        """Like :meth:`lookup` but returns a ``concurrent.futures.Future`` at once (never blocks);
        ``tiers``: ask only the routes' tiers among them (a request's tier filter)."""
        return self.loop.submit(self._lookup(list(keys), tiers))

    async def _lookup(
        self, keys: list[bytes], tiers: Container[str] | None = None
    ) -> list[tuple[KeyState, str | None]]:
        try:
            return await self._lookup_keys(keys, tiers)
        finally:
            self._events += 1  # its tier calls may have counted (errors, a breaker)

    async def _lookup_keys(
        self, keys: list[bytes], tiers: Container[str] | None = None
    ) -> list[tuple[KeyState, str | None]]:
        out: list[tuple[KeyState, str | None]] = [(KeyState.MISS, None)] * len(keys)
        todo: list[int] = []
        for i, k in enumerate(keys):
            if self.inflight.is_pending(k):
                out[i] = (KeyState.PENDING, None)
            else:
                todo.append(i)
        for i, name in (await self.routes.find_many(keys, todo, tiers)).items():
            out[i] = (KeyState.HIT, name)
        for k, (state, _) in zip(keys, out):
            if state is not _PENDING:
                self._count_lookup(key_group(k), state is _HIT)
        return out

    def probe(self, key: bytes) -> KeyState | None:
        """Answer a lookup of ``key`` at once, from the calling thread, when every tier of its route
        can tell without waiting (:meth:`Tier.probe_key`: the CPU slab, a local LMDB); None when
        some tier cannot (a Redis server) or its breaker is not closed, and no earlier tier holds
        it: ask :meth:`lookup_future`.

        vLLM's scheduler calls this once per key per step: the route is resolved once per group
        (:meth:`RouteWalker.plan <tieredkv.pipeline.route.RouteWalker.plan>`), and a probe is a
        dict lookup, the plan's walk and the count (the lock taken and released by hand: ``with``
        costs twice as much on this path)."""
        if key in self.inflight.pending:
            return _PENDING
        plan = self._plans.get(key[GROUP_SUFFIX]) or self.routes.plan(key)
        if plan is None:
            return None
        found = plan.find(key)
        if found is None:
            return None  # let the asynchronous path (and its breaker probes) decide
        gs = plan.stats
        lock = self._lookup_lock
        lock.acquire()
        try:
            if found is False:
                gs.misses += 1
            else:
                gs.hits += 1
        finally:
            lock.release()
        return _MISS if found is False else _HIT

    def probe_prefix(
        self, keys: Sequence[bytes], start: int = 0, writing: Container[bytes] = ()
    ) -> list[KeyState | None]:
        """:meth:`probe` of ``keys[start:]`` in order, up to and including the first answer that
        is neither HIT nor PENDING (a MISS, or None: ask that one elsewhere, the rest were not
        probed). Keys in ``writing`` (the caller's own stores not submitted yet) are PENDING, as
        keys in flight here are; neither is counted. The counts are added under one lock at the
        end: a scheduler's prefix scan of a group is one call instead of one per key.

        The leading run of keys of one group that its route's first tier holds (and that are not
        in flight) is found by C loops when that tier has an in-process index
        (:meth:`RoutePlan.hit_run <tieredkv.pipeline.route.RoutePlan.hit_run>`: the CPU tier);
        the rest key by key."""
        out: list[KeyState | None] = []
        n = len(keys)
        plan: RoutePlan | None = None
        suffix = b""
        hits = misses = 0
        pending = self.inflight.pending
        if start < n:
            plan = self._plans.get(keys[start][GROUP_SUFFIX])
            if plan is not None:
                run = plan.hit_run(keys, start)
                if run and not (
                    (pending and any(map(pending.__contains__, run)))
                    or (writing and any(map(writing.__contains__, run)))
                ):
                    suffix = keys[start][GROUP_SUFFIX]
                    hits = len(run)
                    out = [_HIT] * hits
                    start += hits
                else:
                    plan = None
        plans = self._plans
        counts: list[tuple[GroupStats, int, int]] = []
        for i in range(start, n):
            key = keys[i]
            if key in pending or key in writing:
                out.append(_PENDING)
                continue
            if key[GROUP_SUFFIX] != suffix or plan is None:
                if plan is not None and (hits or misses):
                    counts.append((plan.stats, hits, misses))
                    hits = misses = 0
                plan = plans.get(key[GROUP_SUFFIX]) or self.routes.plan(key)
                if plan is None:
                    out.append(None)
                    break
                suffix = key[GROUP_SUFFIX]
            found = plan.find(key)
            if found is None:
                out.append(None)
                break
            if found is False:
                out.append(_MISS)
                misses += 1
                break
            out.append(_HIT)
            hits += 1
        if plan is not None and (hits or misses):
            counts.append((plan.stats, hits, misses))
        if counts:
            lock = self._lookup_lock
            lock.acquire()
            try:
                for g, h, m in counts:
                    g.hits += h
                    g.misses += m
            finally:
                lock.release()
        return out

    def probe_many(self, keys: Sequence[bytes]) -> list[KeyState | None]:
        """:meth:`probe` of each key, answered in the calling thread where it can be within
        bounded time: a key in flight is PENDING; each key's route is walked as :meth:`probe`
        walks it, and a tier that cannot tell without waiting is asked once for every key that
        reached it, within its own bound (:meth:`Tier.probe_batch
        <tieredkv.backends.base.Tier.probe_batch>`: Redis, one pipelined ``EXISTS`` within its
        ``lookup_budget_ms``). None for a key that could not be answered so (ask
        :meth:`lookup_future`). For a scheduler that learns a request's whole prefix at once:
        one round trip answers all of it in the step. Counted as lookups, like :meth:`probe`."""
        out: list[KeyState | None] = [None] * len(keys)
        pending = self.inflight.pending
        todo = []
        for i, k in enumerate(keys):
            if k in pending:
                out[i] = _PENDING
            else:
                todo.append(i)
        if not todo or not self._live():
            return out
        counts: dict[int, list[int]] = {}  # id(stats) -> [hits, misses]
        stats: dict[int, GroupStats] = {}
        for i, (plan, got) in self.routes.find_now(keys, todo).items():
            gs = plan.stats
            c = counts.get(id(gs))
            if c is None:
                c = counts[id(gs)] = [0, 0]
                stats[id(gs)] = gs
            if got is False:
                out[i] = _MISS
                c[1] += 1
            else:
                out[i] = _HIT
                c[0] += 1
        if counts:
            with self._lookup_lock:
                for sid, (h, m) in counts.items():
                    stats[sid].hits += h
                    stats[sid].misses += m
        return out

    def locate(self, key: bytes) -> str | None:
        """The first tier of ``key``'s route that holds it (the one a load reads first), asked
        without waiting (:meth:`Tier.probe_key`) and not counted as a lookup; None when a tier
        before it cannot tell (a Redis server, a breaker not closed) or none holds it."""
        plan = self.routes.plan(key) if self._live() else None
        return (plan.find(key) or None) if plan is not None else None

    def _live(self) -> bool:
        """Whether the pipeline runs (started, not closed): route plans are made and kept only then."""
        return not self._closed and self.loop.running

    def _count_lookup(self, group: int, hit: bool) -> None:
        with self._lookup_lock:
            gs = self.group_stats[group]
            if hit:
                gs.hits += 1
            else:
                gs.misses += 1

    def pin(self, keys: Sequence[bytes]) -> None:
        """Protect ``keys`` from eviction in every tier until :meth:`unpin` (e.g. an accepted hit).
        Applied at once, from the calling thread: an eviction the loop runs next cannot take them."""
        for t in self.tiers.values():
            t.pin_many(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for t in self.tiers.values():
            t.unpin_many(keys)

    # ---- stats ---------------------------------------------------------------------------------

    def breaker_states(self) -> dict[str, str]:
        return {n: lane.breaker.state.value for n, lane in self._lanes.items()}

    def stats(self) -> PipelineStats:
        """A typed snapshot: counters, per-tier lanes, per-group stats, staging, jobs in flight."""
        pending = self.inflight.pending_per_group()
        groups = {g: dataclasses.replace(gs, pending=pending.get(g, 0)) for g, gs in list(self.group_stats.items())}
        for g in self._groups:  # registered groups are reported (as zeros) before their first job
            groups.setdefault(g, GroupStats(pending=pending.get(g, 0)))
        return PipelineStats(
            counters=dict(self.counters),
            lanes={n: lane.stats() for n, lane in self._lanes.items()},
            groups=groups,
            staging=StagingStats(
                self.staging.capacity, self.staging.in_use, self.staging.high_water, self.staging.refusals
            ),
            jobs_in_flight=self.inflight.jobs,
        )

    def add_group_counts(self, group: int, **counts: int) -> None:
        """Add ``counts`` (:class:`GroupStats` fields) to group ``group``'s counters from an engine
        thread (what admission declined), moving :meth:`activity`."""
        gs = self.group_stats[group]
        with self._lookup_lock:
            for name, n in counts.items():
                setattr(gs, name, getattr(gs, name) + n)
        self._events += 1

    def activity(self) -> int:
        """A number that moves whenever something :meth:`stats` reports may have moved: a job or
        write-back ended (their tier calls, drops and breaker changes happen before), a batched
        lookup ended, a store was refused at submit, a group was registered. Equal numbers: no
        counter of those moved in between (tier calls made outside the pipeline, e.g. through
        ``TieredStore.run``, are not seen). Cheap: for callers that poll every engine step."""
        return self.inflight.ended + self._events

    def live_counts(self) -> tuple[dict[str, LaneStats], dict[int, GroupStats]]:
        """Each tier's lane stats and each group's *live* counters (the pipeline's own objects,
        not copies: read, never write; ``pending`` is not filled), for callers that poll on every
        engine step (vLLM's stats hook): a few µs where :meth:`stats` copies everything."""
        groups = dict(self.group_stats)
        for g in self._groups:  # registered groups are reported (as zeros) before their first job
            if g not in groups:
                groups[g] = GroupStats()
        return {n: lane.stats() for n, lane in self._lanes.items()}, groups

    # ---- plumbing ----------------------------------------------------------------------------

    def _group(self, group: int) -> GroupBinding:
        grp = self._groups.get(group)
        if grp is None:
            raise KeyError(f"group {group} is not registered; call register_group first")
        return grp

    def _refused(self, kind: str) -> bool:
        if not self._closed and self.loop.running:
            return False
        self.counters[f"{kind}_refused_closed"] += 1
        return True

    def _finish(
        self,
        run: JobRun,
        t0: float,
        nbytes: int,
        done: tuple[bytes, ...],
        failed: tuple[bytes, ...],
        tiers: dict[str, int],
    ) -> None:
        """Publish a job's result and count it out of the jobs in flight (every family, every outcome)."""
        seconds = time.perf_counter() - t0
        res = JobResult(run.job_id, run.kind, not run.error, nbytes, seconds, run.error, done, failed, tiers)
        object.__setattr__(res, "finished_at", time.perf_counter())
        self._finished.append(res)
        self.counters[f"{res.kind}_{'ok' if res.ok else 'failed'}"] += 1
        if res.ok:
            self.latencies[res.kind].append(res.seconds)
        self.inflight.end()


def _nbytes(buf: Any) -> int:
    return len(memoryview(buf).cast("B"))

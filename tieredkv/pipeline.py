"""The asyncio store/load pipeline: an event loop on its own thread between the engine and the tiers.

Primitives:

* :class:`ChunkRef`, :class:`StoreJob`, :class:`LoadJob` — what the engine submits: per KV
  group, chunk keys with the GPU block ids of each chunk.
* :class:`JobResult` — what :meth:`Pipeline.poll_finished` returns: id, ok, bytes, seconds,
  error, and per key what happened (stored / refused; loaded / missing).
* :class:`Pipeline` — ``submit_store`` / ``submit_load`` return at once (the engine is never
  blocked by a tier); bytes move GPU → staging → tiers and back on the loop thread. The
  staging pool bounds the bytes in flight: a job that does not fit now is refused
  (back-pressure; offer it again later), and one larger than the whole pool is staged in
  parts through as much of the pool as is free, so it is never refused for good.

Inside the loop, each tier has one writer task that batches queued chunks (one LMDB
transaction or one Redis pipeline per batch) and one :class:`~tieredkv.policy.CircuitBreaker`:
a dead tier means dropped (counted) stores and misses, never an exception into the engine, and
it heals through half-open probes without a restart. ``drain()`` waits for everything in
flight (write-backs included); ``close()`` drains, writes every chunk a write-back route
acknowledged in the CPU tier down to the next tier (bounded by its timeout; what cannot be
written is counted in ``write_back_lost`` and logged), cancels what is left, closes the tiers
and joins the thread.

A key is *pending* from ``submit_store`` until its writes finish, so a lookup never reports a
hit for bytes that are not written yet. The engine must leave a store's GPU blocks alone until
its result is polled (vLLM's connector guarantees that).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tieredkv.backends.base import Tier
from tieredkv.backends.cpu import CPUTier
from tieredkv.config import PipelineConfig
from tieredkv.errors import TierClosedError, TieredKVError, TierFullError, TierUnavailableError
from tieredkv.policy import BreakerState, CircuitBreaker, GroupRoute, TierPolicy
from tieredkv.staging import Copier, KVGroupTensors, StagingBuffer, StagingPool

__all__ = ["ChunkRef", "JobResult", "KeyState", "LoadJob", "Pipeline", "StoreJob"]

log = logging.getLogger(__name__)

NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk: its stored key and the GPU block ids it occupies, in order."""

    key: bytes
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoreJob:
    job_id: int
    group: int
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load whole chunks into GPU blocks.

    A chunk's ``block_ids`` either list one destination per block of the chunk, with the
    null id 0 for a block not to copy, or (first chunk only) just the blocks after
    ``skip_blocks`` blocks that are not copied (the local prefix ends mid-chunk).
    """

    job_id: int
    group: int
    chunks: tuple[ChunkRef, ...]
    skip_blocks: int = 0

    def placements(self, i: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
        """``(position_in_chunk, block_id)`` pairs to copy for chunk ``i``."""
        ids = self.chunks[i].block_ids
        if len(ids) == blocks_per_chunk:
            return [(p, b) for p, b in enumerate(ids) if b != NULL_BLOCK]
        skip = self.skip_blocks if i == 0 else 0
        if skip + len(ids) != blocks_per_chunk:
            raise ValueError(
                f"load job {self.job_id}: chunk {i} has {len(ids)} block ids (+{skip} skipped),"
                f" a chunk has {blocks_per_chunk} blocks"
            )
        return [(skip + p, b) for p, b in enumerate(ids)]


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    kind: str  # "store" | "load" (KV tensors) or "put" | "get" (host buffers)
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None
    done: tuple[bytes, ...] = ()
    """Store: keys now held by at least one tier. Load: keys copied into their blocks."""
    failed: tuple[bytes, ...] = ()
    """Store: keys refused or dropped (offer them again later). Load: keys not found."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Store: chunks written per tier. Load: chunks read per tier."""
    finished_at: float = 0.0
    """``time.perf_counter()`` when the job finished."""


class KeyState(str, Enum):
    HIT = "hit"
    PENDING = "pending"
    MISS = "miss"


class _Outcome(Enum):
    OK = 1
    FULL = 2
    DROPPED = 3


@dataclass(slots=True)
class _WriteItem:
    key: bytes
    payload: Any
    fut: asyncio.Future[_Outcome]


class _TierLane:
    """One tier on the loop: its writer queue, writer task and breaker."""

    def __init__(self, tier: Tier, cfg: PipelineConfig) -> None:
        self.tier = tier
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self.queue: asyncio.Queue[_WriteItem] = asyncio.Queue()
        self.max_bytes = int(cfg.max_batch_bytes)
        self.max_items = cfg.max_batch_items
        self.dropped = 0
        self.batches = 0
        self.task: asyncio.Task[None] | None = None

    def write(self, key: bytes, payload: Any) -> asyncio.Future[_Outcome]:
        fut: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(_WriteItem(key, payload, fut))
        return fut

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            nbytes = len(batch[0].payload)
            while not self.queue.empty() and len(batch) < self.max_items and nbytes < self.max_bytes:
                item = self.queue.get_nowait()
                batch.append(item)
                nbytes += len(item.payload)
            await self._write_batch(batch)

    async def _write_batch(self, batch: list[_WriteItem]) -> None:
        outcome = _Outcome.OK
        if not self.breaker.allow():
            outcome = _Outcome.DROPPED
        else:
            try:
                await self.tier.put_many([(it.key, it.payload) for it in batch])
                self.breaker.success()
                self.batches += 1
            except TierFullError:
                self.breaker.success()  # the tier answered: it is alive, just full
                outcome = _Outcome.FULL
            except TieredKVError as e:
                self.breaker.failure()
                log.warning("tier %s: store of %d chunks dropped: %s", self.tier.name, len(batch), e)
                outcome = _Outcome.DROPPED
        if outcome is _Outcome.DROPPED:
            self.dropped += len(batch)
        for it in batch:
            if not it.fut.done():
                it.fut.set_result(outcome)

    async def read(self, keys: list[bytes], into: list[Any]) -> list[Any] | None:
        """``get_many`` guarded by the breaker; ``None`` when the tier is skipped or failed."""
        if not self.breaker.allow():
            return None
        try:
            got = await self.tier.get_many(keys, into=into)
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


@dataclass(slots=True)
class _Group:
    tensors: KVGroupTensors
    blocks_per_chunk: int
    route: GroupRoute

    @property
    def chunk_bytes(self) -> int:
        return self.tensors.chunk_bytes(self.blocks_per_chunk)

    def direct_view(self, placements: Sequence[tuple[int, int]]) -> Any:
        """The device bytes of a whole chunk when they already are its payload — one CPU tensor and
        consecutive blocks — so tiers can read and write them with no staging copy; else None."""
        t = self.tensors
        if len(t.tensors) != 1 or t.device.type != "cpu" or len(placements) != self.blocks_per_chunk:
            return None
        first = placements[0][1]
        if any(pos != j or b != first + j for j, (pos, b) in enumerate(placements)):
            return None
        return t.tensors[0][first : first + self.blocks_per_chunk].view(-1)


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
        self.copier = Copier()
        self._groups: dict[int, _Group] = {}
        self._lanes: dict[str, _TierLane] = {}
        self._finished: collections.deque[JobResult] = collections.deque()
        self._pending: collections.Counter[bytes] = collections.Counter()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Loop thread only: chunks a write-back route acknowledged in its CPU tier and not yet
        #: sent down (evicted or flushed at close), with their route.
        self._dirty: dict[bytes, GroupRoute] = {}
        self._write_backs: set[asyncio.Future[_Outcome]] = set()  # eviction write-backs in flight
        self.latencies: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=100_000)
        )
        self.counters: collections.Counter[str] = collections.Counter()
        #: Per KV group: stored/loaded chunks and bytes, chunks refused or missing.
        self.group_counters: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> Pipeline:
        """Start the loop thread and open every tier (raises what opening raises)."""
        if self._thread is not None:
            return self
        loop = _new_loop(self.cfg.uvloop)
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="tieredkv-pipeline", daemon=True)
        self._thread.start()
        try:
            self._call(self._open(), timeout=60)
        except BaseException:
            try:  # cancel the writers already started and close the tiers already open
                self._call(self._shutdown(), timeout=10)
            except Exception:
                log.debug("cleanup after a failed start failed", exc_info=True)
            self._stop_loop()
            raise
        return self

    async def _open(self) -> None:
        for tier in self.tiers.values():
            lane = _TierLane(tier, self.cfg)
            try:
                await tier.open()
            except TierUnavailableError as e:  # a dead tier at start is a tier with an open breaker
                log.warning("tier %s unavailable at start (misses and dropped stores until it heals): %s", tier.name, e)
                lane.breaker.trip()
            lane.task = asyncio.get_running_loop().create_task(lane.run(), name=f"tieredkv-writer-{tier.name}")
            self._lanes[tier.name] = lane
            hook = getattr(tier, "set_evict_listener", None)
            if hook is not None:
                hook(self._on_evict)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Drain (up to ``timeout``), flush write-backs (up to ``timeout`` more), cancel what is
        left, close the tiers, join the thread. Never hangs on a dead tier: chunks a write-back
        route acknowledged that could not be written down are counted (``counters
        ["write_back_lost"]``, ``write_back_flushed`` for the rest) and logged as an error.

        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        self.drain(timeout)
        try:
            self._call(self._shutdown(flush_s=timeout), timeout=2 * timeout + 5)
        finally:
            self._stop_loop()
            self.staging.free()  # do not wait for the garbage collector to return the pool

    async def _shutdown(self, flush_s: float = 0.0) -> None:
        if flush_s > 0:
            try:
                await self._flush_write_backs(flush_s)
            except Exception:
                log.exception("write-back flush at close failed")
        tasks = [*self._tasks, *(lane.task for lane in self._lanes.values() if lane.task)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for tier in self.tiers.values():
            await tier.close()

    async def _flush_write_backs(self, timeout: float) -> None:
        """Write every dirty chunk (acknowledged by a write-back route in its CPU tier, not yet
        sent down) to the route's next tier, in writer-sized batches, and wait for eviction
        write-backs already queued, all within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        dirty, self._dirty = self._dirty, {}
        todo: dict[tuple[str, str], list[bytes]] = collections.defaultdict(list)
        for key, route in dirty.items():
            todo[(route.tiers[0], route.tiers[1])].append(key)
        flushed = lost = gone = 0
        for (top, down), keys in todo.items():
            lane = self._lanes[down]
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
                futs = [lane.write(k, v) for k, v in zip(batch, payloads) if v is not None]
                gone += len(batch) - len(futs)  # deleted from the CPU tier meanwhile: nothing to keep
                if not futs:
                    continue
                done, pending = await asyncio.wait(futs, timeout=left)
                ok = sum(1 for f in done if f.result() is _Outcome.OK)
                flushed += ok
                lost += len(futs) - ok
        queued = [f for f in self._write_backs if not f.done()]
        if queued:
            left = max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(queued, timeout=left) if left > 0 else (set(), set(queued))
            lost += len(pending) + sum(1 for f in done if f.result() is not _Outcome.OK)
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

    def _mark_dirty(self, route: GroupRoute, keys: Sequence[bytes]) -> None:
        """Record chunks a write-back route just acknowledged in its CPU tier (they live only there)."""
        if route.write == "back" and len(route.tiers) > 1 and isinstance(self.tiers[route.tiers[0]], CPUTier):
            for k in keys:
                self._dirty[k] = route

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
        self._loop = None
        self._thread = None

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- groups --------------------------------------------------------------------------

    def register_group(
        self, group: int, tensors: Sequence[Any], *, blocks_per_chunk: int = 1, kind: str = "full"
    ) -> GroupRoute:
        """Declare a KV group: its tensors (block id first), chunk size in blocks and kind."""
        kv = KVGroupTensors(tensors)
        route = self.policy.route(group, kv.chunk_bytes(blocks_per_chunk), kind)
        unknown = [n for n in route.tiers if n not in self.tiers]
        if unknown:
            raise TieredKVError(f"group {group} routes to unknown tiers {unknown}")
        self._groups[group] = _Group(kv, blocks_per_chunk, route)
        return route

    # ---- submit (engine thread) ------------------------------------------------------------

    def submit_store(self, job: StoreJob) -> bool:
        """Queue a store; returns at once whether it was admitted. Back-pressure (staging full),
        a closed pipeline or an empty job refuses it: False (counted), and no result will come.
        A job larger than the whole staging pool is staged in parts (see :meth:`_admit`)."""
        admitted = self._admit(job, "store")
        if admitted is None:
            self.group_counters[job.group]["store_refused"] += len(job.chunks)
            return False
        grp, buf = admitted
        ready = self.copier.record_ready(grp.tensors)
        with self._lock:
            self._inflight += 1
            for c in job.chunks:
                self._pending[c.key] += 1
        self._spawn(self._store(job, grp, buf, ready, time.perf_counter()))
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
        with self._lock:
            self._inflight += 1
        self._spawn(self._load(job, grp, buf, time.perf_counter()))
        return True

    def _admit(self, job: StoreJob | LoadJob, kind: str) -> tuple[_Group, StagingBuffer] | None:
        """Staging for a job's chunks (it also bounds the bytes in flight), or None when refused.

        A job that fits the pool gets room for all its chunks or waits (back-pressure: refused
        now). One larger than the whole pool could never get that: it gets as many whole chunks
        as the largest free range holds now (at least one, counted in ``{kind}_in_parts``) and
        moves through that buffer part by part. Only a single chunk larger than the pool is
        refused for good."""
        grp = self._group(job.group)
        if not job.chunks or self._refused(job, kind):
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

    def run_background(self, coro: Any) -> None:
        """Run ``coro`` on the pipeline loop until it ends or the pipeline closes (then cancelled)."""
        self._spawn(coro)

    def poll_finished(self) -> list[JobResult]:
        """Every job finished since the last call (never blocks)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    # ---- lookups (any thread) ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], timeout: float | None = 5.0) -> list[tuple[KeyState, str | None]]:
        """Per key: (HIT, tier) / (PENDING, None) / (MISS, None), searching each key's route in order."""
        return self._call(self._lookup(list(keys)), timeout=timeout)

    async def _lookup(self, keys: list[bytes]) -> list[tuple[KeyState, str | None]]:
        out: list[tuple[KeyState, str | None]] = [(KeyState.MISS, None)] * len(keys)
        todo: list[int] = []
        for i, k in enumerate(keys):
            if k in self._pending:
                out[i] = (KeyState.PENDING, None)
            else:
                todo.append(i)
        for name in self._tier_order():
            ask = [i for i in todo if name in self.policy.get(_group_of(keys[i])).tiers]
            if not ask:
                continue
            got = await self._lanes[name].contains([keys[i] for i in ask])
            if got is None:
                continue
            hit = {i for i, present in zip(ask, got) if present}
            for i in hit:
                out[i] = (KeyState.HIT, name)
            todo = [i for i in todo if i not in hit]
        return out

    def probe(self, key: bytes) -> KeyState | None:
        """Answer a lookup of ``key`` at once, from the calling thread, when every tier of its route
        can tell without waiting (:meth:`Tier.probe`: the CPU slab, a local LMDB); None when some
        tier cannot (a Redis server) and no earlier tier holds it: ask :meth:`lookup_future`."""
        if key in self._pending:
            return KeyState.PENDING
        if self._closed or self._loop is None:
            return None
        for name in self.policy.get(_group_of(key)).tiers:
            lane = self._lanes.get(name)
            if lane is None:
                return None
            if lane.breaker.state is not BreakerState.CLOSED:
                return None  # let the asynchronous path (and its breaker probes) decide
            got = lane.tier.probe([key])
            if got is None:
                return None
            if got[0]:
                return KeyState.HIT
        return KeyState.MISS

    def pin(self, keys: Sequence[bytes]) -> None:
        """Protect ``keys`` from eviction in every tier until :meth:`unpin` (e.g. an accepted hit).
        Applied at once, from the calling thread: an eviction the loop runs next cannot take them."""
        for t in self.tiers.values():
            t.pin_many(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        for t in self.tiers.values():
            t.unpin_many(keys)

    def breaker_states(self) -> dict[str, str]:
        return {n: lane.breaker.state.value for n, lane in self._lanes.items()}

    def stats(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "dropped": {n: lane.dropped for n, lane in self._lanes.items()},
            "breakers": self.breaker_states(),
            "breaker_opens": {n: lane.breaker.opens for n, lane in self._lanes.items()},
            "groups": {g: dict(c) for g, c in self.group_counters.items()},
            "staging": {
                "capacity": self.staging.capacity,
                "in_use": self.staging.in_use,
                "high_water": self.staging.high_water,
                "refusals": self.staging.refusals,
            },
        }

    # ---- loop side -------------------------------------------------------------------------

    async def _write_items(
        self, route: GroupRoute, keys: list[bytes], views: list[Any]
    ) -> tuple[list[bytes], dict[str, int]]:
        """Write every item to the route's write tiers; keys held by at least one tier, and per-tier counts."""
        lanes = [self._lanes[n] for n in route.write_tiers]
        futs = [[lane.write(k, v) for k, v in zip(keys, views)] for lane in lanes]
        results = [await asyncio.gather(*f) for f in futs]
        written = {lane.tier.name: sum(r is _Outcome.OK for r in res) for lane, res in zip(lanes, results)}
        done = [k for i, k in enumerate(keys) if any(res[i] is _Outcome.OK for res in results)]
        self._mark_dirty(route, done)
        return done, written

    async def _read_items(
        self,
        tiers: Sequence[str],
        keys: list[bytes],
        views: list[Any],
        nbytes: int | None,
        todo: list[int] | None = None,
    ) -> dict[int, str]:
        """Read items (all, or indices ``todo``) tier by tier; ``{index: tier}`` of those found
        (of exactly ``nbytes`` when given)."""
        found_in: dict[int, str] = {}
        todo = list(range(len(keys))) if todo is None else todo
        for name in tiers:
            if not todo:
                break
            got = await self._lanes[name].read([keys[i] for i in todo], [views[i] for i in todo])
            if got is None:
                continue
            for i, n in zip(todo, got):
                if n is not None and (nbytes is None or n == nbytes):
                    found_in[i] = name
            todo = [i for i in todo if i not in found_in]
        return found_in

    async def _promote(self, route: GroupRoute, keys: list[bytes], views: list[Any], found_in: dict[int, str]) -> None:
        """Copy items found below the route's first tier into it (waits, since ``views`` are reused after)."""
        first = route.tiers[0]
        if not route.promote:
            return
        lane = self._lanes[first]
        futs = [lane.write(keys[i], views[i]) for i, n in found_in.items() if n != first]
        if futs:
            await asyncio.gather(*futs)
            self.counters["promotions"] += len(futs)

    def _job_error(self, e: BaseException, kind: str, job_id: int) -> str:
        if isinstance(e, TimeoutError):
            return f"{kind} job ran past job_timeout_s={self.cfg.job_timeout_s}"
        log.error("%s job %s failed", kind, job_id, exc_info=e)
        return f"{type(e).__name__}: {e}"

    def _cpu_first(self, tiers: Sequence[str]) -> CPUTier | None:
        """The route's first tier when it is a CPU slab whose breaker lets work through."""
        lane = self._lanes[tiers[0]]
        return lane.tier if isinstance(lane.tier, CPUTier) and lane.breaker.allow() else None

    async def _store(self, job: StoreJob, grp: _Group, buf: StagingBuffer, ready: Any, t0: float) -> None:
        cb = grp.chunk_bytes
        keys = [c.key for c in job.chunks]
        written: dict[str, int] = {}
        done: list[bytes] = []
        error = None
        try:
            async with asyncio.timeout(self.cfg.job_timeout_s):
                cpu = self._cpu_first(grp.route.write_tiers) if len(grp.route.write_tiers) == 1 else None
                if cpu is not None:
                    done, written = await self._store_into_slots(cpu, job, grp, ready)
                else:
                    for part in _parts(len(job.chunks), buf.nbytes // cb):  # one part unless the job
                        ev = None  # is larger than the pool
                        views = []
                        for j, i in enumerate(part):
                            c = job.chunks[i]
                            direct = grp.direct_view(list(enumerate(c.block_ids)))
                            if direct is None:
                                direct = buf.view(j * cb, cb)
                                ev = self.copier.gather(grp.tensors, c.block_ids, direct, after=ready)
                            views.append(memoryview(direct.numpy()))
                        await _wait_event(ev)
                        got, w = await self._write_items(grp.route, [keys[i] for i in part], views)
                        done += got  # the writes are over: the buffer is free for the next part
                        for name, n in w.items():
                            written[name] = written.get(name, 0) + n
                if len(done) < len(keys):
                    error = "some chunks were refused or dropped by every tier"
        except asyncio.CancelledError:
            error = "cancelled at close"
            raise
        except Exception as e:  # noqa: BLE001 - never into the engine
            error = self._job_error(e, "store", job.job_id)
        finally:
            self.staging.release(buf)
            with self._lock:
                for k in keys:
                    self._unpend(k)
            done_set = set(done)
            gc = self.group_counters[job.group]
            gc["store_chunks"] += len(done)
            gc["store_bytes"] += len(done) * cb
            gc["store_refused"] += len(keys) - len(done)
            self._finish(
                JobResult(
                    job.job_id,
                    "store",
                    not error,
                    len(done) * cb,
                    time.perf_counter() - t0,
                    error,
                    tuple(done),
                    tuple(k for k in keys if k not in done_set),
                    written,
                ),
                counted=True,
            )

    async def _store_into_slots(
        self, cpu: CPUTier, job: StoreJob, grp: _Group, ready: Any
    ) -> tuple[list[bytes], dict[str, int]]:
        """Device blocks straight into CPU-tier slots (one copy), then publish them."""
        keys = [c.key for c in job.chunks]
        try:
            slots = cpu.reserve([(k, grp.chunk_bytes) for k in keys])
        except TierFullError:
            return [], {cpu.name: 0}
        try:
            ev = None
            for i, c in enumerate(job.chunks):
                ev = self.copier.gather(
                    grp.tensors, c.block_ids, cpu.slot_view(slots[i]), after=ready if i == 0 else None
                )
            await _wait_event(ev)
        except BaseException:
            cpu.abort(slots)
            raise
        cpu.commit(list(zip(keys, slots)))
        self._mark_dirty(grp.route, keys)
        return keys, {cpu.name: len(keys)}

    async def _load(self, job: LoadJob, grp: _Group, buf: StagingBuffer, t0: float) -> None:
        cb = grp.chunk_bytes
        keys = [c.key for c in job.chunks]
        found_in: dict[int, str] = {}
        error = None
        cpu = self._cpu_first(grp.route.tiers)
        borrowed: dict[int, Any] = {}
        try:
            places = [job.placements(i, grp.blocks_per_chunk) for i in range(len(keys))]
            direct = [grp.direct_view(pl) for pl in places]
            async with asyncio.timeout(self.cfg.job_timeout_s):
                if cpu is not None:  # CPU hits are copied straight from their slots
                    for i, slot in enumerate(cpu.borrow(keys)):
                        if slot is not None:
                            borrowed[i] = slot
                            found_in[i] = cpu.name
                lower = grp.route.tiers[1:] if cpu is not None else grp.route.tiers
                complete = True  # every chunk so far was found: keep copying
                for part in _parts(len(keys), buf.nbytes // cb):  # one part unless the job is larger
                    part_keys = [keys[i] for i in part]  # than the pool
                    views = [buf.view(j * cb, cb) if direct[i] is None else direct[i] for j, i in enumerate(part)]
                    rest = [j for j, i in enumerate(part) if i not in found_in]
                    if rest:
                        got = await self._read_items(lower, part_keys, views, cb, rest)
                        found_in.update({part[j]: name for j, name in got.items()})
                    complete = complete and all(i in found_in for i in part)
                    if not complete:
                        continue  # the job fails; read on only to report every missing chunk
                    ev = None
                    for j, i in enumerate(part):
                        if i in borrowed:
                            ev = self.copier.scatter(
                                grp.tensors,
                                places[i],
                                cpu.slot_view(borrowed[i]),  # type: ignore[union-attr]
                                grp.blocks_per_chunk,
                            )
                        elif direct[i] is None:
                            ev = self.copier.scatter(grp.tensors, places[i], views[j], grp.blocks_per_chunk)
                    await _wait_event(ev)
                    await self._promote(
                        grp.route,
                        part_keys,
                        [memoryview(v.numpy()) for v in views],
                        {j: found_in[i] for j, i in enumerate(part)},
                    )
                if len(found_in) < len(keys):
                    error = f"{len(keys) - len(found_in)} of {len(keys)} chunks not found in any tier"
        except asyncio.CancelledError:
            error = "cancelled at close"
            raise
        except Exception as e:  # noqa: BLE001
            error = self._job_error(e, "load", job.job_id)
        finally:
            if borrowed:
                cpu.give_back([keys[i] for i in borrowed], list(borrowed.values()))  # type: ignore[union-attr]
            self.staging.release(buf)
            ok_keys = tuple(keys) if not error else ()
            gc = self.group_counters[job.group]
            gc["load_chunks"] += len(ok_keys)
            gc["load_bytes"] += len(ok_keys) * cb
            gc["load_missing"] += len(keys) - len(found_in)
            self._finish(
                JobResult(
                    job.job_id,
                    "load",
                    not error,
                    len(ok_keys) * cb,
                    time.perf_counter() - t0,
                    error,
                    ok_keys,
                    tuple(k for i, k in enumerate(keys) if i not in found_in),
                    dict(collections.Counter(found_in.values())),
                ),
                counted=True,
            )

    # ---- host-buffer jobs (a caller that already holds the bytes in host memory) ---------------

    def submit_put(self, job_id: int, items: Sequence[tuple[bytes, Any]]) -> bool:
        """Store ``(key, host buffer)`` items, each routed by its key's group. Returns at once;
        the caller keeps the buffers unchanged until the job's result is polled (kind "put")."""
        if self._refused_buffers("put"):
            return False
        items = list(items)
        with self._lock:
            self._inflight += 1
            for k, _ in items:
                self._pending[k] += 1
        self._spawn(self._put_buffers(job_id, items, time.perf_counter()))
        return True

    def submit_get(self, job_id: int, items: Sequence[tuple[bytes, Any]]) -> bool:
        """Read ``(key, writable host buffer)`` items, each buffer filled completely by its record
        (result kind "get": ``done`` found and copied, ``failed`` missing)."""
        if self._refused_buffers("get"):
            return False
        with self._lock:
            self._inflight += 1
        self._spawn(self._get_buffers(job_id, list(items), time.perf_counter()))
        return True

    def _refused_buffers(self, kind: str) -> bool:
        if not self._closed and self._loop is not None:
            return False
        self.counters[f"{kind}_refused_closed"] += 1
        return True

    def lookup_future(self, keys: Sequence[bytes]) -> Any:
        """Like :meth:`lookup` but returns a ``concurrent.futures.Future`` at once (never blocks)."""
        loop = self._loop
        if loop is None:
            raise TierClosedError("pipeline is not running")
        return asyncio.run_coroutine_threadsafe(self._lookup(list(keys)), loop)

    async def _put_buffers(self, job_id: int, items: list[tuple[bytes, Any]], t0: float) -> None:
        done: list[bytes] = []
        written: collections.Counter[str] = collections.Counter()
        error = None
        try:
            async with asyncio.timeout(self.cfg.job_timeout_s):
                for group, idx in _by_group(items).items():
                    keys = [items[i][0] for i in idx]
                    got, w = await self._write_items(self.policy.get(group), keys, [items[i][1] for i in idx])
                    done += got
                    written.update(w)
                    gc = self.group_counters[group]
                    gc["store_chunks"] += len(got)
                    gc["store_bytes"] += sum(len(memoryview(items[i][1]).cast("B")) for i in idx)
            if len(done) < len(items):
                error = "some items were refused or dropped by every tier"
        except asyncio.CancelledError:
            error = "cancelled at close"
            raise
        except Exception as e:  # noqa: BLE001
            error = self._job_error(e, "put", job_id)
        finally:
            with self._lock:
                for k, _ in items:
                    self._unpend(k)
            done_set = set(done)
            nbytes = sum(len(memoryview(b).cast("B")) for k, b in items if k in done_set)
            self._finish(
                JobResult(
                    job_id,
                    "put",
                    not error,
                    nbytes,
                    time.perf_counter() - t0,
                    error,
                    tuple(done),
                    tuple(k for k, _ in items if k not in done_set),
                    dict(written),
                ),
                counted=True,
            )

    async def _get_buffers(self, job_id: int, items: list[tuple[bytes, Any]], t0: float) -> None:
        found: dict[int, str] = {}
        error = None
        try:
            async with asyncio.timeout(self.cfg.job_timeout_s):
                for group, idx in _by_group(items).items():
                    route = self.policy.get(group)
                    keys = [items[i][0] for i in idx]
                    views = [items[i][1] for i in idx]
                    sizes = {len(memoryview(v).cast("B")) for v in views}
                    got = await self._read_items(route.tiers, keys, views, sizes.pop() if len(sizes) == 1 else None)
                    found.update({idx[j]: t for j, t in got.items()})
                    await self._promote(route, keys, views, got)
                    self.group_counters[group]["load_chunks"] += len(got)
            if len(found) < len(items):
                error = f"{len(items) - len(found)} of {len(items)} items not found in any tier"
        except asyncio.CancelledError:
            error = "cancelled at close"
            raise
        except Exception as e:  # noqa: BLE001
            error = self._job_error(e, "get", job_id)
        finally:
            nbytes = sum(len(memoryview(items[i][1]).cast("B")) for i in found)
            self._finish(
                JobResult(
                    job_id,
                    "get",
                    not error,
                    nbytes,
                    time.perf_counter() - t0,
                    error,
                    tuple(items[i][0] for i in sorted(found)),
                    tuple(k for i, (k, _) in enumerate(items) if i not in found),
                    dict(collections.Counter(found.values())),
                ),
                counted=True,
            )

    def _on_evict(self, key: bytes, payload: bytes) -> None:
        """CPU tier eviction (loop thread): write-back groups send the chunk one tier down."""
        route = self._dirty.pop(key, None) or self.policy.get(_group_of(key))
        if route.write != "back" or len(route.tiers) < 2:
            return
        with self._lock:  # pending for lookups, in flight for drain(), until written
            self._pending[key] += 1
            self._inflight += 1
        fut = self._lanes[route.tiers[1]].write(key, payload)
        self._write_backs.add(fut)
        self.counters["write_backs"] += 1

        def done(f: Any) -> None:
            self._write_backs.discard(f)
            with self._idle:
                self._unpend(key)
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()

        fut.add_done_callback(done)

    # ---- plumbing ----------------------------------------------------------------------------

    def _group(self, group: int) -> _Group:
        grp = self._groups.get(group)
        if grp is None:
            raise KeyError(f"group {group} is not registered; call register_group first")
        return grp

    def _tier_order(self) -> list[str]:
        return list(self.tiers)

    def _unpend(self, key: bytes) -> None:
        n = self._pending[key] - 1
        if n > 0:
            self._pending[key] = n
        else:
            self._pending.pop(key, None)

    def _refused(self, job: Any, kind: str) -> bool:
        if not self._closed and self._loop is not None:
            return False
        self.counters[f"{kind}_refused_closed"] += 1
        return True

    def _finish(self, res: JobResult, counted: bool = False) -> None:
        object.__setattr__(res, "finished_at", time.perf_counter())
        self._finished.append(res)
        self.counters[f"{res.kind}_{'ok' if res.ok else 'failed'}"] += 1
        if res.ok:
            self.latencies[res.kind].append(res.seconds)
        if counted:
            with self._idle:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()

    def _spawn(self, coro: Any) -> None:
        def start() -> None:
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._call_soon(start)

    def _call_soon(self, fn: Any) -> None:
        loop = self._loop
        if loop is None:
            raise TierClosedError("pipeline is not running")
        loop.call_soon_threadsafe(fn)

    def _call(self, coro: Any, timeout: float | None) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            raise TierClosedError("pipeline is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _parts(n: int, per: int) -> list[range]:
    """Indices ``0 .. n-1`` in consecutive parts of ``per`` (a staging buffer's worth of chunks)."""
    per = max(1, per)
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big")


def _by_group(items: list[tuple[bytes, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = collections.defaultdict(list)
    for i, (k, _) in enumerate(items):
        out[_group_of(k)].append(i)
    return out


async def _wait_event(ev: Any) -> None:
    """Wait for a CUDA event without blocking the loop (None: nothing to wait for)."""
    if ev is None:
        return
    while not ev.query():
        await asyncio.sleep(0.0002)


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()

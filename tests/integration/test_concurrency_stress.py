"""Concurrency stress: threads and asyncio tasks store, load, promote, evict, delete and overwrite
overlapping keys across a small CPU tier + LMDB (+ Redis); every loaded byte is checked.

Every value names its key and version in each 16-byte word (magic, key id, version, word index),
so a load may see any version of its own key that was written, never another key's bytes, a
mix of versions, a shifted copy or bytes that were never copied (destinations are poisoned
first). The run is bounded by an operation count, not by time: ``STRESS_OPS`` (default 2400,
a few seconds) and ``STRESS_SEED`` make a longer or different run, e.g.
``STRESS_OPS=200000 pytest -s tests/integration/test_concurrency_stress.py``. (Not
``TIEREDKV_*``: those are config overrides.)

Workers, all at once:

* tensor threads (group 0, CPU + LMDB write-through): ``submit_store`` of chunks from their own
  blocks, ``submit_load`` into their own blocks — CPU hits are copied straight from borrowed
  slab slots, LMDB hits are promoted;
* host-buffer threads: ``submit_put`` / ``submit_get`` of group 1 (write-back: evictions
  demote to LMDB) and group 2 (CPU + Redis, or CPU + LMDB without Redis);
* asyncio tasks on the pipeline's loop, on the CPU tier itself: ``put_many`` overwrites of any
  group's keys, ``borrow`` held across several yields then checked byte by byte,
  ``get_many`` and ``delete_many``.

The CPU tier holds about a third of the keys, so evictions, segment reclaims and promotions are
constant. At the end the figures are printed: operations, chunks verified, wrong bytes (must be
0), misses, stale reads (an older written version; allowed) and the tiers' counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.fs import FSTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import (
    CPUTierConfig,
    FSTierConfig,
    LMDBTierConfig,
    PipelineConfig,
    PolicyRule,
    RedisTierConfig,
)
from tieredkv.errors import TieredKVError
from tieredkv.keys import Namespace
from tieredkv.pipeline import ChunkRef, JobResult, LoadJob, Pipeline, StoreJob
from tieredkv.policy import TierPolicy
from tieredkv.staging import StagingPool

OPS = int(os.environ.get("STRESS_OPS", "2400"))
SEED = int(os.environ.get("STRESS_SEED", "0"))

NS = Namespace(model="concurrency-stress")
MAGIC = 0x5EED_C0DE
BPC = 2  # blocks per chunk
BLOCK = 256  # bytes per block per layer
LAYERS = 2
SIZES = {0: LAYERS * BPC * BLOCK, 1: 1536, 2: 2048}  # chunk bytes per group (distinct slot classes)
KINDS = {0: "full", 1: "sliding_window", 2: "mamba"}
NKEYS = {0: 120, 1: 120, 2: 60}
TENSOR_THREADS, BUFFER_THREADS, ASYNC_TASKS = 3, 2, 3
CHUNKS_PER_JOB = 3
WAIT_LIMIT_S = 300.0  # a hang guard only; nothing is timed


def kid_of(group: int, i: int) -> int:
    return group * 100_000 + i


def key_of(kid: int) -> bytes:
    return NS.key(kid.to_bytes(32, "big"), kid // 100_000)


def value(kid: int, version: int, nbytes: int) -> bytes:
    words = np.empty((nbytes // 16, 4), dtype="<u4")
    words[:, 0] = MAGIC
    words[:, 1] = kid
    words[:, 2] = version
    words[:, 3] = np.arange(len(words), dtype="<u4")
    return words.tobytes()


class Model:
    """What was written: per key every version whose store was started, and the newest acknowledged."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next: Counter[int] = Counter()
        self.written: dict[int, set[int]] = defaultdict(set)
        self.acked: dict[int, int] = {}
        self.figures: Counter[str] = Counter()
        self.errors: list[str] = []

    def new_version(self, kid: int) -> int:
        with self.lock:
            self.next[kid] += 1
            v = self.next[kid]
            self.written[kid].add(v)
            return v

    def ack(self, kid: int, version: int) -> None:
        with self.lock:
            if version > self.acked.get(kid, 0):
                self.acked[kid] = version

    def newest_acked(self, kid: int) -> int:
        with self.lock:
            return self.acked.get(kid, 0)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.figures[name] += n

    def check(self, kid: int, data: bytes, acked_before: int, where: str) -> None:
        """Verify one loaded chunk of ``kid``."""
        words = np.frombuffer(data, dtype="<u4").reshape(-1, 4)
        version = int(words[0, 2])
        good = (
            len(data) % 16 == 0
            and bool((words[:, 0] == MAGIC).all())
            and bool((words[:, 1] == kid).all())
            and bool((words[:, 2] == version).all())
            and bool((words[:, 3] == np.arange(len(words), dtype="<u4")).all())
        )
        with self.lock:
            self.figures["chunks_verified"] += 1
            self.figures["bytes_verified"] += len(data)
            if not good or version not in self.written[kid]:
                bad = int(
                    (
                        (words[:, 0] != MAGIC)
                        | (words[:, 1] != kid)
                        | (words[:, 2] != version)
                        | (words[:, 3] != np.arange(len(words), dtype="<u4"))
                    ).sum()
                ) * 16 or len(data)
                self.figures["wrong_chunks"] += 1
                self.figures["wrong_bytes"] += bad
                if len(self.errors) < 20:
                    self.errors.append(
                        f"{where}: key {kid} got (magic {words[0, 0]:#x}, key {words[0, 1]}, version {version});"
                        f" written versions {sorted(self.written[kid])[-5:]}"
                    )
            elif version < acked_before:
                self.figures["stale_reads"] += 1


class Results:
    """Routes ``poll_finished`` results to the thread waiting for each job id."""

    def __init__(self, p: Pipeline) -> None:
        self.p = p
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list[JobResult]]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stress-results", daemon=True)
        self.thread.start()

    def new_id(self) -> tuple[int, threading.Event, list[JobResult]]:
        ev, box = threading.Event(), []
        with self.lock:
            jid = next(self.ids)
            self.waiting[jid] = (ev, box)
        return jid, ev, box

    def forget(self, jid: int) -> None:
        with self.lock:
            self.waiting.pop(jid, None)

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.p.poll_finished()
            for r in got:
                with self.lock:
                    ev, box = self.waiting.pop(r.job_id, (None, None))
                if ev is not None and box is not None:
                    box.append(r)
                    ev.set()
            if not got:
                time.sleep(0.0005)

    def wait(self, ev: threading.Event, box: list[JobResult]) -> JobResult:
        assert ev.wait(WAIT_LIMIT_S), "a job never finished"
        return box[0]


def _tensor_worker(
    p: Pipeline, res: Results, model: Model, tensors: list[torch.Tensor], idx: int, nops: int, rng: random.Random
) -> None:
    per = CHUNKS_PER_JOB * BPC
    src_base = idx * 2 * per  # this thread's blocks: per for stores, per for loads
    dst_base = src_base + per

    def job_blocks(base: int, n: int) -> list[tuple[int, ...]]:
        """Each chunk's blocks: in order (a fresh pool: moved in place) or, half the time, at
        scattered ids of this thread's range (a churned pool: gathered and scattered)."""
        ids = list(range(base, base + n * BPC))
        if rng.random() < 0.5:
            rng.shuffle(ids)
        return [tuple(ids[j * BPC : (j + 1) * BPC]) for j in range(n)]

    for _ in range(nops):
        kids = rng.sample([kid_of(0, i) for i in range(NKEYS[0])], rng.randint(1, CHUNKS_PER_JOB))
        if rng.random() < 0.45:  # store (new versions; overwrites of keys others are loading)
            refs, versions = [], []
            for kid, blocks in zip(kids, job_blocks(src_base, len(kids))):
                v = model.new_version(kid)
                data = np.frombuffer(value(kid, v, SIZES[0]), dtype=np.uint8).reshape(LAYERS, BPC, BLOCK)
                for layer, t in enumerate(tensors):
                    t[list(blocks)] = torch.from_numpy(data[layer].copy())
                refs.append(ChunkRef(key_of(kid), blocks))
                versions.append(v)
            jid, ev, box = res.new_id()
            if not p.submit_store(StoreJob(jid, 0, tuple(refs))):
                res.forget(jid)
                model.count("refused")
                continue
            r = res.wait(ev, box)
            model.count("stores")
            done = set(r.done)
            for kid, v in zip(kids, versions):
                if key_of(kid) in done:
                    model.ack(kid, v)
        else:  # load into poisoned blocks, then check every byte of every chunk
            refs = []
            for kid, blocks in zip(kids, job_blocks(dst_base, len(kids))):
                for t in tensors:
                    t[list(blocks)] = 0xEE
                refs.append(ChunkRef(key_of(kid), blocks))
            before = [model.newest_acked(kid) for kid in kids]
            jid, ev, box = res.new_id()
            if not p.submit_load(LoadJob(jid, 0, tuple(refs))):
                res.forget(jid)
                model.count("refused")
                continue
            r = res.wait(ev, box)
            model.count("loads")
            if not r.ok:
                model.count("load_misses")
                continue
            if r.tiers == {"cpu": len(kids)}:  # every chunk copied straight from its borrowed slot
                model.count("slot_only_loads")
            for kid, ref, acked in zip(kids, refs, before):
                data = b"".join(t[b].numpy().tobytes() for t in tensors for b in ref.block_ids)
                model.check(kid, data, acked, f"tensor load job {jid}")


def _buffer_worker(p: Pipeline, res: Results, model: Model, nops: int, rng: random.Random) -> None:
    for _ in range(nops):
        group = rng.choice((1, 2))
        kids = rng.sample([kid_of(group, i) for i in range(NKEYS[group])], rng.randint(1, CHUNKS_PER_JOB))
        if rng.random() < 0.45:
            versions = [model.new_version(kid) for kid in kids]
            items = [(key_of(kid), value(kid, v, SIZES[group])) for kid, v in zip(kids, versions)]
            jid, ev, box = res.new_id()
            if not p.submit_put(jid, items):
                res.forget(jid)
                model.count("refused")
                continue
            r = res.wait(ev, box)
            model.count("puts")
            done = set(r.done)
            for kid, v in zip(kids, versions):
                if key_of(kid) in done:
                    model.ack(kid, v)
        else:
            bufs = [bytearray(b"\xee" * SIZES[group]) for _ in kids]
            before = [model.newest_acked(kid) for kid in kids]
            jid, ev, box = res.new_id()
            if not p.submit_get(jid, [(key_of(kid), b) for kid, b in zip(kids, bufs)]):
                res.forget(jid)
                model.count("refused")
                continue
            r = res.wait(ev, box)
            model.count("gets")
            done = set(r.done)
            model.count("get_misses", len(kids) - len(done))
            for kid, b, acked in zip(kids, bufs, before):
                if key_of(kid) in done:
                    model.check(kid, bytes(b), acked, f"host get job {jid}")


async def _direct_task(cpu: CPUTier, model: Model, nops: int, rng: random.Random) -> None:
    """On the pipeline's loop, on the CPU tier itself: overwrites, long borrows, reads, deletes."""
    for _ in range(nops):
        group = rng.choice((0, 0, 1, 2))
        kid = kid_of(group, rng.randrange(NKEYS[group]))
        key = key_of(kid)
        op = rng.random()
        try:
            if op < 0.35:
                v = model.new_version(kid)
                await cpu.put_many([(key, value(kid, v, SIZES[group]))])
                model.ack(kid, v)
                model.count("direct_puts")
            elif op < 0.7:
                before = model.newest_acked(kid)
                (slot,) = cpu.borrow([key])
                if slot is None:
                    model.count("direct_misses")
                    continue
                try:
                    for _ in range(rng.randint(1, 6)):  # others overwrite, evict and reclaim meanwhile
                        await asyncio.sleep(0)
                    data = bytes(cpu.slot_view(slot).numpy())
                finally:
                    cpu.give_back([key], [slot])
                model.count("direct_borrows")
                model.check(kid, data, before, "borrowed slot")
            elif op < 0.9:
                before = model.newest_acked(kid)
                buf = bytearray(b"\xee" * SIZES[group])
                (n,) = await cpu.get_many([key], into=[buf])
                if n is None:
                    model.count("direct_misses")
                    continue
                model.check(kid, bytes(buf[:n]), before, "cpu get_many")
            else:
                await cpu.delete_many([key])
                model.count("direct_deletes")
        except TieredKVError as e:  # a full tier (everything pinned) is an answer, not a failure
            model.count(f"direct_{type(e).__name__}")
        await asyncio.sleep(0)


@pytest.mark.timeout(max(120, OPS // 100))  # a hang guard that grows with STRESS_OPS
@pytest.mark.parametrize("second", ["lmdb", "redis", "fs"])
def test_concurrent_store_load_promote_evict_overwrite_never_returns_wrong_bytes(
    tmp_path: Path, request: pytest.FixtureRequest, second: str
) -> None:
    rng = random.Random(SEED)
    cpu = CPUTier(CPUTierConfig(capacity_bytes=160 << 10, segment_bytes=16 << 10, min_slot_bytes=512))
    # file_batch_bytes: the larger batches go to record files beside the index, the rest stay in LMDB
    low = LMDBTier(
        LMDBTierConfig(
            path=str(tmp_path / "lmdb"), map_size_bytes=64 << 20, size_cap_bytes=32 << 20, file_batch_bytes=4 << 10
        )
    )
    tiers: list[Any] = [cpu, low]
    other = "lmdb"
    red: RedisTier | None = None
    if second == "fs":
        tiers.append(FSTier(FSTierConfig(path=str(tmp_path / "fs"), size_cap_bytes=32 << 20)))
        other = "fs"
    if second == "redis":
        srv = request.getfixturevalue("redis_server")
        red = RedisTier(RedisTierConfig(url=srv.url, key_prefix=f"stress-{uuid.uuid4().hex[:8]}"))
        tiers.append(red)
        other = red.name
    rules = [
        PolicyRule(kinds=["sliding_window"], tiers=["cpu", "lmdb"], write="back"),
        PolicyRule(kinds=["mamba"], tiers=["cpu", other]),
        PolicyRule(tiers=["cpu", "lmdb"]),
    ]
    pol = TierPolicy(rules, [t.name for t in tiers])
    p = Pipeline(tiers, pol, PipelineConfig(uvloop=True), staging=StagingPool(4 << 20)).start()
    model = Model()
    res = Results(p)
    try:
        nblocks = TENSOR_THREADS * 2 * CHUNKS_PER_JOB * BPC
        tensors = [torch.zeros((nblocks, BLOCK), dtype=torch.uint8) for _ in range(LAYERS)]
        assert p.register_group(0, tensors, blocks_per_chunk=BPC, kind="full").write == "through"
        assert p.policy.route(1, SIZES[1], KINDS[1]).write == "back"
        assert list(p.policy.route(2, SIZES[2], KINDS[2]).tiers) == ["cpu", other]

        nworkers = TENSOR_THREADS + BUFFER_THREADS + ASYNC_TASKS
        per = max(1, OPS // nworkers)
        failures: list[BaseException] = []

        def guarded(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                failures.append(e)

        tasks_done = threading.Event()
        tasks_left = [ASYNC_TASKS]

        async def direct(seed: int) -> None:
            try:
                await _direct_task(cpu, model, per, random.Random(seed))
            except BaseException as e:
                failures.append(e)
                raise
            finally:
                tasks_left[0] -= 1  # loop thread only
                if not tasks_left[0]:
                    tasks_done.set()

        threads = [
            threading.Thread(
                target=guarded, args=(_tensor_worker, p, res, model, tensors, i, per, random.Random(rng.random()))
            )
            for i in range(TENSOR_THREADS)
        ] + [
            threading.Thread(target=guarded, args=(_buffer_worker, p, res, model, per, random.Random(rng.random())))
            for _ in range(BUFFER_THREADS)
        ]
        for t in threads:
            t.start()
        for _ in range(ASYNC_TASKS):
            p.run_background(direct(rng.randrange(1 << 30)))
        for t in threads:
            t.join(WAIT_LIMIT_S)
            assert not t.is_alive(), "a worker thread never finished"
        assert tasks_done.wait(WAIT_LIMIT_S), "the asyncio tasks never finished"
        assert p.drain(WAIT_LIMIT_S)
        assert not failures, failures[:3]

        cs = p.run(cpu.stats(), timeout=30)
        st = p.stats()
        f = model.figures
        ops = sum(
            f[k]
            for k in (
                "stores",
                "loads",
                "puts",
                "gets",
                "direct_puts",
                "direct_borrows",
                "direct_deletes",
                "direct_misses",
            )
        )
        print(
            f"\nstress[{second}] seed={SEED} operations={ops} (target {OPS}) chunks_verified={f['chunks_verified']}"
            f" bytes_verified={f['bytes_verified']} wrong_chunks={f['wrong_chunks']} wrong_bytes={f['wrong_bytes']}"
            f" stale_reads={f['stale_reads']} load_misses={f['load_misses']} get_misses={f['get_misses']}"
            f" refused={f['refused']}\n  figures={dict(f)}\n  cpu={dict(cs.counters)} extra={cs.extra}"
            f"\n  pipeline={st.counters}"
        )
        assert model.errors == [] and f["wrong_bytes"] == 0, model.errors
        assert f["chunks_verified"] > 0 and f["slot_only_loads"] > 0  # loads of slot hits only, among overwrites
        assert cs.extra["lent_slots"] == 0 and cs.extra["parked_slots"] == 0, cs.extra
        assert cs.counters.get("evictions", 0) > 0 and st.counters.get("promotions", 0) > 0

        # a clean close writes the write-back group's CPU-only chunks down; LMDB then holds valid bytes
        res.stop.set()
        p.close()
        assert p.stats().counters.get("write_back_lost", 0) == 0, p.stats().counters

        async def read_lmdb() -> list[bytes | None]:
            async with LMDBTier(
                LMDBTierConfig(path=str(tmp_path / "lmdb"), map_size_bytes=64 << 20, size_cap_bytes=32 << 20)
            ) as again:
                return await again.get_many([key_of(kid_of(1, i)) for i in range(NKEYS[1])])

        kept = 0
        for i, data in enumerate(asyncio.run(read_lmdb())):
            if data is not None:
                kept += 1
                model.check(kid_of(1, i), data, 0, "LMDB after close")
        print(
            f"  after close: write_back_flushed={p.stats().counters.get('write_back_flushed', 0)}"
            f" group-1 keys in LMDB={kept}/{NKEYS[1]} wrong_bytes={f['wrong_bytes']}"
        )
        assert model.errors == [] and f["wrong_bytes"] == 0, model.errors
        assert set(os.listdir(tmp_path / "lmdb" / "files")) - {"spare"}, "no batch went to a record file"
    finally:
        res.stop.set()
        res.thread.join(10)
        p.close()
        if red is not None:

            async def wipe() -> None:
                async with RedisTier(RedisTierConfig(url=red.config.url, key_prefix=red.config.key_prefix)) as r:
                    keys = [i.key async for i in r.scan()]
                    await r.delete_many(keys)

            with contextlib.suppress(Exception):  # best effort cleanup of this run's keys
                asyncio.run(wipe())

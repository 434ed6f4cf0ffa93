"""CPU- and LMDB-specific behaviour beyond the shared contract."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import lmdb
import pytest
import torch

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.registry import build_tier
from tieredkv.config import CPUTierConfig, LMDBTierConfig
from tieredkv.errors import ConfigError, TierUnavailableError
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload

NS = Namespace(model="specific")
KiB, MiB = 1024, 1024 * 1024


def k(i: int, g: int = 0) -> bytes:
    return NS.key(i.to_bytes(32, "big"), g)


# ---- CPU -------------------------------------------------------------------------------


async def test_cpu_power_of_two_chunks_fill_slots_exactly() -> None:
    async with CPUTier(CPUTierConfig(capacity_bytes=8 * MiB, segment_bytes=1 * MiB)) as tier:
        await tier.put_many([(k(i), payload(256 * KiB, i)) for i in range(32)])
        st = await tier.stats()
        assert st.records == 32 and st.used_bytes == 8 * MiB == st.capacity_bytes
        await tier.put_many([(k(99), payload(256 * KiB))])
        assert await tier.contains_many([k(0), k(1), k(99)]) == [False, True, True]
        assert tier.counters["evictions"] == 1


async def test_cpu_a_full_tiers_batch_evicts_the_oldest_it_needs_skipping_pinned_and_read() -> None:
    """A batch into a full tier finds its room in one walk of the policy: exactly as many
    records as it needs go, the least recently used first, never a pinned one or one read
    since; the new records and everything else stay."""
    async with CPUTier(CPUTierConfig(capacity_bytes=8 * MiB, segment_bytes=1 * MiB)) as tier:
        await tier.put_many([(k(i), payload(256 * KiB, i)) for i in range(32)])  # full
        tier.pin_many([k(1)])
        assert await tier.get_many([k(0)]) == [payload(256 * KiB, 0).numpy().tobytes()]  # read: the newest now
        new = [(k(100 + i), payload(256 * KiB, 100 + i)) for i in range(5)]
        await tier.put_many(new)
        gone = [i for i, held in enumerate(await tier.contains_many([k(i) for i in range(32)])) if not held]
        assert gone == [2, 3, 4, 5, 6]
        assert tier.counters["evictions"] == 5
        assert await tier.get_many([key for key, _ in new]) == [v.numpy().tobytes() for _, v in new]
        tier.unpin_many([k(1)])
        await tier.put_many([(k(200), payload(256 * KiB, 200))])  # unpinned, k(1) is the oldest
        assert await tier.contains_many([k(1), k(7)]) == [False, True]


async def test_cpu_odd_sizes_waste_at_most_a_third() -> None:
    async with CPUTier(CPUTierConfig(capacity_bytes=8 * MiB, segment_bytes=1 * MiB)) as tier:
        await tier.put_many([(k(i), payload(3 * 64 * KiB + 1, i)) for i in range(10)])
        st = await tier.stats()
        assert st.used_bytes <= 10 * (3 * 64 * KiB + 1) * 4 / 3


async def test_cpu_reclaims_a_segment_of_another_size_class() -> None:
    async with CPUTier(CPUTierConfig(capacity_bytes=4 * MiB, segment_bytes=1 * MiB)) as tier:
        await tier.put_many([(k(i), payload(64 * KiB, i)) for i in range(64)])  # all 4 segments
        assert (await tier.stats()).extra["free_segments"] == 0
        await tier.put_many([(k(1000), payload(1 * MiB))])
        assert await tier.contains_many([k(1000)]) == [True]
        assert tier.counters["evictions"] == 16  # one whole 64 KiB-class segment
        out = torch.empty(64 * KiB, dtype=torch.uint8)
        survivors = [i for i, p in enumerate(await tier.contains_many([k(i) for i in range(64)])) if p]
        assert len(survivors) == 48
        assert await tier.get_many([k(survivors[0])], into=[out]) == [64 * KiB]
        assert torch.equal(out, payload(64 * KiB, survivors[0]))


async def test_cpu_chunk_larger_than_a_segment_is_a_config_error() -> None:
    async with CPUTier(CPUTierConfig(capacity_bytes=4 * MiB, segment_bytes=1 * MiB)) as tier:
        with pytest.raises(ConfigError, match="segment_bytes"):
            await tier.put_many([(k(1), payload(2 * MiB))])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
async def test_cpu_pinning_without_cuda() -> None:
    with pytest.raises(ConfigError, match="pin_memory: got 'always' but CUDA is not available"):
        await CPUTier(CPUTierConfig(capacity_bytes=MiB, segment_bytes=MiB, pin_memory="always")).open()
    async with CPUTier(CPUTierConfig(capacity_bytes=MiB, segment_bytes=MiB)) as tier:
        assert tier.pinned is False and tier.slab.numel() == MiB


# ---- LMDB ------------------------------------------------------------------------------


def lmdb_cfg(path: Path, **kw: object) -> LMDBTierConfig:
    base: dict[str, object] = {"path": str(path), "map_size_bytes": 64 * MiB, "size_cap_bytes": 32 * MiB}
    return LMDBTierConfig(**{**base, **kw})


async def test_lmdb_survives_reopen_with_lru_order(tmp_path: Path) -> None:
    cfg = lmdb_cfg(tmp_path, size_cap_bytes=4 * (64 * KiB + 64))
    async with LMDBTier(cfg) as tier:
        for i in range(4):
            await tier.put_many([(k(i), payload(64 * KiB, i))])
        await tier.get_many([k(0)])  # k0 becomes the most recently used
    async with LMDBTier(cfg) as tier:
        st = await tier.stats()
        assert st.records == 4 and st.used_bytes == 4 * (64 * KiB + 64)
        await tier.put_many([(k(4), payload(64 * KiB, 4))])  # evicts the LRU: k1, not k0
        assert await tier.contains_many([k(i) for i in range(5)]) == [True, False, True, True, True]
        out = torch.empty(64 * KiB, dtype=torch.uint8)
        assert await tier.get_many([k(0)], into=[out]) == [64 * KiB]
        assert torch.equal(out, payload(64 * KiB, 0))


async def test_lmdb_map_grows_on_map_full(tmp_path: Path) -> None:
    cfg = lmdb_cfg(tmp_path, map_size_bytes=1 * MiB, size_cap_bytes=900 * KiB, max_map_size_bytes=16 * MiB)
    async with LMDBTier(cfg) as tier:
        # 4097-byte payloads take two 4 KiB overflow pages each: the map fills before the cap.
        for i in range(0, 200, 20):
            await tier.put_many([(k(j), payload(4097, j)) for j in range(i, i + 20)])
        st = await tier.stats()
        assert tier.counters["map_growths"] >= 1 and st.extra["map_size"] > 1 * MiB
        assert all(await tier.contains_many([k(j) for j in range(200)]))


@pytest.mark.parametrize("kind", ["cpu", "lmdb"])
async def test_pins_from_another_thread_while_the_loop_evicts(tmp_path: Path, kind: str) -> None:
    """The scheduler thread pins and unpins accepted hits while the tier's own loop evicts under
    pressure: no pin update is lost (the count ends where it started) and a pinned key is never
    evicted."""
    if kind == "cpu":
        tier: CPUTier | LMDBTier = CPUTier(CPUTierConfig(capacity_bytes=1 * MiB, segment_bytes=256 * KiB))
    else:
        tier = LMDBTier(lmdb_cfg(tmp_path, map_size_bytes=4 * MiB, size_cap_bytes=1 * MiB))
    async with tier:
        held = [k(i) for i in range(4)]
        await tier.put_many([(key, payload(64 * KiB, i)) for i, key in enumerate(held)])
        tier.pin_many(held)  # the base pin the thread's pin/unpin pairs go above
        stop = threading.Event()
        cycles = 0

        def pinner() -> None:
            nonlocal cycles
            while not stop.is_set():
                tier.pin_many(held)
                tier.unpin_many(held)
                cycles += 1
                time.sleep(0)  # let the loop thread run between pairs (the GIL is shared)

        t = threading.Thread(target=pinner)
        t.start()
        try:
            for i in range(100, 260, 4):  # 10 MiB through a 1 MiB tier: evictions all along
                await tier.put_many([(k(j), payload(64 * KiB, j)) for j in range(i, i + 4)])
        finally:
            stop.set()
            t.join()
        assert cycles > 0 and tier.counters["evictions"] > 0
        assert all(tier._pins[key] == 1 for key in held), {key[-6:].hex(): tier._pins[key] for key in held}
        got = await tier.get_many(held)
        assert all(g is not None and g == payload(64 * KiB, i).numpy().tobytes() for i, g in enumerate(got))


async def test_lmdb_probe_from_another_thread_while_the_map_grows(tmp_path: Path) -> None:
    """The scheduler thread probes (one read transaction) while the writer grows the map: LMDB
    forbids set_mapsize with a transaction open, so a probe yields (None) instead of racing it,
    and every answer it does give is right."""
    cfg = lmdb_cfg(tmp_path, map_size_bytes=1 * MiB, size_cap_bytes=900 * KiB, max_map_size_bytes=16 * MiB)
    async with LMDBTier(cfg) as tier:
        await tier.put_many([(k(0), payload(4097, 0))])
        tier.pin_many([k(0)])  # never evicted: every answer about it must be "present"
        stop = threading.Event()
        answers: list[list[bool] | None] = []

        def prober() -> None:
            while not stop.is_set():
                answers.append(tier.probe([k(0), k(10_000)]))

        t = threading.Thread(target=prober)
        t.start()
        try:
            for i in range(1, 400, 20):
                await tier.put_many([(k(j), payload(4097, j)) for j in range(i, i + 20)])
        finally:
            stop.set()
            t.join()
        assert tier.counters["map_growths"] >= 1
        given = [a for a in answers if a is not None]
        assert given and all(a == [True, False] for a in given)
    assert tier.probe([k(0)]) is None  # closed: nothing to ask


async def test_lmdb_map_at_its_limit_evicts_instead_of_crashing(tmp_path: Path) -> None:
    cfg = lmdb_cfg(tmp_path, map_size_bytes=1 * MiB, size_cap_bytes=1000 * KiB, max_map_size_bytes=1 * MiB)
    async with LMDBTier(cfg) as tier:
        for i in range(0, 400, 20):
            await tier.put_many([(k(j), payload(4097, j)) for j in range(i, i + 20)])
        present = await tier.contains_many([k(j) for j in range(400)])
        assert present[-1] and not present[0]
        assert tier.counters["evictions"] > 0


async def test_lmdb_durable_mode_round_trip(tmp_path: Path) -> None:
    async with LMDBTier(lmdb_cfg(tmp_path, sync_mode="durable")) as tier:
        await tier.put_many([(k(1), payload(1000))])
        assert (await tier.get_many([k(1)]))[0] == payload(1000).numpy().tobytes()


async def test_lmdb_runs_on_its_own_thread_and_leaves_none_behind(tmp_path: Path) -> None:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    tier = LMDBTier(lmdb_cfg(tmp_path, map_size_bytes=256 * MiB, size_cap_bytes=128 * MiB))
    await tier.open()
    t = asyncio.create_task(ticker())
    await tier.put_many([(k(i), payload(MiB, i)) for i in range(48)])
    stop = True
    await t
    assert ticks > 3, "the event loop was blocked while LMDB wrote"
    assert any(th.name.startswith("tieredkv-lmdb-") for th in threading.enumerate())
    await tier.close()
    assert not any(th.name.startswith("tieredkv-lmdb-") for th in threading.enumerate())


async def test_cpu_reserve_commit_borrow_path() -> None:
    async with CPUTier(CPUTierConfig(capacity_bytes=2 * MiB, segment_bytes=1 * MiB)) as tier:
        # a reserved slot is invisible until committed, and its segment cannot be reclaimed
        (slot,) = tier.reserve([(k(1), 512 * KiB)])
        tier.slot_view(slot).copy_(payload(512 * KiB, 1))
        assert await tier.contains_many([k(1)]) == [False]
        await tier.put_many([(k(2), payload(64 * KiB, 2))])  # takes the other segment
        await tier.put_many([(k(3), payload(1 * MiB, 3))])  # reclaims k2's segment, never the reserved one
        assert await tier.contains_many([k(2), k(3)]) == [False, True]
        tier.commit([(k(1), slot)])
        (got,) = tier.borrow([k(1)])
        assert got is not None and tier.is_pinned(k(1))
        assert torch.equal(tier.slot_view(got), payload(512 * KiB, 1))
        tier.give_back([k(1)])
        assert not tier.is_pinned(k(1))
        # bytes written in the process are served without a checksum pass; a record arriving
        # from outside (raw_put_many: migrate) is verified on borrow: a flipped byte is a
        # miss, dropped, counted
        (rec,) = await tier.raw_get_many([k(1)])
        assert rec is not None
        bad = bytearray(rec)
        bad[64 + 7] ^= 0xFF
        await tier.raw_put_many([(k(1), bytes(bad))])
        assert tier.borrow([k(1)]) == [None] and tier.counters["corrupt"] == 1
        assert await tier.contains_many([k(1)]) == [False]
        (s2,) = tier.reserve([(k(4), 1000)])
        tier.abort([s2])
        assert await tier.contains_many([k(4)]) == [False]


async def test_lmdb_raw_records_respect_the_size_cap(tmp_path: Path) -> None:
    rec_bytes = 64 * KiB + 64
    async with LMDBTier(lmdb_cfg(tmp_path, size_cap_bytes=4 * rec_bytes)) as tier:
        await tier.put_many([(k(0), payload(64 * KiB, 0))])
        (rec,) = await tier.raw_get_many([k(0)])
        # a migration writes already-encoded records; they must not overflow the cap
        for i in range(1, 8):
            await tier.raw_put_many([(k(i), rec)])
        st = await tier.stats()
        assert st.used_bytes <= 4 * rec_bytes and st.records == 4
        assert tier.counters["evictions"] == 4


class _ResizingEnv:
    """An lmdb.Environment whose first ``fail`` open_db calls raise MapResizedError, as when another
    process grows the map between mdb_env_open and the first transaction."""

    def __init__(self, env: object, fail: int) -> None:
        self._env, self.fail = env, fail

    def open_db(self, *a: object, **kw: object) -> object:
        if self.fail:
            self.fail -= 1
            raise lmdb.MapResizedError("injected: another process grew the map")
        return self._env.open_db(*a, **kw)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)


async def test_lmdb_open_during_a_resize_adopts_and_never_stays_half_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = lmdb.open

    def opening(fail: int) -> object:
        return lambda *a, **kw: _ResizingEnv(real_open(*a, **kw), fail)

    monkeypatch.setattr(lmdb, "open", opening(1))
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:  # resized once while opening: adopted, retried
        await tier.put_many([(k(1), payload(1000, 1))])
    monkeypatch.setattr(lmdb, "open", opening(1_000))
    with pytest.raises(TierUnavailableError, match="grew the map"):
        await LMDBTier(lmdb_cfg(tmp_path)).open()
    monkeypatch.undo()
    # the failed open closed its environment instead of leaving it half open: it opens again here
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        assert await tier.contains_many([k(1)]) == [True]
        assert (await tier.stats()).used_bytes == 1000 + 64


async def test_lmdb_evicts_by_the_shared_stamps_records_it_never_saw(tmp_path: Path) -> None:
    """Records another writer stored (here a second store on the same directory: one environment)
    are evicted oldest-stamp first, not after this process's own recently read ones, and the cap
    holds for the environment."""
    rec = 64 * KiB + 64
    cfg = lmdb_cfg(tmp_path, size_cap_bytes=4 * rec)
    async with LMDBTier(cfg) as mine, LMDBTier(cfg) as other:
        for i in range(4):
            await other.put_many([(k(i), payload(64 * KiB, i))])
        await mine.get_many([k(1)])  # mine has seen k1 only, and just now
        await mine.put_many([(k(10), payload(64 * KiB, 10))])
        assert await mine.contains_many([k(i) for i in (0, 1, 2, 3, 10)]) == [False, True, True, True, True]
        assert mine.counters["shared_lru_scans"] == 1 and mine.counters["evictions"] == 1
        st = await other.stats()
        assert st.used_bytes == 4 * rec and st.records == 4


# ---- kind-free seams: sizing, relocating, "no data here yet" -----------------------------------


@pytest.mark.parametrize("kind", ["cpu", "lmdb"])
async def test_with_capacity_holds_that_many_records_without_evicting(tmp_path: Path, kind: str) -> None:
    chunk, n = 300 * KiB, 12
    base: CPUTierConfig | LMDBTierConfig = (
        CPUTierConfig(segment_bytes=256 * KiB) if kind == "cpu" else lmdb_cfg(tmp_path / "kv")
    )
    cfg = base.with_capacity(n * (chunk + 64), largest_record_bytes=chunk + 64)
    tier = build_tier(cfg)
    async with tier:
        for i in range(n):
            await tier.put_many([(k(i), payload(chunk, i))])
        assert await tier.contains_many([k(i) for i in range(n)]) == [True] * n
        assert tier.counters["evictions"] == 0
        for i in range(n, 3 * n):  # past the capacity: it evicts, it does not fail
            await tier.put_many([(k(i), payload(chunk, i))])
        assert tier.counters["evictions"] > 0


async def test_missing_says_where_no_lmdb_environment_is_yet_without_creating_one(tmp_path: Path) -> None:
    cfg = lmdb_cfg(tmp_path / "kv")
    assert LMDBTier.missing(cfg) == f"no LMDB environment at {tmp_path / 'kv'}"
    assert not (tmp_path / "kv").exists()
    async with build_tier(cfg) as tier:
        await tier.put_many([(k(1), payload(10))])
    assert LMDBTier.missing(cfg) is None
    assert CPUTier.missing(CPUTierConfig()) is None  # the default: cannot tell, may hold data
    moved = cfg.with_local_dir(tmp_path / "elsewhere")
    assert moved.path == str(tmp_path / "elsewhere") and LMDBTier.missing(moved) is not None


async def test_lmdb_large_reads_verified_after_the_copy_serve_no_wrong_bytes(tmp_path: Path) -> None:
    """Records of 128 KiB and more are copied into their buffers first and verified there: a
    corrupt one among them (or among small ones, verified inline) is a miss, counted and
    deleted; every other buffer holds exactly its record; a buffer too small is a miss."""
    tier = LMDBTier(lmdb_cfg(tmp_path, map_size_bytes=256 * MiB, size_cap_bytes=128 * MiB))
    async with tier:
        sizes = [256 << 10, 1 << 20, 4 << 10, 300 << 10, 2 << 20, 128 << 10, 1000]
        keys = [k(i) for i in range(len(sizes))]
        data = [payload(n, i).numpy().tobytes() for i, n in enumerate(sizes)]
        await tier.put_many(list(zip(keys, data)))
        raw = await tier.raw_get_many([keys[1], keys[2]])
        for key, rec in zip((keys[1], keys[2]), raw):
            assert rec is not None
            bad = bytearray(rec)
            bad[-1] ^= 0xFF  # last payload byte
            await tier.raw_put_many([(key, bytes(bad))])
        bufs = [bytearray(n) for n in sizes]
        bufs[4] = bytearray(sizes[4] - 1)  # too small: a miss, not a partial copy reported as a hit
        got = await tier.get_many(keys, into=bufs)
        assert got == [sizes[0], None, None, sizes[3], None, sizes[5], sizes[6]]
        for i in (0, 3, 5, 6):
            assert bytes(bufs[i]) == data[i]
        assert tier.counters["corrupt"] == 2
        assert await tier.contains_many(keys) == [True, False, False, True, True, True, True]
        assert await tier.get_many([keys[4]]) == [data[4]]


@pytest.mark.parametrize(("size", "n"), [(MiB, 8), (256 * KiB, 10)])  # 256 KiB: the smallest split records
async def test_lmdb_large_batches_read_on_two_threads_serve_no_wrong_bytes(tmp_path: Path, size: int, n: int) -> None:
    """A batch of large records is read in two halves on two threads: corrupt records in either
    half are misses (counted, deleted, zeroed where they landed), a record deleted meanwhile is a
    miss and leaves the LRU, a buffer too small is a miss (never written to), every other buffer
    holds exactly its record, and the records read are touched in the LRU (the oldest is now one
    not read)."""
    threads: list[str] = []

    class Recording(LMDBTier):
        def _read_part(self, keys, into):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return super()._read_part(keys, into)

    tier = Recording(lmdb_cfg(tmp_path, map_size_bytes=256 * MiB, size_cap_bytes=128 * MiB))
    async with tier:
        keys = [k(i) for i in range(n + 1)]
        data = [payload(size, i).numpy().tobytes() for i in range(n + 1)]
        await tier.put_many([(keys[n], data[n])])  # the oldest record, not read below
        await tier.put_many(list(zip(keys[:n], data[:n])))
        for i in (1, 6):  # one corrupt record in each half
            (rec,) = await tier.raw_get_many([keys[i]])
            assert rec is not None
            bad = bytearray(rec)
            bad[len(bad) // 2] ^= 0x01
            await tier.raw_put_many([(keys[i], bytes(bad))])
        delete = (  # another process deletes a record this one holds in its LRU
            "import lmdb, sys\n"
            "env = lmdb.open(sys.argv[1], max_dbs=2)\n"
            "with env.begin(write=True) as txn:\n"
            "    assert txn.delete(bytes.fromhex(sys.argv[2]), db=env.open_db(b'records', txn=txn))\n"
        )
        await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", delete, str(tmp_path), keys[3].hex()], check=True
        )
        bufs = [bytearray(b"\xab" * size) for _ in range(n)]
        bufs[5] = bytearray(b"\xab" * (size - 1))
        threads.clear()
        got = await tier.get_many(keys[:n], into=bufs)
        assert len(set(threads)) == 2, threads  # the batch was read by two threads
        assert got == [size, None, size, None, size, None, None, size] + [size] * (n - 8)
        for i in (0, 2, 4, 7, *range(8, n)):
            assert bytes(bufs[i]) == data[i]
        for i in (1, 6):  # a damaged record landed before it was verified: zeroed, none of it stays
            assert not any(bufs[i]), i
        assert bufs[3] == b"\xab" * size and bufs[5] == b"\xab" * (size - 1)  # never written to
        assert tier.counters["corrupt"] == 2
        assert keys[3] not in tier._policy and keys[1] not in tier._policy
        want = [True, False, True, False, True, True, False, True] + [True] * (n - 8) + [True]
        assert await tier.contains_many(keys) == want
        assert next(iter(tier._policy.victims())) == keys[n]  # the records read were touched, the unread one is oldest
        threads.clear()
        one = await tier.get_many([keys[0], keys[2]])
        assert one == [data[0], data[2]] and len(threads) == 1  # read into new bytes: one thread


_LARGE = 512 * KiB  # copied first and verified in the buffer, in batches read by two threads
_WRITER = """
import asyncio, sys
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import LMDBTierConfig
from tieredkv.keys import Namespace
ns = Namespace(model="specific")
def value(kid, v):
    word = kid.to_bytes(4, "little") + v.to_bytes(4, "little")
    return word * ({size} // 8)
async def main():
    cfg = LMDBTierConfig(path=sys.argv[1], map_size_bytes=256 << 20, size_cap_bytes=128 << 20,
                         file_batch_bytes={file_batch})
    async with LMDBTier(cfg) as tier:
        for v in range(1000, 1000 + {rounds}):
            await tier.put_many([(ns.key(kid.to_bytes(32, "big"), 0), value(kid, v)) for kid in range({keys})])
asyncio.run(main())
"""


def _version_of(kid: int, buf: bytes | bytearray) -> int | None:
    """The version ``buf`` holds if it is exactly one written value of key ``kid``; else None."""
    v = int.from_bytes(buf[4:8], "little")
    word = kid.to_bytes(4, "little") + v.to_bytes(4, "little")
    return v if bytes(buf) == word * (len(buf) // 8) else None


@pytest.mark.parametrize("file_batch", [None, 1], ids=["in-lmdb", "record-files"])
def test_lmdb_large_reads_under_threads_tasks_and_another_process(tmp_path: Path, file_batch: int | None) -> None:
    """Large records (copied, then verified in the buffer) read while they are overwritten:
    two threads, each with its own loop and tier on one directory (one shared environment), run
    writer and reader tasks on the same keys while another process writes new versions of them
    too. Every read is a miss or exactly one written version of its own key; nothing is corrupt.
    Also with every batch in a record file (``record-files``): files removed and blocks given
    back under readers of this process and the other."""
    keys, rounds = 8, 12
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _WRITER.format(size=_LARGE, rounds=rounds, keys=keys, file_batch=file_batch),
            str(tmp_path),
        ],
        stderr=subprocess.PIPE,
    )
    bad: list[str] = []
    seen = Counter[str]()

    def value(kid: int, v: int) -> bytes:
        return (kid.to_bytes(4, "little") + v.to_bytes(4, "little")) * (_LARGE // 8)

    async def engine(offset: int) -> None:
        cfg = LMDBTierConfig(
            path=str(tmp_path), map_size_bytes=256 * MiB, size_cap_bytes=128 * MiB, file_batch_bytes=file_batch
        )
        async with LMDBTier(cfg) as tier:

            async def writer(w: int) -> None:
                for v in range(offset + w, offset + 40, 2):
                    # batches of every other key as well: files that keep records of older ones
                    some = range(keys) if v % 3 else range(w, keys, 2)
                    await tier.put_many([(k(kid), value(kid, v)) for kid in some])

            async def reader() -> None:
                for _ in range(25):
                    bufs = [bytearray(b"\xee" * _LARGE) for _ in range(keys)]
                    got = await tier.get_many([k(kid) for kid in range(keys)], into=bufs)
                    for kid, (n, buf) in enumerate(zip(got, bufs)):
                        if n is None:
                            seen["miss"] += 1
                        elif n != _LARGE or _version_of(kid, buf) is None:
                            bad.append(f"key {kid}: {n} bytes, not one written version")
                        else:
                            seen["hit"] += 1

            await asyncio.gather(writer(0), writer(1), reader(), reader())
            assert tier.counters["corrupt"] == 0

    failed: list[BaseException] = []

    def run_engine(offset: int) -> None:
        try:
            asyncio.run(engine(offset))
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below, not lost in this one
            failed.append(e)

    threads = [threading.Thread(target=run_engine, args=(off,)) for off in (0, 500)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, err = child.communicate()
    assert child.returncode == 0, err.decode()[-2000:]
    if failed:
        raise failed[0]
    assert not bad, bad[:3]
    assert seen["hit"] > 0

    # the last word on each key is one version someone wrote, whole
    async def final() -> None:
        cfg = LMDBTierConfig(path=str(tmp_path), map_size_bytes=256 * MiB, size_cap_bytes=128 * MiB)
        async with LMDBTier(cfg) as tier:
            bufs = [bytearray(_LARGE) for _ in range(keys)]
            assert await tier.get_many([k(kid) for kid in range(keys)], into=bufs) == [_LARGE] * keys
            assert all(_version_of(kid, b) is not None for kid, b in enumerate(bufs))
            assert bool(set(os.listdir(tmp_path / "files")) - {"spare"}) == (file_batch is not None)

    asyncio.run(final())


async def test_lmdb_checksums_a_batch_while_the_one_before_is_written_and_keeps_their_order(tmp_path: Path) -> None:
    """A lane keeps two batches in flight on an LMDB tier: the second's headers are computed on
    the helper thread while the tier's thread is still inside the first's write, and the batches land in the
    order they were sent: keys in both hold the second's value, and the used bytes count each
    record once."""
    from tieredkv.config import PipelineConfig
    from tieredkv.format import as_readable
    from tieredkv.pipeline.lanes import Outcome, TierLane

    in_first, release, second_encoded = threading.Event(), threading.Event(), threading.Event()
    encoders: list[str] = []

    class Gated(LMDBTier):  # the real tier; its first write is held until the test lets it go
        def _heads(self, items):  # type: ignore[no-untyped-def]
            out = super()._heads(items)
            encoders.append(threading.current_thread().name)
            if len(encoders) == 2:
                second_encoded.set()
            return out

        def _put_records(self, items, heads=None):  # type: ignore[no-untyped-def]
            if not in_first.is_set():
                in_first.set()
                assert release.wait(120), "the test never released the first write"
            super()._put_records(items, heads)

    tier = Gated(lmdb_cfg(tmp_path))
    async with tier:
        assert tier.capabilities.writes_in_flight == 2
        lane = TierLane(tier, PipelineConfig(max_batch_items=4))
        lane.task = asyncio.get_running_loop().create_task(lane.run())
        try:
            keys = [k(i) for i in range(6)]
            # 4 x 300 KiB: the headers of batches of 1 MiB or more are computed on the helper thread
            first = {key: payload(300 * KiB, i) for i, key in enumerate(keys[:4])}
            second = {key: payload(300 * KiB, 100 + i) for i, key in enumerate(keys[2:])}
            ((n1, f1),) = lane.write_many(list(first), [as_readable(p) for p in first.values()])
            ((n2, f2),) = lane.write_many(list(second), [as_readable(p) for p in second.values()])
            assert (n1, n2) == (4, 4)
            assert await asyncio.to_thread(in_first.wait, 120)
            assert await asyncio.to_thread(second_encoded.wait, 120)  # while the first is held
            assert not f1.done() and not f2.done()
            assert all(name.startswith(f"tieredkv-lmdb-{tier.name}-helper") for name in encoders), encoders
            release.set()
            assert [await f1, await f2] == [Outcome.OK, Outcome.OK]
        finally:
            release.set()
            lane.task.cancel()
            await asyncio.gather(lane.task, return_exceptions=True)
        want = {**first, **second}
        got = await tier.get_many(keys)
        assert [bytes(g or b"") for g in got] == [want[key].numpy().tobytes() for key in keys]
        assert (await tier.stats()).used_bytes == 6 * (300 * KiB + 64)


async def test_a_small_lmdb_batch_is_checksummed_on_the_tiers_thread_unless_one_before_it_is_still_on_the_helper(
    tmp_path: Path,
) -> None:
    """A batch under 1 MiB has its headers computed on the tier's own thread, right before its
    transaction (no hand-off to the helper and back); a larger one on the helper. While a larger
    batch is still on the helper, a small one waits behind it there too, so the later write still wins."""
    entered, gate = threading.Event(), threading.Event()
    encoders: list[tuple[int, str]] = []

    class Traced(LMDBTier):  # the real tier; the headers of a batch of 1 MiB or more can be held
        def _heads(self, items):  # type: ignore[no-untyped-def]
            big = sum(len(p) for _, p in items) >= MiB
            encoders.append((len(items), threading.current_thread().name))
            if big and not entered.is_set():
                entered.set()
                assert gate.wait(120), "the test never released the batch"
            return super()._heads(items)

    async with Traced(lmdb_cfg(tmp_path)) as tier:
        writer, helper = f"tieredkv-lmdb-{tier.name}_", f"tieredkv-lmdb-{tier.name}-helper_"
        await tier.put_many([(k(1), payload(200 * KiB, 1)), (k(2), payload(200 * KiB, 2))])
        assert encoders[-1][0] == 2 and encoders[-1][1].startswith(writer), encoders
        big = asyncio.create_task(tier.put_many([(k(i), payload(400 * KiB, 10 + i)) for i in (3, 4, 5)]))
        try:
            assert await asyncio.to_thread(entered.wait, 120)
            assert encoders[-1][0] == 3 and encoders[-1][1].startswith(helper), encoders
            small = asyncio.create_task(tier.put_many([(k(4), payload(100 * KiB, 40))]))  # overwrites k(4)
            await asyncio.sleep(0)  # it starts, and is queued wherever it goes, before the gate opens
        finally:
            gate.set()
        await asyncio.gather(big, small)
        assert encoders[-1][0] == 1 and encoders[-1][1].startswith(helper), encoders
        got = await tier.get_many([k(i) for i in (1, 2, 3, 4, 5)])
        want = [payload(200 * KiB, 1), payload(200 * KiB, 2), payload(400 * KiB, 13), payload(100 * KiB, 40)]
        want.append(payload(400 * KiB, 15))
        assert [bytes(g or b"") for g in got] == [w.numpy().tobytes() for w in want]
        assert (await tier.stats()).used_bytes == 2 * (200 * KiB + 64) + 2 * (400 * KiB + 64) + 100 * KiB + 64


async def test_concurrent_small_and_large_lmdb_batches_on_the_same_keys_land_in_call_order(tmp_path: Path) -> None:
    """40 puts started at once, small (under 1 MiB: headers computed on the tier's thread) and
    large (1 MiB and more: on the helper) mixed, over the same four keys: each key ends holding the
    payload of the last call that wrote it, and the used bytes count each key once."""
    sizes = {"small": 100 * KiB, "large": 400 * KiB}  # three records per call: 300 KiB / 1.2 MiB
    calls = []
    for c in range(40):
        kind = "large" if (c * 7) % 5 < 2 else "small"
        calls.append([(k(1 + (c + j) % 4), payload(sizes[kind], 1000 * c + j)) for j in range(3)])
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        await asyncio.gather(*(asyncio.create_task(tier.put_many(items)) for items in calls))
        last = {key: p for items in calls for key, p in items}  # the later call wins
        got = await tier.get_many(list(last))
        assert [bytes(g or b"") for g in got] == [p.numpy().tobytes() for p in last.values()]
        assert (await tier.stats()).used_bytes == sum(len(p.numpy().tobytes()) + 64 for p in last.values())


async def test_an_lmdb_put_cancelled_on_the_helper_stores_nothing_and_spoils_no_later_put(tmp_path: Path) -> None:
    """A put whose caller gives up while its batch's headers are being computed writes nothing;
    later puts (which wait behind it on the helper) land whole, and so do puts after them."""
    entered, gate = threading.Event(), threading.Event()

    class Slow(LMDBTier):  # the real tier; its first batch is held on the helper until the test lets it go
        def _heads(self, items):  # type: ignore[no-untyped-def]
            if not entered.is_set():
                entered.set()
                assert gate.wait(120), "the test never released the batch"
            return super()._heads(items)

    async with Slow(lmdb_cfg(tmp_path)) as tier:
        gone = asyncio.create_task(tier.put_many([(k(1), payload(1100 * KiB, 1))]))  # 1 MiB+: on the helper
        try:
            assert await asyncio.to_thread(entered.wait, 120)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            later = asyncio.create_task(tier.put_many([(k(2), payload(300 * KiB, 2)), (k(3), payload(200 * KiB, 3))]))
        finally:
            gate.set()
        await later
        await tier.put_many([(k(4), payload(300 * KiB, 4)), (k(5), payload(300 * KiB, 5))])
        assert await tier.contains_many([k(1)]) == [False]
        got = await tier.get_many([k(i) for i in (2, 3, 4, 5)])
        sizes = {2: 300 * KiB, 3: 200 * KiB, 4: 300 * KiB, 5: 300 * KiB}
        assert [bytes(g or b"") for g in got] == [payload(sizes[i], i).numpy().tobytes() for i in (2, 3, 4, 5)]
        assert tier.counters["corrupt"] == 0


def _lmdb_entries(path: Path, key: bytes) -> tuple[bytes | None, bytes | None]:
    """What the environment holds for ``key``: its ``records`` value and its ``access`` entry
    (read with py-lmdb itself, the tier closed)."""
    env = lmdb.open(str(path), max_dbs=2, readonly=True)
    try:
        rec, acc = env.open_db(b"records", create=False), env.open_db(b"access", create=False)
        with env.begin() as txn:
            return txn.get(key, db=rec), txn.get(key, db=acc)
    finally:
        env.close()


async def test_lmdb_stores_a_put_apart_and_a_raw_record_whole_and_serves_each_only_as_written(tmp_path: Path) -> None:
    """``put_many`` stores a payload as it is and its header after its access stamp;
    ``raw_put_many`` (migrations, tools) stores a whole record. Both read back as written, and
    ``raw_get_many`` gives the whole record of either. A payload byte or a header byte changed
    on disk, or the header of one key put beside another's payload, makes a miss, and the
    damaged records go."""
    from tieredkv.format import HEADER_SIZE, encode_record

    p = {i: payload(70 * KiB + i, i) for i in range(1, 7)}
    records = {i: bytes(encode_record(k(i), p[i])) for i in p}
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        await tier.put_many([(k(i), p[i]) for i in (1, 3, 4, 5)])
        await tier.raw_put_many([(k(i), records[i]) for i in (2, 6)])
        assert await tier.raw_get_many([k(i) for i in range(1, 7)]) == [records[i] for i in range(1, 7)]
    for i in (1, 3, 4, 5):
        value, meta = _lmdb_entries(tmp_path, k(i))
        assert value == p[i].numpy().tobytes() and meta is not None
        assert len(meta) == 16 + HEADER_SIZE and meta[16:] == records[i][:HEADER_SIZE]
    value, meta = _lmdb_entries(tmp_path, k(2))
    assert value == records[2] and meta is not None and len(meta) == 16

    env = lmdb.open(str(tmp_path), max_dbs=2)  # damage: as a disk or another program might
    try:
        rec, acc = env.open_db(b"records"), env.open_db(b"access")
        with env.begin(write=True) as txn:
            bad = bytearray(txn.get(k(3), db=rec))
            bad[len(bad) // 2] ^= 1
            txn.put(k(3), bytes(bad), db=rec)  # a payload byte
            meta = bytearray(txn.get(k(4), db=acc))
            meta[16 + 9] ^= 1
            txn.put(k(4), bytes(meta), db=acc)  # the fingerprint in a header
            meta = bytearray(txn.get(k(5), db=acc))
            meta[16:] = txn.get(k(1), db=acc)[16:]
            txn.put(k(5), bytes(meta), db=acc)  # another key's header
            six = bytearray(txn.get(k(6), db=rec))
            six[-1] ^= 1
            txn.put(k(6), bytes(six), db=rec)  # the payload of a record stored whole
    finally:
        env.close()
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        dsts = [torch.zeros(70 * KiB + i, dtype=torch.uint8) for i in range(1, 7)]
        got = await tier.get_many([k(i) for i in range(1, 7)], dsts)
        assert got == [70 * KiB + 1, 70 * KiB + 2, None, None, None, None]
        assert all(torch.equal(dsts[i - 1], p[i]) for i in (1, 2))
        assert tier.counters["corrupt"] == 4
        assert await tier.contains_many([k(i) for i in range(1, 7)]) == [True, True, False, False, False, False]
        assert (await tier.stats()).used_bytes == len(records[1]) + len(records[2])


async def test_lmdb_stamps_written_later_keep_the_header_beside_them(tmp_path: Path) -> None:
    """A read bumps a record's access stamp in memory; the next write transaction writes it.
    That rewrite keeps the header stored after the stamp: the record still reads back whole,
    in this process and after a reopen, and the stamp did move."""
    import struct

    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        await tier.put_many([(k(1), payload(100 * KiB, 1))])
        _, before = await _stamp(tier, k(1))
        while time.time() <= before:  # the clock has moved: the new stamp differs
            await asyncio.sleep(0.001)
        assert (await tier.get_many([k(1)]))[0] == payload(100 * KiB, 1).numpy().tobytes()
        await tier.put_many([(k(2), payload(10 * KiB, 2))])  # writes the dirty stamp of k(1)
        assert (await tier.get_many([k(1)]))[0] == payload(100 * KiB, 1).numpy().tobytes()
    _, meta = _lmdb_entries(tmp_path, k(1))
    assert meta is not None and len(meta) == 16 + 64 and struct.unpack_from("<d", meta)[0] > before
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:
        assert (await tier.get_many([k(1)]))[0] == payload(100 * KiB, 1).numpy().tobytes()
        assert tier.counters["corrupt"] == 0


async def _stamp(tier: LMDBTier, key: bytes) -> tuple[int, float]:
    """(record payload bytes, access stamp) of ``key`` as the tier's scan reports them."""
    async for info in tier.scan():
        if info.key == key:
            return info.size, info.stamp
    raise AssertionError("key not found")


async def test_lmdb_records_stored_apart_and_whole_on_the_same_keys_at_once(tmp_path: Path) -> None:
    """``put_many`` (stored apart) and ``raw_put_many`` (stored whole) of the same keys, 30 calls
    started at once: each key ends holding the last call's bytes in whichever layout that call
    wrote, reads back whole (no stale header beside a whole record, no whole-record stamp beside
    a payload), and the used bytes count each key once."""
    from tieredkv.format import HEADER_SIZE, encode_record

    keys = [k(i) for i in range(4)]
    calls: list[tuple[str, list[tuple[bytes, object]]]] = []
    for c in range(30):
        way = "raw" if c % 3 == 1 else "put"
        items = [(keys[(c + j) % 4], payload(50 * KiB + 7 * c + j, 100 * c + j)) for j in range(3)]
        if way == "raw":
            items = [(key, bytes(encode_record(key, p))) for key, p in items]
        calls.append((way, items))
    async with LMDBTier(lmdb_cfg(tmp_path)) as tier:

        async def call(way: str, items: list[tuple[bytes, object]]) -> None:
            await (tier.raw_put_many(items) if way == "raw" else tier.put_many(items))

        await asyncio.gather(*(asyncio.create_task(call(w, it)) for w, it in calls))
        last: dict[bytes, bytes] = {}
        for way, items in calls:
            for key, p in items:
                last[key] = bytes(p)[HEADER_SIZE:] if way == "raw" else p.numpy().tobytes()  # type: ignore[attr-defined]
        got = await tier.get_many(keys)
        assert [bytes(g or b"") for g in got] == [last[key] for key in keys]
        assert tier.counters["corrupt"] == 0
        assert (await tier.stats()).used_bytes == sum(len(v) + HEADER_SIZE for v in last.values())

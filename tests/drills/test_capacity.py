"""Capacity drills: LMDB map at its maximum, a full disk, and a CPU tier whose every slot is pinned.

The full disk is a small tmpfs mounted for the test (root only). Where mounting is refused the
disk-full drills fall back to an LMDB map capped at a small size (reason printed), which takes
the same refusal path inside the tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.drills._util import NS, block_hash, check_payload, payload, report, small_fs, wait_jobs
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, PipelineConfig, PolicyRule
from tieredkv.errors import TierFullError
from tieredkv.pipeline import KeyState, Pipeline
from tieredkv.policy import TierPolicy

pytestmark = [pytest.mark.timeout(120)]

KiB, MiB = 1 << 10, 1 << 20


def _key(i: int) -> bytes:
    return NS.key(block_hash(i), 0)


def _fill(path: Path) -> Path:
    """Fill the filesystem holding ``path`` with a ballast file; return it."""
    ballast = path / "ballast"
    with open(ballast, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (256 * KiB))
            f.flush()
    return ballast


# ---- LMDB --------------------------------------------------------------------------------------


async def test_lmdb_map_at_its_max_with_everything_pinned_refuses_cleanly(tmp_path: Path) -> None:
    cfg = LMDBTierConfig(
        path=str(tmp_path / "env"), map_size_bytes=MiB, size_cap_bytes=1000 * KiB, max_map_size_bytes=MiB
    )
    async with LMDBTier(cfg) as tier:
        stored: list[int] = []
        for b in range(0, 400, 20):
            await tier.put_many([(_key(i), payload(i, 1, 4097)) for i in range(b, b + 20)])
            stored += range(b, b + 20)
        present = [i for i, ok in zip(stored, await tier.contains_many([_key(i) for i in stored])) if ok]
        assert present and len(present) < len(stored), "the map limit should have forced evictions"
        tier.pin_many([_key(i) for i in present])
        refused = accepted = 0
        for b in range(1000, 1200, 20):
            batch = [_key(i) for i in range(b, b + 20)]
            try:
                await tier.put_many([(k, payload(b, 1, 4097)) for k in batch])
                accepted += 1  # free pages left by earlier evictions may still take a batch
                assert all(await tier.contains_many(batch))
            except TierFullError:
                refused += 1
                assert not any(await tier.contains_many(batch)), "a refused batch left records"
        assert refused >= 1, "with every record pinned the full map must refuse"
        for i, data in zip(present, await tier.get_many([_key(i) for i in present])):
            assert data is not None and check_payload(i, data) == 1
        tier.unpin_many([_key(i) for i in present])
        await tier.put_many([(_key(i), payload(i, 1, 4097)) for i in range(2000, 2020)])
        assert all(await tier.contains_many([_key(i) for i in range(2000, 2020)]))
        st = await tier.stats()
    report(
        "capacity-lmdb-map-max",
        records=st.records,
        evictions=tier.counters["evictions"],
        batches_refused_all_pinned=refused,
        batches_accepted_all_pinned=accepted,
    )


def test_lmdb_disk_full_refuses_cleanly_then_recovers(tmp_path: Path) -> None:
    """Durable mode on a full filesystem: puts are refused (counted drops in the pipeline), reads
    keep working, and once space is freed the tier and the breaker recover by themselves."""
    with small_fs(tmp_path) as (mnt, why):
        if mnt is None:
            # Fallback: a map that cannot grow, with every stored record pinned, so nothing can be
            # evicted and the tier must refuse (TierFullError); "freeing space" is unpinning.
            print(f"disk-full drill: {why}; falling back to a small LMDB map")
            cfg = LMDBTierConfig(
                path=str(tmp_path / "env"),
                sync_mode="durable",
                map_size_bytes=4 * MiB,
                size_cap_bytes=int(3.9 * MiB),
                max_map_size_bytes=4 * MiB,
            )
        else:
            cfg = LMDBTierConfig(
                path=str(mnt / "env"),
                sync_mode="durable",
                map_size_bytes=32 * MiB,
                size_cap_bytes=24 * MiB,
                max_map_size_bytes=64 * MiB,
            )
        tier = LMDBTier(cfg)
        pol = TierPolicy([PolicyRule()], [tier.name])
        p = Pipeline([tier], pol, PipelineConfig(breaker_failures=2, breaker_reset_s=0.2, job_timeout_s=10)).start()
        try:
            job = 0
            good: list[int] = []
            for b in range(0, 40, 8):  # 40 x 64 KiB fits easily
                job += 1
                assert p.submit_put(job, [(_key(i), payload(i, 1, 64 * KiB)) for i in range(b, b + 8)])
                assert wait_jobs(p, {job})[job].ok
                good += range(b, b + 8)
            ballast = _fill(mnt) if mnt is not None else None
            pinned = [_key(i) for i in good]
            if mnt is None:
                p.pin(pinned)
            refused = 0
            errors: set[str] = set()
            for b in range(100, 400, 8):
                job += 1
                batch = [_key(i) for i in range(b, b + 8)]
                assert p.submit_put(job, [(k, payload(i, 1, 64 * KiB)) for i, k in zip(range(b, b + 8), batch)])
                r = wait_jobs(p, {job})[job]
                if not r.ok:
                    refused += 1
                    errors.add(r.error or "")
                elif mnt is None:
                    p.pin(batch)
                    pinned += batch
                if refused >= 6:
                    break
            assert refused >= 1, "a full disk (or map) must refuse some stores"
            # Reads while the disk is full are served, right, through the pipeline (a full disk is
            # a full tier: the breaker stays closed) and by the tier itself.
            bufs = [bytearray(64 * KiB) for _ in good]
            job += 1
            assert p.submit_get(job, [(_key(i), b) for i, b in zip(good, bufs)])
            r = wait_jobs(p, {job})[job]
            assert set(r.done) == {_key(i) for i in good}, f"{len(r.done)}/{len(good)} loaded on a full disk"
            for i, b in zip(good, bufs):
                check_payload(i, bytes(b))
            assert p.stats().lanes[tier.name].breaker_opens == 0
            direct = p.run(tier.get_many([_key(i) for i in good]), timeout=10)
            for i, data in zip(good, direct):
                assert data is not None and check_payload(i, data) == 1
            served = len(direct)
            st = p.stats()
            if ballast is not None:
                ballast.unlink()
            else:  # map variant: make room by unpinning
                p.unpin(pinned)
            recovered_after = None
            t0 = time.monotonic()
            for b in range(1000, 1400, 8):
                job += 1
                assert p.submit_put(job, [(_key(i), payload(i, 1, 64 * KiB)) for i in range(b, b + 8)])
                if wait_jobs(p, {job})[job].ok:
                    recovered_after = time.monotonic() - t0
                    break
                time.sleep(0.1)
            assert recovered_after is not None and recovered_after < 5, "no recovery after space was freed"
        finally:
            p.close()

        # Everything on disk still verifies after the episode.
        async def scrub() -> int:
            async with LMDBTier(cfg) as t2:
                keys = [i.key async for i in t2.scan()]
                got = await t2.get_many(keys)
                assert all(g is not None for g in got) and t2.counters["corrupt"] == 0
                return len(keys)

        records = asyncio.run(scrub())
    report(
        "capacity-disk-full",
        medium="tmpfs-8MiB" if mnt is not None else "small-map",
        refused_jobs=refused,
        dropped=st.dropped[tier.name],
        breaker_opens=st.lanes[tier.name].breaker_opens,
        reads_served=served,
        recovered_s=round(recovered_after, 2),
        records_verified=records,
        errors=sorted(errors)[:1],
    )


@pytest.mark.parametrize("file_batch", [None, 256 * KiB], ids=["in-lmdb", "record-files"])
async def test_lmdb_disk_full_is_tier_full(tmp_path: Path, file_batch: int | None) -> None:
    """A full disk is TierFullError, whether LMDB's commit or a record file's write meets it; a
    refused record file leaves nothing behind, and what was stored before still verifies."""
    with small_fs(tmp_path) as (mnt, why):
        if mnt is None:
            pytest.skip(f"needs a small filesystem: {why}")
        cfg = LMDBTierConfig(
            path=str(mnt / "env"),
            sync_mode="durable",
            map_size_bytes=32 * MiB,
            size_cap_bytes=24 * MiB,
            max_map_size_bytes=64 * MiB,
            file_batch_bytes=file_batch,
        )
        async with LMDBTier(cfg) as tier:
            await tier.put_many([(_key(i), payload(i, 1, 64 * KiB)) for i in range(8)])
            _fill(mnt)
            with pytest.raises(TierFullError):
                for b in range(8, 400, 8):
                    await tier.put_many([(_key(i), payload(i, 1, 64 * KiB)) for i in range(b, b + 8)])
            files = [n for n in os.listdir(mnt / "env" / "files") if n != "spare"]
            assert len(files) == (await tier.stats()).extra["record_files"]  # none half-written left
            got = await tier.get_many([_key(i) for i in range(8)])
            assert [check_payload(i, g) for i, g in enumerate(got) if g is not None] == [1] * 8


_FAST_WRITER = textwrap.dedent("""
    import asyncio, os, sys
    from tieredkv.backends.lmdb import LMDBTier
    from tieredkv.config import LMDBTierConfig
    from tieredkv.errors import TieredKVError
    from tieredkv.keys import Namespace
    ns = Namespace(model="drills/disk-full")
    async def main():
        cfg = LMDBTierConfig(path=sys.argv[1], sync_mode="fast", map_size_bytes="32MiB",
                             size_cap_bytes="24MiB", max_map_size_bytes="64MiB")
        async with LMDBTier(cfg) as t:
            for b in range(100):
                try:
                    await t.put_many([(ns.key(os.urandom(32), 0), os.urandom(64 << 10)) for _ in range(4)])
                except TieredKVError as e:
                    print("refused:", type(e).__name__, flush=True)
                    return
    asyncio.run(main())
""")


def test_lmdb_fast_mode_disk_full_is_a_refusal_not_a_crash(tmp_path: Path) -> None:
    with small_fs(tmp_path) as (mnt, why):
        if mnt is None:
            pytest.skip(f"needs a small filesystem: {why}")
        r = subprocess.run(
            [sys.executable, "-c", _FAST_WRITER, str(mnt / "env")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, f"writer died with {r.returncode} (-7 = SIGBUS): {r.stderr[-300:]}"
        assert "refused:" in r.stdout


# ---- CPU tier -------------------------------------------------------------------------------------


def test_cpu_tier_all_pinned_refuses_then_stores_after_unpin() -> None:
    # 2 segments of 64 KiB; a 4 KiB chunk takes a 4 KiB slot (the header is kept apart): 32 slots.
    cpu = CPUTier(CPUTierConfig(capacity_bytes=128 * KiB, segment_bytes=64 * KiB))
    p = Pipeline([cpu], TierPolicy([PolicyRule()], ["cpu"]), PipelineConfig(job_timeout_s=10)).start()
    try:
        held = list(range(32))
        assert p.submit_put(1, [(_key(i), payload(i, 1, 4 * KiB)) for i in held])
        assert wait_jobs(p, {1})[1].ok
        p.pin([_key(i) for i in held])  # e.g. hits accepted by the engine, about to be loaded
        new = list(range(100, 105))
        t0 = time.perf_counter()
        assert p.submit_put(2, [(_key(i), payload(i, 1, 4 * KiB)) for i in new])
        assert time.perf_counter() - t0 < 0.05, "submit must not block on a full tier"
        r = wait_jobs(p, {2})[2]
        assert not r.ok and set(r.failed) == {_key(i) for i in new} and r.done == ()
        # The pinned chunks are still served while stores are refused (no deadlock).
        bufs = [bytearray(4 * KiB) for _ in held]
        assert p.submit_get(3, [(_key(i), b) for i, b in zip(held, bufs)])
        assert len(wait_jobs(p, {3})[3].done) == len(held)
        for i, b in zip(held, bufs):
            check_payload(i, bytes(b))
        assert p.lookup([_key(i) for i in new]) == [(KeyState.MISS, None)] * len(new)
        st = p.stats()
        assert st.breakers["cpu"] == "closed", "a full tier is alive: the breaker must not open"
        assert st.dropped["cpu"] == 0
        # The refused chunks are offered again after the loads finished and unpinned them.
        p.unpin([_key(i) for i in held])
        assert p.submit_put(4, [(_key(i), payload(i, 1, 4 * KiB)) for i in new])
        r4 = wait_jobs(p, {4})[4]
        assert r4.ok and set(r4.done) == {_key(i) for i in new}
        assert all(s is KeyState.HIT for s, _ in p.lookup([_key(i) for i in new]))
        evictions = p.run(cpu.stats(), timeout=5).counters.get("evictions", 0)
        assert evictions == len(new)
    finally:
        p.close()
    report("capacity-cpu-all-pinned", slots=32, refused=len(new), stored_after_unpin=len(r4.done), evictions=evictions)

"""A full disk under the LMDB tier, met on each write path (fault injection around the real calls;
the real full disk is ``tests/drills/test_full_disk.py``): a full disk is TierFullError (alive,
counted ``disk_full``), a failing disk with room is TierUnavailableError; spares give back their
room; reads and deletions go on."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.lmdb import env as lmdb_env
from tieredkv.backends.lmdb import records as lmdb_records
from tieredkv.backends.lmdb import space as _lmdb_space
from tieredkv.config import LMDBTierConfig
from tieredkv.errors import TierFullError, TierUnavailableError
from tieredkv.format import encode_record
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload

NS = Namespace(model="lmdb-full-disk")
KiB, MiB = 1024, 1024 * 1024
SIZE = 64 * KiB


def k(i: int) -> bytes:
    return NS.key(i.to_bytes(32, "big"), 0)


def cfg(path: Path, **kw: Any) -> LMDBTierConfig:
    base: dict[str, Any] = {"path": str(path), "file_batch_bytes": 256 * KiB, "size_cap_bytes": 64 * MiB}
    return LMDBTierConfig(**{**base, **kw})


def spares(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "files" / "spare").iterdir())


def files(path: Path) -> list[str]:
    """Record files on disk (not spares)."""
    return sorted(p.name for p in (path / "files").iterdir() if p.name != "spare")


def disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """The filesystem's free space, as the tier reads it (``os.statvfs``)."""
    monkeypatch.setattr(_lmdb_space, "free_bytes", lambda path: free)
    monkeypatch.setattr(lmdb_records, "free_bytes", lambda path: free)


def failing_commits(monkeypatch: pytest.MonkeyPatch, tier: LMDBTier, error: str) -> None:
    """Every write transaction of ``tier`` fails at its commit with LMDB's ``error`` (nothing
    committed: the transaction is not begun); reads run as they are."""
    real = tier._txn

    def txn(fn: Any, write: bool = False, db: Any = None, buffers: bool = False) -> Any:
        if write:
            raise lmdb.Error(f"mdb_txn_commit: {error}")
        return real(fn, write, db, buffers)

    monkeypatch.setattr(tier, "_txn", txn)


@pytest.mark.parametrize("layout", ["in-lmdb", "record-file"])
async def test_eio_at_commit_is_a_full_disk_only_while_the_disk_has_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """LMDB reports a short write at commit (a full disk) as EIO: with less free space than the
    write needed it is TierFullError, and the stored records still read; with room on the disk it
    is an I/O error: TierUnavailableError."""
    n = 8 if layout == "record-file" else 2
    async with LMDBTier(cfg(tmp_path)) as tier:
        await tier.put_many([(k(i), payload(SIZE, i)) for i in range(n)])
        failing_commits(monkeypatch, tier, "Input/output error")
        disk(monkeypatch, 0)
        with pytest.raises(TierFullError, match="disk .* is full"):
            await tier.put_many([(k(100 + i), payload(SIZE, i)) for i in range(n)])
        assert tier.counters["disk_full"] == 1
        disk(monkeypatch, 10 << 30)
        with pytest.raises(TierUnavailableError):
            await tier.put_many([(k(100 + i), payload(SIZE, i)) for i in range(n)])
        assert tier.counters["disk_full"] == 1
        assert await tier.get_many([k(i) for i in range(n)]) == [payload(SIZE, i).numpy().tobytes() for i in range(n)]
        assert await tier.contains_many([k(100 + i) for i in range(n)]) == [False] * n
        assert len(files(tmp_path)) == (await tier.stats()).extra["record_files"]  # the refused batches' went


@pytest.mark.parametrize(
    ("err", "free", "full"),
    [
        (errno.ENOSPC, 10 << 30, True),
        (errno.EDQUOT, 10 << 30, True),
        (errno.EIO, 0, True),
        (errno.EIO, 10 << 30, False),
    ],
    ids=["ENOSPC", "EDQUOT", "EIO-no-room", "EIO-with-room"],
)
async def test_a_record_file_write_on_a_full_disk_is_tier_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, free: int, full: bool
) -> None:
    """A record file's write or sync that fails for a full disk (ENOSPC, EDQUOT, or EIO with no
    room) is TierFullError and gives back every spare; nothing is left behind."""
    async with LMDBTier(cfg(tmp_path)) as tier:
        for b in range(3):
            await tier.put_many([(k(8 * b + i), payload(SIZE, i)) for i in range(8)])
        await tier.delete_many([k(i) for i in range(16)])
        assert len(spares(tmp_path)) == 2
        real = lmdb_records.write_records

        def write(path: str, *args: Any, **kw: Any) -> None:
            real(path, *args, **kw)  # written, then its sync fails
            raise OSError(err, f"fdatasync: {errno.errorcode[err]}", path)

        monkeypatch.setattr(lmdb_records, "write_records", write)
        disk(monkeypatch, free)
        with pytest.raises(TierFullError if full else TierUnavailableError):
            await tier.put_many([(k(100 + i), payload(SIZE, i)) for i in range(8)])
        assert tier.counters["disk_full"] == int(full)
        assert len(spares(tmp_path)) == (0 if full else 1)  # (the other one was taken by the write)
        assert len(files(tmp_path)) == (await tier.stats()).extra["record_files"] == 1  # nothing left behind


async def test_a_full_disk_at_map_growth_is_tier_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = cfg(tmp_path, file_batch_bytes=None, map_size_bytes=2 * MiB, size_cap_bytes=int(1.9 * MiB))
    async with LMDBTier(small) as tier:

        def grow(self: Any, target: int) -> None:
            raise lmdb.DiskError("mdb_env_set_mapsize: No space left on device")

        monkeypatch.setattr(lmdb_env.SharedEnv, "grow_map", grow)
        with pytest.raises(TierFullError):
            for b in range(0, 64, 4):  # the map fills: it must grow
                await tier.put_many([(k(b + i), payload(60 * KiB, i)) for i in range(4)])
        assert tier.counters["disk_full"] >= 1


async def test_reads_and_lookups_go_on_while_the_disk_is_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that finds a damaged record answers a miss even when the disk cannot take the
    record's deletion (it is deleted by a later read); lookups answer."""
    async with LMDBTier(cfg(tmp_path)) as tier:
        await tier.put_many([(k(i), payload(SIZE, i)) for i in range(8)])
        bad = encode_record(k(50), payload(1000, 50))
        bad[-1] ^= 1
        await tier.raw_put_many([(k(50), bad)])
        failing_commits(monkeypatch, tier, "No space left on device")
        got = await tier.get_many([k(50), k(1)])
        assert got == [None, payload(SIZE, 1).numpy().tobytes()]
        assert tier.counters["corrupt"] == 1
        assert await tier.contains_many([k(50), k(1), k(99)]) == [True, True, False]
        assert tier.probe([k(1)]) == [True]
        monkeypatch.undo()
        assert await tier.get_many([k(50)]) == [None]
        assert await tier.contains_many([k(50)]) == [False]


async def test_a_deletion_too_large_for_a_full_disk_is_done_in_smaller_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LMDBTier(cfg(tmp_path)) as tier:
        await tier.put_many([(k(i), payload(1000, i)) for i in range(100)])
        real = tier._delete_txn

        def delete(keys: list[bytes], *args: Any) -> int:
            if len(keys) > 30:  # the pages a larger one copies do not fit
                raise TierFullError("the disk is full")
            return real(keys, *args)

        monkeypatch.setattr(tier, "_delete_txn", delete)
        assert await tier.delete_many([k(i) for i in range(100)]) == 100
        st = await tier.stats()
        assert (st.records, st.used_bytes) == (0, 0)


async def test_spares_are_kept_only_while_the_disk_has_room_to_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LMDBTier(cfg(tmp_path)) as tier:
        for b in range(4):
            await tier.put_many([(k(8 * b + i), payload(SIZE, i)) for i in range(8)])
        disk(monkeypatch, 200 * MiB)  # below the floor of free space spares may hold back
        await tier.delete_many([k(i) for i in range(8)])
        assert spares(tmp_path) == []
        disk(monkeypatch, 1 << 40)
        await tier.delete_many([k(i) for i in range(8, 16)])
        assert len(spares(tmp_path)) == 1
        disk(monkeypatch, 300 * MiB)
        await tier._run(tier._upkeep_sync)
        assert len(spares(tmp_path)) == 1  # 300 MiB free: room for a 512 KiB spare
        disk(monkeypatch, 100 * MiB)
        await tier._run(tier._upkeep_sync)  # a sweep finds the disk short: the spare goes
        assert spares(tmp_path) == [] and tier.counters["spares_given_back"] == 1


def test_disk_full_tells_a_full_disk_from_a_failing_one(tmp_path: Path) -> None:
    full = _lmdb_space.disk_full
    assert full(OSError(errno.ENOSPC, "x"), str(tmp_path))
    assert full(OSError(errno.EDQUOT, "x"), str(tmp_path))
    assert full(lmdb.DiskError("mdb_txn_commit: No space left on device"), str(tmp_path))
    assert full(lmdb.Error(f"mdb_txn_commit: {os.strerror(errno.EDQUOT)}"), str(tmp_path))
    eio = lmdb.Error("mdb_txn_commit: Input/output error")
    assert not full(eio, str(tmp_path))  # this disk has room
    assert full(eio, str(tmp_path), need=1 << 60)  # no disk has this much free
    assert not full(OSError(errno.EACCES, "x"), str(tmp_path))
    assert not full(lmdb.MapFullError("mdb_put: MDB_MAP_FULL"), str(tmp_path))

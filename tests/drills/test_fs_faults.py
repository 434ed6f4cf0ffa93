"""Drills: the ``fs`` tier when its medium misbehaves — a full filesystem, a read-only mount, no
permission, a stale NFS handle, a ledger another node holds, planted files, bad config — each a
clear error, counted, stores refused, reads going on, no partial record visible.

The filesystems are real (a tmpfs of a few MiB mounted for the drill, remounted read-only); a
fault the kernel here cannot produce (``ESTALE``: no NFS) is injected around the real call.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.drills._util import payload, report, skey, small_fs
from tieredkv.backends.fs import FSTier, FSTierConfig
from tieredkv.backends.fs import records as fs_records
from tieredkv.backends.fs.layout import Layout, host_token
from tieredkv.errors import ConfigError, TierFullError, TierTimeoutError, TierUnavailableError
from tieredkv.format import HEADER_SIZE

KiB, MiB = 1024, 1024 * 1024


def tier(path: Path, **kw: Any) -> FSTier:
    return FSTier(FSTierConfig(path=str(path), **{"size_cap_bytes": "64MiB", **kw}))


def mounted(tmp_path: Path, size: str) -> Any:
    ctx = small_fs(tmp_path, size)
    mnt, why = ctx.__enter__()
    if mnt is None:
        ctx.__exit__(None, None, None)
        pytest.skip(f"needs a filesystem of its own: {why}")
    return ctx, mnt


def test_full_filesystem_refuses_stores_counts_them_and_reads_go_on(tmp_path: Path) -> None:
    ctx, mnt = mounted(tmp_path, "4m")
    try:

        async def run() -> dict[str, int]:
            async with tier(mnt / "d") as t:
                kept = [(skey(i), payload(i, 1, 256 * KiB)) for i in range(4)]
                await t.put_many(kept)
                refused = 0
                for i in range(4, 40):  # the cap (64 MiB) is far above what the disk holds
                    try:
                        await t.put_many([(skey(i), payload(i, 1, 256 * KiB))])
                    except TierFullError as e:
                        assert "filesystem is full" in str(e)
                        refused += 1
                assert refused > 0
                assert await t.get_many([k for k, _ in kept]) == [p for _, p in kept]
                assert Layout(str(mnt / "d")).temps() == [], "a refused write left its temporary file"
                st = await t.stats()
                on_disk = sum([r.size + 64 async for r in t.scan()])
                assert st.used_bytes == on_disk, "a refused write stayed counted in the ledger"
                # room made: stores work again
                await t.delete_many([k for k, _ in kept])
                await t.put_many([(skey(99), payload(99, 1, 256 * KiB))])
                return {"refused": refused, "disk_full": t.counters["disk_full"]}

        got = asyncio.run(run())
    finally:
        ctx.__exit__(None, None, None)
    report("fs_full_disk", **got)
    assert got["disk_full"] == got["refused"]


def test_read_only_mount_refuses_stores_and_serves_reads(tmp_path: Path) -> None:
    ctx, mnt = mounted(tmp_path, "16m")
    try:
        items = [(skey(i), payload(i, 1, 100 * KiB)) for i in range(6)]

        async def seed() -> None:
            async with tier(mnt / "d") as t:
                await t.put_many(items[:3])

        async def run() -> int:
            async with tier(mnt / "d") as ro:
                with pytest.raises(TierUnavailableError, match="read-only"):
                    await ro.put_many(items[3:])
                with pytest.raises(TierUnavailableError, match="read-only"):
                    await ro.delete_many([items[0][0]])
                assert await ro.get_many([k for k, _ in items]) == [p for _, p in items[:3]] + [None] * 3
                assert (await ro.stats()).records == 3
                assert [r.key async for r in ro.scan()] != []
                return ro.counters["refused_stores"]

        asyncio.run(seed())
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, timeout=10)
        refused = asyncio.run(run())
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=False, timeout=10)
        ctx.__exit__(None, None, None)
    report("fs_read_only", refused=refused)
    assert refused == 2


NOBODY = """
import asyncio, os, sys
sys.path.insert(0, {repo!r})
from tests.drills._util import payload, skey
from tieredkv.backends.fs import FSTier, FSTierConfig
import tieredkv.backends.fs.tier
from tieredkv.errors import TierUnavailableError
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # everything imported: now the user of another node, who may only read
async def main():
    async with FSTier(FSTierConfig(path={path!r})) as t:
        got = await t.get_many([skey(i) for i in range(3)])
        assert got == [payload(i, 1, 4096) for i in range(3)], "reads failed"
        try:
            await t.put_many([(skey(9), b"x" * 10)])
        except TierUnavailableError as e:
            print("REFUSED", "Permission denied" in str(e), t.counters["refused_stores"])
asyncio.run(main())
"""


def test_permission_denied_refuses_stores_and_serves_reads(tmp_path: Path) -> None:
    """A node whose user may read the directory but not write it (another user's tree)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the other node as another user (nobody)")
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's tmp_path is root's alone)
    os.chmod(top, 0o755)
    d = top / "d"
    asyncio.run(_seed(d))
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", NOBODY.format(repo=repo, path=str(d))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    shutil.rmtree(top, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["REFUSED", "True", "1"], out.stdout + out.stderr[-2000:]
    report("fs_permission_denied", refused=1, reads_ok=3)


def test_stale_nfs_handle_on_read_is_a_counted_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ESTALE (the file was removed on another NFS client): injected around the real open."""
    real = fs_records._open_record
    stale: set[str] = set()

    def opener(path: str, passive: bool) -> int:
        if path in stale:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), path)
        return real(path, passive)

    monkeypatch.setattr(fs_records, "_open_record", opener)

    async def run() -> None:
        async with tier(tmp_path / "d") as t:
            items = [(skey(i), payload(i, 1, 8192)) for i in range(4)]
            await t.put_many(items)
            stale.add(t.layout.record_path(items[1][0]))
            got = await t.get_many([k for k, _ in items])
            assert got == [items[0][1], None, items[2][1], items[3][1]]
            assert t.counters["stale_handles"] == 1 and t.counters["corrupt"] == 0
            assert await t.raw_get_many([items[1][0]]) == [None]

    asyncio.run(run())


HOLDER = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.lockf(fd, fcntl.LOCK_EX);"
    " print('HELD', flush=True); sys.stdin.read()"
)


def test_a_ledger_held_elsewhere_refuses_the_store_within_the_timeout(tmp_path: Path) -> None:
    """Another node holds the usage ledger's lock and never lets go: the store is refused after
    ``lock_timeout_s`` (counted), reads go on; once it lets go, stores work."""
    d = tmp_path / "d"
    asyncio.run(_seed(d))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            str(Layout(str(d)).ledger),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"

        async def run() -> int:
            async with tier(d, lock_timeout_s=0.3) as t:
                t0 = time.monotonic()
                with pytest.raises(TierTimeoutError, match="usage ledger"):
                    await t.put_many([(skey(50), payload(50, 1, 4096))])
                assert time.monotonic() - t0 < 30  # refused, not hung (0.3 s asked; a busy box is slow)
                assert await t.get_many([skey(0)]) == [payload(0, 1, 4096)]
                assert holder.stdin is not None
                holder.stdin.close()
                holder.wait(timeout=30)
                await t.put_many([(skey(50), payload(50, 1, 4096))])
                return t.counters["ledger_busy"]

        assert asyncio.run(run()) == 1
    finally:
        holder.kill()
        holder.wait()


async def _seed(d: Path) -> None:
    async with tier(d) as t:
        await t.put_many([(skey(i), payload(i, 1, 4096)) for i in range(3)])


def test_planted_files_are_never_records(tmp_path: Path) -> None:
    """A symlink at a record's name is not followed (a miss, counted); names of the wrong shape,
    or in the wrong fan-out directory, are not listed; nothing of theirs is read."""
    d = tmp_path / "d"
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4096)

    async def run() -> None:
        async with tier(d) as t:
            await t.put_many([(skey(i), payload(i, 1, 4096)) for i in range(3)])
            p0 = Path(t.layout.record_path(skey(0)))
            p0.unlink()
            p0.symlink_to(secret)
            other = Path(t.layout.record_path(skey(1)))
            (other.parent / "zz.kv").write_bytes(b"junk")  # not hex
            wrong_dir = Path(t.layout.record_path(skey(5))).parent
            wrong_dir.mkdir(parents=True, exist_ok=True)
            # skey(2)'s name in skey(5)'s fan-out directory (unless they share it)
            if wrong_dir != Path(t.layout.record_path(skey(2))).parent:
                (wrong_dir / Path(t.layout.record_path(skey(2))).name).write_bytes(b"x" * 100)
            assert await t.get_many([skey(0), skey(1)]) == [None, payload(1, 1, 4096)]
            assert t.counters["not_a_record"] == 1
            assert await t.contains_many([skey(0)]) == [False]
            listed = {r.key async for r in t.scan()}
            assert listed == {skey(1), skey(2)}
            assert secret.read_bytes() == b"s" * 4096

    asyncio.run(run())


def test_temporary_files_are_swept_by_owner_and_age(tmp_path: Path) -> None:
    """A dead writer of this host: swept at once; another host's: only once older than
    ``temp_max_age_s``; a live writer's: never."""
    d = tmp_path / "d"
    asyncio.run(_seed(d))
    lay = Layout(str(d))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    files = {
        "dead_here": f"{host_token()}-{dead_pid}-1.1.100.tmp",
        "live_here": f"{host_token()}-{os.getpid()}-{_start(os.getpid())}.1.100.tmp",
        "old_elsewhere": "0123456789abcdef-42-42.1.100.tmp",
        "new_elsewhere": "0123456789abcdef-43-43.1.100.tmp",
        "old_unnamed": "stray.tmp",
    }
    for name in files.values():
        (Path(lay.tmp) / name).write_bytes(b"x" * 100)
    old = time.time() - 3600
    for k in ("old_elsewhere", "old_unnamed"):
        os.utime(Path(lay.tmp) / files[k], (old, old))

    async def run() -> int:
        async with tier(d, temp_max_age_s=600) as t:
            return t.counters["temps_swept"]

    swept = asyncio.run(run())
    left = sorted(p.name for p in Path(lay.tmp).iterdir())
    assert left == sorted([files["live_here"], files["new_elsewhere"]])
    assert swept == 3


def _start(pid: int) -> int:
    from tieredkv.backends.fs.layout import _start_time

    got = _start_time(pid)
    assert got is not None
    return got


def test_bad_config_and_foreign_directories_name_the_field(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")

    async def open_at(p: Path) -> None:
        async with tier(p):
            pass

    with pytest.raises(ConfigError, match=r"tiers\.fs\.path: .*cannot hold an fs tier"):
        asyncio.run(open_at(afile))
    other = tmp_path / "other"
    other.mkdir()
    (other / "FSTIER").write_text('{"format": "something-else"}')
    with pytest.raises(ConfigError, match=r"tiers\.fs\.path: .* is not a tieredkv fs tier"):
        asyncio.run(open_at(other))
    with pytest.raises(ValueError, match="sync_mode"):
        FSTierConfig(path=str(tmp_path), sync_mode="sometimes")  # type: ignore[arg-type]


def test_a_batch_that_meets_a_full_filesystem_stores_nothing(tmp_path: Path) -> None:
    """All or nothing, as the tier contract says: a batch whose later records meet ENOSPC leaves
    none of its records, and none of its bytes counted."""
    ctx, mnt = mounted(tmp_path, "2m")
    try:

        async def run() -> None:
            async with tier(mnt / "d") as t:
                batch = [(skey(i), payload(i, 1, 384 * KiB)) for i in range(8)]  # 3 MiB: the 2 MiB disk fills midway
                with pytest.raises(TierFullError, match="filesystem is full"):
                    await t.put_many(batch)
                assert await t.contains_many([k for k, _ in batch]) == [False] * 8
                assert [r async for r in t.scan()] == []
                assert (await t.stats()).used_bytes == 0
                assert Layout(str(mnt / "d")).temps() == []
                await t.put_many(batch[:2])  # and the disk takes a smaller one
                assert await t.get_many([k for k, _ in batch[:2]]) == [p for _, p in batch[:2]]

        asyncio.run(run())
    finally:
        ctx.__exit__(None, None, None)


def test_a_huge_file_at_a_records_name_is_never_read_whole(tmp_path: Path) -> None:
    """A file larger than any record the tier can hold (planted, or grown by something else) at a
    record's name: a load is a counted miss that allocates nothing for it, an admin read gets a
    bounded prefix that no check takes for a record, a repair leaves it (it is not the bytes read)
    and every other record reads on."""
    d = tmp_path / "d"
    cap = 1 << 20

    async def run() -> None:
        async with tier(d, size_cap_bytes=cap) as t:
            await t.put_many([(skey(i), payload(i, 1, 4096)) for i in range(2)])
            huge = Path(t.layout.record_path(skey(0)))
            with open(huge, "r+b") as f:  # noqa: ASYNC230 - a sparse file: no data written
                f.truncate(8 << 30)  # 8 GiB, sparse
            assert await t.get_many([skey(0), skey(1)]) == [None, payload(1, 1, 4096)]
            assert t.counters["corrupt"] == 1
            (raw,) = await t.raw_get_many([skey(0)])
            assert raw is not None and len(raw) == cap + HEADER_SIZE + 1
            assert t.check_record(raw, skey(0)) is not None
            assert await t.delete_if_same([(skey(0), raw)]) == 0  # not the bytes read: kept
            assert huge.stat().st_size == 8 << 30

    asyncio.run(run())

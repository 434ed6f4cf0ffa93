"""Drills: one ``fs`` tier directory shared by several processes standing in for nodes (writers,
readers, evictors, a writer SIGKILLed mid-write), on a local directory and, where this machine
can mount one, over NFS.

Every other process is a real one (``_fs_node.py``); the parent waits for their lines and for
files to appear, never for wall time. Each drill prints a ``DRILL`` line with its figures.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.drills._util import Child, check_payload, payload, report, skey, small_fs
from tieredkv.backends.fs import FSTier, FSTierConfig
from tieredkv.backends.fs.layout import Layout

NODE = str(Path(__file__).with_name("_fs_node.py"))
KiB, MiB = 1024, 1024 * 1024
WAIT_S = 180.0  # bound on a child's run on a loaded 2-core box: slow, never stuck


def nfs_reason() -> str | None:
    """Why the NFS variant cannot run here (None: it can)."""
    if os.environ.get("TIEREDKV_NFS_DIR"):
        return None
    with open("/proc/filesystems") as f:
        kinds = f.read().split()
    if "nfs" not in kinds and "nfs4" not in kinds:
        return (
            "no NFS client in this kernel (nfs is not in /proc/filesystems, and it has no modules to load);"
            " set TIEREDKV_NFS_DIR to a directory on an NFS mount to run these drills over NFS"
        )
    if os.geteuid() != 0 or shutil.which("exportfs") is None:
        return "a loopback NFS export needs root and nfs-kernel-server (exportfs); or set TIEREDKV_NFS_DIR"
    return None


@pytest.fixture(params=["local", "nfs"])
def shared_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """The directory the nodes share: a local one, or one on an NFS mount."""
    if request.param == "local":
        # a tmpfs of its own where this process may mount one: statvfs then counts what the
        # directory holds in one atomic look (see usage)
        with small_fs(tmp_path, "256m") as (mnt, _):
            yield (mnt or tmp_path) / "shared"
        return
    why = nfs_reason()
    if why is not None:
        pytest.skip(f"NFS drills: {why}")
    root = os.environ.get("TIEREDKV_NFS_DIR")
    if root:
        d = Path(root) / f"tieredkv-drill-{os.getpid()}-{time.monotonic_ns()}"
        yield d
        shutil.rmtree(d, ignore_errors=True)
        return
    yield from _loopback_nfs(tmp_path)


def _loopback_nfs(tmp_path: Path) -> Iterator[Path]:  # pragma: no cover - needs a kernel with NFS
    export, mnt = tmp_path / "export", tmp_path / "mnt"
    export.mkdir()
    mnt.mkdir()
    subprocess.run(["exportfs", "-o", "rw,sync,no_root_squash,insecure", f"127.0.0.1:{export}"], check=True)
    try:
        subprocess.run(["mount", "-t", "nfs", "-o", "vers=4.2", f"127.0.0.1:{export}", str(mnt)], check=True)
        try:
            yield mnt / "shared"
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
    finally:
        subprocess.run(["exportfs", "-u", f"127.0.0.1:{export}"], check=False)


def node(*args: object) -> Child:
    return Child([sys.executable, NODE, *map(str, args)], stdin=True)


def finish(c: Child) -> str:
    """Its last line once it exits by itself (failing on a hang, a crash or wrong bytes)."""
    try:
        rc = c.proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        c.kill()
        raise AssertionError(f"node never finished: {c.lines[-3:]}") from None
    c.reader.join(timeout=10)
    assert rc == 0, f"node exited {rc}: {c.lines[-3:]} {c.stderr()[-3000:]}"
    return c.lines[-1]


def usage_gauge(root: Path) -> tuple[str, object]:
    """How to measure what ``root`` holds: ``("statvfs", bytes used before)`` when it is alone on
    its filesystem (a tmpfs of its own), else ``("walk", None)``."""
    root.mkdir(parents=True, exist_ok=True)
    if os.stat(root).st_dev != os.stat(root.parent.parent).st_dev or os.path.ismount(root.parent):
        st = os.statvfs(root)
        return "statvfs", (st.f_blocks - st.f_bfree) * st.f_frsize
    return "walk", None


def on_disk(root: Path, gauge: tuple[str, object] = ("walk", None)) -> int:
    """Bytes the directory holds right now, records and records in the making: by statvfs (one
    atomic look) on a filesystem of its own, else by walking ``ns/`` and ``tmp/`` (not atomic:
    a record evicted after the walk passed it and its replacement written where the walk has yet
    to go are both counted, so a walk can only overstate)."""
    if gauge[0] == "statvfs":
        st = os.statvfs(root)
        base = gauge[1]
        assert isinstance(base, int)
        return (st.f_blocks - st.f_bfree) * st.f_frsize - base
    total = 0
    for sub in ("ns", "tmp"):
        for dirpath, _, files in os.walk(root / sub):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:
                    pass
    return total


def fields(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in (p.split("=") for p in line.split()[1:])}


async def read_all(path: Path) -> tuple[int, int, int]:
    """Open the directory as one more node, read every record it lists: (records, hits, corrupt)."""
    async with FSTier(FSTierConfig(path=str(path), size_cap_bytes="1GiB")) as tier:
        keys = [r.key async for r in tier.scan()]
        got = await tier.get_many(keys)
        index = {skey(i): i for i in range(256)} | {skey(i, 0): i for i in range(4096)}
        for k, data in zip(keys, got, strict=True):
            if data is not None:
                check_payload(index[k], data)
        return len(keys), sum(g is not None for g in got), tier.counters["corrupt"]


def test_store_in_one_process_load_byte_exact_in_another(shared_dir: Path) -> None:
    """Through the public engine API: a node stores and exits; this process opens the same
    directory with the same config and loads every byte."""
    import torch

    import tieredkv
    from tests.drills._fs_node import node_config

    writer = node("store", shared_dir, 24, 96 * KiB + 5)
    assert finish(writer) == "STORED 24"
    with tieredkv.open_store(node_config(str(shared_dir))) as store:
        store.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        keys = [store.key(i.to_bytes(32, "big"), 0) for i in range(24)]
        bufs = [bytearray(96 * KiB + 5) for _ in keys]
        job = store.get_records(list(zip(keys, bufs)))
        assert job is not None
        res = store.wait([job], timeout=60)[job]
        assert res.ok and len(res.done) == 24
        for i, b in enumerate(bufs):
            assert bytes(b) == payload(i, 1, 96 * KiB + 5)
    report("fs_store_load_two_processes", records=24, exact=24)


def test_two_writers_and_a_reader_evictor_hold_the_cap(shared_dir: Path) -> None:
    """Two writer nodes on one directory capped at 8 MiB, a third reading and deleting: the
    directory never holds more than 1.25x the cap, and every hit on every node is byte-exact."""
    cap = 8 * MiB
    gauge = usage_gauge(shared_dir)
    a, b = node("writer", shared_dir, cap, 1, 160), node("writer", shared_dir, cap, 2, 160)
    a.wait_ready(WAIT_S)
    b.wait_ready(WAIT_S)
    r = node("reader", shared_dir, 3)
    r.wait_ready(WAIT_S)
    peak = samples = 0
    while a.running() or b.running():
        peak = max(peak, on_disk(shared_dir, gauge))
        samples += 1
    done_a, done_b = fields(finish(a)), fields(finish(b))
    assert r.proc.stdin is not None
    r.proc.stdin.close()
    done_r = fields(finish(r))
    records, hits, corrupt = asyncio.run(read_all(shared_dir))
    line = report(
        "fs_two_writers",
        cap_mib=8,
        gauge=gauge[0],
        peak_mib=round(peak / MiB, 2),
        peak_x=round(peak / cap, 3),
        samples=samples,
        puts=done_a["puts"] + done_b["puts"],
        writer_hits=done_a["hits"] + done_b["hits"],
        reader_hits=done_r["hits"],
        left=records,
    )
    assert peak <= 1.25 * cap, line
    assert done_a["puts"] + done_b["puts"] > 200, line  # they wrote far more than the cap holds
    assert done_a["hits"] + done_b["hits"] + done_r["hits"] > 0, line
    assert corrupt == 0 and hits == records, line
    assert on_disk(shared_dir, gauge) <= cap


def test_five_sigkills_mid_write_leave_no_partial_record_and_no_temp_pile(shared_dir: Path) -> None:
    """A durable writer of 4 MiB records is SIGKILLed five times while a record is half written
    (stopped the moment its temporary file holds part of the record, then killed):
    no node ever sees a partial record, and the temporary files go (at the next open, as their
    writer is dead)."""
    lay = Layout(str(shared_dir))
    seen_partial = 0
    for _ in range(5):
        c = node("big", shared_dir)
        c.wait_ready(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while True:  # stop it while a temporary file holds some, not all, of its record's bytes
            assert c.running() and time.monotonic() < deadline, f"writer never wrote: {c.lines[-3:]}"
            if not any(partial(lay, c.proc.pid)):
                continue
            c.proc.send_signal(signal.SIGSTOP)
            if any(partial(lay, c.proc.pid)):
                break
            c.proc.send_signal(signal.SIGCONT)  # it finished that record in between: again
        seen_partial += any(partial(lay, c.proc.pid))
        c.kill()
        records, hits, corrupt = asyncio.run(read_all(shared_dir))  # opening sweeps the dead writer's files
        assert corrupt == 0 and hits == records
        assert lay.temps() == [], "a dead writer's temporary files outlived the next open"
    line = report("fs_sigkill_mid_write", kills=5, killed_mid_record=seen_partial, records=records)
    assert seen_partial == 5, line


def partial(lay: Layout, pid: int) -> list[bool]:
    """Per temporary file of process ``pid``: whether it holds some, but not all, of its record."""
    return [0 < st.st_size < n.size for _, n, st in lay.temps() if n is not None and n.pid == pid]


def test_a_record_deleted_by_one_node_while_another_reads_is_a_miss_or_whole(tmp_path: Path) -> None:
    """Node A deletes and rewrites keys while node B reads them: B gets each record whole or a
    miss, never bytes of two versions."""

    async def run() -> tuple[int, int]:
        cfg = FSTierConfig(path=str(tmp_path / "d"), size_cap_bytes="64MiB", touch_interval_s=0)
        async with FSTier(cfg) as a, FSTier(cfg) as b:
            keys = [skey(i) for i in range(16)]
            hits = misses = 0
            for seq in range(40):
                await a.put_many([(k, payload(i, seq, 200 * KiB)) for i, k in enumerate(keys)])
                dels = asyncio.ensure_future(a.delete_many(keys[seq % 2 :: 2]))
                got = await b.get_many(keys)
                await dels
                for i, g in enumerate(got):
                    if g is None:
                        misses += 1
                    else:
                        check_payload(i, g)
                        hits += 1
            assert b.counters["corrupt"] == 0
            return hits, misses

    hits, misses = asyncio.run(run())
    report("fs_delete_while_reading", hits=hits, misses=misses)
    assert hits > 0

"""Crash consistency of the LMDB tier: a writer process SIGKILLed at random points, N times.

After every kill the environment is reopened by this process and checked:

* every record verifies and holds exactly the bytes some write put there for its key (never
  another key's bytes, never a version that was not written yet) — or is absent;
* the LRU index (the ``access`` DB) agrees with the records: same keys, and ``used_bytes`` is
  the sum of their sizes; nothing was counted corrupt;
* durable mode: the last put the writer reported committed is there (nothing committed lost);
  also with record files (``-files``: puts of 16 KiB or more go to a file beside the index,
  written before the commit that names it);
  fast mode: the same is measured and reported — it may lose the last unsynced writes on a
  power loss, though a process crash alone leaves committed pages in the page cache.
* the environment takes a new write and closes cleanly.

The kills accumulate on one environment per mode, so later rounds start from crash debris.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import struct
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.drills._lmdb_writer import config
from tests.drills._util import Child, check_payload, payload, report, skey
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.cli import ops
from tieredkv.config import load_config
from tieredkv.format import HEADER_SIZE

pytestmark = [pytest.mark.timeout(150)]

WRITER = Path(__file__).with_name("_lmdb_writer.py")
KILLS = 12  # per mode
INDEX_OF = {skey(i): i for i in range(192)}


def _writer(path: Path, mode: str, seed: int, first_seq: int, *, stderr: bool = True) -> Child:
    return Child([sys.executable, str(WRITER), str(path), mode, str(seed), str(first_seq)], stderr=stderr)


def _run_and_kill(path: Path, mode: str, seed: int, first_seq: int, rng: random.Random) -> list[str]:
    """Start the writer, SIGKILL it at a random moment after it opened, return its output lines."""
    w = _writer(path, mode, seed, first_seq)
    try:
        w.wait_ready(20)
        time.sleep(rng.uniform(0.0, 0.3))
        assert w.running(), f"writer exited early ({w.proc.returncode}): {w.lines[-3:]} {w.stderr()}"
    finally:
        w.kill()
    assert w.proc.returncode == -signal.SIGKILL, (w.proc.returncode, w.lines[-3:])
    assert not any(line.startswith("BAD") for line in w.lines), [x for x in w.lines if x.startswith("BAD")]
    return w.lines


async def _verify(path: Path, mode: str, lines: list[str], first_seq: int) -> dict[str, int]:
    writes = [int(x.split()[1]) for x in lines if x.startswith("W ")]
    newest = max(writes, default=first_seq)  # no version above the last write begun can exist
    next_seq = first_seq + 9_999_999  # this check's own write; below the next round's first_seq
    last_put = next((x for x in reversed(lines) if x.startswith("P ")), None)
    async with LMDBTier(config(str(path), mode)) as tier:
        infos = [info async for info in tier.scan()]
        st = await tier.stats()
        keys = [i.key for i in infos]
        assert len(set(keys)) == len(keys)
        assert st.records == len(infos), "records DB and LRU index disagree on the number of records"
        assert st.used_bytes == sum(i.size + HEADER_SIZE for i in infos), "used_bytes is not the sum of the records"
        got = await tier.get_many(keys)
        assert all(g is not None for g in got), "a key in the LRU index has no record that verifies"
        for info, data in zip(infos, got):
            assert info.key in INDEX_OF, f"unknown key {info.key.hex()} in the environment"
            assert data is not None and len(data) == info.size
            seq = check_payload(INDEX_OF[info.key], data)  # never wrong bytes
            assert seq <= newest, f"version {seq} was never written (last write begun: {newest})"
        assert tier.counters["corrupt"] == 0, "a record failed verification after a crash"
        survived = lost = 0
        if last_put is not None:
            _, s, idx = last_put.split()
            pseq = int(s)
            deleted_after = {
                int(i)
                for x in lines[lines.index(last_put) + 1 :]
                if x.startswith("D ")
                for i in x.split()[2].split(",")
            }
            want = [int(i) for i in idx.split(",") if int(i) not in deleted_after]
            for i, data in zip(want, await tier.get_many([skey(i) for i in want])):
                if data is not None and check_payload(i, data) >= pseq:
                    survived += 1
                else:
                    lost += 1
        # A write in flight at the kill ("W" with no "P"/"D" for it) may have committed without
        # printing: a delete of one of the last put's keys, or a put's size-cap evictions. Only
        # with nothing in flight must every record of the last printed put be there.
        last_w = next((x for x in reversed(lines) if x.startswith("W ")), None)
        in_flight = (
            last_w is not None
            and (last_put is None or lines.index(last_w) > lines.index(last_put))
            and not any(x.startswith(("P ", "D ")) and x.split()[1] == last_w.split()[1] for x in lines)
        )
        if mode.startswith("durable") and not in_flight:
            assert lost == 0, f"{lost} records of the last committed put were lost in durable mode"
        # The environment is writable after the crash.
        await tier.put_many([(skey(0), payload(0, next_seq))])
        assert check_payload(0, (await tier.get_many([skey(0)]))[0]) == next_seq
    return {
        "record_files": st.extra["record_files"],
        "records": len(infos),
        "last_put_survived": survived,
        "last_put_lost": lost,
        "commits_seen": sum(1 for x in lines if x[:1] in "PD"),
    }


@pytest.mark.parametrize("mode", ["durable", "fast", "durable-files", "fast-files"])
def test_sigkilled_writer_leaves_only_verified_records(tmp_path: Path, mode: str) -> None:
    rng = random.Random(f"crash-{mode}")
    path = tmp_path / "env"
    totals = {
        "kills": 0,
        "records_checked": 0,
        "commits_seen": 0,
        "last_put_survived": 0,
        "last_put_lost": 0,
        "record_files": 0,
    }
    t0 = time.monotonic()
    for n in range(KILLS):
        first = (n + 1) * 10_000_000
        lines = _run_and_kill(path, mode, seed=rng.randrange(1 << 30), first_seq=first, rng=rng)
        res = asyncio.run(_verify(path, mode, lines, first))
        totals["kills"] += 1
        totals["records_checked"] += res["records"]
        for k in ("commits_seen", "last_put_survived", "last_put_lost", "record_files"):
            totals[k] += res[k]
    assert totals["commits_seen"] > KILLS, "the writer should commit something before most kills"
    # with -files, records in record files were there after the kills (and all verified above)
    assert (totals["record_files"] > 0) == mode.endswith("-files")
    report(f"lmdb-crash[{mode}]", **totals, seconds=round(time.monotonic() - t0, 1))


# ---- a SIGKILL storm: several record-file writers on one directory ------------------------------

STORM_WRITERS = 3
STORM_KILLS = 18


def _on_disk(path: Path) -> dict[str, Any]:
    """What the directory holds, read as any process sees it: the record files the files DB names
    and the records it counts in each, the records each file holds by the access entries, and
    the record files on disk (not spares)."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=True)
    try:
        acc = env.open_db(b"access", create=False)
        files = env.open_db(b"files", create=False)
        with env.begin() as txn:
            counted = {bytes(t).hex(): struct.unpack("<Q", v)[0] for t, v in txn.cursor(db=files)}
            held: Counter[str] = Counter()
            for v in txn.cursor(db=acc).iternext(keys=False):
                if len(v) == 40:  # stamp, size, file token, offset: a record in a record file
                    held[bytes(v[16:32]).hex()] += 1
    finally:
        env.close()
    disk = {n for n in os.listdir(path / "files") if n != "spare"}
    return {"counted": counted, "held": dict(held), "disk": disk}


@pytest.mark.parametrize("mode", ["fast-files", "durable-files"])
def test_a_sigkill_storm_on_record_file_writers_leaves_every_record_verified(tmp_path: Path, mode: str) -> None:
    """Three writer processes with record files on share one directory; one at a time, at random
    moments, a writer is SIGKILLed and a new one started (its open sweeps while the others
    write), 18 times, then all are. Afterwards: every record verifies with the bytes some write
    put there for its key (a version some writer began) or is absent; the files DB counts
    exactly the records each file holds and every named file is on disk; used bytes are the sum
    of the records; the sweep of the next open leaves no file no record names; nothing is
    counted corrupt, by reads or by ``verify``."""
    rng = random.Random(f"storm-{mode}")
    path = tmp_path / "env"
    t0 = time.monotonic()
    started = 0
    live: list[Child] = []
    outputs: list[list[str]] = []

    def start() -> None:
        nonlocal started
        started += 1
        live.append(_writer(path, mode, rng.randrange(1 << 30), started * 10_000_000, stderr=False))

    try:
        for _ in range(STORM_WRITERS):
            start()
        for _ in range(STORM_KILLS):
            deadline = time.monotonic() + 30
            while not all(w.ready.is_set() for w in live):
                assert time.monotonic() < deadline, "a writer did not open the tier"
                assert all(w.running() for w in live), "a writer exited early"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            w = live.pop(rng.randrange(len(live)))
            w.kill()
            assert w.proc.returncode == -signal.SIGKILL, (w.proc.returncode, w.lines[-3:])
            outputs.append(w.lines)
            start()
    finally:
        for w in live:
            w.kill()
            outputs.append(w.lines)
    assert not [x for lines in outputs for x in lines if x.startswith("BAD")]
    begun = {int(x.split()[1]) for lines in outputs for x in lines if x.startswith("W ")}
    commits = sum(1 for lines in outputs for x in lines if x[:1] in "PD")
    before = _on_disk(path)
    orphans = len(before["disk"] - before["counted"].keys())

    async def check() -> dict[str, int]:
        async with LMDBTier(config(str(path), mode)) as tier:  # its open sweeps
            infos = [info async for info in tier.scan()]
            st = await tier.stats()
            got = await tier.get_many([i.key for i in infos])
            for info, data in zip(infos, got):
                assert info.key in INDEX_OF, f"unknown key {info.key.hex()}"
                assert data is not None, f"key {INDEX_OF[info.key]} is listed but does not verify"
                assert len(data) == info.size
                seq = check_payload(INDEX_OF[info.key], data)  # never wrong bytes
                assert seq in begun, f"key {INDEX_OF[info.key]} holds version {seq}, which no writer began"
            assert st.records == len(infos)
            assert st.used_bytes == sum(i.size + HEADER_SIZE for i in infos), "used bytes are not the records' sum"
            assert tier.counters["corrupt"] == 0
            return {"records": len(infos), "swept": tier.counters["orphan_files_removed"]}

    res = asyncio.run(check())
    after = _on_disk(path)  # (after the open's sweep; LMDB lets one process open an environment once)
    assert after["counted"] == after["held"], "the files DB does not count the records each file holds"
    assert after["disk"] == set(after["counted"]), (
        f"unnamed files survived the sweep: {sorted(after['disk'] - set(after['counted']))[:3]};"
        f" named files missing: {sorted(set(after['counted']) - after['disk'])[:3]}"
    )
    cfg = load_config(
        {"tiers": [{"kind": "lmdb", "name": "disk", **config(str(path), mode).model_dump(exclude_none=True)}]}
    )
    verified = asyncio.run(ops.verify(cfg, None, None, None))
    assert verified.corrupt == [] and verified.tiers[0].ok == res["records"], verified
    assert res["records"] > 0 and commits > STORM_KILLS
    report(
        f"lmdb-sigkill-storm[{mode}]",
        writers=STORM_WRITERS,
        kills=STORM_KILLS + STORM_WRITERS,
        commits_seen=commits,
        orphans_left=orphans,
        orphans_swept=res["swept"],
        records_verified=res["records"],
        record_files=len(after["counted"]),
        seconds=round(time.monotonic() - t0, 1),
    )

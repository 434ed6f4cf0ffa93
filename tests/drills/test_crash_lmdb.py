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
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.drills._lmdb_writer import config
from tests.drills._util import check_payload, payload, report, skey
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.format import HEADER_SIZE

pytestmark = [pytest.mark.timeout(150)]

WRITER = Path(__file__).with_name("_lmdb_writer.py")
KILLS = 12  # per mode
INDEX_OF = {skey(i): i for i in range(192)}


def _run_and_kill(path: Path, mode: str, seed: int, first_seq: int, rng: random.Random) -> list[str]:
    """Start the writer, SIGKILL it at a random moment after it opened, return its output lines."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), mode, str(seed), str(first_seq)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("READY"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(20), f"writer did not open the tier: {proc.stderr.read() if proc.poll() is not None else ''}"
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, f"writer exited early ({proc.returncode}): {lines[-3:]} {proc.stderr.read()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, lines[-3:])
    assert not any(line.startswith("BAD") for line in lines), [x for x in lines if x.startswith("BAD")]
    return lines


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

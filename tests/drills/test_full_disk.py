"""A full disk under an LMDB tier with record files, through the pipeline: the tier stays alive.

A 48 MiB tmpfs (root only) holds an LMDB tier whose size cap (64 MiB) is above the disk, with
record files on (write batches of 16 KiB or more go to a file beside the index). An engine
(``tieredkv.open_store``) stores 200 keys, then stores new ones, and stores some of them again,
until the disk is full: LMDB's commit then meets the full disk as ENOSPC or as EIO (a short write),
a record file's write as ENOSPC.

* Every store the disk cannot take is refused (the job fails, nothing acknowledged is missing,
  nothing refused is there) and counted (``disk_full``); the breaker stays closed.
* All 200 old keys are found and load with the right bytes all through the full window and after
  it (before: the commit's EIO was an outage, the breaker opened, 0 of 200 loaded for its window).
* Once space is freed stores succeed again; ``tieredkv evict --to-size 8MiB`` then frees the disk
  for real: no spare record file keeps what it freed (before: 4 spares held 32 MiB of the 48).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.drills._util import block_hash, check_payload, payload, report, small_fs
from tieredkv import open_store
from tieredkv.config import load_config
from tieredkv.pipeline import KeyState

pytestmark = [pytest.mark.timeout(120)]

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parents[2]
OLD = range(200)
SIZES = (4 * KiB, 16 * KiB, 64 * KiB)
REFUSALS = 40  # refused store jobs in the full window


def size_of(i: int) -> int:
    return SIZES[i % len(SIZES)]


def settings(path: Path) -> dict[str, Any]:
    return {
        "namespace": {"model": "drills/full-disk"},
        "tiers": [
            {
                "kind": "lmdb",
                "name": "disk",
                "path": str(path),
                "sync_mode": "fast",
                "map_size_bytes": "128MiB",
                "size_cap_bytes": "64MiB",  # above the 48 MiB disk
                "max_map_size_bytes": "256MiB",
                "file_batch_bytes": "32KiB",
            }
        ],
        # one failure opens the breaker (for 5 s): a full disk taken for an outage shows at once
        "pipeline": {"breaker_failures": 1, "breaker_reset_s": 5, "job_timeout_s": 20, "staging_bytes": "32MiB"},
    }


def disk_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class Engine:
    def __init__(self, path: Path) -> None:
        self.store = open_store(load_config(settings(path), env={}))
        self.tier = self.store.tiers[0]

    def key(self, i: int) -> bytes:
        return self.store.key(block_hash(i), 0)

    def put(self, ids: list[int], seq: int) -> Any:
        job = self.store.put_records([(self.key(i), payload(i, seq, size_of(i))) for i in ids])
        assert job is not None
        return self.store.wait([job], timeout=30)[job]

    def load(self, ids: list[int]) -> dict[int, int]:
        """Load ``ids``; the version each loaded (wrong bytes fail the drill)."""
        bufs = [bytearray(size_of(i)) for i in ids]
        job = self.store.get_records([(self.key(i), b) for i, b in zip(ids, bufs)])
        assert job is not None
        done = set(self.store.wait([job], timeout=30)[job].done)
        return {i: check_payload(i, bytes(b)) for i, b in zip(ids, bufs) if self.key(i) in done}

    def found(self, ids: list[int]) -> int:
        return sum(state is KeyState.HIT for state, _ in self.store.lookup([self.key(i) for i in ids]))

    def breaker(self) -> tuple[str, int]:
        st = self.store.stats()
        return st.breakers["disk"], st.lanes["disk"].breaker_opens

    def counters(self) -> Any:
        return self.store.run(self.tier.stats(), timeout=10).counters


def test_a_full_disk_refuses_stores_and_keeps_every_old_key_loading(tmp_path: Path) -> None:
    with small_fs(tmp_path, "48m") as (mnt, why):
        if mnt is None:
            pytest.skip(f"needs a 48 MiB tmpfs (mount -t tmpfs, root only): {why}")
        env = mnt / "env"
        eng = Engine(env)
        t0 = time.monotonic()
        try:
            for b in range(0, len(OLD), 8):
                assert eng.put(list(OLD[b : b + 8]), 1).ok
            assert eng.load(list(OLD)) == {i: 1 for i in OLD}

            # Fill the disk: new keys, and now and then a batch stored again (its old file's
            # records all go: the file is retired, a spare a later batch writes over).
            rng = random.Random(41)
            stored: dict[int, int] = {}  # key -> version acknowledged
            batches: list[list[int]] = []
            refused = jobs = 0
            refused_keys: set[int] = set()
            loads_in_window: list[int] = []
            lookups_in_window: list[int] = []
            nxt = 1000
            while refused < REFUSALS:
                jobs += 1
                assert jobs < 2000, "the disk never filled"
                if batches and jobs % 3 == 0:
                    ids, seq = rng.choice(batches), 2 + jobs
                else:
                    n = rng.randint(1, 8)
                    ids, seq = list(range(nxt, nxt + n)), 1
                    nxt += n
                r = eng.put(ids, seq)
                done = {eng.key(i) for i in ids} & set(r.done)
                for i in ids:
                    if eng.key(i) in done:
                        stored[i] = seq
                    else:
                        refused_keys.add(i)
                if r.ok:
                    if seq == 1:
                        batches.append(ids)
                    continue
                refused += 1
                if refused % 5 == 0:  # during the full window: every old key is there and loads
                    lookups_in_window.append(eng.found(list(OLD)))
                    loads_in_window.append(len(eng.load(list(OLD))))
            full_used = disk_used(mnt)
            counted = eng.counters()
            window = f"old keys found {lookups_in_window}, loaded {loads_in_window} of {len(OLD)}"
            assert eng.breaker() == ("closed", 0), f"the breaker opened on a full disk; {window}"
            assert lookups_in_window == [len(OLD)] * len(lookups_in_window), window
            assert loads_in_window == [len(OLD)] * len(loads_in_window), window
            assert counted.get("disk_full", 0) >= 1, "the refusals were not counted as a full disk"
            # acknowledged stores are there with their bytes; refused ones left nothing new
            new = sorted(stored)
            assert eng.load(new) == stored
            never = sorted(refused_keys - stored.keys())
            assert eng.found(never) == 0, "a refused store left a record"

            # End the window: free space by deleting the new keys; stores succeed again.
            eng.store.run(eng.tier.delete_many([eng.key(i) for i in new]), timeout=30)
            assert eng.put([9_000_000 + i for i in range(8)], 1).ok
            assert eng.load(list(OLD)) == {i: 1 for i in OLD}
            assert eng.breaker() == ("closed", 0)

            # Fill again, then `tieredkv evict --to-size 8MiB` from another process.
            nxt = 10_000_000
            while eng.put(list(range(nxt, nxt + 8)), 1).ok:
                nxt += 8
            before_evict = disk_used(mnt)
            cfg_file = tmp_path / "tieredkv.yaml"
            cfg_file.write_text(yaml.safe_dump(settings(env)))
            r = subprocess.run(
                [sys.executable, "-m", "tieredkv.cli", "evict", "-c", str(cfg_file), "--to-size", "8MiB", "--json"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=60,
                check=False,
            )
            assert r.returncode == 0, r.stderr[-2000:]
            row = json.loads(r.stdout)["tiers"][0]
            assert row["remaining_bytes"] <= 8 * MiB and row["evicted"] > 0
            spares = os.listdir(env / "files" / "spare")
            st = eng.store.run(eng.tier.stats(), timeout=10)
            after_evict = disk_used(mnt)
            index = os.stat(env / "data.mdb").st_blocks * 512
            # records left, the index, and the blocks punched records share with neighbours
            assert spares == [], f"spares keep what evict freed: {spares}"
            assert after_evict <= st.used_bytes + index + 8 * KiB * st.records + 1 * MiB, (after_evict, st)
            assert eng.put([20_000_000 + i for i in range(8)], 1).ok
            assert eng.breaker() == ("closed", 0)
            counted = eng.counters()
        finally:
            eng.store.close()
    report(
        "lmdb-full-disk",
        store_jobs=jobs,
        refused_jobs=refused,
        disk_full=counted["disk_full"],
        spares_given_back=counted.get("spares_given_back", 0),
        old_keys_found_in_window=f"{min(lookups_in_window)}/{len(OLD)}",
        old_keys_loaded_in_window=f"{min(loads_in_window)}/{len(OLD)}",
        breaker_opens=0,
        disk_used_full_mib=round(full_used / MiB, 1),
        disk_used_before_evict_mib=round(before_evict / MiB, 1),
        disk_used_after_evict_mib=round(after_evict / MiB, 1),
        spares_after_evict=len(spares),
        seconds=round(time.monotonic() - t0, 1),
    )

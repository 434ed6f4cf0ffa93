"""Child process of the LMDB crash drill: writes, overwrites, deletes and reads until killed.

Usage: ``python _lmdb_writer.py PATH MODE SEED FIRST_SEQ [SECONDS]``. Prints ``READY`` once the
tier is open, ``W <seq>`` before each write and ``P <seq> <i,i,...>`` / ``D <seq> <i,...>`` after
each committed put / delete, flushing every line, so the parent knows what was committed when its
SIGKILL landed; ``E <seq> <i,...>`` (before its ``P``) names the records a put evicted to fit
under the cap. Exits by itself after SECONDS (20; never left running) with ``DONE corrupt=<n>``
(records its reads found damaged), and with code 3 if a read ever returns wrong bytes.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.drills._util import check_payload, payload, skey
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import LMDBTierConfig

KEYSPACE = 192


def config(path: str, mode: str) -> LMDBTierConfig:
    """``mode``: ``durable`` or ``fast`` (the sync mode), with ``-files``: puts of 16 KiB or more
    go to record files beside the index (else the default, which keeps these small puts in LMDB)."""
    # ~1.2 MiB of live data over a 1 MiB cap: puts evict regularly; a small first map grows.
    sync, _, layout = mode.partition("-")
    files = {"file_batch_bytes": "16KiB"} if layout == "files" else {}
    return LMDBTierConfig(
        path=path, sync_mode=sync, map_size_bytes="2MiB", size_cap_bytes="1MiB", max_map_size_bytes="64MiB", **files
    )


INDEX = {skey(i): i for i in range(KEYSPACE)}


def report_evictions(tier: LMDBTier, seq: list[int]) -> None:
    """Print ``E <seq> <i,...>`` for the records each of the tier's writes evicts (an observer on
    the tier's own bookkeeping: it changes nothing)."""
    after = tier._after_evictions

    def observed(evicted: dict[bytes, int]) -> None:
        gone = [INDEX[k] for k, size in evicted.items() if size and k in INDEX]  # (size 0: gone already)
        if gone:
            print(f"E {seq[0]} {','.join(map(str, gone))}", flush=True)
        after(evicted)

    tier._after_evictions = observed  # type: ignore[method-assign]


async def main(path: str, mode: str, seed: int, seq: int, seconds: float = 20) -> int:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    now = [seq]
    async with LMDBTier(config(path, mode)) as tier:
        report_evictions(tier, now)
        print("READY", flush=True)
        op = 0
        while time.monotonic() < deadline:
            op += 1
            seq += 1
            now[0] = seq
            if op % 6 == 0:
                idx = rng.sample(range(KEYSPACE), rng.randint(1, 3))
                print(f"W {seq}", flush=True)
                await tier.delete_many([skey(i) for i in idx])
                print(f"D {seq} {','.join(map(str, idx))}", flush=True)
            elif op % 4 == 0:
                idx = rng.sample(range(KEYSPACE), 8)
                for i, got in zip(idx, await tier.get_many([skey(i) for i in idx])):
                    if got is not None:
                        try:
                            check_payload(i, got)
                        except AssertionError as e:
                            print(f"BAD {e}", flush=True)
                            return 3
            else:
                idx = rng.sample(range(KEYSPACE), rng.randint(1, 8))
                print(f"W {seq}", flush=True)
                await tier.put_many([(skey(i), payload(i, seq)) for i in idx])
                print(f"P {seq} {','.join(map(str, idx))}", flush=True)
        print(f"DONE corrupt={tier.counters['corrupt']}", flush=True)
    return 0


if __name__ == "__main__":
    seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 20
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), seconds)))

"""Child process of the LMDB crash drill: writes, overwrites, deletes and reads until killed.

Usage: ``python _lmdb_writer.py PATH MODE SEED FIRST_SEQ``. Prints ``READY`` once the tier is
open, ``W <seq>`` before each write and ``P <seq> <i,i,...>`` / ``D <seq> <i,...>`` after each
committed put / delete, flushing every line, so the parent knows what was committed when its
SIGKILL landed. Exits by itself after 20 s (never left running) and with code 3 if a read ever
returns wrong bytes.
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


async def main(path: str, mode: str, seed: int, seq: int) -> int:
    rng = random.Random(seed)
    deadline = time.monotonic() + 20
    async with LMDBTier(config(path, mode)) as tier:
        print("READY", flush=True)
        op = 0
        while time.monotonic() < deadline:
            op += 1
            seq += 1
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
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))

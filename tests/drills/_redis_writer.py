"""Child process of the live-repair drill: an "engine" writing a Redis tier while the admin CLI
scrubs and repairs it.

Usage: ``python _redis_writer.py URL PREFIX SEED``. Keys ``0..GOOD-1`` get good records only;
keys ``GOOD..KEYSPACE-1`` alternate between a damaged record (as a failing disk or a foreign
writer would leave) and a good one. Prints ``READY``, then after every acknowledged write
``P <i> <seq>`` (good) or ``X <i> <seq>`` (damaged), flushing each line: the parent knows each
key's last write. Stops when its stdin closes (or after 60 s), then prints ``DONE``.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.drills._util import payload, skey
from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.format import encode_record

GOOD, KEYSPACE = 48, 80


def key(i: int) -> bytes:
    return skey(i, group=0)


def damaged(i: int, seq: int) -> bytes:
    rec = bytearray(encode_record(key(i), payload(i, seq, 2048)))
    rec[-1] ^= 0xFF  # the checksum no longer matches
    return bytes(rec)


async def main(url: str, prefix: str, seed: int) -> int:
    rng = random.Random(seed)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    deadline = time.monotonic() + 60
    cfg = RedisTierConfig(url=url, key_prefix=prefix, socket_timeout_s=5.0, op_timeout_s=10.0)
    async with RedisTier(cfg) as tier:
        print("READY", flush=True)
        seq = 0
        while not stop.is_set() and time.monotonic() < deadline:
            seq += 1
            i = rng.randrange(KEYSPACE)
            if i >= GOOD and rng.random() < 0.5:
                await tier.raw_put_many([(key(i), damaged(i, seq))])
                print(f"X {i} {seq}", flush=True)
            else:
                await tier.put_many([(key(i), payload(i, seq, 2048))])
                print(f"P {i} {seq}", flush=True)
            if seq % 8 == 0:
                await asyncio.sleep(0.001)  # let the scrubber's commands in between
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))

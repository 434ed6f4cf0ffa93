"""A child process standing in for one node on a shared ``fs`` tier directory.

Usage: ``python _fs_node.py MODE PATH [ARGS...]``; every mode prints ``READY`` once its tier is
open and flushes every line.

* ``store PATH N SIZE`` — through the public engine API (``tieredkv.open_store``, an fs tier
  only): store N records of SIZE bytes (``_util.payload(i, 1, SIZE)``), wait for them, print
  ``STORED <n>`` and exit.
* ``writer PATH CAP SEED BATCHES`` — through the tier API: BATCHES batches of 1-4 records of
  64-512 KiB from a keyspace of 256, each followed by reads of random keys; every hit must be
  exactly what some writer wrote for that key (exit code 3 otherwise). Ends with
  ``DONE puts=<n> hits=<n> misses=<n> full=<n>``.
* ``big PATH`` — durable writes of 4 MiB records, one at a time, forever (a SIGKILL target):
  ``W <i>`` before each, ``P <i>`` after.
* ``reader PATH SEED`` — reads random keys of the writers' keyspace until stdin closes, deleting
  every eighth one it finds (an evictor on another node); ``DONE hits=<n> misses=<n>``.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.drills._util import check_payload, payload, skey
from tieredkv.backends.fs import FSTier, FSTierConfig
from tieredkv.errors import TierFullError

KEYSPACE = 256
KiB, MiB = 1024, 1024 * 1024


def say(*a: object) -> None:
    print(*a, flush=True)


def node_config(path: str) -> dict:
    return {"tiers": [{"kind": "fs", "name": "shared", "path": path, "size_cap_bytes": "64MiB"}]}


def store_mode(path: str, n: int, size: int) -> int:
    import torch

    import tieredkv

    with tieredkv.open_store(node_config(path)) as store:
        store.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        say("READY")
        keys = [store.key(i.to_bytes(32, "big"), 0) for i in range(n)]
        job = store.put_records([(k, payload(i, 1, size)) for i, k in enumerate(keys)])
        assert job is not None
        res = store.wait([job], timeout=120)[job]
        if not res.ok:
            say(f"FAILED {res}")
            return 2
        say(f"STORED {len(res.done)}")
    return 0


async def read_checked(tier: FSTier, look: list[int]) -> list[int]:
    """Read the keys of ``look``; the ones found, each exactly what some writer wrote for it (else
    the process exits with code 3, naming the key)."""
    found = []
    for i, got in zip(look, await tier.get_many([skey(i) for i in look]), strict=True):
        if got is not None:
            try:
                check_payload(i, got)
            except AssertionError as e:
                say(f"WRONG {e}")
                sys.exit(3)
            found.append(i)
    return found


def size_of(i: int, seq: int) -> int:
    return (64 + (i * 7 + seq * 13) % 449) * KiB


async def writer_mode(path: str, cap: str, seed: int, batches: int) -> int:
    rng = random.Random(seed)
    puts = hits = misses = full = 0
    async with FSTier(FSTierConfig(path=path, size_cap_bytes=cap, touch_interval_s=0)) as tier:
        say("READY")
        for b in range(batches):
            seq = seed * 1_000_000 + b
            idx = rng.sample(range(KEYSPACE), rng.randint(1, 4))
            try:
                await tier.put_many([(skey(i), payload(i, seq, size_of(i, seq))) for i in idx])
                puts += len(idx)
            except TierFullError:
                full += 1
            found = await read_checked(tier, rng.sample(range(KEYSPACE), 4))
            hits, misses = hits + len(found), misses + 4 - len(found)
    say(f"DONE puts={puts} hits={hits} misses={misses} full={full}")
    return 0


async def big_mode(path: str) -> int:
    cfg = FSTierConfig(path=path, size_cap_bytes="256MiB", sync_mode="durable")
    async with FSTier(cfg) as tier:
        say("READY")
        i = 0
        while True:
            say(f"W {i}")
            await tier.put_many([(skey(i, 0), payload(i, 7, 4 * MiB))])
            say(f"P {i}")
            i += 1


async def reader_mode(path: str, seed: int) -> int:
    rng = random.Random(seed)
    hits = misses = 0
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    loop.add_reader(sys.stdin.fileno(), lambda: stop.done() or stop.set_result(None))
    async with FSTier(FSTierConfig(path=path, size_cap_bytes="8MiB", touch_interval_s=0)) as tier:
        say("READY")
        n = 0
        while not stop.done():
            found = await read_checked(tier, rng.sample(range(KEYSPACE), 8))
            hits, misses = hits + len(found), misses + 8 - len(found)
            for i in found:
                n += 1
                if n % 8 == 0:
                    await tier.delete_many([skey(i)])
            await asyncio.sleep(0)
    say(f"DONE hits={hits} misses={misses}")
    return 0


def main(argv: list[str]) -> int:
    mode, path, *rest = argv
    if mode == "store":
        return store_mode(path, int(rest[0]), int(rest[1]))
    if mode == "writer":
        return asyncio.run(writer_mode(path, rest[0], int(rest[1]), int(rest[2])))
    if mode == "big":
        return asyncio.run(big_mode(path))
    if mode == "reader":
        return asyncio.run(reader_mode(path, int(rest[0])))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

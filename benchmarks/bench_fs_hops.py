"""Where the fs tier's time goes: the same record files written and read three ways.

    .venv/bin/python benchmarks/bench_fs_hops.py --sizes 64,1024 --reps 2

For each chunk size, ``--total-mib`` of records (the tier's layout: fanned-out directories, a
64-byte header before each payload, a temporary file renamed into place, the checksum verified
on the load), in batches of 16 MiB as the pipeline gives them:

* **tier** — ``FSTier.put_many`` / ``get_many`` (aiofiles: each file operation is one hand-off
  to the tier's I/O threads and back, 6-8 per stored record, 4 per loaded one);
* **one hop** — the same system calls, each record's calls in one function run on a pool of
  16 threads (one hand-off per record);
* **one thread** — the same system calls, one record after another on the caller's thread.

Each way runs on fresh directories (the fan-out directories made by the writes, as in
``tieredkv bench``, which starts every run on an empty tier) and on directories made first (a
tier that has been in use). The tier against "one hop" is what the hand-offs cost; "one hop"
against "one thread" what the medium gives to concurrency. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tieredkv.backends.fs import FSTier, FSTierConfig
from tieredkv.backends.fs.layout import Layout
from tieredkv.bench import sizes_option
from tieredkv.format import HEADER_SIZE, encode_heads_into, verify_parts
from tieredkv.keys import Namespace

KiB, MiB = 1 << 10, 1 << 20
BATCH_BYTES = 16 * MiB


class Records:
    """``n`` records of ``size`` bytes: keys, one payload, their headers, read buffers."""

    def __init__(self, size: int, n: int) -> None:
        ns = Namespace(model="bench-fs-hops")
        self.size, self.n = size, n
        self.keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
        self.payload = memoryview(os.urandom(size))
        self.heads = memoryview(bytearray(HEADER_SIZE * n))
        encode_heads_into(self.heads, [(k, self.payload) for k in self.keys])
        self.dsts = [memoryview(bytearray(size)) for _ in range(n)]
        self.batch = max(1, BATCH_BYTES // size)

    def head(self, i: int) -> memoryview:
        return self.heads[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]

    def write_one(self, lay: Layout, i: int) -> None:
        """Record ``i`` as the tier publishes it: a temporary file, then ``rename`` into place
        (its fan-out directory made on the first record there)."""
        tmp = lay.temp_path("bench", i, self.size)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.pwritev(fd, [self.head(i), self.payload], 0)
        finally:
            os.close(fd)
        final = lay.record_path(self.keys[i])
        try:
            os.rename(tmp, final)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(tmp, final)

    def read_one(self, lay: Layout, i: int) -> None:
        fd = os.open(lay.record_path(self.keys[i]), os.O_RDONLY | os.O_CLOEXEC)
        head = bytearray(HEADER_SIZE)
        try:
            os.preadv(fd, [head, self.dsts[i]], 0)
        finally:
            os.close(fd)
        verify_parts(memoryview(head), self.dsts[i], self.keys[i])


def fresh(recs: Records, workdir: str, dirs_first: bool) -> tuple[str, Layout]:
    root = tempfile.mkdtemp(dir=workdir)
    lay = Layout(root)
    lay.ensure()
    if dirs_first:
        for k in recs.keys:
            os.makedirs(lay.record_dir(k), exist_ok=True)
    return root, lay


async def by_tier(recs: Records, lay: Layout) -> tuple[float, float]:
    cfg = FSTierConfig(path=lay.root, size_cap_bytes=recs.n * (recs.size + HEADER_SIZE) + 8 * MiB)
    async with FSTier(cfg) as tier:
        t0 = time.perf_counter()
        for b in range(0, recs.n, recs.batch):
            await tier.put_many([(k, recs.payload) for k in recs.keys[b : b + recs.batch]])
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in range(0, recs.n, recs.batch):
            got = await tier.get_many(recs.keys[b : b + recs.batch], recs.dsts[b : b + recs.batch])
            if None in got:
                raise RuntimeError("a record read back as a miss")
        return tw, time.perf_counter() - t0


async def by_one_hop(recs: Records, lay: Layout) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(16) as pool:

        async def each(fn: Callable[[Layout, int], None]) -> float:
            t0 = time.perf_counter()
            for b in range(0, recs.n, recs.batch):
                todo = range(b, min(recs.n, b + recs.batch))
                await asyncio.gather(*(loop.run_in_executor(pool, fn, lay, i) for i in todo))
            return time.perf_counter() - t0

        return await each(recs.write_one), await each(recs.read_one)


async def by_one_thread(recs: Records, lay: Layout) -> tuple[float, float]:
    t0 = time.perf_counter()
    for i in range(recs.n):
        recs.write_one(lay, i)
    tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(recs.n):
        recs.read_one(lay, i)
    return tw, time.perf_counter() - t0


WAYS = {"tier": by_tier, "one hop": by_one_hop, "one thread": by_one_thread}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=sizes_option, default="64,1024", help="chunk sizes in KiB")
    ap.add_argument("--total-mib", type=int, default=128, help="bytes of records per size and run")
    ap.add_argument("--reps", type=int, default=2, help="runs of every way (each one printed)")
    ap.add_argument("--workdir", default=None, help="where the record directories go (default: a temporary one)")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tieredkv-fs-hops-", dir=a.workdir)
    try:
        for size in a.sizes:
            recs = Records(size, max(4, a.total_mib * MiB // size))
            print(f"{size // KiB} KiB x {recs.n}, batches of {recs.batch}; load average {os.getloadavg()[0]:.1f}")
            for rep in range(a.reps):
                for dirs_first in (False, True):
                    for name, way in WAYS.items():
                        root, lay = fresh(recs, work, dirs_first)
                        try:
                            tw, tr = asyncio.run(way(recs, lay))
                        finally:
                            shutil.rmtree(root, ignore_errors=True)
                        gb = recs.n * size / 1e9
                        where = "dirs made first" if dirs_first else "fresh dirs"
                        print(
                            f"  rep {rep} {name:10} [{where:15}] store {gb / tw:5.2f} GB/s ({tw / recs.n * 1e6:5.0f}"
                            f" us/record)  load {gb / tr:5.2f} GB/s ({tr / recs.n * 1e6:5.0f} us/record)"
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

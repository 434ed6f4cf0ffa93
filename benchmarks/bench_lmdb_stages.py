"""Where an LMDB tier's store time goes: the same records written four ways, interleaved.

    ./scripts/bench stages               # or: .venv/bin/python benchmarks/bench_lmdb_stages.py --help

Per chunk size, each repetition writes the same 256 MiB of chunks (16 MiB transactions) as

* ``raw``: py-lmdb puts of the bare payloads with the tier's flags (``tieredkv bench``'s
  baseline for the LMDB store);
* ``raw+encode``: the same puts of whole records (header beside payload, checksummed), each
  batch encoded on a second thread while the one before is written: the record format's cost
  on this medium, no tier around it;
* ``tier``: :meth:`~tieredkv.backends.base.Tier.put_many` of a bench LMDB tier, two batches in
  flight (as a pipeline lane keeps them), on an event loop and nothing else: what the tier's
  own write path adds (access stamps, size accounting, its threads);
* ``pipeline``: a one-tier store, every chunk through the real pipeline from engine blocks
  (the ``lmdb.store`` figure of ``tieredkv bench``): what the pipeline's jobs, lanes and loop add.

Prints GB/s (median of the repetitions) and each stage over ``raw``; writes
benchmarks/results/stages-<UTC time>.json. Not part of the timed test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import lmdb
import torch

from tieredkv.backends._rawbench import raw_lmdb, warm_free_pages
from tieredkv.bench import (
    BATCH_BYTES,
    KiB,
    MiB,
    add_run_args,
    bench_blocks,
    frozen_heap,
    machine_info,
    make_tier,
    pipeline_store_load,
    run_plan,
    size_label,
    steady_malloc,
)
from tieredkv.config import LMDBTierConfig
from tieredkv.format import HEADER_SIZE, as_readable, encode_records_into, verify_record
from tieredkv.keys import Namespace

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("raw", "raw+encode", "tier", "pipeline")


def raw_encoded(src: torch.Tensor, keys: list[bytes], workdir: str) -> float:
    """Seconds to put every chunk of ``src`` as a record, encoding batch k+1 while batch k is put
    (then, untimed, every record is read back and verified)."""
    n, size = src.shape
    per = max(1, BATCH_BYTES // size)
    path = tempfile.mkdtemp(dir=workdir)
    env = lmdb.open(
        path, map_size=max(4 * n * size, 64 * MiB), sync=False, metasync=False, readahead=False, meminit=False
    )
    bufs = [bytearray(per * (size + HEADER_SIZE)) for _ in range(2)]
    views = [as_readable(src[i]) for i in range(n)]

    def encode(k: int, b: int) -> list[tuple[bytes, memoryview]]:
        mv = memoryview(bufs[k % 2])
        items = [(keys[i], views[i]) for i in range(b, min(n, b + per))]
        ends = encode_records_into(mv, items)
        return [(key, mv[a:e]) for (key, _), a, e in zip(items, [0, *ends], ends)]

    starts = list(range(0, n, per))
    try:
        with ThreadPoolExecutor(1) as helper:
            warm_free_pages(src)
            t0 = time.perf_counter()
            fut = helper.submit(encode, 0, starts[0])
            for k in range(len(starts)):
                records = fut.result()
                if k + 1 < len(starts):
                    fut = helper.submit(encode, k + 1, starts[k + 1])
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(records)
            seconds = time.perf_counter() - t0
        with env.begin(buffers=True) as rtxn:  # untimed: every record is there and reads back whole
            for i in range(n):
                if verify_record(rtxn.get(keys[i], b""), keys[i]) != views[i]:
                    raise RuntimeError(f"raw+encode: record {i} read back other bytes")
        return seconds
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def tier_put_many(src: torch.Tensor, keys: list[bytes], workdir: str) -> float:
    """Seconds for a bench LMDB tier's ``put_many`` of every chunk, two batches in flight (then,
    untimed, every chunk is read back and compared)."""
    n, size = src.shape
    per = max(1, BATCH_BYTES // size)
    views = [as_readable(src[i]) for i in range(n)]
    tier = make_tier(LMDBTierConfig(path=workdir), size, n, workdir)

    async def run() -> float:
        async with tier:
            warm_free_pages(src)
            slots = asyncio.Semaphore(tier.capabilities.writes_in_flight)

            async def put(b: int) -> None:
                async with slots:
                    await tier.put_many([(keys[i], views[i]) for i in range(b, min(n, b + per))])

            t0 = time.perf_counter()
            # all batches at once: they start in order and take the slots in that order (FIFO)
            tasks = [asyncio.ensure_future(put(b)) for b in range(0, n, per)]
            await asyncio.gather(*tasks)
            seconds = time.perf_counter() - t0
            back = torch.zeros_like(src)  # untimed: every chunk reads back as written
            got = await tier.get_many(keys, [back[i] for i in range(n)])
            if got != [size] * n or not torch.equal(back, src):
                raise RuntimeError(f"tier: {sum(g != size for g in got)} of {n} chunks did not read back as written")
            return seconds

    return asyncio.run(run())


def measure(
    sizes: list[int], total: int, reps: int, log: Callable[[str], None] = print
) -> dict[int, dict[str, list[float]]]:
    """Per chunk size, per stage, the GB/s of each kept repetition (stages interleaved, their
    order reversed every other rep; rep 0 warms up and is not kept)."""
    ns = Namespace(model="tieredkv-bench", tenant_salt=uuid.uuid4().hex)
    work = tempfile.mkdtemp(prefix="tieredkv-stages-")
    out: dict[int, dict[str, list[float]]] = {}
    try:
        for size in sizes:
            out[size] = got = _at_size(size, max(4, total // size), reps, ns, work)
            med = {s: statistics.median(v) for s, v in got.items()}
            cells = [f"{med[s]:5.2f} ({med[s] / med['raw']:4.2f}x)" for s in STAGES]
            log(f"{size_label(size):>8} " + " ".join(f"{c:>18}" for c in cells))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _at_size(size: int, n: int, reps: int, ns: Namespace, work: str) -> dict[str, list[float]]:
    src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    blocks = bench_blocks(src)
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]

    def pipeline(d: str) -> float:
        tier = make_tier(LMDBTierConfig(path=d), size, n, d)
        return pipeline_store_load(tier, src, dst, ns, blocks)[0]

    runs: dict[str, Callable[[str], float]] = {
        "raw": lambda d: raw_lmdb(src, dst, d)[0],
        "raw+encode": lambda d: raw_encoded(src, keys, d),
        "tier": lambda d: tier_put_many(src, keys, d),
        "pipeline": pipeline,
    }
    got: dict[str, list[float]] = {s: [] for s in STAGES}
    with frozen_heap():
        for rep in range(reps + 1):
            for stage in STAGES if rep % 2 == 0 else STAGES[::-1]:
                own = tempfile.mkdtemp(dir=work)
                try:
                    seconds = runs[stage](own)
                finally:
                    shutil.rmtree(own, ignore_errors=True)
                if rep:
                    got[stage].append(n * size / seconds / 1e9)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, total_mib=256, per="stage and rep", reps=8, quick_sizes=[64 * KiB], quick_mib=16)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    sizes, total, reps = run_plan(a)
    steady_malloc()  # a bench process, as in tieredkv bench
    torch.set_num_threads(1)
    print(f"{'chunk':>8} " + " ".join(f"{s:>18}" for s in STAGES))
    got = measure(sizes, total, reps, log=lambda m: print(m, flush=True))
    print(f"GB/s, median of {reps} interleaved reps; (x) = over the raw py-lmdb put")
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(a.out, f"stages-{stamp}{'-quick' if a.quick else ''}.json")
    rows = [
        {"size": size, "gbps": {s: statistics.median(v) for s, v in by.items()}, "reps": by} for size, by in got.items()
    ]
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), "total_bytes": total, "reps": reps, "results": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

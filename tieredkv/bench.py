"""Throughput of each tier through the real pipeline, next to its medium's raw limit in the same run.

Used by ``benchmarks/bench_tiers.py`` and ``tieredkv bench``. For each chunk size it measures:

* through tieredkv (a :class:`~tieredkv.store.TieredStore` over one tier, a KV "device" tensor of CPU memory, bytes verified):
  store GB/s (device blocks → tier) and load GB/s (tier → device blocks);
* the raw limit of the same medium on the same bytes: ``torch`` ``copy_`` into a preallocated
  tensor (CPU memory), ``os.pwrite``/``os.preadv`` of a file (page cache, and with ``fdatasync``),
  py-lmdb put/get (same map flags as the tier), redis-py pipelined SET/GET and ``redis-benchmark``.

Each figure is the median of ``reps`` runs; every tier run starts from an empty store, as does
each raw run (first-touch costs are paid by both).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tieredkv.backends.base import Tier
from tieredkv.config import (
    CPUTierConfig,
    LMDBTierConfig,
    NamespaceConfig,
    PipelineConfig,
    RedisTierConfig,
    TieredKVConfig,
)
from tieredkv.keys import Namespace
from tieredkv.store import TieredStore

__all__ = ["SIZES", "BenchResult", "run_tier_bench"]

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
BATCH_BYTES = 16 * MiB


@dataclass
class BenchResult:
    size: int
    chunks: int
    gbps: dict[str, float] = field(default_factory=dict)  # "<what>.<store|load>" -> GB/s
    reps: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, samples: list[float]) -> None:
        self.reps[name] = [round(x, 3) for x in samples]
        self.gbps[name] = round(statistics.median(samples), 3)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- raw limits ------------------------------------------------------------------------------


def raw_memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    def run() -> None:
        for i in range(src.shape[0]):
            dst[i].copy_(src[i])

    return _timed(run)


def raw_file(src: torch.Tensor, dst: torch.Tensor, workdir: str, durable: bool) -> tuple[float, float]:
    """(write seconds, warm read seconds) of the chunks as one file."""
    path = os.path.join(workdir, "raw.bin")
    size = src.shape[1]
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(src.shape[0]):
            os.pwrite(fd, memoryview(src[i].numpy()), i * size)
        if durable:
            os.fdatasync(fd)
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(src.shape[0]):
            os.preadv(fd, [memoryview(dst[i].numpy())], i * size)
        tr = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return tw, tr


def raw_lmdb(src: torch.Tensor, dst: torch.Tensor, workdir: str) -> tuple[float, float]:
    import lmdb

    path = tempfile.mkdtemp(dir=workdir)
    n, size = src.shape
    env = lmdb.open(
        path,
        map_size=max(4 * n * size, 64 * MiB),
        writemap=False,
        sync=False,
        metasync=False,
        readahead=False,
        meminit=False,
        max_dbs=2,
    )
    db = env.open_db(b"records")
    per = max(1, BATCH_BYTES // size)
    keys = [i.to_bytes(8, "big") for i in range(n)]
    try:
        t0 = time.perf_counter()
        for b in range(0, n, per):
            with env.begin(write=True, db=db) as txn:
                for i in range(b, min(n, b + per)):
                    txn.put(keys[i], memoryview(src[i].numpy()))
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        with env.begin(db=db, buffers=True) as txn:
            for i in range(n):
                memoryview(dst[i].numpy())[:] = txn.get(keys[i])
        tr = time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return tw, tr


def raw_redis(src: torch.Tensor, dst: torch.Tensor, url: str) -> tuple[float, float]:
    """redis-py (uvloop when installed) pipelined SET/GET in batches of about BATCH_BYTES."""
    import redis.asyncio as aioredis

    n, size = src.shape
    per = max(1, min(64, (8 * MiB) // size))

    async def run() -> tuple[float, float]:
        r = aioredis.Redis.from_url(url)
        try:
            t0 = time.perf_counter()
            for b in range(0, n, per):
                p = r.pipeline(transaction=False)
                for i in range(b, min(n, b + per)):
                    p.set(f"raw:{i}", memoryview(src[i].numpy()))
                await p.execute()
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            for b in range(0, n, per):
                p = r.pipeline(transaction=False)
                for i in range(b, min(n, b + per)):
                    p.get(f"raw:{i}")
                for i, v in zip(range(b, min(n, b + per)), await p.execute()):
                    memoryview(dst[i].numpy())[:] = v
            tr = time.perf_counter() - t0
            for b in range(0, n, 1000):  # only the keys this run wrote, never the whole database
                await r.delete(*[f"raw:{i}" for i in range(b, min(n, b + 1000))])
            return tw, tr
        finally:
            await r.aclose()

    return _run_loop(run())


#: The keys ``redis-benchmark -t set,get`` writes (without ``-r`` the placeholder stays literal).
REDIS_BENCHMARK_KEYS = ("key:__rand_int__",)


def redis_benchmark(port: int, size: int, n: int) -> tuple[float, float] | None:
    """GB/s of SET and GET from ``redis-benchmark`` (-P1 -c1: the best setting for big values here).

    It writes :data:`REDIS_BENCHMARK_KEYS` into database 0 of the user's server: when one of them
    already exists there (someone's data) nothing is run (None); otherwise they are deleted after
    the run, whatever happens, so the server is left as it was found."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, db=0, socket_timeout=30)
    try:
        if client.exists(*REDIS_BENCHMARK_KEYS):
            return None  # never overwrite (and then delete) a key that is not ours
        try:
            return _run_redis_benchmark(exe, port, size, n)
        finally:
            client.delete(*REDIS_BENCHMARK_KEYS)
    finally:
        client.close()


def _run_redis_benchmark(exe: str, port: int, size: int, n: int) -> tuple[float, float] | None:
    out = subprocess.run(
        [
            exe,
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            "set,get",
            "-d",
            str(size),
            "-n",
            str(n),
            "-P",
            "1",
            "-c",
            "1",
            "-q",
        ],  # one key: every GET hits a value of the full size
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    ).stdout
    rps = {m.group(1).lower(): float(m.group(2)) for m in re.finditer(r"(SET|GET): ([\d.]+) requests per second", out)}
    if "set" not in rps or "get" not in rps:
        return None
    return rps["set"] * size / 1e9, rps["get"] * size / 1e9


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---- through the pipeline -----------------------------------------------------------------------


def pipeline_store_load(tier: Tier, src: torch.Tensor, dst: torch.Tensor, ns: Namespace) -> tuple[float, float]:
    """(store seconds, load seconds) of every chunk of ``src`` through a one-tier store; bytes verified.

    Row ``i`` of ``src`` is device block ``i + 1`` (block 0 is the engine's null block); it loads
    back into block ``n + 1 + i``. Every key it writes is deleted again (a shared tier is left as
    it was found)."""
    n, size = src.shape
    null = torch.zeros(1, size, dtype=torch.uint8)
    blocks = torch.cat([null, src, torch.zeros_like(src)])
    per = max(1, BATCH_BYTES // size)
    pipeline = PipelineConfig(
        max_batch_bytes=BATCH_BYTES,
        max_batch_items=max(per, 1),
        job_timeout_s=600,
        staging_bytes=min(n * size, 512 * MiB) + BATCH_BYTES,
    )
    cfg = TieredKVConfig(namespace=NamespaceConfig(model=ns.model), pipeline=pipeline)
    store = TieredStore(cfg, namespace=ns, tiers=[tier])
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
    with store.start():
        store.register_group(0, [blocks])

        def run(submit: Callable[[list[tuple[bytes, Sequence[int]]]], int | None], first: int) -> float:
            t0 = time.perf_counter()
            for b in range(0, n, per):
                chunks: list[tuple[bytes, Sequence[int]]] = [(keys[i], (first + i,)) for i in range(b, min(n, b + per))]
                while submit(chunks) is None:  # staging full: wait for room (back-pressure)
                    time.sleep(0.0005)
            if not store.drain(600):
                raise RuntimeError("pipeline did not drain")
            dt = time.perf_counter() - t0
            bad = [r for r in store.poll() if not r.ok]
            if bad:
                raise RuntimeError(f"{len(bad)} jobs failed: {bad[0].error}")
            return dt

        try:
            ts = run(lambda chunks: store.store(0, chunks), 1)
            tl = run(lambda chunks: store.load(0, chunks), n + 1)
        finally:
            store.run(tier.delete_many(keys), timeout=120)
    if not torch.equal(blocks[n + 1 :], src):
        raise RuntimeError(f"{tier.kind} tier: loaded bytes differ from stored bytes")
    return ts, tl


def make_tier(kind: str, size: int, n: int, workdir: str, redis_url: str | None) -> Tier:
    from tieredkv.backends.registry import build_tier

    total = n * size
    if kind == "cpu":
        cfg: Any = CPUTierConfig(capacity_bytes=total + 8 * MiB, segment_bytes=max(8 * MiB, size), prefault=True)
    elif kind == "lmdb":
        cfg = LMDBTierConfig(
            path=tempfile.mkdtemp(dir=workdir),
            map_size_bytes=4 * total + 64 * MiB,
            size_cap_bytes=2 * total + 32 * MiB,
            max_map_size_bytes=8 * total + 128 * MiB,
        )
    else:
        cfg = RedisTierConfig(url=redis_url or "redis://127.0.0.1:6379/0", op_timeout_s=120, socket_timeout_s=30)
    return build_tier(cfg)


def run_tier_bench(
    sizes: list[int] = SIZES,
    total_bytes: int = 256 * MiB,
    reps: int = 3,
    kinds: tuple[str, ...] = ("cpu", "lmdb", "redis"),
    redis_url: str | None = None,
    redis_port: int | None = None,
    workdir: str | None = None,
    log: Callable[[str], None] = print,
) -> list[BenchResult]:
    """Run the whole comparison; returns one :class:`BenchResult` per size."""
    torch.set_num_threads(1)  # the copy path runs single-threaded (machine-limits finding 3)
    work = workdir or tempfile.mkdtemp(prefix="tieredkv-bench-")
    ns = Namespace(model="tieredkv-bench", tenant_salt=uuid.uuid4().hex)
    out = []
    for size in sizes:
        n = max(4, total_bytes // size)
        src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        res = BenchResult(size, n)
        nbytes = n * size
        samples: dict[str, list[float]] = {}

        def add(name: str, seconds: float, nbytes: int = nbytes, samples: dict[str, list[float]] = samples) -> None:
            samples.setdefault(name, []).append(nbytes / seconds / 1e9)

        # Each rep measures every figure once, raw limits and tiers interleaved, so both see the
        # same machine (this box's disk and neighbours swing by 2x over a minute).
        for _ in range(reps):
            add("memcpy", raw_memcpy(src, dst))
            if "lmdb" in kinds:
                w, r = raw_file(src, dst, work, durable=False)
                add("file_pagecache.store", w)
                add("file.load", r)
                add("file_durable.store", raw_file(src, dst, work, durable=True)[0])
                w, r = raw_lmdb(src, dst, work)
                add("lmdb_raw.store", w)
                add("lmdb_raw.load", r)
            if "redis" in kinds and redis_url:
                w, r = raw_redis(src, dst, redis_url)
                add("redis_py.store", w)
                add("redis_py.load", r)
                rb = redis_benchmark(redis_port, size, min(n, 2000)) if redis_port else None
                if rb:
                    samples.setdefault("redis_benchmark.store", []).append(rb[0])
                    samples.setdefault("redis_benchmark.load", []).append(rb[1])
            for kind in kinds:
                if kind == "redis" and not redis_url:
                    continue
                ts, tl = pipeline_store_load(make_tier(kind, size, n, work, redis_url), src, dst, ns)
                add(f"{kind}.store", ts)
                add(f"{kind}.load", tl)
        for name, xs in samples.items():
            res.add(name, xs)
        log(f"{size // KiB:>5} KiB: " + ", ".join(f"{k}={v:.2f}" for k, v in res.gbps.items()))
        out.append(res)
        del src, dst
    if workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return out


#: Which raw figure each tier is judged against (tier figure / raw figure).
BASELINES = {
    "cpu.store": "memcpy",
    "cpu.load": "memcpy",
    "lmdb.store": "lmdb_raw.store",
    "lmdb.load": "lmdb_raw.load",
    "redis.store": "redis_py.store",
    "redis.load": "redis_py.load",
}


def ratios(res: BenchResult) -> dict[str, float]:
    return {k: round(res.gbps[k] / res.gbps[b], 2) for k, b in BASELINES.items() if k in res.gbps and b in res.gbps}


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    redis_v = ""
    if shutil.which("redis-server"):
        redis_v = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    import tieredkv

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tieredkv": tieredkv.__version__,
        "redis_server": redis_v,
        "loadavg": os.getloadavg(),
    }


def plot(results: list[BenchResult], path: str) -> None:
    """Bar chart per chunk size: each tier's store/load GB/s next to its raw limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, op in zip(axes, ("store", "load")):
        pairs = [(f"{k.split('.')[0]}", f"{k}", BASELINES[k]) for k in BASELINES if k.endswith(op)]
        width = 0.8 / (2 * len(pairs))
        for j, (label, key, base) in enumerate(pairs):
            xs = [i + (2 * j) * width for i in range(len(results))]
            ax.bar(xs, [r.gbps.get(key, 0) for r in results], width, label=f"tieredkv {label}")
            ax.bar(
                [x + width for x in xs],
                [r.gbps.get(base, 0) for r in results],
                width,
                alpha=0.45,
                label=f"raw {base.split('.')[0]}",
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
        ax.set_xticklabels([f"{r.size // KiB} KiB" if r.size < MiB else f"{r.size // MiB} MiB" for r in results])
        ax.set_title(f"{op} GB/s (median of reps)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

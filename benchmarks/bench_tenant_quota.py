"""What tenant quotas cost the Redis tier's store path (issue 42).

    .venv/bin/python benchmarks/bench_tenant_quota.py [--reps 5] [--total-mib 256] [--cluster] [--json out.json]

Store throughput (GB/s of payload) of ``RedisTier.put_many`` as a pipeline lane calls it: batches
of at most 64 chunks / 16 MiB (the pipeline's defaults), two batches in flight
(``writes_in_flight``), into a private redis-server on loopback (or a private 3-master cluster
with ``--cluster``), flushed between runs. Variants, interleaved within each repetition:

* ``default`` — no tenants (the path as it was before tenants: records of version 1);
* ``tenant`` — every chunk a tenant's, no quota configured (a version-2 header; no books);
* ``quota`` — the same with quotas configured and the tenant far under its quota: the books
  are kept (a script per batch after its SETs), nothing evicted;
* ``quota-full`` — the tenant at its quota (a quarter of what one run writes, at least four
  batches), filled before the clock starts: every batch also
  takes its oldest records out of the books and deletes them.

Medians of ``--reps`` runs per variant and chunk size (64 KiB and 1 MiB) of three figures: GB/s
(wall clock), and CPU seconds per GB of the client process (``time.process_time``: every thread)
and of the server(s) (``INFO cpu``: ``used_cpu_user + used_cpu_sys``). On a shared, loaded
machine the wall figure swings; the CPU figures are what the books cost whatever else runs.
Not part of the test suite; the numbers go into ``benchmarks/results/tenant-quota-redis-*.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import redis

from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.keys import Namespace, tenant_id
from tieredkv.tenants import TenantQuotas
from tieredkv.testing.servers import RedisCluster, RedisServer

MiB = 1 << 20
NS = Namespace(model="bench/tenant-quota")
VARIANTS = ("default", "tenant", "quota", "quota-full")
BATCH_ITEMS, BATCH_BYTES, IN_FLIGHT = 64, 16 * MiB, 2


def server_cpu(ports: list[int]) -> float:
    out = 0.0
    for port in ports:
        r = redis.Redis(port=port)
        info = r.info("cpu")
        r.close()
        out += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return out


async def one_run(url: str, cluster: bool, variant: str, size: int, total: int, ports: list[int]) -> tuple[float, ...]:
    """(wall seconds, client CPU seconds, server CPU seconds) to store ``total`` bytes of
    ``size``-byte chunks in ``variant``'s way."""
    n = total // size
    per = max(1, min(BATCH_ITEMS, BATCH_BYTES // size))
    tier = RedisTier(RedisTierConfig(url=url, cluster=cluster, key_prefix="bq", op_timeout_s=120, socket_timeout_s=60))
    if variant.startswith("quota"):
        quota = max(total // 4, 4 * BATCH_BYTES) if variant == "quota-full" else 100 * total
        tier.set_quotas(TenantQuotas(default=quota))
    tenant = None if variant == "default" else tenant_id("bench")
    payload = os.urandom(size)
    keys = [NS.key(i.to_bytes(16, "big"), 0) for i in range(n)]
    async with tier:
        if variant == "quota-full":  # at its quota before the clock starts
            for b in range(0, n, per):
                batch = keys[b : b + per]
                await tier.put_many([(k, payload) for k in batch], tenants=[tenant] * len(batch))
            keys = [NS.key((n + i).to_bytes(16, "big"), 0) for i in range(n)]
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def put(batch: list[bytes]) -> None:
            async with slots:
                items = [(k, payload) for k in batch]
                if tenant is None:
                    await tier.put_many(items)
                else:
                    await tier.put_many(items, tenants=[tenant] * len(items))

        s0, c0, t0 = server_cpu(ports), time.process_time(), time.perf_counter()
        tasks = []
        for b in range(0, n, per):
            await slots.acquire()  # (as a lane: the next batch is formed once a slot is free)
            slots.release()
            tasks.append(asyncio.create_task(put(keys[b : b + per])))
        await asyncio.gather(*tasks)
        dt, cpu, srv = time.perf_counter() - t0, time.process_time() - c0, server_cpu(ports) - s0
        if variant == "quota-full":
            assert tier.counters["tenant_evictions"] > 0
    return dt, cpu, srv


def flush(ports: list[int]) -> None:
    for port in ports:
        r = redis.Redis(port=port)
        r.flushall()
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--cluster", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    total = a.total_mib * MiB
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    server: Any = RedisCluster(masters=3) if a.cluster else RedisServer()
    with server:
        ports = [p for _, p in server.nodes] if a.cluster else [server.port]
        for size in (64 << 10, 1 << 20):
            for rep in range(a.reps):
                order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    flush(ports)
                    dt, cpu, srv = asyncio.run(one_run(server.url, a.cluster, v, size, total, ports))
                    got = {
                        "gbps": total / dt / 1e9,
                        "client_s_per_gb": cpu / total * 1e9,
                        "server_s_per_gb": srv / total * 1e9,
                    }
                    by = results.setdefault(f"{size >> 10}KiB", {}).setdefault(v, {})
                    for name, value in got.items():
                        by.setdefault(name, []).append(value)
                    print(
                        f"{size >> 10} KiB rep {rep} {v:<10} " + " ".join(f"{k} {x:.3f}" for k, x in got.items()),
                        flush=True,
                    )
    for figure in ("gbps", "client_s_per_gb", "server_s_per_gb"):
        print(f"\n{figure} (median; against default)")
        print("| chunk | " + " | ".join(VARIANTS) + " |")
        print("|---|" + "---|" * len(VARIANTS))
        for size, by in results.items():
            base = statistics.median(by["default"][figure])
            cells = [
                f"{statistics.median(by[v][figure]):.3f} ({statistics.median(by[v][figure]) / base:.2f}x)"
                for v in VARIANTS
            ]
            print(f"| {size} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"total_bytes": total, "cluster": a.cluster, "gbps": results}, f, indent=1)


if __name__ == "__main__":
    main()

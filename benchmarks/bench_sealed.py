"""What encryption costs on the Redis path: a store over one Redis tier with and without
``encryption`` (sealed records, AES-256-GCM), next to AES-GCM's own speed on this machine.

    .venv/bin/python benchmarks/bench_sealed.py            # 64 KiB, 256 KiB, 1 MiB; 7 reps
    .venv/bin/python benchmarks/bench_sealed.py --quick    # a smoke run

Starts its own redis-server on a free loopback port (``native_io``, two connections: the tier's
defaults). Per chunk size and repetition, both tiers run in turn (which goes first alternates),
each through a :class:`~tieredkv.store.TieredStore` of its own: every chunk stored from an engine
block tensor and loaded back into it, the blocks scattered as an engine's are (chunk ``i`` from
and to random block ids, never two neighbours in order), the bytes compared after each load, the
keys deleted after each run. Figures are GB/s of payload, the median of the repetitions, after an
untimed warm-up run. ``aes_gcm.seal`` / ``aes_gcm.open`` are one thread sealing and opening the
same chunks as records (:class:`~tieredkv.sealing.Keyring`, header included) and
``aes_gcm_raw.*`` the bare ``AESGCM.encrypt_into`` / ``decrypt_into`` over them: what one core
spends per byte, the bound of what sealing can cost.

Writes ``benchmarks/results/sealed-<UTC time>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tieredkv.backends.registry import build_tier
from tieredkv.bench import (
    BATCH_BYTES,
    KiB,
    MiB,
    frozen_heap,
    machine_info,
    size_label,
    sizes_option,
    steady_malloc,
    warm_free_pages,
)
from tieredkv.config import NamespaceConfig, PipelineConfig, RedisTierConfig, TieredKVConfig
from tieredkv.keys import Namespace
from tieredkv.sealing import Keyring, sealed_size
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisServer

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [64 * KiB, 256 * KiB, 1 * MiB]


def scattered(n: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Block ids 1..2n split in two random halves (where chunks are stored from, loaded into)."""
    perm = (torch.randperm(2 * n, generator=gen) + 1).tolist()
    return perm[:n], perm[n:]


def store_load(
    cfg: RedisTierConfig, src: torch.Tensor, blocks: torch.Tensor, ns: Namespace, seed: int
) -> tuple[float, float]:
    """(store seconds, load seconds) of every chunk of ``src`` through a one-tier store over a tier
    built from ``cfg``, at scattered block ids; the loaded bytes compared; the keys deleted."""
    n, size = src.shape
    gen = torch.Generator().manual_seed(seed)
    out_ids, in_ids = scattered(n, gen)
    blocks[torch.tensor(out_ids)] = src
    blocks[torch.tensor(in_ids)] = 0
    per = max(1, BATCH_BYTES // size)
    pipeline = PipelineConfig(
        max_batch_bytes=BATCH_BYTES,
        max_batch_items=per,
        job_timeout_s=600,
        staging_bytes=min(n * size, 512 * MiB) + BATCH_BYTES,
    )
    store = TieredStore(
        TieredKVConfig(namespace=NamespaceConfig(model=ns.model), pipeline=pipeline),
        namespace=ns,
        tiers=[build_tier(cfg)],
    )
    keys = [ns.key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]
    with store.start():
        store.register_group(0, [blocks])

        def run(submit: Callable[[list[tuple[bytes, Sequence[int]]]], int | None], ids: list[int]) -> float:
            t0 = time.perf_counter()
            for b in range(0, n, per):
                chunks: list[tuple[bytes, Sequence[int]]] = [(keys[i], (ids[i],)) for i in range(b, min(n, b + per))]
                while submit(chunks) is None:  # staging full: back-pressure
                    time.sleep(0.0005)
            if not store.drain(600):
                raise RuntimeError("pipeline did not drain")
            dt_ = time.perf_counter() - t0
            bad = [r for r in store.poll() if not r.ok]
            if bad:
                raise RuntimeError(f"{len(bad)} jobs failed: {bad[0].error}")
            return dt_

        try:
            warm_free_pages(src)
            ts = run(lambda chunks: store.store(0, chunks), out_ids)
            tl = run(lambda chunks: store.load(0, chunks), in_ids)
        finally:
            store.run(store.tiers[0].delete_many(keys), timeout=120)
    if not torch.equal(blocks[torch.tensor(in_ids)], src):
        raise RuntimeError(f"{cfg.label}: loaded bytes differ from stored bytes")
    return ts, tl


def aes_gcm(src: torch.Tensor, ns: Namespace) -> dict[str, float]:
    """Seconds of one thread sealing / opening every chunk of ``src`` as records, and of the bare
    AES-GCM calls over the same bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    n, size = src.shape
    ring = Keyring([os.urandom(32)])
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
    rows = [memoryview(src[i].numpy()) for i in range(n)]  # type: ignore[arg-type]
    arena = memoryview(bytearray(n * sealed_size(size)))
    dst = memoryview(bytearray(size))
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    at = 0
    recs = []
    for k, row in zip(keys, rows, strict=True):
        m = ring.seal_into(arena[at:], k, row)
        recs.append(arena[at : at + m])
        at += m
    out["aes_gcm.seal"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k, rec in zip(keys, recs, strict=True):
        ring.open_into(rec, k, dst)
    out["aes_gcm.open"] = time.perf_counter() - t0
    aead, nonce, aad = AESGCM(os.urandom(32)), os.urandom(12), b"a" * 100
    cts = [arena[i * (size + 16) : (i + 1) * (size + 16)] for i in range(n)]  # each chunk its own place
    t0 = time.perf_counter()
    for row, ct in zip(rows, cts, strict=True):
        aead.encrypt_into(nonce, row, aad, ct)
    out["aes_gcm_raw.seal"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for ct in cts:
        aead.decrypt_into(nonce, ct, aad, dst)
    out["aes_gcm_raw.open"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", type=sizes_option, default=",".join(str(s // KiB) for s in SIZES), help="chunk sizes in KiB"
    )
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per size, figure and rep")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per size (the median is reported; at least 5)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 KiB and 1 MiB, 16 MiB, 1 rep")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    sizes = [64 * KiB, 1 * MiB] if a.quick else a.sizes
    total = 16 * MiB if a.quick else a.total_mib * MiB
    reps = 1 if a.quick else max(5, a.reps)
    steady_malloc()
    torch.set_num_threads(1)
    ns = Namespace(model="tieredkv-bench-sealed", tenant_salt=uuid.uuid4().hex)
    work = tempfile.mkdtemp(prefix="tieredkv-sealed-")
    keys_file = os.path.join(work, "keys")
    with open(os.open(keys_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    rows: list[dict[str, Any]] = []
    with RedisServer() as srv:
        tiers = {
            "redis": RedisTierConfig(url=srv.url, op_timeout_s=120, socket_timeout_s=30),
            "redis_sealed": RedisTierConfig(
                url=srv.url, name="sealed", op_timeout_s=120, socket_timeout_s=30, encryption={"keys_file": keys_file}
            ),
        }
        for size in sizes:
            n = max(4, total // size)
            src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
            blocks = torch.zeros(1 + 2 * n, size, dtype=torch.uint8)
            samples: dict[str, list[float]] = {}
            with frozen_heap():
                for rep in range(reps + 1):  # rep 0 warms up and is not kept
                    order = list(tiers.items()) if rep % 2 else list(reversed(tiers.items()))
                    for label, cfg in order:
                        ts, tl = store_load(cfg, src, blocks, ns, seed=rep)
                        if rep:
                            samples.setdefault(f"{label}.store", []).append(n * size / ts / 1e9)
                            samples.setdefault(f"{label}.load", []).append(n * size / tl / 1e9)
                    for name, secs in aes_gcm(src, ns).items():
                        if rep:
                            samples.setdefault(name, []).append(n * size / secs / 1e9)
            med = {k: round(statistics.median(v), 3) for k, v in samples.items()}
            ratio = {op: round(med[f"redis_sealed.{op}"] / med[f"redis.{op}"], 2) for op in ("store", "load")}
            rows.append(
                {
                    "size": size,
                    "chunks": n,
                    "gbps": med,
                    "sealed_over_plain": ratio,
                    "reps": {k: [round(x, 3) for x in v] for k, v in samples.items()},
                }
            )
            print(f"{size_label(size)}: {med} sealed/plain {ratio}", file=sys.stderr, flush=True)
    print_table(rows)
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(a.out, f"sealed-{stamp}{'-quick' if a.quick else ''}.json")
    with open(path, "w") as f:
        json.dump(
            {"machine": machine_info(), "total_bytes_per_figure": total, "reps": reps, "results": rows}, f, indent=1
        )
    print(f"wrote {path}")
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print("GB/s of payload, median of reps (store = engine blocks -> Redis, load = Redis -> engine blocks)")
    head = [
        "size",
        "plain store",
        "sealed store",
        "ratio",
        "plain load",
        "sealed load",
        "ratio",
        "AES-GCM seal",
        "open",
        "raw enc",
        "raw dec",
    ]
    print(" | ".join(f"{h:>12}" for h in head))
    for r in rows:
        g, q = r["gbps"], r["sealed_over_plain"]
        cells = [
            size_label(r["size"]),
            f"{g['redis.store']:.2f}",
            f"{g['redis_sealed.store']:.2f}",
            f"{q['store']:.2f}x",
            f"{g['redis.load']:.2f}",
            f"{g['redis_sealed.load']:.2f}",
            f"{q['load']:.2f}x",
            f"{g['aes_gcm.seal']:.1f}",
            f"{g['aes_gcm.open']:.1f}",
            f"{g['aes_gcm_raw.seal']:.1f}",
            f"{g['aes_gcm_raw.open']:.1f}",
        ]
        print(" | ".join(f"{c:>12}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())

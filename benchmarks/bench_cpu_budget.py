"""What bounds the CPU tier on engine-like block layouts: its CPU budget, pass by pass (issue 46).

    ./scripts/bench budget                                   # 64 KiB and 1 MiB chunks, 5 reps
    .venv/bin/python benchmarks/bench_cpu_budget.py --sizes 64,256,1024,4096 --reps 7

The CPU tier's limit in ``tieredkv bench`` is the strongest raw figure of host memory: on this
machine kind two threads copying contiguous bytes with non-temporal stores (``copy_2t_nt``: both
vCPUs, nothing else). The tier has to do more on the same two vCPUs: its copies move scattered
16 KiB blocks (a churned pool's ids), and around them run the caller's submits, the pipeline's
loop (jobs, the slab's slots, results) and the GIL hand-offs between them. Per chunk size and
direction, each repetition measures, interleaved (the order turns each rep), 256 MiB each:

* ``limit``: the CPU tier's raw limits (:meth:`CPUTier.raw_limits`), the strongest of them;
* ``copies``: the tier's own copies and nothing else: :class:`~tieredkv.staging.Copier` moves
  (deferred to the C helper's mover, as the slot path makes them) of the same permuted block ids
  into contiguous memory and back, in the pipeline's jobs (``BATCH_BYTES`` each);
* ``tier``: :func:`tieredkv.bench.pipeline_store_load` on a CPU tier (every chunk through the
  real pipeline, bytes verified), with the CPU time of every thread of the process over each
  timed phase (``/proc/self/task/*/schedstat``, nanoseconds): the copy threads (the C helper's
  mover and helpers: every thread Python does not know), the pipeline's loop thread, the
  calling (engine) thread, other Python threads;
* ``full``: the same on a full tier (``pipeline_store_load(full=True)``: filled first, so every
  store evicts a record, the steady state of an engine's CPU tier; its free slots then come in
  whatever order evictions left them).

Printed per cell: each figure in GB/s, the tier and the copies over the limit, the tier's CPU by
thread class and how many vCPUs it kept busy, and the budget the goal leaves: to reach the goal's
ratio on two vCPUs the whole pass may spend ``2 x bytes / (goal x limit)`` seconds of CPU; the
copies alone spend what ``copies`` measured; what is left, per chunk, is what everything else may
cost, beside what it costs now. Writes benchmarks/results/cpu-budget-<UTC time>.json with
``--out DIR``. Not part of the timed test suite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tieredkv import bench
from tieredkv.backends.cpu.config import CPUTierConfig
from tieredkv.backends.cpu.tier import CPUTier
from tieredkv.config import PipelineConfig
from tieredkv.keys import Namespace
from tieredkv.layouts import BLOCKS_PER_CHUNK, round_ids
from tieredkv.staging import Copier, KVGroupTensors

KiB, MiB = 1024, 1024 * 1024
#: Issue 46's goals for the CPU tier (engine-like layout, over the gather limit): by chunk size,
#: the smallest first; a size takes the goal of the largest key not above it.
GOALS = {64 * KiB: 0.7, 1 * MiB: 0.9}
LOOP_THREAD = "tieredkv-pipeline"
CLASSES = ("copy threads", "loop", "caller", "other python")
#: The tier's figures: a fresh tier (room for every chunk), and a full one (every store evicts).
TIERS = {"tier": "tier", "full": "full tier"}


def goal(size: int) -> float:
    return max((g for s, g in GOALS.items() if s <= size), default=min(GOALS.values()))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread class so far: Python threads by name (the loop, the caller),
    every other thread of the process (the C helper's) as ``copy threads``, from the process
    total (``getrusage``: threads that ended count too)."""
    out = dict.fromkeys(CLASSES, 0.0)
    main = threading.current_thread()
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        cls = "caller" if t is main else "loop" if t.name == LOOP_THREAD else "other python"
        out[cls] += ns / 1e9
    r = resource.getrusage(resource.RUSAGE_SELF)
    out["copy threads"] = max(0.0, r.ru_utime + r.ru_stime - sum(out.values()))
    return out


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Case:
    """One chunk size: 256 MiB (or ``total``) of chunks in a KV group of 4-block chunks."""

    def __init__(self, size: int, total: int, work: str) -> None:
        self.size = size
        self.n = n = max(4, total // size)
        self.src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.fill_(1)
        self.blocks = bench.bench_blocks(self.src)
        self.bpc = BLOCKS_PER_CHUNK
        self.work = work
        self.ns = Namespace(model="bench-cpu-budget")
        self.contig = torch.empty(n * size, dtype=torch.uint8)  # where the copies put the payloads
        self.contig.fill_(1)

    def limit(self) -> dict[str, float]:
        """GB/s of every raw figure the CPU tier is judged against (the limit is the one with the
        highest median over the reps, as ``tieredkv bench`` picks it: :func:`summarize`)."""
        cfg = bench.bench_config(CPUTierConfig(), self.size, self.n, self.work)
        lim = CPUTier.raw_limits(cfg, self.src, self.dst, workdir=self.work)
        return {k: lim.gbps[k] for k in lim.limit("store")}

    def copies(self, seed: int, copier: Copier, *, check: bool = False) -> dict[str, tuple[float, float]]:
        """(GB/s, CPU seconds) of the tier's copies alone, store (gather) and load (scatter);
        ``check``: then compare the bytes (a 256 MiB gather of its own, whose memory freed
        and handed back to the host slowed the next rep's copies by a third: once, at the end)."""
        nb = self.n * self.bpc
        store_ids, load_ids = round_ids("permuted", nb, seed)
        group = KVGroupTensors([self.blocks])
        per = max(1, bench.BATCH_BYTES // self.size)
        out = {}
        for op, ids in (("store", store_ids), ("load", load_ids)):
            c0, t0 = process_cpu(), time.perf_counter()
            moves = []
            for a in range(0, self.n, per):
                b = min(self.n, a + per)
                span = self.contig[a * self.size : b * self.size]
                job = ids[a * self.bpc : b * self.bpc]
                if op == "store":
                    moves.append(copier.gather(group, job, span, chunk_blocks=self.bpc, defer=True))
                else:
                    moves.append(copier.scatter_blocks(group, job, span, self.bpc, defer=True))
            for m in moves:
                if m is not None:
                    m.synchronize()
            secs = time.perf_counter() - t0
            out[op] = (self.n * self.size / secs / 1e9, process_cpu() - c0)
        if check and not torch.equal(
            self.blocks[torch.tensor(load_ids)].view(self.n, -1), self.contig.view(self.n, -1)
        ):
            raise RuntimeError("the copies lost bytes")
        return out

    def tier(self, seed: int, full: bool = False) -> dict[str, tuple[float, float, dict[str, float]]]:
        """(GB/s, wall seconds, CPU seconds by thread class) of the tier, store and load
        (``full``: on a full tier)."""
        marks: dict[str, list[dict[str, float]]] = {}

        def phase(op: str, started: bool) -> None:
            marks.setdefault(op, []).append(thread_cpu())

        t = bench.make_tier(CPUTierConfig(), self.size, self.n, self.work)
        ts, tl = bench.pipeline_store_load(
            t, self.src, self.dst, self.ns, self.blocks, layout="permuted", seed=seed, phase=phase, full=full
        )
        out = {}
        for op, secs in (("store", ts), ("load", tl)):
            a, b = marks[op]
            out[op] = (self.n * self.size / secs / 1e9, secs, {k: b[k] - a[k] for k in CLASSES})
        return out


def measure(
    sizes: list[int], total: int, reps: int, *, log: Callable[[str], None] = print
) -> dict[int, dict[str, Any]]:
    """Per size: every rep's figures (``limit``, ``copies``, ``tier``) and the summary line per op."""
    copier = Copier(threads=PipelineConfig().copy_threads)
    results: dict[int, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory() as work, bench.frozen_heap():
            for size in sizes:
                case = Case(size, total, work)
                steps: list[tuple[str, Callable[[int], Any]]] = [
                    ("limit", lambda r, c=case: c.limit()),
                    ("copies", lambda r, c=case: c.copies(r, copier)),
                    ("tier", case.tier),
                    ("full", lambda r, c=case: c.tier(r, full=True)),
                ]
                for r in range(-1, reps):  # rep -1: an untimed warm-up
                    row = {}
                    for k in range(len(steps)):
                        name, fn = steps[(k + max(r, 0)) % len(steps)]
                        row[name] = fn(max(r, 0))
                    if r >= 0:
                        results.setdefault(size, {"reps": []})["reps"].append(row)
                case.copies(reps, copier, check=True)  # the bytes the copies moved, checked once
                res = results[size]
                for which in TIERS:
                    res[f"summary_{which}"] = {op: summarize(size, case.n, res["reps"], op, which) for op in bench.OPS}
                    for op in bench.OPS:
                        log(line(size, op, res[f"summary_{which}"][op], which))
    finally:
        copier.close()
    return results


def summarize(size: int, n: int, reps: list[dict[str, Any]], op: str, which: str = "tier") -> dict[str, Any]:
    med = statistics.median
    limits = {k: med(r["limit"][k] for r in reps) for k in reps[0]["limit"]}
    limit = max(limits, key=limits.__getitem__)
    limit_gbps = limits[limit]
    copies_gbps = med(r["copies"][op][0] for r in reps)
    copies_cpu = med(r["copies"][op][1] for r in reps)
    tier_gbps = med(r[which][op][0] for r in reps)
    wall = med(r[which][op][1] for r in reps)
    cpu = {k: med(r[which][op][2][k] for r in reps) for k in CLASSES}
    nbytes = n * size
    g = goal(size)
    budget = 2 * nbytes / (g * limit_gbps * 1e9)  # CPU seconds on two vCPUs at the goal
    others = sum(v for k, v in cpu.items() if k != "copy threads")
    return {
        "limit": limit,
        "limit_gbps": limit_gbps,
        "copies_gbps": copies_gbps,
        "copies_ratio": copies_gbps / limit_gbps,
        "copies_cpu_s": copies_cpu,
        "tier_gbps": tier_gbps,
        "tier_ratio": tier_gbps / limit_gbps,
        "tier_wall_s": wall,
        "tier_cpu_s": cpu,
        "busy_vcpus": sum(cpu.values()) / wall,
        "goal": g,
        "goal_cpu_budget_s": budget,
        "left_per_chunk_us": (budget - copies_cpu) / n * 1e6,
        "others_per_chunk_us": others / n * 1e6,
        "chunks": n,
    }


def line(size: int, op: str, s: dict[str, Any], which: str = "tier") -> str:
    ms = {k: v * 1e3 for k, v in s["tier_cpu_s"].items()}
    split = ", ".join(f"{k} {v:.0f}" for k, v in ms.items())
    return (
        f"{bench.size_label(size)} {op}: limit {s['limit']} {s['limit_gbps']:.2f} GB/s | copies alone"
        f" {s['copies_gbps']:.2f} ({s['copies_ratio']:.2f}x), {s['copies_cpu_s'] * 1e3:.0f} ms CPU | {TIERS[which]}"
        f" {s['tier_gbps']:.2f} ({s['tier_ratio']:.2f}x): {s['tier_wall_s'] * 1e3:.0f} ms, CPU ms {split}"
        f" ({s['busy_vcpus']:.2f} vCPUs busy) | goal {s['goal']:.1f}x: {s['goal_cpu_budget_s'] * 1e3:.0f} ms"
        f" of CPU on two vCPUs, {s['left_per_chunk_us']:.2f} us a chunk left beside the copies,"
        f" {s['others_per_chunk_us']:.2f} spent"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=bench.sizes_option, default="64,1024", help="chunk sizes in KiB")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per figure")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (the median is reported)")
    ap.add_argument("--out", help="directory for cpu-budget-<UTC time>.json")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.total_mib < 1:
        ap.error(f"--reps and --total-mib must be at least 1, got {a.reps} and {a.total_mib}")
    bench.steady_malloc()
    torch.set_num_threads(1)
    res = measure(a.sizes, a.total_mib * MiB, a.reps)
    if a.out:
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        path = os.path.join(a.out, f"cpu-budget-{stamp}.json")
        doc = {
            "bench": "cpu_budget",
            "machine": bench.machine_info(),
            "total_bytes": a.total_mib * MiB,
            "reps": a.reps,
            "results": [{"size": s, **r} for s, r in res.items()],
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

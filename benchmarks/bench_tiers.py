"""Every tier through the real pipeline next to its medium's raw limit, measured in the same run.

    ./scripts/bench tiers                # or: .venv/bin/python benchmarks/bench_tiers.py --help

Starts its own redis-server on a free loopback port. Prints GB/s per tier and per raw limit and
the ratio tier / raw; writes benchmarks/results/tiers-<UTC time>.json and a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

from tieredkv.bench import BASELINES, SIZES, KiB, MiB, machine_info, plot, ratios, run_tier_bench
from tieredkv.testing.servers import RedisServer

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(str(s // KiB) for s in SIZES), help="chunk sizes in KiB")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per size and figure")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiers", default="cpu,lmdb,redis")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test): 2 sizes, 16 MiB, 1 rep")
    a = ap.parse_args(argv)
    sizes = [int(x) * KiB for x in a.sizes.split(",")]
    total, reps = a.total_mib * MiB, a.reps
    if a.quick:
        sizes, total, reps = [64 * KiB, 1 * MiB], 16 * MiB, 1
    kinds = tuple(a.tiers.split(","))
    with RedisServer() as srv:
        results = run_tier_bench(
            sizes, total, reps, kinds, redis_url=srv.url, redis_port=srv.port, log=lambda m: print(m, file=sys.stderr)
        )
    print_table(results)
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    base = os.path.join(a.out, f"tiers-{stamp}{'-quick' if a.quick else ''}")
    with open(base + ".json", "w") as f:
        json.dump(
            {
                "machine": machine_info(),
                "total_bytes_per_figure": total,
                "reps": reps,
                "results": [
                    {"size": r.size, "chunks": r.chunks, "gbps": r.gbps, "reps": r.reps, "ratios": ratios(r)}
                    for r in results
                ],
            },
            f,
            indent=1,
        )
    try:
        plot(results, base + ".png")
        print(f"wrote {base}.json and {base}.png")
    except ImportError:
        print(f"wrote {base}.json (install matplotlib for the plot: pip install 'tieredkv[bench]')")
    return 0


def print_table(results: list) -> None:
    keys = list(BASELINES)
    head = f"{'size':>8} | " + " | ".join(f"{k:>17}" for k in keys)
    print("tieredkv GB/s (raw GB/s) ratio")
    print(head)
    print("-" * len(head))
    for r in results:
        cells = []
        for k in keys:
            b = BASELINES[k]
            if k in r.gbps and b in r.gbps:
                cells.append(f"{r.gbps[k]:.2f}/{r.gbps[b]:.2f} {r.gbps[k] / r.gbps[b]:.2f}x".rjust(17))
            else:
                cells.append(" " * 17)
        label = f"{r.size // KiB} KiB" if r.size < MiB else f"{r.size // MiB} MiB"
        print(f"{label:>8} | " + " | ".join(cells))
    print("baselines: " + ", ".join(f"{k} vs {v}" for k, v in BASELINES.items()))


if __name__ == "__main__":
    raise SystemExit(main())

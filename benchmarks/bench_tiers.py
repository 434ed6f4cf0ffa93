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

from tieredkv.backends.registry import config_model
from tieredkv.bench import (
    LAYOUTS,
    BenchResult,
    KiB,
    MiB,
    add_run_args,
    floored_figures,
    judged_lines,
    machine_info,
    plot,
    ratio_rows,
    raw_figures,
    raw_rows,
    result_row,
    run_plan,
    run_tier_bench,
    size_label,
    steady_malloc,
    tier_tables,
)
from tieredkv.config import TierConfigBase
from tieredkv.testing.servers import RedisServer

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, total_mib=256, per="figure and rep", reps=5, quick_sizes=[64 * KiB, 1 * MiB], quick_mib=16)
    ap.add_argument(
        "--tiers",
        default="cpu,lmdb,lmdb:sync_mode=durable,fs,redis",
        help="tier kinds, each with its defaults; kind:field=value[:field=value] sets fields (and names it)",
    )
    ap.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="block-id layouts, the first the default figure: permuted (a churned pool), fragmented"
        " (short runs), consecutive (a fresh pool, the best case)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    sizes, total, reps = run_plan(a)
    steady_malloc()  # this process is a bench: raw baselines at the medium's limit
    with RedisServer() as srv:
        tiers = [tier_config(kind, srv.url) for kind in a.tiers.split(",")]
        results = run_tier_bench(
            tiers, sizes, total, reps, log=lambda m: print(m, file=sys.stderr), layouts=a.layouts.split(",")
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
                "layouts": a.layouts.split(","),
                "results": [result_row(r) for r in results],
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


def tier_config(spec: str, url: str) -> TierConfigBase:
    """``kind`` or ``kind:field=value[:field=value]``: the kind's defaults with those fields set
    (named ``kind-value-...``); a tier with a server ``url`` field points at this run's redis-server."""
    kind, *sets = spec.split(":")
    model = config_model(kind)
    fields = dict(item.split("=", 1) for item in sets)
    if fields:
        fields.setdefault("name", "-".join([kind, *fields.values()]))
    return model.model_validate({"kind": kind, **({"url": url} if "url" in model.model_fields else {}), **fields})


def print_table(results: list[BenchResult]) -> None:
    for title, cols, rows in tier_tables(results):
        _print_rows(title, cols, [[label, *cells] for label, *cells in rows], rule=True)
    for line in judged_lines(results):
        print(line)
    floored = floored_figures(results, layouts=False)
    if floored:
        title = "tieredkv GB/s / integrity floor GB/s (ratio): the medium's raw work plus a checksum of every payload"
        _print_rows(title, floored, ratio_rows(results, floored, floors=True))
    raw = raw_figures(results)
    if raw:
        print("raw limits GB/s: each medium without tieredkv, on the same bytes")
        width = max(len(k) for k, *_ in raw_rows(results, raw))
        print(f"{'figure':>{width}} | " + " | ".join(f"{size_label(r.size):>8}" for r in results))
        for name, *cells in raw_rows(results, raw):
            print(f"{name:>{width}} | " + " | ".join(c.rjust(8) for c in cells))


def _print_rows(title: str, keys: list[str], rows: list[list[str]], rule: bool = False) -> None:
    head = f"{'size':>8} | " + " | ".join(f"{k:>22}" for k in keys)
    print(title)
    print(head)
    if rule:
        print("-" * len(head))
    for label, *cells in rows:
        print(f"{label:>8} | " + " | ".join(c.rjust(22) for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())

"""Soak: the demo workload for N minutes against CPU + Redis + LMDB while Redis is killed and
restarted at random moments.

    .venv/bin/python benchmarks/soak.py --minutes 10 [--seed 0] [--restart-mean-s 20] [--json out.json]

Each round replays a ``tieredkv demo`` trace (hybrid model: full attention + sliding window)
through a fresh :class:`~tieredkv.store.TieredStore` (so some rounds open while Redis is down);
trace seeds repeat, so later rounds hit what earlier rounds stored (in LMDB, and in Redis when it
survived). A background thread SIGKILLs the ``redis-server`` (no persistence: its data is lost)
and restarts it on the same port after a short outage.

Reports: operations (requests, lookups, store and load jobs), errors surfaced to the caller
(exceptions out of the TieredStore API — must be 0), wrong bytes (loaded blocks that differ from
what computing them gives — must be 0), loads of accepted hits that failed (the tier died between
lookup and load; an engine recomputes those, as this one does), dropped stores, breaker opens,
Redis restarts and RSS after each round, post-GC (first vs last minute). Exit status 1 when
errors or wrong bytes are not 0.

Not part of the test suite (it runs for minutes); the lead runs it for the closing note.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tieredkv import demo
from tieredkv.config import load_config
from tieredkv.testing.servers import RedisServer


class SoakEngine(demo._Engine):
    """The demo engine, except that a failed load of an accepted hit is recomputed (as vLLM does
    with the blocks a connector reports failed) instead of raising."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.lookups = 0
        self.load_failed_jobs = 0

    def admit(self, r: Any) -> bool:
        self.lookups += 1
        return super().admit(r)

    def failed_load(self, r: Any, pos: int, gl: Any, res: Any) -> None:
        self.load_failed_jobs += 1  # recompute these blocks
        for b, p in zip(gl.dst_block_ids, gl.block_positions):
            self.fill_block(r, pos, p, b)

    def extra_summary(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "load_failed_jobs": self.load_failed_jobs}


def run_round(cfg: Any, o: demo.DemoOptions) -> dict[str, Any]:
    """``demo.run_demo`` with :class:`SoakEngine`; the demo summary plus soak counters."""
    return demo.run_demo(cfg, o, engine_cls=SoakEngine, device="cpu")


class _CountWarnings(logging.Handler):
    """Counts tieredkv warnings (dropped stores, failed loads) instead of printing each one."""

    def __init__(self, totals: Counter[str], verbose: bool) -> None:
        super().__init__(logging.WARNING)
        self.totals, self.verbose = totals, verbose

    def emit(self, record: logging.LogRecord) -> None:
        self.totals[f"log_{record.levelname.lower()}s"] += 1
        if self.verbose or record.levelno >= logging.ERROR:
            print(f"{record.levelname}: {self.format(record)}", file=sys.stderr, flush=True)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="How long to run (default 10).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-mean-s", type=float, default=20.0, help="Mean seconds between Redis kills.")
    ap.add_argument("--max-down-s", type=float, default=2.0, help="Longest Redis outage per kill.")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--traces", type=int, default=5, help="Distinct trace seeds cycled through (reuse = hits).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    ap.add_argument("--verbose", action="store_true", help="Print every tieredkv warning.")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    data = Path(tempfile.mkdtemp(prefix="tieredkv-soak-"))
    totals: Counter[str] = Counter()
    errors: list[str] = []
    rss: list[tuple[float, int]] = []
    stop = threading.Event()
    t_start = time.monotonic()
    tk_log = logging.getLogger("tieredkv")
    tk_log.addHandler(_CountWarnings(totals, args.verbose))
    tk_log.propagate = False

    with RedisServer(maxmemory="256mb", maxmemory_policy="allkeys-lru") as srv:
        cfg = load_config(
            {
                "namespace": {"model": "soak/hybrid"},
                "tiers": [
                    {"kind": "cpu", "capacity_bytes": "32MiB", "segment_bytes": "1MiB"},
                    {
                        "kind": "redis",
                        "url": srv.url,
                        "socket_timeout_s": 0.5,
                        "connect_timeout_s": 0.2,
                        "op_timeout_s": 2.0,
                    },
                    {"kind": "lmdb", "path": str(data / "lmdb"), "map_size_bytes": "1GiB", "size_cap_bytes": "512MiB"},
                ],
                "pipeline": {
                    "breaker_failures": 3,
                    "breaker_reset_s": 1.0,
                    "job_timeout_s": 20,
                    "staging_bytes": "64MiB",
                },
            },
            env={},
        )

        def chaos() -> None:
            while not stop.wait(min(max(rng.expovariate(1 / args.restart_mean_s), 3.0), 3 * args.restart_mean_s)):
                srv.kill()
                totals["redis_kills"] += 1
                stop.wait(rng.uniform(0.0, args.max_down_s))
                try:
                    srv.restart()
                    totals["redis_restarts"] += 1
                except RuntimeError as e:  # keep going; count it
                    errors.append(f"redis restart failed: {e}")

        threads = [threading.Thread(target=chaos, name="soak-chaos", daemon=True)]
        for t in threads:
            t.start()
        rnd = 0
        try:
            while time.monotonic() < deadline:
                o = demo.DemoOptions(
                    conversations=args.conversations, turns=args.turns, seed=args.seed * 1000 + rnd % args.traces
                )
                rnd += 1
                try:
                    s = run_round(cfg, o)
                except Exception:  # noqa: BLE001 - an error surfaced to the caller: the thing we count
                    totals["errors_surfaced"] += 1
                    errors.append(traceback.format_exc(limit=6))
                    continue
                # A closed store's buffers sit in reference cycles until the cyclic GC runs; collect
                # now so RSS measures what is really kept, not when the GC last ran.
                gc.collect()
                rss.append((time.monotonic() - t_start, rss_bytes()))
                totals["rounds"] += 1
                totals["requests"] += s["requests"]
                totals["lookups"] += s["lookups"]
                totals["store_jobs"] += s["store"]["jobs"]
                totals["load_jobs"] += s["load"]["jobs"]
                totals["store_jobs_failed"] += s["store"]["failed"]
                totals["load_failed_jobs_recomputed"] += s["load_failed_jobs"]
                totals["verified_blocks"] += s["verified_blocks"]
                totals["wrong_bytes_blocks"] += s["mismatches"]
                totals["stored_mib"] += s["store"]["bytes"] >> 20
                totals["loaded_mib"] += s["load"]["bytes"] >> 20
                for tier, n in s["drops"].items():
                    totals[f"drops_{tier}"] += n
                for tier, n in s["breaker_opens"].items():
                    totals[f"breaker_opens_{tier}"] += n
                for tier, row in s["tiers"].items():
                    totals[f"hits_{tier}"] += row["hits"]
                print(
                    f"[{(time.monotonic() - t_start) / 60:5.1f} min] round {rnd}: {s['requests']} requests, "
                    f"{s['verified_blocks']} blocks verified, {s['mismatches']} wrong, "
                    f"{s['load_failed_jobs']} loads recomputed, redis breaker opens "
                    f"{s['breaker_opens'].get('redis', 0)}, rss {rss_bytes() >> 20} MiB",
                    flush=True,
                )
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)

    elapsed = time.monotonic() - t_start
    # RSS after each round (post-GC): mean of the first minute's rounds vs the last minute's.
    first = [b for t, b in rss if t <= 60] or [b for _, b in rss[:1]]
    last = [b for t, b in rss if t >= elapsed - 60] or [b for _, b in rss[-1:]]
    report: dict[str, Any] = {
        "minutes": round(elapsed / 60, 2),
        **dict(totals),
        "errors_surfaced": totals["errors_surfaced"],
        "wrong_bytes_blocks": totals["wrong_bytes_blocks"],
        "rss_first_minute_mib": round(sum(first) / len(first) / 2**20, 1) if first else None,
        "rss_last_minute_mib": round(sum(last) / len(last) / 2**20, 1) if last else None,
        "rss_max_mib": round(max(b for _, b in rss) / 2**20, 1) if rss else None,
    }
    if first and last:
        report["rss_growth_mib"] = round((sum(last) / len(last) - sum(first) / len(first)) / 2**20, 1)
    print(json.dumps(report, indent=2))
    for e in errors[:3]:
        print("error surfaced:\n" + e, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"report": report, "errors": errors[:20]}, indent=2))
    ok = report["errors_surfaced"] == 0 and report["wrong_bytes_blocks"] == 0
    print(
        "SOAK " + ("OK" if ok else "FAILED") + ": errors surfaced "
        f"{report['errors_surfaced']}, wrong bytes {report['wrong_bytes_blocks']}"
    )
    shutil.rmtree(data, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

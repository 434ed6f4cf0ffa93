"""Scheduler-side cost per engine step: vLLM's OffloadingConnector vs TieredKVConnector.

Runs vLLM 0.33's real scheduler with the engine-loop harness (``tests/vllm/engine.py``: emulated
model runner, CPU tensors) on a hybrid model (full attention + sliding window + Mamba,
``blocks_per_chunk`` 1) with N concurrent requests of ~600 tokens, twice (the second round hits),
and times every scheduler-side connector hook (lookups, allocation, ``build_connector_meta``,
outputs, ``request_finished``): µs per engine step. With ``--fault always`` every
``prepare_store`` is refused, so the chunks waiting to be stored grow every step (vLLM re-offers
its whole backlog each pass; tieredkv offers at most ``max_store_keys_per_step`` per request and
holds finished requests' blocks up to its hold budget).

Not part of the test suite. Usage (vLLM venv, from the repository root):

    .venv-vllm/bin/python benchmarks/bench_connector.py [--requests 6 24 96]
    .venv-vllm/bin/python benchmarks/bench_connector.py --table REPORT.json   # the suite's table
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/vllm

from tests.vllm.engine import ReqSpec, reference_extra_config, run_engine
from tests.vllm.faults import StoreFault

TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}


def workload(n: int, seed: int = 0) -> list[list[ReqSpec]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(560, 640))] for _ in range(n)]
    first = [ReqSpec(f"R{i}", 0, tuple(p), 4) for i, p in enumerate(prompts)]
    again = [ReqSpec(f"R{i}b", 0, tuple(p), 4) for i, p in enumerate(prompts)]
    return [first, again]


def render(report_path: str) -> None:
    """Markdown table of a ``CONNECTOR_REPORT`` JSON written by ``tests/vllm/test_connector.py``."""
    import json

    rows = json.loads(Path(report_path).read_text())
    print(
        "| groups | bpc | async | variant | hits OffloadingConnector | hits TieredKVConnector | "
        "first-load hits O → T | lost O → T | keys offered O → T | µs/step O → T |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rec in rows:
        for variant, runs in rec["variants"].items():
            o, t = runs["OffloadingConnector"], runs["TieredKVConnector"]

            def hits(r: dict, key: str = "hits") -> str:
                return "/".join(str(v) for v in r[key].values())

            print(
                f"| {rec['groups']} | {rec['bpc']} | {int(rec['async'])} | {variant} | {hits(o)} | {hits(t)} | "
                f"{hits(o, 'first_hits')} → {hits(t, 'first_hits')} | {o['lost']} → {t['lost']} | "
                f"{o['keys_offered']} → {t['keys_offered']} | {o['us_per_step']} → {t['us_per_step']} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, nargs="+", default=[6, 24, 96])
    ap.add_argument("--fault", nargs="+", default=["none", "always"])
    ap.add_argument("--table", metavar="REPORT_JSON", help="only render a CONNECTOR_REPORT as markdown")
    args = ap.parse_args()
    if args.table:
        render(args.table)
        return
    groups = ("full", "swa", "mamba")
    print(
        f"{'requests':>8} {'fault':>7} {'connector':>20} {'steps':>6} {'us/step':>8} {'keys offered':>12} "
        f"{'hits full/swa/mamba':>20} {'wrong':>5}"
    )
    for n in args.requests:
        for fault in args.fault:
            for name, kw in (("OffloadingConnector", {}), ("TieredKVConnector", TKC)):
                r = run_engine(
                    reference_extra_config(1),
                    groups=groups,
                    blocks_per_chunk=1,
                    workload=workload(n),
                    num_gpu_blocks=60 * n + 64,
                    max_num_seqs=n,
                    max_num_batched_tokens=4096,
                    long_prefill_token_threshold=512,
                    step_budget=20000,
                    store_fault=None if fault == "none" else StoreFault(fault),
                    **kw,
                )
                hits = "/".join(str(r.hit_tokens.get(g, 0)) for g in groups)
                us = r.connector_s / max(1, r.steps) * 1e6
                print(
                    f"{n:>8} {fault:>7} {name:>20} {r.steps:>6} {us:>8.0f} {r.keys_offered or 0:>12} {hits:>20} "
                    f"{r.wrong_bytes:>5}"
                    + (f" ERROR {r.error}" if r.error else "")
                    + ("" if r.idle_reached else " NOT-IDLE"),
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""Scheduler-side cost inside vLLM per engine step: tieredkv's manager vs vLLM's CPU manager.

Runs vLLM 0.33's real scheduler with the engine-loop harness (``tests/vllm/engine.py``: emulated
model runner on CPU tensors, every KV byte checked) and times, per engine step, every call the
connector makes into its ``OffloadingManager`` (``lookup``, ``prepare_load``, ``touch``,
``complete_load``, ``prepare_store``, ``complete_store``, ``take_events``, ``get_stats``,
``on_schedule_end``, ...) and every scheduler-side connector hook the scheduler calls
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished``, ``take_events``, ``get_kv_connector_stats``,
...). Variants (interleaved, one rep of each before the next rep):

* ``O+cpu``: vLLM's ``OffloadingConnector`` + vLLM's ``CPUOffloadingSpec`` (CPU stand-in worker);
* ``O+tkv``: vLLM's ``OffloadingConnector`` + ``TieredKVOffloadingSpec`` (one in-process CPU tier);
* ``T+tkv``: ``TieredKVConnector`` + ``TieredKVOffloadingSpec``.

Manager µs/step: ``O+tkv`` vs ``O+cpu`` (same connector, only the manager differs). Connector
µs/step (hooks, manager calls inside them included): ``T+tkv`` vs ``O+cpu``. Timers wrap the
classes' own methods, so the harness's bookkeeping around the hooks is not counted (the part of
its ``prepare_store`` wrapper that runs inside a hook is measured and subtracted). Only the
outermost call of each kind is timed (a manager method calling another counts once).

Not part of the test suite. Usage (vLLM venv, from the repository root):

    .venv-vllm/bin/python benchmarks/bench_manager.py [--reps 3] [--json out.json] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/vllm

from tests.vllm.engine import (
    Engine,
    ReqSpec,
    RunResult,
    _drive,
    build_workload,
    cpu_workers,
    reference_extra_config,
    tieredkv_extra_config,
)

MANAGER_METHODS = (
    "lookup",
    "lookup_prefix",
    "get_load_source",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
    "take_events",
    "on_schedule_end",
    "has_pending_work",
    "reset_cache",
    "on_reset_flushed",
    "get_stats",
    "config_info",
)
CONNECTOR_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "on_new_request",
    "has_pending_push_work",
    "has_pending_block_frees",
    "take_events",
    "get_kv_connector_stats",
    "reset_cache",
)
TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}
VARIANTS = ("O+cpu", "O+tkv", "T+tkv")
# The same with tieredkv's counters read for vLLM's stats on every step (``stats_interval_s`` 0,
# the behaviour before the interval): the "before" columns.
BEFORE = ("O+tkv0", "T+tkv0")


class Timers:
    """Per-kind (``mgr`` / ``conn``) totals and call counts; only the outermost call is timed.

    Only ``perf_counter`` is read (``thread_time`` is a system call of ~2 µs here: reading it
    around every manager call made the hooks around them ~4 µs a call slower on both sides). The
    wrapper's own cost inside an enclosing hook (:func:`wrapper_overhead`) is taken off the
    connector's total once per manager call made inside a hook (``nested``)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.by_method: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)
        self.nested = 0  # timed calls made inside a connector hook

    def wrap(self, kind: str, name: str, fn: Any) -> Any:
        clock = time.perf_counter
        depth, total, by_method, calls = self.depth, self.total, self.by_method, self.calls
        label = f"{kind}.{name}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if depth[kind]:
                return fn(*args, **kwargs)
            if kind != "conn" and depth["conn"] and not depth["harness"]:
                self.nested += 1
            depth[kind] += 1
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t
                depth[kind] -= 1
                total[kind] += dt
                by_method[label] += dt
                calls[label] += 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


def wrapper_overhead(n: int = 200_000) -> float:
    """Seconds a timed call adds to an enclosing timer, over a bare call (median of 5)."""

    class _A:
        def f(self, x: int) -> int:
            return x

    a, timers = _A(), Timers()
    timed = timers.wrap("mgr", "f", _A.f)
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            a.f(1)
        t1 = time.perf_counter()
        for _ in range(n):
            timed(a, 1)
        out.append((time.perf_counter() - t1 - (t1 - t0)) / n)
    return statistics.median(out)


@contextlib.contextmanager
def patched_classes(timers: Any) -> Iterator[None]:
    """Timers on the manager classes' and the connector class's own methods (class level, so the
    bound methods the harness captures when it builds the engine are the timed ones)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from tieredkv.integrations.vllm.spec import TieredKVManager

    saved: list[tuple[type, str, Any]] = []
    targets: list[tuple[type, str, tuple[str, ...]]] = [
        (CPUOffloadingManager, "mgr", MANAGER_METHODS),
        (TieredKVManager, "mgr", MANAGER_METHODS),
        (OffloadingConnector, "conn", CONNECTOR_HOOKS),
    ]
    for cls, kind, names in targets:
        for name in names:
            fn = getattr(cls, name, None)
            if fn is None:
                continue
            saved.append((cls, name, cls.__dict__.get(name)))
            setattr(cls, name, timers.wrap(kind, name, fn))
    try:
        yield
    finally:
        for cls, name, old in reversed(saved):
            if old is None:
                delattr(cls, name)
            else:
                setattr(cls, name, old)


def write_config(path: Path) -> Path:
    """tieredkv with one in-process CPU tier as large as the reference's 64 MiB CPU pool."""
    cfg = {
        "version": 1,
        "namespace": {"model": "x"},
        "tiers": [{"kind": "cpu", "name": "cpu", "capacity_bytes": "64MiB"}],
        "pipeline": {"staging_bytes": "8MiB"},
    }
    path.write_text(json.dumps(cfg))
    return path


def many_workload(n: int, seed: int = 0) -> list[list[ReqSpec]]:
    """``bench_connector``'s schedule: n requests of ~600 tokens, then the same prompts again."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(560, 640))] for _ in range(n)]
    first = [ReqSpec(f"R{i}", 0, tuple(p), 4) for i, p in enumerate(prompts)]
    again = [ReqSpec(f"R{i}b", 0, tuple(p), 4) for i, p in enumerate(prompts)]
    return [first, again]


def schedules() -> dict[str, dict[str, Any]]:
    hybrid = ("full", "swa", "mamba")
    return {
        # The harness's default: three phases, chunked prefill (24-token cap), preemptions.
        "3phase full": {"groups": ("full",), "workload": None},
        "3phase full+swa+mamba": {"groups": hybrid, "workload": None},
        "3phase full+swa+mamba async": {"groups": hybrid, "workload": None, "async_scheduling": True},
        # bench_connector's: N requests of ~600 tokens twice (the second round hits).
        "24 req x2 full+swa+mamba": {
            "groups": hybrid,
            "workload": many_workload(24),
            "num_gpu_blocks": 60 * 24 + 64,
            "max_num_seqs": 24,
            "max_num_batched_tokens": 4096,
            "long_prefill_token_threshold": 512,
        },
    }


def _engine_args(
    variant: str, sched: dict[str, Any], cfg_path: Path, bpc: int, settle: bool
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The engine's extra config, connector and schedule keywords for ``variant``."""
    if variant.startswith("O+cpu"):  # "O+cpu1": the stand-in completes each job a step later
        extra = reference_extra_config(bpc, delay_steps=int(variant[5:] or 0))
    else:
        extra = tieredkv_extra_config(bpc, cfg_path)
    if variant.endswith("0"):
        extra["stats_interval_s"] = 0
    kw: dict[str, Any] = dict(TKC) if variant.startswith("T+") else {}
    eng_kw = {k: v for k, v in sched.items() if k != "workload"}
    eng_kw["settle"] = settle
    return extra, kw, eng_kw


def run_once(
    variant: str, sched: dict[str, Any], cfg_path: Path, bpc: int = 1, overhead: float = 0.0, settle: bool = True
) -> dict[str, Any]:
    """One run; ``overhead``: :func:`wrapper_overhead`, taken off the connector per nested call.

    ``settle``: each step's transfers finish before the step reports (the harness's model of a
    device step that outlasts the tier I/O it overlaps; untimed), as vLLM's stand-in worker's
    copies do. Without it tieredkv's pipeline, which completes on its own thread, reports a store
    a step later than the synchronous stand-in: finished requests keep their blocks a step
    longer, the 3-phase full-attention schedule preempts once more and takes 138 steps instead of
    126 (``O+cpu1``, the stand-in one step late, takes the same 138)."""
    extra, kw, eng_kw = _engine_args(variant, sched, cfg_path, bpc, settle)
    res = RunResult(tuple(sched["groups"]), bpc, bool(sched.get("async_scheduling", False)))
    timers = Timers()
    phases = sched["workload"] if sched["workload"] is not None else build_workload(0)
    per_step: dict[str, list[float]] = {"mgr": [], "conn": []}
    by_hook_steps: list[dict[str, float]] = []
    with patched_classes(timers), cpu_workers(extra, False):
        eng = Engine(extra, blocks_per_chunk=bpc, result=res, **kw, **eng_kw)
        assert eng.connector_scheduler is not None
        m = eng.connector_scheduler.manager
        # The harness's prepare_store wrapper (counting, fault hook) runs inside the connector's
        # hooks: time it whole, so its own part can be taken off the connector total.
        harness_store = m.prepare_store
        m.prepare_store = timers.wrap("harness", "prepare_store", harness_store)
        step = eng.step

        def timed_step() -> bool:
            before = dict(timers.total)
            hooks_before = dict(timers.by_method)
            mps = timers.by_method["mgr.prepare_store"]
            nested = timers.nested
            try:
                return step()
            finally:
                per_step["mgr"].append(timers.total["mgr"] - before.get("mgr", 0.0))
                harness_own = (timers.total["harness"] - before.get("harness", 0.0)) - (
                    timers.by_method["mgr.prepare_store"] - mps
                )
                wrappers = (timers.nested - nested) * overhead
                per_step["conn"].append(timers.total["conn"] - before.get("conn", 0.0) - harness_own - wrappers)
                by_hook_steps.append(
                    {k[5:]: v - hooks_before.get(k, 0.0) for k, v in timers.by_method.items() if k.startswith("conn.")}
                )

        eng.step = timed_step  # type: ignore[method-assign]
        try:
            _drive(eng, phases, 20000, 200, 0.001, 200, False)
        finally:
            res.steps = eng.step_no
            eng.shutdown()
    steps = max(1, res.steps)
    harness_own = timers.total["harness"] - timers.by_method["mgr.prepare_store"]
    conn = timers.total["conn"] - harness_own - timers.nested * overhead
    hits = sum(res.hit_tokens.values())
    return {
        "variant": variant,
        "steps": res.steps,
        "idle": res.idle_reached,
        "wrong_bytes": res.wrong_bytes,
        "error": res.error,
        "hit_tokens": dict(res.hit_tokens),
        "hits": hits,
        "keys_offered": res.keys_offered,
        "mgr_us_step": timers.total["mgr"] / steps * 1e6,
        "conn_us_step": conn / steps * 1e6,
        "conn_nested_calls": timers.nested,
        "wrapper_overhead_us": overhead * 1e6,
        "mgr_us_step_median": statistics.median(per_step["mgr"]) * 1e6 if per_step["mgr"] else 0.0,
        "mgr_us_step_p90": _pct(per_step["mgr"], 0.9) * 1e6,
        "conn_us_step_p90": _pct(per_step["conn"], 0.9) * 1e6,
        "conn_us_steps": [round(x * 1e6, 3) for x in per_step["conn"]],
        "mgr_us_steps": [round(x * 1e6, 3) for x in per_step["mgr"]],
        "conn_us_steps_by_hook": {
            h: [round(d.get(h, 0.0) * 1e6, 3) for d in by_hook_steps] for h in set().union(*by_hook_steps)
        },
        "mgr_calls": {k[4:]: v for k, v in timers.calls.items() if k.startswith("mgr.")},
        "mgr_us_by_method": {k[4:]: v * 1e6 / steps for k, v in timers.by_method.items() if k.startswith("mgr.")},
        "conn_us_by_hook": {k[5:]: v * 1e6 / steps for k, v in timers.by_method.items() if k.startswith("conn.")},
    }


# ---- instructions (callgrind): the same runs, counted instead of timed --------------------------

_CG_SOURCE = """
#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *s) { CALLGRIND_DUMP_STATS_AT(s); }
int cg_running(void) { return RUNNING_ON_VALGRIND; }
"""
CG_VARIANTS = (("conn", "O+cpu"), ("conn", "T+tkv"), ("mgr", "O+cpu"), ("mgr", "O+tkv"))
_CG_STATS_INTERVAL_S = 1e6  # see count_once
_CG_OUT = "BENCH_MANAGER_CG_OUT"  # the child's callgrind dump files and results (not TIEREDKV_*: overrides)


class Collector:
    """Switches callgrind's collection on inside what is measured and off elsewhere.

    ``counting="conn"``: inside the connector's outermost hooks; ``"mgr"``: inside the manager's
    outermost calls. The harness's ``prepare_store`` wrapper inside a hook is not counted (the
    manager's own ``prepare_store`` inside it is), as the timers take it off. A stack of wanted
    states: collection follows its top, one toggle per change. Each outermost measured call ends
    with a dump named after it (callgrind then starts counting from zero): instructions by hook."""

    def __init__(self, lib: Any, counting: str) -> None:
        self.lib, self.counting = lib, counting
        self.stack: list[bool] = []
        self.on = False
        self.depth: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        want = bool(self.stack) and self.stack[-1]
        if want != self.on:
            self.lib.cg_toggle()
            self.on = want

    def wrap(self, kind: str, name: str, fn: Any) -> Any:
        if kind == "mgr" and self.counting == "conn" and name != "prepare_store":
            # Counting hooks, a manager call inside one changes nothing: left bare, so a side that
            # makes more manager calls (vLLM's key-by-key lookups) pays no wrapper for them.
            # prepare_store is wrapped: the harness's wrapper around it switches collection off.
            return fn
        depth = self.depth

        def counted(*args: Any, **kwargs: Any) -> Any:
            if kind == "harness":
                want = False
            elif depth[kind]:
                return fn(*args, **kwargs)  # only the outermost call of a kind changes anything
            elif kind == "mgr":
                want = self.counting == "mgr" or depth["conn"] > 0
            else:
                want = self.counting == "conn"
            depth[kind] += 1
            self.stack.append(want)
            self._sync()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                self._sync()
                depth[kind] -= 1
                if want and kind == self.counting:
                    self.lib.cg_dump(f"hook|{name}".encode())

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted


def count_once(lib: Any, counting: str, variant: str, sched_name: str, cfg_path: Path, out_dir: Path) -> dict[str, Any]:
    """One settled run under callgrind, counted by hook (``counting="conn"``) or by manager
    method (``"mgr"``). The cyclic GC is off during the run (as ``timeit`` does): a collection
    is counted in whatever hook happens to trigger it."""
    import gc

    sched = schedules()[sched_name]
    extra, kw, eng_kw = _engine_args(variant, sched, cfg_path, 1, True)
    if "stats_interval_s" not in extra and not variant.startswith("O+cpu"):
        # Under valgrind a step takes seconds: tieredkv's stats, read "at most every
        # stats_interval_s (0.1 s) while transfers are in flight" and on quiet steps, were read
        # on 76 of 114 hybrid steps. In real time the same runs read them 18 / 17 / 14 / 6 times
        # (schedules in order) with the 0.1 s interval and 18 / 14 / 12 / 3 with no read on time
        # (counted, 2026-12-04): no read on time is the closer model of a real run here.
        extra["stats_interval_s"] = _CG_STATS_INTERVAL_S
    res = RunResult(tuple(sched["groups"]), 1, bool(sched.get("async_scheduling", False)))
    col = Collector(lib, counting)
    phases = sched["workload"] if sched["workload"] is not None else build_workload(0)
    gc.collect()
    gc.disable()
    try:
        with patched_classes(col), cpu_workers(extra, False):
            eng = Engine(extra, blocks_per_chunk=1, result=res, **kw, **eng_kw)
            assert eng.connector_scheduler is not None
            m = eng.connector_scheduler.manager
            m.prepare_store = col.wrap("harness", "prepare_store", m.prepare_store)
            _read_dumps(out_dir)  # drop what came before
            lib.cg_zero()
            try:
                _drive(eng, phases, 20000, 200, 0.001, 200, False)
            finally:
                res.steps = eng.step_no
                eng.shutdown()
    finally:
        gc.enable()
    by_hook = _read_dumps(out_dir)
    return {
        "counting": counting,
        "variant": variant,
        "schedule": sched_name,
        "steps": res.steps,
        "hits": sum(res.hit_tokens.values()),
        "wrong_bytes": res.wrong_bytes,
        "error": res.error,
        "instructions": sum(by_hook.values()),
        "by_hook": by_hook,
    }


def build_toggle_lib(tmp: Path) -> Path:
    src, lib = tmp / "cgtoggle.c", tmp / "libcgtoggle.so"
    src.write_text(_CG_SOURCE)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _read_dumps(out_dir: Path) -> dict[str, int]:
    """The instructions of the main thread's ``hook|NAME`` dumps in ``out_dir``, summed by name;
    every dump file read is deleted (a hybrid run writes ~1,500 of ~250 KB)."""
    found: dict[str, int] = defaultdict(int)
    for f in out_dir.glob("cg.out.*.*-*"):
        label = total = None
        if f.name.endswith("-01"):  # thread 1: the engine's (the scheduler's hooks run there)
            with f.open() as fh:
                for line in fh:
                    if line.startswith("desc: Trigger: Client Request: "):
                        label = line.split("Client Request: ", 1)[1].strip()
                    elif line.startswith(("totals:", "summary:")):
                        total = int(line.split()[1])
                        break
        if label and label.startswith("hook|") and total is not None:
            found[label[5:]] += total
        f.unlink()
    return dict(found)


def callgrind_table(rows: list[dict[str, Any]], names: list[str]) -> str:
    """Instructions per step, and per run, by schedule (the same columns as the timed table)."""
    by = {(r["counting"], r["schedule"], r["variant"]): r for r in rows}
    lines = [
        (
            "| schedule | steps O+cpu / T+tkv | manager instr/step vLLM CPU | tieredkv | ratio "
            "| connector instr/step O+cpu | T+tkv | ratio per step | ratio per run |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def per_step(r: dict[str, Any]) -> float:
        return float(r["instructions"]) / max(1, r["steps"])

    for n in names:
        try:
            co, ct = by[("conn", n, "O+cpu")], by[("conn", n, "T+tkv")]
            mo, mt = by[("mgr", n, "O+cpu")], by[("mgr", n, "O+tkv")]
        except KeyError:
            continue
        lines.append(
            f"| {n} | {co['steps']} / {ct['steps']} | {per_step(mo) / 1e3:.0f}k | {per_step(mt) / 1e3:.0f}k "
            f"| {per_step(mt) / per_step(mo):.2f} | {per_step(co) / 1e3:.0f}k | {per_step(ct) / 1e3:.0f}k "
            f"| {per_step(ct) / per_step(co):.2f} | {ct['instructions'] / co['instructions']:.2f} |"
        )
    return "\n".join(lines)


def hooks_table(rows: list[dict[str, Any]], names: list[str]) -> str:
    """Connector instructions per step by hook, O+cpu vs T+tkv."""
    by = {(r["counting"], r["schedule"], r["variant"]): r for r in rows}
    out = []
    for n in names:
        if ("conn", n, "O+cpu") not in by or ("conn", n, "T+tkv") not in by:
            continue
        o, t = by[("conn", n, "O+cpu")], by[("conn", n, "T+tkv")]
        out.append(f"{n}: connector instructions per step by hook (O+cpu / T+tkv)")
        for h in sorted(set(o["by_hook"]) | set(t["by_hook"])):
            a = o["by_hook"].get(h, 0) / max(1, o["steps"])
            b = t["by_hook"].get(h, 0) / max(1, t["steps"])
            out.append(f"  {h:36} {a / 1e3:9.1f}k {b / 1e3:9.1f}k {(b - a) / 1e3:+9.1f}k")
    return "\n".join(out)


def run_callgrind(names: list[str], json_path: str | None) -> None:
    """Re-run this script under ``valgrind --tool=callgrind`` (collection off at start; switched
    on only inside what is measured) and print instructions per step: repeatable whatever else
    the machine does, where the timed runs swing up to 2x from rep to rep on this VM."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-manager-cg-"))
    lib = build_toggle_lib(tmp)
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--separate-threads=yes",
        f"--callgrind-out-file={tmp}/cg.out.%p",
        sys.executable,
        __file__,
        "--schedules",
        *names,
    ]
    env = dict(os.environ, BENCH_MANAGER_CG_LIB=str(lib), **{_CG_OUT: str(tmp)})
    print(f"under callgrind (vLLM's import alone takes minutes): {' '.join(cmd)}", flush=True)
    log = tmp / "child.log"
    with log.open("w") as err:  # valgrind's own lines and the child's traceback, if any
        rc = subprocess.run(cmd, env=env, stderr=err, check=False).returncode
    if rc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"the run under callgrind failed ({rc}); the end of {log}:\n{tail}")
    rows = [json.loads(line) for line in (tmp / "results.jsonl").read_text().splitlines()]
    print(callgrind_table(rows, names))
    print(hooks_table(rows, names))
    if json_path:
        Path(json_path).write_text(json.dumps({"callgrind": rows}, indent=1))


def _counted_runs(lib_path: str, names: list[str]) -> None:
    """Inside valgrind: each schedule's four counted runs, appended to ``results.jsonl``."""
    import ctypes

    lib = ctypes.CDLL(lib_path)
    if not lib.cg_running():
        raise SystemExit("BENCH_MANAGER_CG_LIB is set but this process is not under valgrind")
    out_dir = Path(os.environ[_CG_OUT])
    tmp = Path(tempfile.mkdtemp(prefix="bench-manager-"))
    cfg_path = write_config(tmp / "tieredkv.json")
    for n in names:
        for counting, v in CG_VARIANTS:
            r = count_once(lib, counting, v, n, cfg_path, out_dir)
            with (out_dir / "results.jsonl").open("a") as fh:
                fh.write(json.dumps(r) + "\n")
            print(
                f"counted {counting:>4} {n:>28} {v:>6} steps {r['steps']:>4} hits {r['hits']:>6} "
                f"instructions/step {r['instructions'] / max(1, r['steps']) / 1e3:.0f}k wrong {r['wrong_bytes']}"
                + (f" ERROR {r['error']}" if r["error"] else ""),
                flush=True,
            )


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def profile(sched_name: str, variant: str, cfg_path: Path, top: int = 25) -> str:
    """cProfile of one run; the callees of the manager's methods, by cumulative time."""
    pr = cProfile.Profile()
    pr.enable()
    r = run_once(variant, schedules()[sched_name], cfg_path)
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf).sort_stats("tottime")
    st.print_stats(r"tieredkv/(integrations|planner|keys|store|pipeline)", top)
    return f"{variant} on {sched_name}: {r['steps']} steps\n" + buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=None, help="names (default: all)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"also: {' '.join(BEFORE)}")
    ap.add_argument("--json", help="write the raw runs here")
    ap.add_argument("--no-settle", action="store_true", help="report transfers as the harness steps find them")
    ap.add_argument("--profile", action="store_true", help="cProfile O+tkv and T+tkv on the first schedule")
    ap.add_argument(
        "--callgrind", action="store_true", help="count instructions per step under valgrind instead of timing"
    )
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import torch

    # The emulated forward's torch ops would leave an OpenMP thread spinning on the second core
    # (0.15-0.45 s of CPU per run, measured): not part of what is timed, only a competitor of it.
    torch.set_num_threads(1)
    all_sched = schedules()
    names = args.schedules or list(all_sched)
    if os.environ.get("BENCH_MANAGER_CG_LIB"):
        _counted_runs(os.environ["BENCH_MANAGER_CG_LIB"], names)
        return
    if args.callgrind:
        run_callgrind(names, args.json)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-manager-"))
    cfg_path = write_config(tmp / "tieredkv.json")
    if args.profile:
        for v in ("O+tkv", "T+tkv"):
            print(profile(names[0], v, cfg_path))
        return
    overhead = wrapper_overhead()
    print(f"a timed call adds {overhead * 1e9:.0f} ns to its hook: taken off per nested call", flush=True)
    load = os.getloadavg()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {v: [] for v in args.variants} for n in names}
    for rep in range(args.reps):
        for n in names:
            for v in args.variants:
                r = run_once(v, all_sched[n], cfg_path, overhead=overhead, settle=not args.no_settle)
                runs[n][v].append(r)
                print(
                    f"rep {rep} {n:>28} {v:>6} steps {r['steps']:>4} mgr {r['mgr_us_step']:8.1f} µs/step "
                    f"conn {r['conn_us_step']:8.1f} µs/step hits {r['hits']:>6} wrong {r['wrong_bytes']}"
                    + (f" ERROR {r['error']}" if r["error"] else "")
                    + ("" if r["idle"] else " NOT-IDLE"),
                    flush=True,
                )
    load_end = os.getloadavg()
    print(f"\nload average at start {load[0]:.2f} {load[1]:.2f}, at end {load_end[0]:.2f} {load_end[1]:.2f}\n")
    print(table(runs))
    print("\nEach step's fastest rep, summed (the same runs):\n")
    print(min_table(runs))
    if args.json:
        out = {
            "load_start": load,
            "load_end": load_end,
            "wrapper_overhead_us": overhead * 1e6,
            "settle": not args.no_settle,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))


def step_min(rs: list[dict[str, Any]], key: str) -> float | None:
    """µs per step from each step's fastest rep: the schedule is deterministic, so step k does
    the same work in every rep, and the least disturbed rep of each step is the closest reading
    of its cost on a box whose neighbours swing whole runs by up to 1.8x. None when the reps
    took different numbers of steps."""
    lists = [r[key] for r in rs if r.get(key)]
    if not lists or len({len(x) for x in lists}) != 1 or len(lists) != len(rs):
        return None
    return sum(map(min, zip(*lists))) / len(lists[0])


def min_table(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """The per-step minimum over reps (:func:`step_min`), summed: manager O+tkv vs O+cpu,
    connector T+tkv vs O+cpu."""
    lines = [
        (
            "| schedule | manager µs/step vLLM CPU / tieredkv (ratio), per-step min | "
            "connector µs/step O+cpu / T+tkv (ratio), per-step min |"
        ),
        "|---|---|---|",
    ]
    for n, by_v in runs.items():
        cells = []
        for kind, a, b in (("mgr", "O+cpu", "O+tkv"), ("conn", "O+cpu", "T+tkv")):
            x = step_min(by_v.get(a) or [], f"{kind}_us_steps")
            y = step_min(by_v.get(b) or [], f"{kind}_us_steps")
            cells.append(f"{x:.0f} / {y:.0f} ({y / x:.2f})" if x and y else "n/a")
        lines.append(f"| {n} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def table(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Medians over the reps. Manager: O+tkv vs O+cpu (same connector); connector: T+tkv vs O+cpu,
    per step and per whole run (the variants may take different numbers of steps: more hits,
    fewer prefill steps). "before" (``*0`` variants, counters read every step) where they ran."""
    lines = [
        (
            "| schedule | steps O+cpu / O+tkv / T+tkv | hit tokens O+cpu / O+tkv / T+tkv "
            "| manager µs/step vLLM CPU | manager µs/step tieredkv | ratio "
            "| connector µs/step O+cpu | connector µs/step T+tkv | ratio per step | ratio per run |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def us(rs: list[dict[str, Any]], kind: str) -> str:
        return f"{med(rs, kind + '_us_step'):.0f}"

    def per_run(rs: list[dict[str, Any]]) -> float:
        return statistics.median(r["conn_us_step"] * r["steps"] for r in rs)

    for n, by_v in runs.items():
        if not all(by_v.get(v) for v in VARIANTS):
            continue
        o, ot, t = by_v["O+cpu"], by_v["O+tkv"], by_v["T+tkv"]
        ot0, t0 = by_v.get("O+tkv0") or [], by_v.get("T+tkv0") or []
        m_o, c_o = med(o, "mgr_us_step"), med(o, "conn_us_step")

        def pair(before: list[dict[str, Any]], after: list[dict[str, Any]], kind: str, base: float) -> tuple[str, str]:
            vals = f"{us(before, kind)} → {us(after, kind)}" if before else us(after, kind)
            ratio = f"{med(after, kind + '_us_step') / base:.2f}"
            if before:
                ratio = f"{med(before, kind + '_us_step') / base:.2f} → {ratio}"
            return vals, ratio

        mv, mr = pair(ot0, ot, "mgr", m_o)
        cv, cr = pair(t0, t, "conn", c_o)
        steps = " / ".join(str(int(med(x, "steps"))) for x in (o, ot, t))
        hits = " / ".join(str(int(med(x, "hits"))) for x in (o, ot, t))
        run_ratio = per_run(t) / per_run(o)
        lines.append(
            f"| {n} | {steps} | {hits} | {us(o, 'mgr')} | {mv} | {mr} | {us(o, 'conn')} | {cv} | {cr} | {run_ratio:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

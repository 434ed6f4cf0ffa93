"""tieredkv under engine-like vLLM 0.33 schedules, next to vLLM's own CPU offloading path.

Every row (KV groups × ``blocks_per_chunk`` × async scheduling) runs the three-phase workload of
``tests/vllm/engine.py`` — chunked prefill, six concurrent requests sharing prefixes, a GPU block
pool small enough to preempt and resume, GPU prefix-cache resets and zeroed "GPU" KV between
phases, multi-turn extensions — through vLLM's real ``Scheduler`` / ``AsyncScheduler`` and
``OffloadingConnector`` with an emulated model runner that checks every KV byte (and Mamba state)
a forward reads, every step. The same schedule runs with:

* ``ref`` — vLLM's own ``CPUOffloadingSpec`` (its CUDA worker replaced by a CPU stand-in that
  copies within the step);
* ``spec-cpu`` / ``spec-lmdb`` / ``spec-fs`` / ``spec-redis`` — ``TieredKVOffloadingSpec`` over one tier;
* ``sec-lmdb`` / ``sec-fs`` / ``sec-redis`` — ``TieredKVSecondaryTier`` under vLLM's ``TieringOffloadingSpec``,
  vLLM's primary CPU tier reset between phases (``keep_on_reset: true`` keeps tieredkv's records),
  so every hit of a later phase is promoted from tieredkv;
* ``cap1-lmdb`` — the spec with ``max_inflight_store_chunks: 1``: full-attention batches are
  deferred all the time, sliding-window and Mamba keys must still never be lost;
* ``async-lmdb`` / ``async-redis`` / ``async-sec-redis`` — without settling (real asynchronous
  timing): the spinning checks.

"settle": the harness lets I/O started in a step finish before the step ends (the reference's
stand-in copies synchronously; a device step outlasts tier I/O), so the rows compare what the
manager *decides*, not how fast this 2-core box is. Likewise a settled Redis row gives the
tier's in-step lookups (``lookup_budget_ms``, one pipelined ``EXISTS`` per request) a budget this
box always meets (:data:`SETTLED_LOOKUP_BUDGET_MS`; on a loopback round trip of 50-100 µs the
default 1 ms is met unless the server waits for one of the two shared cores). Rows without
settling check the same correctness (idle, 0 wrong bytes) under real asynchronous timing, with
the default budget.

Asserted per row: every run reaches idle (no spinning: ``has_pending_work`` is false once the work
is done), 0 wrong bytes, every request finishes with the model's tokens, steps ≤ vLLM's ×1.25 (+8)
(×1.6 + 20 unsettled), and hit tokens of every group ≥ 0.9× vLLM's own path (settled runs).

Known gaps are reported as an xfail with their numbers, never hidden, and only where the cause
is outside what tieredkv decides: on hybrid rows (SWA + Mamba), a path whose lookup of a new
prefix is answered a step later — vLLM's own tiering manager, which promotes a secondary-tier
hit into its primary before the load and answers HIT_PENDING until it is there, whatever the
secondary tier (``sec-lmdb`` answers in the step and defers the same way) — shifts which
sliding-window / Mamba boundaries vLLM 0.33's store logic keeps (only replay and shared-prefix
boundaries), and later hits can fall under 0.9×. A Redis route answers in the step now (the
request's whole prefix in one pipelined ``EXISTS``), so ``spec-redis`` is held to 0.9× like the
others, here and on seeds 1-2 (:func:`test_hybrid_rows_over_redis_on_more_seeds`). ``cap1-lmdb`` hits are reported, not compared: vLLM's connector drops a
full-attention chunk refused on a request's last store pass (tieredkv's own connector is the fix
for both); what is asserted there is that no sliding-window or Mamba key is ever declined.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import GROUP_SETS, RunResult, reference_extra_config, run_engine, secondary_extra, spec_extra
from tieredkv.keys import key_group

pytestmark = pytest.mark.vllm

ROWS = [(g, bpc, a) for g in GROUP_SETS for bpc in (1, 2, 4) for a in (False, True)]
HIT_RATIO = 0.9
STEP_RATIO, STEP_SLACK = 1.25, 8
_REPORT: list[dict[str, Any]] = []


def _row_id(row: tuple[tuple[str, ...], int, bool]) -> str:
    groups, bpc, a = row
    return f"{'+'.join(groups)}-bpc{bpc}-{'async' if a else 'sync'}"


#: ``lookup_budget_ms`` of the settled rows' Redis tiers: what this shared 2-core box always meets
#: (a batch the box delays past 1 ms would fall back to the asynchronous path, a timing effect the
#: settled rows leave out, as they do for stores); unsettled rows keep the default (1 ms).
SETTLED_LOOKUP_BUDGET_MS = 1000.0


def _tiers_file(
    path: Path, kind: str, url: str | None = None, cluster: bool = False, lookup_budget_ms: float | None = None
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tier = {
        "cpu": {"kind": "cpu", "name": "cpu", "capacity_bytes": "16MiB"},
        "lmdb": {
            "kind": "lmdb",
            "name": "nvme",
            "path": str(path / "lmdb"),
            "map_size_bytes": "64MiB",
            "size_cap_bytes": "32MiB",
        },
        "fs": {"kind": "fs", "name": "shared", "path": str(path / "fs"), "size_cap_bytes": "32MiB"},
        "redis": {
            "kind": "redis",
            "name": "redis",
            "url": url,
            "cluster": cluster,
            "key_prefix": f"tkv-loop-{uuid.uuid4().hex[:12]}",
        },  # cold, like the reference
    }[kind]
    if kind == "redis" and lookup_budget_ms is not None:
        tier["lookup_budget_ms"] = lookup_budget_ms
    f = path / "tiers.json"
    f.write_text(
        json.dumps(
            {
                "version": 1,
                "namespace": {"model": "engine-loop"},
                "tiers": [tier],
                "pipeline": {"staging_bytes": "8MiB"},
            }
        )
    )
    return f


def report_table() -> list[str]:
    """Hit tokens per group (full/swa/mamba) and steps of every run, vLLM's own path first."""
    lines = []
    for rec in _REPORT:
        head = f"{rec['groups']:15} bpc={rec['bpc']} {'async' if rec['async'] else 'sync '}"
        if rec.get("seed"):
            head += f" seed={rec['seed']}"
        cells = []
        for name, run in rec["runs"].items():
            hits = "/".join(str(v) for v in run["hits"].values())
            cells.append(f"{name} {hits} ({run['steps']} steps)")
        lines.append(head + " | " + " | ".join(cells))
    return lines


def assert_healthy(name: str, r: RunResult) -> None:
    assert r.error is None, (name, r.error, r.wrong_examples[:2])
    assert r.stalled is None, (name, r.stalled)
    assert r.idle_reached, (name, "never went idle", r.phase_idle, r.phase_steps_to_idle, r.budget_exhausted)
    assert r.wrong_bytes == 0 and r.wrong_slots == 0, (name, r.wrong_examples[:3])
    assert not r.wrong_outputs and not r.unfinished_requests, (name, r.wrong_outputs, r.unfinished_requests)
    assert r.checked_slots > 10_000, (name, r.checked_slots)


def _record(row: tuple[tuple[str, ...], int, bool], runs: dict[str, RunResult], seed: int = 0) -> dict[str, Any]:
    groups, bpc, a = row
    rec = {"groups": "+".join(groups), "bpc": bpc, "async": a, "seed": seed, "runs": {}}
    for name, r in runs.items():
        rec["runs"][name] = {
            "steps": r.steps,
            "hits": {g: r.hit_tokens.get(g, 0) for g in groups},
            "preemptions": r.preemptions,
            "deferred_lookups": r.deferred_lookups,
            "max_request_steps": r.max_request_steps,
            "wrong_bytes": r.wrong_bytes,
            "mamba_off_grid_loads": r.mamba_off_grid_loads,
            "steps_to_idle": r.phase_steps_to_idle,
            "wall_s": round(r.wall_s, 2),
        }
        print(f"{name:10} {r.summary()}")
    _REPORT.append(rec)
    out = os.environ.get("ENGINE_LOOP_REPORT")
    if out:
        Path(out).write_text(json.dumps(_REPORT, indent=1))
    return rec


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_engine_loop_matches_vllm(row: tuple[tuple[str, ...], int, bool], tmp_path: Path, redis_server: Any) -> None:
    groups, bpc, a = row
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "async_scheduling": a}
    runs = {"ref": run_engine(reference_extra_config(bpc), **kw)}
    for kind in ("cpu", "lmdb", "fs", "redis"):
        tiers = _tiers_file(
            tmp_path / f"spec-{kind}", kind, redis_server.url, lookup_budget_ms=SETTLED_LOOKUP_BUDGET_MS
        )
        runs[f"spec-{kind}"] = run_engine(spec_extra(bpc, tiers), settle=True, **kw)
    for kind in ("lmdb", "fs", "redis"):
        tiers = _tiers_file(tmp_path / f"sec-{kind}", kind, redis_server.url, lookup_budget_ms=SETTLED_LOOKUP_BUDGET_MS)
        runs[f"sec-{kind}"] = run_engine(
            secondary_extra(bpc, tiers), settle=True, tiering_cpu_worker=True, reset_connector=True, **kw
        )
    declined_windowed: list[int] = []
    with _watch_refusals(declined_windowed):
        tiers = _tiers_file(tmp_path / "cap1-lmdb", "lmdb")
        runs["cap1-lmdb"] = run_engine(spec_extra(bpc, tiers, max_inflight_store_chunks=1), settle=True, **kw)
    for kind in ("lmdb", "redis"):
        tiers = _tiers_file(tmp_path / f"async-{kind}", kind, redis_server.url)
        runs[f"async-{kind}"] = run_engine(spec_extra(bpc, tiers), **kw)
    tiers = _tiers_file(tmp_path / "async-sec-redis", "redis", redis_server.url)
    runs["async-sec-redis"] = run_engine(
        secondary_extra(bpc, tiers), tiering_cpu_worker=True, reset_connector=True, **kw
    )
    _record(row, runs)
    ref = runs["ref"]
    assert_healthy("ref", ref)
    assert not declined_windowed, f"{sum(declined_windowed)} sliding-window / Mamba keys declined"
    assert runs["cap1-lmdb"].prepare_store_refused, "cap 1 never deferred a batch: the variant tests nothing"
    gaps = []
    for name, r in runs.items():
        assert_healthy(name, r)
        settled = not name.startswith("async-")
        ratio, slack = (STEP_RATIO, STEP_SLACK) if settled else (1.6, 20)
        assert r.steps <= ref.steps * ratio + slack, (name, r.steps, ref.steps)
        if not settled or name == "cap1-lmdb":
            continue
        for g in groups:
            if r.hit_tokens.get(g, 0) >= HIT_RATIO * ref.hit_tokens.get(g, 0):
                continue
            gap = (name, g, r.hit_tokens.get(g, 0), ref.hit_tokens.get(g, 0))
            assert name in DEFERRED_LOOKUP_PATHS and "mamba" in groups, gap
            gaps.append(gap)
    if gaps:
        pytest.xfail(
            f"hybrid row behind vLLM's tiering manager (it promotes before it loads: HIT_PENDING, a step later): {gaps}"
        )


#: Paths whose hybrid rows may fall under 0.9× (xfail with numbers): behind vLLM's tiering manager,
#: which promotes a secondary-tier hit before loading it (see the module docstring).
DEFERRED_LOOKUP_PATHS = ("sec-lmdb", "sec-fs", "sec-redis")


SEED_ROWS = [(seed, bpc, a) for seed in (1, 2) for bpc in (1, 2, 4) for a in (False, True)]


@pytest.mark.parametrize("row", SEED_ROWS, ids=[f"seed{s}-bpc{b}-{'async' if a else 'sync'}" for s, b, a in SEED_ROWS])
def test_hybrid_rows_over_redis_on_more_seeds(row: tuple[int, int, bool], tmp_path: Path, redis_server: Any) -> None:
    """The hybrid rows (full + sliding window + Mamba) over Redis on workloads of seeds 1 and 2:
    ``TieredKVOffloadingSpec`` behind vLLM's connector (``spec-redis``) and behind
    ``TieredKVConnector`` (``tkc-spec-redis``) get ≥ 0.9× vLLM's own hit tokens in every group,
    every lookup answered in the step it was asked (no asynchronous lookup sent: the request's
    prefix went out as one pipelined ``EXISTS`` within the budget). ``sec-redis`` answers in the
    step too, so it decides as ``sec-lmdb`` does (≥ 0.9× of it); where both fall under 0.9× of
    vLLM's path the cause is vLLM's tiering manager (promotion before load), an xfail with numbers."""
    seed, bpc, a = row
    groups = ("full", "swa", "mamba")
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "async_scheduling": a, "seed": seed}
    budget = SETTLED_LOOKUP_BUDGET_MS
    runs = {"ref": run_engine(reference_extra_config(bpc), **kw)}
    lookups: dict[str, dict[str, int]] = {}
    for name, connector in (("spec-redis", {}), ("tkc-spec-redis", TKC)):
        tiers = _tiers_file(tmp_path / name, "redis", redis_server.url, lookup_budget_ms=budget)
        with _lookup_stats(lookups, name):
            runs[name] = run_engine(spec_extra(bpc, tiers), settle=True, **connector, **kw)
    for kind in ("lmdb", "redis"):
        tiers = _tiers_file(tmp_path / f"sec-{kind}", kind, redis_server.url, lookup_budget_ms=budget)
        runs[f"sec-{kind}"] = run_engine(
            secondary_extra(bpc, tiers), settle=True, tiering_cpu_worker=True, reset_connector=True, **kw
        )
    _record((groups, bpc, a), runs, seed)
    print(f"seed {seed} lookups {lookups}")
    ref = runs["ref"]
    for name, r in runs.items():
        assert_healthy(name, r)
        assert r.steps <= ref.steps * STEP_RATIO + STEP_SLACK, (name, r.steps, ref.steps)
    for name in ("spec-redis", "tkc-spec-redis"):
        st = lookups[name]
        assert st["step_batches"] > 0 and st["queries"] == 0 and st["lookup_retry"] == 0, (name, st)
        for g in groups:
            assert runs[name].hit_tokens.get(g, 0) >= HIT_RATIO * ref.hit_tokens.get(g, 0), (
                name,
                g,
                runs[name].hit_tokens,
                ref.hit_tokens,
            )
    sec, sec_lmdb = runs["sec-redis"], runs["sec-lmdb"]
    for g in groups:
        assert sec.hit_tokens.get(g, 0) >= HIT_RATIO * sec_lmdb.hit_tokens.get(g, 0), (
            g,
            sec.hit_tokens,
            sec_lmdb.hit_tokens,
        )
    gaps = [
        (name, g, runs[name].hit_tokens.get(g, 0), ref.hit_tokens.get(g, 0))
        for name in ("sec-lmdb", "sec-redis")
        for g in groups
        if runs[name].hit_tokens.get(g, 0) < HIT_RATIO * ref.hit_tokens.get(g, 0)
    ]
    if gaps:
        pytest.xfail(f"vLLM's tiering manager promotes before it loads (HIT_PENDING, a step later): {gaps}")


TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}


@contextlib.contextmanager
def _lookup_stats(out: dict[str, dict[str, int]], name: str) -> Iterator[None]:
    """What tieredkv's manager's lookups did in the run (read at its shutdown): in-step batches,
    asynchronous lookups sent, RETRY answers."""
    from tieredkv.integrations.vllm.spec import TieredKVManager

    orig = TieredKVManager.shutdown

    def shutdown(self: Any) -> None:
        lk = self._lookups
        out[name] = {
            "step_batches": lk.step_batches,
            "step_answered": lk.step_answered,
            "queries": lk.queries,
            "lookup_retry": self.counters.get("lookup_retry", 0),
        }
        orig(self)

    TieredKVManager.shutdown = shutdown  # type: ignore[method-assign]
    try:
        yield
    finally:
        TieredKVManager.shutdown = orig  # type: ignore[method-assign]


@contextlib.contextmanager
def _watch_refusals(declined_windowed: list[int]) -> Iterator[None]:
    """Record every ``prepare_store`` that tieredkv's manager answers None for a batch holding a
    sliding-window or Mamba key (vLLM may never offer such a key again: it must not happen)."""
    from tieredkv.integrations.vllm.spec import TieredKVManager

    orig = TieredKVManager.prepare_store

    def prepare_store(self: Any, keys: Any, ctx: Any) -> Any:
        out = orig(self, keys, ctx)
        windowed = [k for k in keys if key_group(bytes(k)) in self._windowed]
        if out is None and windowed:
            declined_windowed.append(len(windowed))
        return out

    TieredKVManager.prepare_store = prepare_store  # type: ignore[method-assign]
    try:
        yield
    finally:
        TieredKVManager.prepare_store = orig  # type: ignore[method-assign]


def test_engine_loop_redis_cluster(tmp_path: Path, redis_cluster: Any) -> None:
    """The spec over a real 3-master Redis Cluster on the hybrid schedule: idle, 0 wrong bytes, and
    (its lookups answered in the step: a request's keys grouped by the node owning their slot, one
    pipelined ``EXISTS`` per node) hit tokens ≥ 0.9× vLLM's own path in every group."""
    groups, bpc = ("full", "swa", "mamba"), 2
    ref = run_engine(reference_extra_config(bpc), groups=groups, blocks_per_chunk=bpc, async_scheduling=True)
    tiers = _tiers_file(
        tmp_path / "cluster", "redis", redis_cluster.url, cluster=True, lookup_budget_ms=SETTLED_LOOKUP_BUDGET_MS
    )
    lookups: dict[str, dict[str, int]] = {}
    with _lookup_stats(lookups, "cluster"):
        r = run_engine(spec_extra(bpc, tiers), groups=groups, blocks_per_chunk=bpc, async_scheduling=True, settle=True)
    print(f"ref        {ref.summary()}\ncluster    {r.summary()} {lookups}")
    assert_healthy("cluster", r)
    assert lookups["cluster"]["queries"] == 0 and lookups["cluster"]["step_batches"] > 0, lookups
    assert all(r.hit_tokens.get(g, 0) >= HIT_RATIO * ref.hit_tokens.get(g, 0) for g in groups), (
        r.hit_tokens,
        ref.hit_tokens,
    )
    assert r.steps <= ref.steps * STEP_RATIO + STEP_SLACK


def test_engine_loop_cache_reset_serves_nothing_older(tmp_path: Path) -> None:
    """A connector reset between phases (vLLM: sleep, weight update) starts a new cache generation:
    later phases get no hit from earlier ones, and still no wrong byte; with ``keep_on_reset``
    they do."""
    groups, bpc = ("full", "swa", "mamba"), 4
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "settle": True}
    plain = run_engine(spec_extra(bpc, _tiers_file(tmp_path / "a", "lmdb")), **kw)
    reset = run_engine(spec_extra(bpc, _tiers_file(tmp_path / "b", "lmdb")), reset_connector=True, **kw)
    kept = run_engine(
        spec_extra(bpc, _tiers_file(tmp_path / "c", "lmdb"), keep_on_reset=True), reset_connector=True, **kw
    )
    for name, r in (("plain", plain), ("reset", reset), ("kept", kept)):
        print(f"{name:6} {r.summary()}")
        assert_healthy(name, r)
    later = [rec for rec in reset.requests.values() if rec.phase > 0]
    assert later and all(not rec.external_hits or rec.preemptions for rec in later), [
        (rec.name, rec.external_hits) for rec in later
    ]
    assert sum(reset.hit_tokens.values()) < sum(plain.hit_tokens.values())
    assert kept.hit_tokens == plain.hit_tokens


def test_partial_records_and_mamba_states_round_trip(tmp_path: Path) -> None:
    """``blocks_per_chunk`` 4 with a window of 2 blocks and a Mamba group: vLLM sends sliding-window
    chunks whose leading blocks left the window and Mamba chunks with one state block in the last
    slot. They are stored as partial records, found by lookups, loaded, and every byte and state the
    forwards then read is right."""
    from tieredkv.integrations.vllm.spec import TieredKVManager, TieredKVWorker

    seen: dict[str, Any] = {}
    orig_m, orig_w = TieredKVManager.shutdown, TieredKVWorker.shutdown

    def m_shutdown(self: Any) -> None:
        seen["manager"] = dict(self.counters)
        orig_m(self)

    def w_shutdown(self: Any) -> None:
        seen["worker"] = dict(self.counters)
        orig_w(self)

    TieredKVManager.shutdown, TieredKVWorker.shutdown = m_shutdown, w_shutdown  # type: ignore[method-assign]
    try:
        groups = ("full", "swa", "mamba")
        r = run_engine(
            spec_extra(4, _tiers_file(tmp_path / "p", "lmdb")),
            groups=groups,
            blocks_per_chunk=4,
            async_scheduling=True,
            settle=True,
        )
    finally:
        TieredKVManager.shutdown, TieredKVWorker.shutdown = orig_m, orig_w  # type: ignore[method-assign]
    print(r.summary(), seen)
    assert_healthy("partial", r)
    assert seen["worker"].get("partial_chunks_stored", 0) > 0, seen
    assert seen["manager"].get("load_partial_chunks", 0) > 0, seen
    assert not seen["worker"].get("unmappable_chunks_not_stored") and not seen["worker"].get(
        "chunks_with_holes_not_stored"
    ), seen
    assert r.hit_tokens["swa"] > 0 and r.hit_tokens["mamba"] > 0
    assert r.mamba_loaded_states_checked > 0 and r.mamba_loaded_states_ok == r.mamba_loaded_states_checked

"""``TieredKVConnector`` next to vLLM's ``OffloadingConnector`` on the same engine-loop schedules.

Every run goes through vLLM 0.33's real ``Scheduler`` / ``AsyncScheduler``, the connector's both
roles built by vLLM's factory, and the emulated model runner of ``tests/vllm/engine.py``, which
checks every KV byte and Mamba state a forward reads, every step. Behind both connectors sits the
same real spec (vLLM's ``CPUOffloadingSpec`` unless said). Store faults
(``tests/vllm/faults.py``) wrap the real manager's ``prepare_store``: a whole call refused, or only
the first half of its keys let through.

Per case of the issue, the same schedule shows the loss with ``OffloadingConnector`` and none with
``TieredKVConnector`` (``test_case_*``). Over every engine-loop row, with no fault and with the
refusal / partial-accept / last-pass variants (``test_connector_rows``): 0 wrong bytes, 0 Mamba
states loaded off the grid, no chunk lost while its blocks were held (a lost key is always one whose
blocks vLLM itself freed and reused first, counted by the connector), and hit tokens per group ≥
``OffloadingConnector``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import (
    DEFAULT_GPU_BLOCKS,
    GROUP_SETS,
    ReqSpec,
    RunResult,
    reference_extra_config,
    run_engine,
)
from tests.vllm.faults import StoreFault
from tests.vllm.test_engine_loop import _tiers_file, assert_healthy, secondary_extra, spec_extra

pytestmark = pytest.mark.vllm

TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}
HYBRID = ("full", "swa", "mamba")
ROWS = [(g, bpc, a) for g in GROUP_SETS for bpc in (1, 2, 4) for a in (False, True)]
VARIANTS = ("none", "every_other", "partial", "last_pass")
_REPORT: list[dict[str, Any]] = []


def _pair(
    groups: tuple[str, ...], bpc: int, async_scheduling: bool, fault: str | None, **tkc_extra: Any
) -> tuple[RunResult, RunResult]:
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "async_scheduling": async_scheduling}
    ref = run_engine(reference_extra_config(bpc), store_fault=fault and StoreFault(fault), **kw)
    tkc = run_engine(
        dict(reference_extra_config(bpc), **tkc_extra), store_fault=fault and StoreFault(fault), **TKC, **kw
    )
    print(f"ref {ref.summary()} lost={ref.lost_keys} reoffered={ref.reoffered_keys}")
    print(f"tkc {tkc.summary()} lost={tkc.lost_keys} reoffered={tkc.reoffered_keys} {tkc.connector_counters}")
    return ref, tkc


def lost(r: RunResult, group: str | None = None) -> int:
    return sum(n for g, n in r.lost_keys.items() if group is None or g == group)


def assert_nothing_lost_while_held(r: RunResult) -> None:
    """Every key the planner let go had blocks vLLM freed and reused first (or was never held)."""
    c = r.connector_counters
    assert c is not None, "not TieredKVConnector"
    assert c["chunks_given_up"] == 0 and c["handoffs_given_up"] == 0, c
    assert lost(r) <= c["chunks_blocks_gone"] + c["handoffs_blocks_gone"] + c["chunks_unheld"], (r.lost_keys, c)


def assert_hits_at_least(tkc: RunResult, ref: RunResult, *, first_only: bool = False) -> None:
    """Hit tokens per group ≥ vLLM's; ``first_only``: over each request's first load before any
    preemption (a reload after a preemption depends on which request the scheduler preempted,
    and holding finished requests' blocks changes that)."""
    a, b = (tkc.first_hit_tokens, ref.first_hit_tokens) if first_only else (tkc.hit_tokens, ref.hit_tokens)
    for g in tkc.groups:
        assert a.get(g, 0) >= b.get(g, 0), (g, "first loads" if first_only else "all loads", a, b)


def assert_on_grid(tkc: RunResult) -> None:
    assert tkc.mamba_off_grid_loads == 0 and tkc.mamba_off_grid_wrong_slots == 0
    assert tkc.mamba_loaded_states_ok == tkc.mamba_loaded_states_checked


# ------------------------------------------------------------------ the cases, one by one


def test_case_refusal_on_the_last_pass() -> None:
    """The store refuses every pass carrying a request's last prompt chunk until the request has
    finished, and its first pass after: vLLM never offers those chunks again; tieredkv holds the
    finished request's blocks, retries, and stores them. (The default hold budget is half the GPU
    pool; in this tiny pool several finished requests are held at once, so the budget is lifted;
    the row matrix below runs the default and counts the requests it could not hold.)"""
    ref, tkc = _pair(HYBRID, 1, False, "last_pass", hold_max_blocks=4 * DEFAULT_GPU_BLOCKS[HYBRID])
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert lost(ref, "full") > 0 and lost(ref, "swa") > 0, ref.lost_keys
    assert lost(tkc) == 0, tkc.lost_keys
    assert tkc.connector_counters and tkc.connector_counters["held_requests"] > 0
    assert_hits_at_least(tkc, ref)


@pytest.mark.parametrize("bpc", [2, 4])
def test_case_sliding_window_refusal(bpc: int) -> None:
    """The first offer of every sliding-window chunk is refused: vLLM drops some for good (its
    blocks are gone or the reachability filter no longer selects it by the next pass); tieredkv
    keeps them waiting and stores them."""
    ref, tkc = _pair(HYBRID, bpc, False, "swa_once")
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert lost(ref, "swa") > 0, ref.lost_keys
    assert lost(tkc) == 0, tkc.lost_keys
    assert_hits_at_least(tkc, ref)


@pytest.mark.parametrize("bpc", [2, 4])
def test_case_mamba_refusal(bpc: int) -> None:
    """The first offer of every Mamba boundary state is refused: vLLM's hand-off is offered once,
    so the state is gone and with it the hybrid hits; tieredkv offers it again."""
    ref, tkc = _pair(HYBRID, bpc, False, "mamba_once")
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert lost(ref, "mamba") > 0, ref.lost_keys
    assert lost(tkc) == 0, tkc.lost_keys
    assert tkc.connector_counters and tkc.connector_counters["handoffs_retried"] > 0
    assert_hits_at_least(tkc, ref)
    assert sum(tkc.hit_tokens.values()) > 2 * sum(ref.hit_tokens.values()), (tkc.hit_tokens, ref.hit_tokens)


@pytest.mark.parametrize("groups", [("full", "swa"), HYBRID])
def test_case_partial_accept(groups: tuple[str, ...]) -> None:
    """The store takes only the first half of each first offer and leaves the rest out for lack of
    room (not vLLM's contract, which says None): vLLM moves every group's cursor past the rest
    (later groups entirely); with ``retry_left_out_keys`` tieredkv tells refused from present and
    offers them again."""
    ref, tkc = _pair(groups, 2, False, "partial", retry_left_out_keys=True)
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert lost(ref, "swa") > 0, ref.lost_keys
    assert sum(ref.hit_tokens.values()) == 0, ref.hit_tokens  # no whole window is left to hit
    assert lost(tkc) == 0, tkc.lost_keys
    assert tkc.connector_counters and tkc.connector_counters["partial_accepts"] > 0
    assert_hits_at_least(tkc, ref)
    assert all(tkc.hit_tokens[g] > 0 for g in groups), tkc.hit_tokens


def test_case_declined_keys_stay_declined() -> None:
    """vLLM's ``CPUOffloadingSpec`` with ``store_threshold: 2`` stores a chunk on its second offer
    (a prefix two requests computed) and leaves it out of ``keys_to_store`` before. "a" computes a
    prompt, the GPU cache is reset, "b" computes it again: under vLLM's connector "a" stores
    nothing and "b" the prompt. ``TieredKVConnector`` takes a key left out as vLLM's contract says
    (declined: not offered again) and stores exactly what vLLM's does; with
    ``retry_left_out_keys`` it offers "a"'s keys again a step later, which the manager counts as
    the second sighting: "a"'s prompt is stored and admission is defeated."""
    prompt = tuple(range(3, 3 + 128))
    workload = [[ReqSpec("a", 0, prompt, 2)], [ReqSpec("b", 0, prompt + tuple(range(500, 540)), 2)]]
    extra = dict(reference_extra_config(1), store_threshold=2)
    runs = {
        "vllm": run_engine(extra, workload=workload),
        "tkc": run_engine(extra, workload=workload, **TKC),
        "tkc-retry": run_engine(dict(extra, retry_left_out_keys=True), workload=workload, **TKC),
    }
    for name, r in runs.items():
        print(name, r.summary(), r.connector_counters)
        assert r.error is None and r.idle_reached and r.wrong_bytes == 0, (name, r.error, r.wrong_examples)
    ref, tkc, retry = runs["vllm"], runs["tkc"], runs["tkc-retry"]
    assert ref.keys_accepted == len(prompt) // 16, ref.summary()  # "b"'s prompt chunks only
    assert tkc.keys_accepted == ref.keys_accepted and tkc.hit_tokens == ref.hit_tokens == {}
    assert tkc.connector_counters and tkc.connector_counters["keys_retried"] == 0
    assert retry.hit_tokens.get("full", 0) == len(prompt), "the retried keys were stored on 'a'"


@pytest.mark.parametrize("bpc", [1, 2])
def test_case_mamba_grid(bpc: int) -> None:
    """Mamba block 64 over attention blocks of 16: vLLM rounds the hit to the Mamba chunk once,
    the other groups shrink it off the grid, and the load brings the state of a later boundary
    (counted apart by the harness). tieredkv's hits stay on the grid, every loaded state is right,
    and there are more of them (sliding-window chunks are stored at Mamba-grid boundaries)."""
    ref, tkc = _pair(HYBRID, bpc, False, None)
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert ref.mamba_off_grid_loads > 0 and ref.mamba_off_grid_wrong_slots > 0, ref.summary()
    assert_on_grid(tkc)
    assert tkc.mamba_loaded_states_checked > 0
    assert_hits_at_least(tkc, ref)


def test_case_reoffers() -> None:
    """GPU-only prefix hits and resumes: vLLM restarts the store cursor at chunk 0 and offers
    every held chunk again; tieredkv's ledgers remember what is done."""
    ref, tkc = _pair(HYBRID, 1, True, None)
    assert_healthy("ref", ref)
    assert_healthy("tkc", tkc)
    assert ref.reoffered_keys > 2 * tkc.reoffered_keys, (ref.reoffered_keys, tkc.reoffered_keys)
    assert ref.keys_offered is not None and tkc.keys_offered is not None
    assert tkc.keys_offered < ref.keys_offered


def test_connector_and_library_plan_with_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """One planner core (``tieredkv.planner``) behind the connector and the library: the
    connector's scheduler side plans and settles with the same ``StorePlanner`` class as the
    library's ``OffloadScheduler`` (``store.planner()``, the demo), each in its configuration
    (the connector's stores partial sliding-window chunks), holds finished requests with the core's
    ``HoldBook`` and retries Mamba states with its ``HandoffQueue``. Spied on the core's classes, a
    refused chunk is offered again through it by both, and the connector loses nothing."""
    from tieredkv.groups import GroupLayout, GroupSpec
    from tieredkv.planner import HandoffQueue, HoldBook, OffloadScheduler, StoreOutcome, StorePlanner

    offers: dict[str, list[list[bytes]]] = {"connector": [], "library": []}
    used: set[str] = set()
    plan, refuse, hold = StorePlanner.plan, HandoffQueue.refuse, HoldBook.hold

    def spy_plan(self: StorePlanner, req: Any, groups: Any, tally: Any = None) -> Any:
        out = plan(self, req, groups, tally)
        offers["connector" if self.partial_chunks else "library"].append([c.key for g in out for c in g])
        return out

    def spy_refuse(self: HandoffQueue, h: Any) -> None:
        used.add("handoff queue")
        refuse(self, h)

    def spy_hold(self: HoldBook[Any], req_id: str, state: Any, num_blocks: int) -> bool:
        held = hold(self, req_id, state, num_blocks)
        if held:
            used.add("hold book")
        return held

    monkeypatch.setattr(StorePlanner, "plan", spy_plan)
    monkeypatch.setattr(HandoffQueue, "refuse", spy_refuse)
    monkeypatch.setattr(HoldBook, "hold", spy_hold)
    for fault, bpc, extra in (
        ("last_pass", 1, {"hold_max_blocks": 4 * DEFAULT_GPU_BLOCKS[HYBRID]}),
        ("mamba_once", 2, {}),
    ):
        r = run_engine(
            dict(reference_extra_config(bpc), **extra),
            store_fault=StoreFault(fault),
            groups=HYBRID,
            blocks_per_chunk=bpc,
            async_scheduling=False,
            **TKC,
        )
        assert_healthy(fault, r)
        assert lost(r) == 0, (fault, r.lost_keys)
    assert used == {"hold book", "handoff queue"}

    layout = GroupLayout(
        (GroupSpec(0, "full", 16, 1), GroupSpec(1, "sliding_window", 16, 1, window_tokens=32)), tokens_per_hash=16
    )
    s = OffloadScheduler(layout)
    s.add_request("r", 64, block_hashes=[bytes([i]) * 8 for i in range(4)])
    s.update_request("r", block_ids=[[1, 2, 3, 4], [5, 6, 7, 8]])
    first = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=64)
    s.complete_store("r", StoreOutcome(refused=frozenset(first.keys)))
    assert s.plan_store("r", num_computed_tokens=64).keys == first.keys
    for engine, plans in offers.items():
        again = {k for i, keys in enumerate(plans) for k in keys if any(k in earlier for earlier in plans[:i])}
        assert again, f"{engine}: no refused chunk offered again through the core"


def test_any_spec_behind_the_connector(tmp_path: Path) -> None:
    """tieredkv's own spec and vLLM's tiering spec with a tieredkv secondary tier work behind the
    connector: idle, 0 wrong bytes, hits on the Mamba grid in every group."""
    groups, bpc = HYBRID, 2
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "async_scheduling": True, "settle": True}
    runs = {
        "spec-lmdb": run_engine(spec_extra(bpc, _tiers_file(tmp_path / "a", "lmdb")), **TKC, **kw),
        "sec-lmdb": run_engine(
            secondary_extra(bpc, _tiers_file(tmp_path / "b", "lmdb")),
            tiering_cpu_worker=True,
            reset_connector=True,
            **TKC,
            **kw,
        ),
    }
    for name, r in runs.items():
        print(f"{name} {r.summary()}")
        assert_healthy(name, r)
        assert_on_grid(r)
        assert all(r.hit_tokens.get(g, 0) > 0 for g in groups), (name, r.hit_tokens)


def test_readme_configuration_runs(tmp_path: Path) -> None:
    """The README's ``--kv-transfer-config`` (docs/vllm.md's third; only the YAML path swapped) on the hybrid schedule."""
    from tests.vllm.test_vllm_roundtrip import documented_kv_transfer_configs, extra_config

    cfg = documented_kv_transfer_configs()["TieredKVConnector"]
    extra = extra_config("TieredKVConnector", _tiers_file(tmp_path, "lmdb"))
    bpc = extra["blocks_per_chunk"]
    r = run_engine(
        extra,
        groups=HYBRID,
        blocks_per_chunk=bpc,
        async_scheduling=True,
        settle=True,
        kv_connector=cfg["kv_connector"],
        kv_connector_module_path=cfg["kv_connector_module_path"],
    )
    ref = run_engine(reference_extra_config(bpc), groups=HYBRID, blocks_per_chunk=bpc, async_scheduling=True)
    print(f"ref {ref.summary()}\nreadme {r.summary()}")
    assert_healthy("readme", r)
    assert_on_grid(r)
    assert r.connector_counters is not None
    assert_hits_at_least(r, ref)


def test_bad_connector_option_names_field_value_and_fix() -> None:
    with pytest.raises(Exception, match=r"max_store_keys_per_step=0 is invalid: expected an integer >= 1"):
        run_engine_raising(dict(reference_extra_config(1), max_store_keys_per_step=0))
    with pytest.raises(Exception, match=r"retry_left_out_keys='yes' is invalid: expected true or false"):
        run_engine_raising(dict(reference_extra_config(1), retry_left_out_keys="yes"))


def run_engine_raising(extra: dict[str, Any]) -> None:
    from tests.vllm.engine import Engine, cpu_workers

    with cpu_workers(extra, False):
        Engine(extra, **TKC)


# ------------------------------------------------------------------ every row, every variant


def _row_id(row: tuple[tuple[str, ...], int, bool]) -> str:
    groups, bpc, a = row
    return f"{'+'.join(groups)}-bpc{bpc}-{'async' if a else 'sync'}"


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_connector_rows(row: tuple[tuple[str, ...], int, bool]) -> None:
    groups, bpc, a = row
    rec: dict[str, Any] = {"groups": "+".join(groups), "bpc": bpc, "async": a, "variants": {}}
    _REPORT.append(rec)
    failures = []
    for variant in VARIANTS:
        # "partial": a store that leaves keys out for lack of room, for which retry_left_out_keys is
        retry = {"retry_left_out_keys": True} if variant == "partial" else {}
        ref, tkc = _pair(groups, bpc, a, None if variant == "none" else variant, **retry)
        rec["variants"][variant] = {
            name: {
                "hits": {g: r.hit_tokens.get(g, 0) for g in groups},
                "first_hits": {g: r.first_hit_tokens.get(g, 0) for g in groups},
                "lost": sum(r.lost_keys.values()),
                "refused": r.fault_refused_keys,
                "steps": r.steps,
                "off_grid_loads": r.mamba_off_grid_loads,
                "keys_offered": r.keys_offered,
                "reoffered": r.reoffered_keys,
                "us_per_step": round(r.connector_s / max(1, r.steps) * 1e6),
                **({"counters": r.connector_counters} if r.connector_counters else {}),
            }
            for name, r in (("OffloadingConnector", ref), ("TieredKVConnector", tkc))
        }
        try:
            assert_healthy(f"ref-{variant}", ref)
            assert_healthy(f"tkc-{variant}", tkc)
            assert_on_grid(tkc)
            assert_nothing_lost_while_held(tkc)
            assert_hits_at_least(tkc, ref, first_only=variant == "last_pass")
            assert tkc.steps <= ref.steps * 1.25 + 16, (tkc.steps, ref.steps)
        except AssertionError as exc:
            failures.append(f"{variant}: {exc}")
    out = os.environ.get("CONNECTOR_REPORT")
    if out:
        Path(out).write_text(json.dumps(_REPORT, indent=1))
    assert not failures, failures


def report_table() -> list[str]:
    """Per row and variant: hit tokens per group and lost keys, OffloadingConnector → TieredKVConnector."""
    lines = []
    for rec in _REPORT:
        head = f"{rec['groups']:15} bpc={rec['bpc']} {'async' if rec['async'] else 'sync '}"
        cells = []
        for variant, runs in rec["variants"].items():
            ref, tkc = runs["OffloadingConnector"], runs["TieredKVConnector"]
            cells.append(
                f"{variant} {'/'.join(map(str, ref['hits'].values()))} lost {ref['lost']} -> "
                f"{'/'.join(map(str, tkc['hits'].values()))} lost {tkc['lost']}"
            )
        lines.append(head + " | " + " | ".join(cells))
    return lines


class _LockedManager:
    """tieredkv's real manager behind a wrapper that sets ``lock`` on the instance (a real lock):
    ``type(manager).lock`` does not exist, ``manager.lock`` does, as with vLLM's own suite's mock."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _wrapped_managers() -> Iterator[None]:
    """tieredkv's spec hands out its manager wrapped in :class:`_LockedManager`."""
    from tests.vllm.engine import _patched
    from tieredkv.integrations.vllm.spec import TieredKVOffloadingSpec

    real_get_manager = TieredKVOffloadingSpec.get_manager
    wrapped: dict[int, _LockedManager] = {}

    def get_manager(self: TieredKVOffloadingSpec) -> Any:
        inner = real_get_manager(self)
        return wrapped.setdefault(id(inner), _LockedManager(inner))

    with _patched(TieredKVOffloadingSpec, "get_manager", get_manager):
        yield


@pytest.mark.parametrize("spec", ["tieredkv", "tiering", "wrapped"])
def test_manager_lock_taken_as_vllm_does_unless_it_is_vllms_no_op(spec: str, tmp_path: Path) -> None:
    """vLLM enters ``manager.lock`` (read from the manager each time) in every hook outside the step
    (a generator context manager) and holds it across the step (an ``ExitStack``). Behind
    tieredkv's spec, whose lock is vLLM's no-op, the connector enters nothing, but the step is
    still marked open and a hook that finds it left open recovers as vLLM does (closes it). Behind
    a manager with a real lock, a property (vLLM's tiering spec) or an attribute of the instance
    (tieredkv's manager wrapped), the connector is built, every hook holds that lock, and the step
    holds it until ``build_connector_meta``."""
    from tests.vllm.engine import Engine, cpu_workers

    tiers = _tiers_file(tmp_path, "lmdb")
    extra = secondary_extra(1, tiers) if spec == "tiering" else spec_extra(1, tiers)
    with cpu_workers(extra, spec == "tiering"), _wrapped_managers() if spec == "wrapped" else contextlib.nullcontext():
        eng = Engine(extra, **TKC)
    try:
        sched = eng.connector_scheduler
        assert sched is not None
        manager = sched.manager
        assert isinstance(manager, _LockedManager) == (spec == "wrapped")
        lock = manager.lock
        real = hasattr(lock, "locked")
        assert real == (spec != "tieredkv")
        seen: list[bool] = []
        get_stats = manager.get_stats

        def observed() -> Any:  # the manager's own method, run while the connector holds it
            seen.append(lock.locked() if real else sched._step_region is None)
            return get_stats()

        manager.get_stats = observed
        sched.get_stats()
        assert seen == [True], "the hook ran the manager under its lock (or with no step open)"
        if real:
            assert not lock.locked()
        sched._acquire_step()
        assert sched._step_region is not None
        assert not real or lock.locked(), "the step holds a real lock until build_connector_meta"
        sched.get_stats()  # a step left open by a schedule() that raised: recovered, as vLLM does
        assert sched._step_region is None
        assert seen[-1] is True and not (real and lock.locked())
        sched._acquire_step()
        sched._acquire_step()  # idempotent within a step
        sched._release_step()
        assert sched._step_region is None and not (real and lock.locked())
    finally:
        eng.shutdown()


def test_manager_with_its_lock_on_the_instance_serves_an_engine_run(tmp_path: Path) -> None:
    """The workload of the engine loop through ``TieredKVConnector`` with tieredkv's manager behind a
    wrapper whose ``lock`` is an instance attribute (vLLM reads ``manager.lock``; reading it from
    the manager's class crashed the connector's construction): every byte right, hits loaded."""
    tiers = _tiers_file(tmp_path, "lmdb")
    with _wrapped_managers():
        r = run_engine(spec_extra(2, tiers), blocks_per_chunk=2, **TKC)
    print(r.summary())
    assert_healthy("wrapped manager", r)
    assert r.hit_tokens.get("full", 0) > 0 and r.keys_accepted

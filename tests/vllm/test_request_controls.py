"""A request's controls through vLLM 0.33's real scheduler, on the engine loop (``tests/vllm/engine.py``:
every KV byte a forward reads checked, every step): tier filters (``kv_load_tiers``,
``kv_store_tiers``), ``max_load_tokens`` / ``max_offload_tokens``, ``kv_hints`` (retain, pin,
no-store, unknown actions counted) and admission per KV group (``admit_after``), in both of
tieredkv's modes — ``TieredKVOffloadingSpec`` (``spec``) and ``TieredKVSecondaryTier`` under vLLM's
``TieringOffloadingSpec`` (``sec``, vLLM's primary CPU tier reset between phases so later hits come
from tieredkv) — each behind vLLM's ``OffloadingConnector`` and behind ``TieredKVConnector``
(``+conn``).

Phases are separated by a GPU prefix-cache reset with every "GPU" byte zeroed, so a later phase's
hits are loads. What a request got is read from the harness's records (``external_hits``: tokens
vLLM loaded for it) and from the tiers themselves (which holds which key, bytes read per tier).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import make_offload_key

from tests.vllm.engine import (
    VOCAB,
    Engine,
    ReqSpec,
    RunResult,
    lmdb_tier,
    reference_extra_config,
    run_engine,
    secondary_extra,
    spec_extra,
    write_config,
)
from tieredkv.integrations.vllm.stats import HINT_ACTIONS, RETAINED, RETENTION, StoreStatsReporter, values_by_metric

pytestmark = pytest.mark.vllm

CONN = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}
MODES = ("spec", "spec+conn", "sec", "sec+conn")
BLOCK = 16  # tokens per block (full attention)


def prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, VOCAB) for _ in range(n))


def req(name: str, toks: tuple[int, ...], arrival: int = 0, **params: Any) -> ReqSpec:
    hints = params.pop("kv_hints", None)
    return ReqSpec(name, arrival, toks, 2, kv_transfer_params=params or None, kv_hints=hints)


def hints(*actions: tuple[str, str, dict[str, Any]], protocol: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope(
        protocol_version=protocol,
        message_id=uuid.uuid4().hex,
        actions=[KvHintAction(f"a{i}", t, v, p) for i, (t, v, p) in enumerate(actions)],
    )


def tiers_file(path: Path, tiers: list[dict[str, Any]], **sections: Any) -> Path:
    return write_config(path / "tiers.json", tiers, model="controls", **sections)


def cpu_tier(capacity: str = "16MiB") -> dict[str, Any]:
    return {
        "kind": "cpu",
        "name": "cpu",
        "capacity_bytes": capacity,
        "segment_bytes": "64KiB",
        "min_slot_bytes": "1KiB",
    }


def redis_tier(url: str) -> dict[str, Any]:
    return {"kind": "redis", "name": "redis", "url": url, "key_prefix": f"tkv-ctl-{uuid.uuid4().hex[:12]}"}


def run(
    mode: str,
    tiers: Path,
    phases: list[list[ReqSpec]],
    *,
    on_phase: Callable[[Engine, int], None] | None = None,
    groups: tuple[str, ...] = ("full",),
    bpc: int = 1,
) -> RunResult:
    kw: dict[str, Any] = {"groups": groups, "blocks_per_chunk": bpc, "workload": phases, "settle": True}
    if mode.endswith("+conn"):
        kw.update(CONN)
    if mode.startswith("spec"):
        extra = spec_extra(bpc, tiers)
    elif mode.startswith("sec"):
        extra = secondary_extra(bpc, tiers)
        kw.update(tiering_cpu_worker=True, reset_connector=True)
    else:  # vLLM's own CPU spec ("ref")
        extra = reference_extra_config(bpc)
    r = run_engine(extra, on_phase=on_phase, **kw)
    print(f"{mode:10} {r.summary()}")
    return r


def assert_healthy(name: str, r: RunResult) -> None:
    """Idle, every request finished with the model's tokens, no wrong byte (``test_engine_loop``'s
    check, for these smaller workloads)."""
    assert r.error is None, (name, r.error, r.wrong_examples[:2])
    assert r.stalled is None, (name, r.stalled)
    assert r.idle_reached, (name, "never went idle", r.phase_idle, r.budget_exhausted)
    assert r.wrong_bytes == 0 and r.wrong_slots == 0, (name, r.wrong_examples[:3])
    assert not r.wrong_outputs and not r.unfinished_requests, (name, r.wrong_outputs, r.unfinished_requests)
    assert r.checked_slots > 500, (name, r.checked_slots)


def store_of(eng: Engine) -> Any:
    m = eng.connector_scheduler.manager
    return m.store if hasattr(m, "store") else m.secondary_tiers[0].store


def hits(r: RunResult, name: str) -> int:
    """Tokens vLLM loaded for the request(s) called ``name``."""
    return sum(sum(rec.external_hits) for rec in r.requests.values() if rec.name == name)


def stored_keys(eng: Engine, name: str, store: Any) -> list[bytes]:
    """The stored keys of every whole block of the (last) request called ``name`` (full group, 1 block a chunk)."""
    req = next(eng.reqs[rid] for rid, rec in reversed(eng.records.items()) if rec.name == name)
    return [store.stored_key(make_offload_key(h, 0)) for h in req.block_hashes]


def holders(eng: Engine, name: str) -> dict[str, int]:
    """Per tier, how many of the request's chunks it holds."""
    store = store_of(eng)
    keys = stored_keys(eng, name, store)
    return {t.name: sum(store.run(t.contains_many(keys))) for t in store.tiers}


def tier_reads(eng: Engine) -> dict[str, int]:
    return {t.name: int(t.counters.get("get_bytes", 0)) for t in store_of(eng).tiers}


# ---- tier filters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["spec", "spec+conn"])
def test_tier_filters_spec(mode: str, tmp_path: Path) -> None:
    """Mode 2 over a CPU slab and LMDB (write-through). ``kv_store_tiers`` puts a request's chunks in
    the tiers it names only; ``kv_load_tiers`` loads only from the tiers it allows (a chunk held
    only elsewhere is a miss, one held in both is read from the allowed one), ``[]`` loads nothing."""
    x, y, z, w = (prompt(i, 160) for i in range(4))
    phases = [
        [
            req("X", x, kv_store_tiers=[{"medium": "CPU"}]),
            req("Y", y, 1, kv_store_tiers=[{"tier": "nvme"}]),
            req("Z", z, 2),
            req("W", w, 3, kv_store_tiers=[]),
        ],
        [req("Z", z, kv_load_tiers=[{"medium": "STORAGE", "locality": "LOCAL"}])],
        [req("Z", z, kv_load_tiers=[])],
        [
            req("X", x, kv_load_tiers=[{"medium": "STORAGE"}]),
            req("Y", y, 1, kv_load_tiers=[{"medium": "CPU"}]),
            req("W", w, 2),
        ],
        [req("X", x, kv_load_tiers=[{"tier": "cpu"}]), req("Y", y, 1, kv_load_tiers=[{"locality": "LOCAL"}])],
    ]
    seen: dict[int, Any] = {}

    def on_phase(eng: Engine, pi: int) -> None:
        seen[pi] = tier_reads(eng)
        if pi == 1:
            seen["held"] = {n: holders(eng, n) for n in "XYZW"}

    r = run(mode, tiers_file(tmp_path, [cpu_tier(), lmdb_tier(tmp_path)]), phases, on_phase=on_phase)
    assert_healthy(mode, r)
    assert seen["held"] == {
        "X": {"cpu": 10, "nvme": 0},
        "Y": {"cpu": 0, "nvme": 10},
        "Z": {"cpu": 10, "nvme": 10},
        "W": {"cpu": 0, "nvme": 0},
    }, seen["held"]
    # phase 2: Z (in both tiers) loaded with only LMDB allowed: read there, not from the slab
    loaded = [rec.external_hits for rec in r.requests.values() if rec.phase == 1]
    assert loaded == [[160]], loaded
    assert seen[2]["cpu"] == seen[1]["cpu"] and seen[2]["nvme"] - seen[1]["nvme"] == 10 * 1024
    # phase 3: no tier allowed; phase 4: held only where the request may not load from; W never stored
    assert [sum(rec.external_hits) for rec in r.requests.values() if rec.phase in (2, 3)] == [0, 0, 0, 0]
    # phase 5: allowed by name and by locality
    assert [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 4] == [160, 160]


@pytest.mark.parametrize("mode", ["sec", "sec+conn"])
def test_tier_filters_secondary(mode: str, tmp_path: Path, redis_server: Any) -> None:
    """Mode 1, tieredkv's tiers LMDB (STORAGE, local) and Redis (STORAGE, remote) behind vLLM's
    primary CPU tier (reset between phases). vLLM's tiering manager asks the secondary tier
    whenever ``kv_load_tiers`` allows STORAGE (its locality: mixed, so unset); tieredkv then loads
    only from the tiers the filter allows. ``kv_store_tiers`` picks the tiers a cascade writes.
    ``[{"medium": "CPU"}]`` leaves the secondary tier out altogether (vLLM's own rule)."""
    x, y, z = (prompt(10 + i, 160) for i in range(3))
    phases = [
        [
            req("X", x, kv_store_tiers=[{"locality": "LOCAL"}]),
            req("Y", y, 1, kv_store_tiers=[{"tier": "redis"}]),
            req("Z", z, 2),
        ],
        [req("Z", z, kv_load_tiers=[{"locality": "REMOTE"}])],
        [req("X", x, kv_load_tiers=[{"locality": "REMOTE"}]), req("Y", y, 1, kv_load_tiers=[{"medium": "CPU"}])],
        [req("X", x, kv_load_tiers=[{"tier": "nvme"}]), req("Y", y, 1, kv_load_tiers=[{"medium": "STORAGE"}])],
    ]
    seen: dict[Any, Any] = {}

    def on_phase(eng: Engine, pi: int) -> None:
        seen[pi] = tier_reads(eng)
        if pi == 1:
            seen["held"] = {n: holders(eng, n) for n in "XYZ"}

    tiers = tiers_file(tmp_path, [lmdb_tier(tmp_path), redis_tier(redis_server.url)])
    r = run(mode, tiers, phases, on_phase=on_phase)
    assert_healthy(mode, r)
    assert seen["held"] == {
        "X": {"nvme": 10, "redis": 0},
        "Y": {"nvme": 0, "redis": 10},
        "Z": {"nvme": 10, "redis": 10},
    }, seen["held"]
    by_phase = [[sum(rec.external_hits) for rec in r.requests.values() if rec.phase == p] for p in range(4)]
    assert by_phase[1] == [160] and by_phase[2] == [0, 0] and by_phase[3] == [160, 160], by_phase
    # Z, held by both, was promoted from Redis (the only tier allowed), not from LMDB (first in route)
    assert seen[2]["nvme"] == seen[1]["nvme"] and seen[2]["redis"] > seen[1]["redis"], seen


# ---- max_load_tokens / max_offload_tokens -------------------------------------------------------


@pytest.mark.parametrize("mode", ["ref", *MODES])
def test_token_caps(mode: str, tmp_path: Path) -> None:
    """``max_offload_tokens`` bounds the prefix a request stores, ``max_load_tokens`` the tokens a
    request loads (vLLM's connector applies both; tieredkv's manager and secondary tier see only
    the keys inside them; ``TieredKVConnector`` keeps vLLM's rules). Next to vLLM's own CPU spec
    (``ref``): the same hits. Caps off the block grid round down to whole blocks."""
    a, b, c = (prompt(20 + i, 200) for i in range(3))
    phases = [
        [req("A", a, max_offload_tokens=64), req("B", b, 1), req("C", c, 2, max_offload_tokens=70)],
        [
            req("A", a),
            req("B", b, 1, max_load_tokens=48),
            req("C", c, 2, max_load_tokens=0),
        ],
        [req("B", b[:120] + prompt(99, 60), max_load_tokens=1000), req("C", c, 1)],
    ]
    stored: dict[str, int] = {}

    promoted: list[int] = []

    def on_phase(eng: Engine, pi: int) -> None:
        if pi == 1 and mode != "ref":
            stored.update({n: sum(holders(eng, n).values()) for n in "ABC"})
        if mode.startswith("sec"):
            promoted.append(eng.connector_scheduler.manager.secondary_tiers[0].counters["loaded_chunks"])

    tiers = tiers_file(tmp_path, [lmdb_tier(tmp_path)])
    r = run(mode, tiers, phases, on_phase=on_phase)
    assert_healthy(mode, r)
    if mode != "ref":
        assert stored == {"A": 4, "B": 12, "C": 4}, stored  # 64, 192 (whole blocks of 200), 70 -> 64 tokens
    # each request's first admission (a preempted request reloads its own KV later: not a cache hit)
    by_phase = [[sum(rec.external_hits[:1]) for rec in r.requests.values() if rec.phase == p] for p in range(3)]
    assert by_phase[1] == [64, 48, 0], by_phase
    if promoted:  # vLLM's tiering manager promoted only chunks that were loaded: none past a cap
        loaded = sum(sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 1)
        assert promoted[2] - promoted[1] == loaded // BLOCK, (promoted, loaded)
    # phase 3: B's prefix (120 tokens: 7 whole blocks) under a cap above it; C as its uncapped phase-2 run stored it
    assert by_phase[2] == [112, 192], by_phase


# ---- kv_hints --------------------------------------------------------------------------------------

PIN = ("tieredkv.retain", "1", {"priority": 5})
NO_STORE = ("tieredkv.no_store", "1", {})


def flood(seed: int, n: int, tokens: int = 160) -> list[ReqSpec]:
    """``n`` new prompts, one arriving each step: enough chunks to push older ones out of a small tier."""
    return [req(f"F{i}", prompt(seed + i, tokens), i) for i in range(n)]


@pytest.mark.parametrize("mode", ["spec", "spec+conn"])
def test_retention_hint_pins_a_prefix_through_a_flood(mode: str, tmp_path: Path) -> None:
    """Mode 2 over a small CPU slab: a request whose hints pin its prefix is hit in full after a
    flood of other prompts has cycled the slab; the same request without the hint is evicted (the
    flood is long enough to evict it), and retention is bounded (a quarter of the slab)."""
    a = prompt(40, 160)
    results = {}
    for hinted in (True, False):
        phases = [
            [req("A", a, kv_hints=hints(PIN) if hinted else None)],
            flood(100, 6),
            [req("A", a)],
        ]
        retained: list[int] = []

        def on_phase(eng: Engine, pi: int, retained: list[int] = retained) -> None:
            retained.append(len(store_of(eng).retention))

        tiers = tiers_file(tmp_path / str(hinted), [cpu_tier("64KiB")])
        r = results[hinted] = run(mode, tiers, phases, on_phase=on_phase)
        assert_healthy(f"{mode} hinted={hinted}", r)
        if hinted:
            assert retained == [0, 10, 10, 10], retained  # A's 10 chunks, held to the end
    assert [rec.external_hits for rec in results[True].requests.values() if rec.phase == 2] == [[160]]
    assert [sum(rec.external_hits) for rec in results[False].requests.values() if rec.phase == 2] == [0]


@pytest.mark.parametrize("mode", ["spec", "spec+conn"])
def test_time_bounded_retention_ends_at_its_time(mode: str, tmp_path: Path) -> None:
    """``seconds``: retained while the (test's) monotonic clock is before its end; released at the
    first scheduler step after it, and then a flood evicts it."""
    a = prompt(41, 160)
    got = {}
    for advance in (29.0, 31.0):
        now = [1000.0]

        def on_phase(eng: Engine, pi: int, advance: float = advance, now: list[float] = now) -> None:
            store = store_of(eng)
            if pi == 0:
                store.retention.clock = lambda: now[0]
            if pi == 1:
                assert len(store.retention) == 10
                now[0] += advance  # before the flood: its first step expires what is due

        phases = [
            [req("A", a, kv_hints=hints(("tieredkv.retain", "1.2", {"seconds": 30})))],
            flood(200, 6),
            [req("A", a)],
        ]
        r = run(mode, tiers_file(tmp_path / str(advance), [cpu_tier("64KiB")]), phases, on_phase=on_phase)
        assert_healthy(mode, r)
        got[advance] = [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 2]
    assert got == {29.0: [160], 31.0: [0]}, got


@pytest.mark.parametrize("mode", ["sec", "sec+conn"])
def test_retention_hint_secondary_over_a_small_lmdb(mode: str, tmp_path: Path) -> None:
    """Mode 1: the pinned request's chunks, cascaded into an LMDB tier with a small size cap, stay
    through a flood (LMDB's eviction skips pinned records) and are promoted back; without the hint
    they are evicted. vLLM's own primary is reset between phases."""
    a = prompt(42, 128)
    got = {}
    for hinted in (True, False):
        phases = [[req("A", a, kv_hints=hints(PIN) if hinted else None)], flood(300, 6), [req("A", a)]]
        tiers = tiers_file(tmp_path / str(hinted), [lmdb_tier(tmp_path / str(hinted), cap="44KiB")])
        r = run(mode, tiers, phases)
        assert_healthy(mode, r)
        got[hinted] = [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 2]
    assert got == {True: [128], False: [0]}, got


@pytest.mark.parametrize("mode", ["ref+conn", *MODES])
def test_no_store_hint(mode: str, tmp_path: Path) -> None:
    """``tieredkv.no_store``: nothing of the request is stored by tieredkv (in mode 1 vLLM's own
    primary tier still takes it behind vLLM's connector: it is reset between phases here);
    ``TieredKVConnector`` offers none of it to any manager, vLLM's own CPU spec included."""
    a, b = prompt(50, 160), prompt(51, 160)
    offered: list[int] = []
    phases = [[req("A", a, kv_hints=hints(NO_STORE)), req("B", b, 1)], [req("A", a), req("B", b, 1)]]

    def on_phase(eng: Engine, pi: int) -> None:
        if pi == 1 and mode != "ref+conn":
            offered.append(sum(holders(eng, "A").values()))
            offered.append(sum(holders(eng, "B").values()))

    r = run(mode, tiers_file(tmp_path, [lmdb_tier(tmp_path)]), phases, on_phase=on_phase)
    assert_healthy(mode, r)
    assert [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 1] == [0, 160]
    if offered:
        assert offered == [0, 10], offered
    if mode.endswith("+conn"):
        assert r.keys_offered == 10 + 10, r.keys_offered  # B's ten blocks, then A's (plain) in phase 2


@pytest.mark.parametrize("mode", ["spec", "sec"])
def test_unknown_hint_actions_are_ignored_and_counted(mode: str, tmp_path: Path) -> None:
    """Actions tieredkv does not know (another type, another major version, a bad payload, an
    envelope of another protocol) change nothing and are counted by outcome, on vLLM's metrics
    path (``vllm:kv_offload_tieredkv_hint_actions_total``)."""
    a, b = prompt(60, 96), prompt(61, 96)
    odd = hints(
        ("kvcr.prefetch", "1", {"tier": "G3"}),
        ("tieredkv.retain", "2", {"seconds": 5}),
        ("tieredkv.retain", "1", {"seconds": -1}),
        ("tieredkv.retain", "1", {"priority": "high"}),
        ("tieredkv.retain", "1", {"seconds": 60, "priority": 2, "future_field": True}),
    )
    other_protocol = hints(NO_STORE, protocol="2")
    phases = [[req("A", a, kv_hints=odd), req("B", b, 1, kv_hints=other_protocol)], [req("A", a), req("B", b, 1)]]
    seen: dict[str, Any] = {}

    def on_phase(eng: Engine, pi: int) -> None:
        if pi == 2:
            store = store_of(eng)
            seen["counts"] = dict(store.control_counts)
            out = StoreStatsReporter(lambda: [store]).take()
            assert out is not None
            seen["metrics"] = values_by_metric(out.data)

    r = run(mode, tiers_file(tmp_path, [lmdb_tier(tmp_path)]), phases, on_phase=on_phase)
    assert_healthy(mode, r)
    assert [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 1] == [96, 96]  # B stored
    want = {
        ("hint:other", "ignored_unknown_type"): 1,
        ("hint:tieredkv.retain", "ignored_unknown_version"): 1,
        ("hint:tieredkv.retain", "ignored_invalid"): 2,
        ("hint:tieredkv.retain", "accepted"): 1,
        ("hint:tieredkv.no_store", "ignored_unknown_version"): 1,
    }
    assert seen["counts"] == want, seen["counts"]
    reported = {labels: n for labels, n in seen["metrics"][HINT_ACTIONS].items() if n}  # (series start at 0)
    assert reported == {(c.removeprefix("hint:"), o): n for (c, o), n in want.items()}
    assert seen["metrics"][RETENTION][("retained",)] == 6 and seen["metrics"][RETAINED] == {(): 6.0}


# ---- admission -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_admission_stores_on_the_second_sighting(mode: str, tmp_path: Path) -> None:
    """``admit_after: 2``: a prefix one request computed is not written; the second request that
    computes it stores it, and the third hits it. With the default (1) the second hits already.
    The bytes admission kept from being written are counted per group."""
    a = prompt(70, 160)
    phases = [[req("A", a)], [req("A", a)], [req("A", a)]]
    got: dict[int, list[int]] = {}
    declined: dict[Any, Any] = {}
    for n in (1, 2):

        def on_phase(eng: Engine, pi: int, n: int = n) -> None:
            if pi == 3:
                gs = store_of(eng).stats().groups
                declined[n] = (gs[0].admission_declined, gs[0].admission_declined_bytes) if 0 in gs else (0, 0)
                m = eng.connector_scheduler.manager
                # what one chunk would have written: its blocks (mode 2), vLLM's primary row (mode 1)
                declined["row"] = m.secondary_tiers[0].block_size_bytes if mode.startswith("sec") else 1024

        tiers = tiers_file(tmp_path / str(n), [lmdb_tier(tmp_path / str(n))], policy=[{"admit_after": n}])
        r = run(mode, tiers, phases, on_phase=on_phase)
        assert_healthy(mode, r)
        got[n] = [sum(rec.external_hits) for rec in r.requests.values()]
    assert got == {1: [0, 160, 160], 2: [0, 0, 160]}, got
    row = declined.pop("row")
    assert declined == {1: (0, 0), 2: (10, 10 * row)}, declined


@pytest.mark.parametrize("mode", ["spec", "spec+conn"])
def test_admission_per_kv_group(mode: str, tmp_path: Path) -> None:
    """A policy per KV group: the sliding-window group admits on the third sighting, the
    full-attention group always. Every byte a forward reads stays right."""
    a = prompt(71, 192)
    phases = [[req("A", a)], [req("A", a)]]
    declined: dict[int, int] = {}

    def on_phase(eng: Engine, pi: int) -> None:
        if pi == 2:
            declined.update({g: gs.admission_declined for g, gs in store_of(eng).stats().groups.items()})

    policy = [{"kinds": ["sliding_window"], "admit_after": 3}, {}]
    tiers = tiers_file(tmp_path, [lmdb_tier(tmp_path)], policy=policy)
    r = run(mode, tiers, phases, on_phase=on_phase, groups=("full", "swa"))
    assert_healthy(mode, r)
    assert declined[0] == 0 and declined[1] > 0, declined
    assert r.stored_tokens["full"] > 0


def test_tier_filter_spec_over_redis_answers_asynchronously(tmp_path: Path, redis_server: Any) -> None:
    """Mode 2 over a CPU slab and Redis: a request that may load only from the remote tier is
    answered by a batched lookup of that tier alone (RETRY first: the scheduler never waits on
    Redis) and loads from it, though the slab holds the same chunks."""
    a = prompt(80, 160)
    phases = [[req("A", a)], [req("A", a, kv_load_tiers=[{"locality": "REMOTE"}])]]
    seen: dict[int, Any] = {}

    def on_phase(eng: Engine, pi: int) -> None:
        seen[pi] = tier_reads(eng)
        if pi == 1:
            seen["held"] = holders(eng, "A")

    tiers = tiers_file(tmp_path, [cpu_tier(), redis_tier(redis_server.url)])
    r = run("spec+conn", tiers, phases, on_phase=on_phase)
    assert_healthy("spec+conn", r)
    assert seen["held"] == {"cpu": 10, "redis": 10}
    rec = next(rec for rec in r.requests.values() if rec.phase == 1)
    assert rec.matched[0] is None and rec.external_hits == [160], rec  # deferred once, then the hit
    assert seen[2]["cpu"] == seen[1]["cpu"] and seen[2]["redis"] > seen[1]["redis"], seen


@pytest.mark.parametrize("mode", ["ref", "ref+conn"])
def test_tier_filters_for_vllms_cpu_manager(mode: str, tmp_path: Path) -> None:
    """vLLM's own CPU manager ignores the tier filters (behind vLLM's connector a request that
    allows only STORAGE still loads from, and stores to, host memory); ``TieredKVConnector`` in
    front of it honours them for its one medium (CPU, local): no hit, no offer."""
    a, b = prompt(90, 160), prompt(91, 160)
    phases = [
        [req("A", a), req("B", b, 1, kv_store_tiers=[{"medium": "STORAGE"}])],
        [req("A", a, kv_load_tiers=[{"medium": "STORAGE"}]), req("B", b, 1)],
    ]
    r = run(mode, tmp_path, phases)
    assert_healthy(mode, r)
    got = [sum(rec.external_hits) for rec in r.requests.values() if rec.phase == 1]
    assert got == ([160, 160] if mode == "ref" else [0, 0]), got

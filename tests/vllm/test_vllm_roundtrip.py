"""tieredkv behind vLLM 0.33's real Scheduler + OffloadingConnector, bytes checked end to end.

For both modes (the whole ``TieredKVOffloadingSpec`` and ``TieredKVSecondaryTier`` under vLLM's
``TieringOffloadingSpec``) and for LMDB, Redis and a per-group mix (full-attention group → LMDB,
sliding-window group → Redis): request A stores its prompt; the engine's prefix cache, vLLM's
primary tier (tiering mode) and the "GPU" KV tensors are wiped; request B shares A's prefix, hits
in tieredkv, loads, and every loaded token slot of both groups must hold exactly A's KV bytes.
The ``--kv-transfer-config`` JSON comes from docs/vllm.md (the README shows the third of them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import Runner
from tieredkv.keys import key_group

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOCS_CONFIG_PATH = "/etc/tieredkv/tiers.yaml"
BLOCK = 16
WINDOW = 32


def documented_kv_transfer_configs() -> dict[str, dict[str, Any]]:
    """The three ``--kv-transfer-config`` JSONs of docs/vllm.md: vLLM's connector's
    by spec_name, tieredkv's connector's as ``TieredKVConnector``."""
    page = (ROOT / "docs" / "vllm.md").read_text()
    out = {}
    for raw in re.findall(r"--kv-transfer-config '([^']+)'", page):
        cfg = json.loads(raw)
        name = cfg["kv_connector"] if cfg["kv_connector"] != "OffloadingConnector" else None
        out[name or cfg["kv_connector_extra_config"]["spec_name"]] = cfg
    assert set(out) == {"TieredKVOffloadingSpec", "TieringOffloadingSpec", "TieredKVConnector"}, out.keys()
    return out


def extra_config(mode: str, tiers_yaml: Path) -> dict[str, Any]:
    """The documented extra config for ``mode`` with only the YAML path (and a test-sized primary) swapped."""
    cfg = documented_kv_transfer_configs()[mode]
    assert cfg["kv_connector"] in ("OffloadingConnector", mode) and cfg["kv_role"] == "kv_both"
    raw = json.dumps(cfg["kv_connector_extra_config"])
    assert DOCS_CONFIG_PATH in raw
    extra = json.loads(raw.replace(DOCS_CONFIG_PATH, str(tiers_yaml)))
    if "cpu_bytes_to_use" in extra:
        extra["cpu_bytes_to_use"] = 4 << 20  # the docs: 8 GiB; the test's primary tier is 4 MiB
    return extra


def write_tiers(path: Path, backend: str, redis_url: str | None) -> Path:
    tiers, policy = [], []
    if backend in ("lmdb", "mixed"):
        tiers.append(
            {
                "kind": "lmdb",
                "name": "nvme",
                "path": str(path.parent / "lmdb"),
                "map_size_bytes": "64MiB",
                "size_cap_bytes": "32MiB",
            }
        )
    if backend in ("redis", "mixed", "cluster"):
        tiers.append(
            {
                "kind": "redis",
                "name": "redis",
                "url": redis_url,
                "cluster": backend == "cluster",
                "key_prefix": f"tkv-vllm-{path.parent.name}",
            }
        )
    if backend == "mixed":
        policy = [{"kinds": ["sliding_window"], "tiers": ["redis"]}, {"tiers": ["nvme"]}]
    cfg = {
        "version": 1,
        "namespace": {"model": "unused-vllm-names-the-model"},
        "tiers": tiers,
        "pipeline": {"staging_bytes": "8MiB"},
    }
    if policy:
        cfg["policy"] = policy
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@pytest.fixture(params=["lmdb", "redis", "mixed", "cluster"])
def tiers_yaml(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    url = None
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    elif request.param != "lmdb":
        url = request.getfixturevalue("redis_server").url
    return request.param, write_tiers(tmp_path / "tiers.yaml", request.param, url)


def _tiering_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tests.vllm.cpu_worker import cpu_get_worker

    monkeypatch.setattr(TieringOffloadingSpec, "get_worker", cpu_get_worker)


def roundtrip(make_runner: Any) -> tuple[Runner, dict[str, Any]]:
    """A stores 160 tokens; the engine restarts (a new scheduler, primary tier and zeroed "GPU"
    KV tensors: only tieredkv's tiers still hold A's bytes); B (same prefix + 12) must load and match.

    A restart rather than ``reset_prefix_cache(reset_connector=True)``: a connector reset is what
    vLLM does on sleep and weight updates, and after it tieredkv must not serve earlier KV
    (``test_cache_reset_starts_new_generation``)."""
    prompt = [100 + (i * 37) % 800 for i in range(160)]
    first = make_runner()
    try:
        first.new_request(prompt)
        first.run_until_done()
        stores = [k for _, _, acc in first.recorded.prepare_store if acc for k in acc]
        assert stores, "vLLM's connector stored nothing"
    finally:
        first.shutdown()
    runner = make_runner()
    assert all(not t.any() for t in runner.kv.values())
    b = runner.new_request(prompt + [5] * 12)
    runner.run_until_done()
    loads = [k for _, keys in runner.recorded.prepare_load for k in keys]
    assert loads, "no hit was loaded"
    # Loaded chunks: full group from 0, sliding-window group within the window before the boundary.
    full_keys = [k for k in loads if key_group(k) == 0]
    swa_keys = [k for k in loads if key_group(k) == 1]
    tokens_per_chunk = BLOCK * runner.connector_scheduler.config.blocks_per_chunk
    boundary = len(full_keys) * tokens_per_chunk
    assert boundary >= 128 and swa_keys, (boundary, len(swa_keys))
    checked = runner.check_kv(b, 0, boundary, groups=(0,))
    checked_swa = runner.check_kv(b, boundary - WINDOW, boundary, groups=(1,))
    assert checked == boundary and checked_swa == WINDOW
    return runner, {"b": b, "boundary": boundary, "full_keys": full_keys, "swa_keys": swa_keys}


def test_spec_roundtrip_bytes(tiers_yaml: tuple[str, Path]) -> None:
    backend, path = tiers_yaml
    runner, res = roundtrip(lambda: Runner(extra_config("TieredKVOffloadingSpec", path)))
    try:
        from tieredkv.integrations.vllm.spec import TieredKVManager

        assert isinstance(runner.manager_obj, TieredKVManager)
        store = runner.manager_obj.store
        groups = store.stats().groups
        assert groups[0].loads == len(res["full_keys"]) and groups[1].loads == len(res["swa_keys"])
        _assert_routes(store, backend)
        # vLLM's hits by source: LMDB is disk; Redis has no member of its own (unspecified).
        from vllm.v1.kv_offload.base import ReqContext

        m = runner.manager_obj
        ctx = ReqContext(req_id="b")
        sources = {g: {m.get_load_source(k, ctx) for k in res[f"{g}_keys"]} for g in ("full", "swa")}
        assert sources == {g: {_source_table()[backend][g]} for g in ("full", "swa")}, sources
        # Never a blocking call: LMDB answers at once from its memory-mapped B-tree (Tier.probe);
        # a Redis route in the step when the request's one pipelined EXISTS is answered within
        # lookup_budget_ms (1 ms), else RETRY until the batched asynchronous lookup is back.
        states = {s for _, _, s in runner.recorded.lookups}
        assert "HIT" in states
        if backend == "lmdb":
            assert "RETRY" not in states and m._lookups.step_batches == 0, states
        else:
            c: dict[str, int] = {}
            for t in store.pipeline.tiers.values():
                for k, v in t.counters_snapshot().items():
                    if k.startswith("bounded_"):
                        c[k] = c.get(k, 0) + v
            assert m._lookups.step_batches > 0 and sum(c.values()) > 0, c  # asked in the step
            unanswered = sum(c.get(f"bounded_lookup_{w}", 0) for w in ("timeouts", "errors", "skipped"))
            assert ("RETRY" not in states) or unanswered > 0, (states, c)  # RETRY only past the budget
            assert ("RETRY" in states) or c.get("bounded_lookups", 0) > 0, (states, c)
    finally:
        runner.shutdown()


def test_secondary_tier_roundtrip_bytes(tiers_yaml: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    backend, path = tiers_yaml
    _tiering_on_cpu(monkeypatch)
    runner, res = roundtrip(lambda: Runner(extra_config("TieringOffloadingSpec", path)))
    try:
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

        from tieredkv.integrations.vllm import TieredKVSecondaryTier

        assert isinstance(runner.manager_obj, TieringOffloadingManager)
        (tier,) = runner.manager_obj.secondary_tiers
        assert isinstance(tier, TieredKVSecondaryTier)
        # vLLM's tiering manager promotes every key a lookup finds here, also ones the connector's
        # cross-group boundary then leaves out of the load: at least the loaded ones came from tieredkv.
        assert tier.counters["loaded_chunks"] >= len(res["full_keys"]) + len(res["swa_keys"])
        _assert_routes(tier.store, backend)
        assert tier.cache_hit_source == _source_table()[backend]["secondary"]  # vLLM reports promotions under it
    finally:
        runner.shutdown()


def _source_table() -> dict[str, dict[str, Any]]:
    """The cache-hit source vLLM is told, by backend and group (and the secondary tier's)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    disk, remote = CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
    return {
        "lmdb": {"full": disk, "swa": disk, "secondary": disk},
        "redis": {"full": remote, "swa": remote, "secondary": remote},
        "cluster": {"full": remote, "swa": remote, "secondary": remote},
        "mixed": {"full": disk, "swa": remote, "secondary": remote},  # the outermost of the two
    }


def _assert_routes(store: Any, backend: str) -> None:
    """tieredkv's per-group policy decided the tiers: each group's chunks are where its route says."""
    routes = {g: store.policy.get(g).tiers for g in (0, 1)}
    want = {
        "lmdb": {0: ("nvme",), 1: ("nvme",)},
        "redis": {0: ("redis",), 1: ("redis",)},
        "cluster": {0: ("redis",), 1: ("redis",)},
        "mixed": {0: ("nvme",), 1: ("redis",)},
    }[backend]
    assert routes == want


def test_documented_json_is_valid_for_vllm() -> None:
    """The documented JSONs parse into vLLM's KVTransferConfig and name loadable classes."""
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from tieredkv.integrations.vllm import TieredKVOffloadingSpec, TieredKVSecondaryTier

    cfgs = documented_kv_transfer_configs()
    for cfg in cfgs.values():
        KVTransferConfig(**cfg)
    spec_cls = OffloadingSpecFactory.get_spec_cls(cfgs["TieredKVOffloadingSpec"]["kv_connector_extra_config"])
    assert spec_cls is TieredKVOffloadingSpec
    (tier_cfg,) = cfgs["TieringOffloadingSpec"]["kv_connector_extra_config"]["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier_cfg) is TieredKVSecondaryTier
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tieredkv.integrations.vllm import TieredKVConnector

    tkc = KVConnectorFactory.get_connector_class(KVTransferConfig(**cfgs["TieredKVConnector"]))
    assert tkc is TieredKVConnector


def test_import_tieredkv_does_not_import_vllm() -> None:
    code = (
        "import sys, tieredkv, tieredkv.integrations.vllm as v; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; v.TieredKVSecondaryTier; "
        "assert 'vllm' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_spec_manager_contract(tmp_path: Path) -> None:
    """prepare_store all-or-nothing (None = retry the same range; nothing dropped), written keys
    HIT_PENDING until complete_store, unknown keys answered by the tier (at once for LMDB), loads pin their chunks in every tier until complete_load."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    runner = Runner(extra_config("TieredKVOffloadingSpec", write_tiers(tmp_path / "t.yaml", "lmdb", None)))
    try:
        m = runner.manager_obj
        m._cap = 2
        ctx = ReqContext(req_id="x")
        k = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        out = m.prepare_store(k[:2], ctx)
        assert out is not None and out.keys_to_store == k[:2] and out.evicted_keys == []
        assert m.prepare_store(k[2:], ctx) is None  # over budget: all or nothing, retried later
        assert m.lookup(k[0], ctx) is LookupResult.HIT_PENDING
        m.complete_store(k[:2], ctx)
        out = m.prepare_store(k[1:], ctx)  # k[1] is stored: not offered again; the rest accepted whole
        assert out is not None and out.keys_to_store == k[2:]
        m.complete_store(k[2:], ctx)
        # An LMDB route answers at once from its memory-mapped B-tree (never waits on a writer);
        # the batched asynchronous lookup is for routes with a network tier.
        # Nothing was written (no worker ran): bookkeeping alone never makes a hit, the tier decides.
        assert m.lookup(k[3], ctx) is LookupResult.MISS
        m.on_schedule_end(None)
        fp = m.spec.namespace.fingerprint
        spec = m.prepare_load([k[0]], ctx)
        assert spec.keys == [k[0]]
        m.store.drain(5)
        tier = m.store.tiers[0]
        import time as _t

        deadline = _t.monotonic() + 5
        while fp + k[0] not in tier._pins and _t.monotonic() < deadline:
            _t.sleep(0.01)
        assert tier._pins[fp + k[0]] == 1
        m.complete_load([k[0]], ctx)
        while fp + k[0] in tier._pins and _t.monotonic() < deadline:
            _t.sleep(0.01)
        assert fp + k[0] not in tier._pins
    finally:
        runner.shutdown()


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_lookup_prefix_answers_as_lookup_does_key_by_key(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """``TieredKVManager.lookup_prefix`` (``TieredKVConnector``'s prefix scan in one call) gives
    ``lookup``'s answer for each key, in order, and stops after the first miss: a stored key is a
    HIT, one being written HIT_PENDING, one no tier holds a MISS (then nothing more is asked). On
    a Redis route an unknown key is RETRY until the batched lookup sent at the end of the step
    answers, and a RETRY does not end the scan (vLLM's connector keeps asking, to start them):
    here the context carries no keys vLLM recorded, so nothing is asked in the step
    (``test_instep_lookups.py`` asks with them)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    runner = Runner(extra_config("TieredKVOffloadingSpec", write_tiers(tmp_path / "t.yaml", backend, url)))
    try:
        m = runner.manager_obj
        ctx = ReqContext(req_id="x")
        k = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(8)]
        fp = m.spec.namespace.fingerprint
        store = m.store
        store.run(store.tiers[0].put_many([(fp + k[i], b"v" * 8) for i in (0, 1, 3, 6)]))
        assert m.prepare_store([k[2], k[5]], ctx) is not None  # being written until complete_store
        orders = [k, k[3:], [k[0], k[2], k[1]], k[4:], [], list(reversed(k))]

        def same_as_one_by_one() -> None:
            for keys in orders:
                one_by_one = []
                for key in keys:
                    one_by_one.append(m.lookup(key, ctx))
                    if one_by_one[-1] is LookupResult.MISS:
                        break
                assert m.lookup_prefix(keys, ctx) == one_by_one, keys

        H, P, M, R = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY
        if backend == "redis":  # nothing known yet: every key asked, none a miss
            same_as_one_by_one()
            assert m.lookup_prefix(k, ctx) == [R, R, P, R, R, P, R, R]
            m.on_schedule_end(None)  # sends the batched lookup
            assert m.wait_idle(10.0)
        same_as_one_by_one()
        assert m.lookup_prefix(k, ctx) == [H, H, P, H, M]
        assert m.lookup_prefix(list(reversed(k)), ctx) == [M]
        m.complete_store([k[2], k[5]], ctx)  # nothing reached a tier (no worker ran): now misses
        if backend == "redis":  # k[2] was never asked of the server (it was being written)
            assert m.lookup_prefix(k, ctx) == [H, H, R, H, M]
            m.on_schedule_end(None)
            assert m.wait_idle(10.0)
        same_as_one_by_one()
        assert m.lookup_prefix(k, ctx) == [H, H, M]
    finally:
        runner.shutdown()


@pytest.mark.parametrize("low", ["lmdb", "redis"])
def test_load_source_is_the_tier_that_holds_the_key(tmp_path: Path, low: str, request: pytest.FixtureRequest) -> None:
    """On a route of CPU then LMDB (or Redis), vLLM is told where each hit comes from: ``host``
    when the CPU tier holds it (the load reads it there first), ``disk`` when only LMDB does;
    ``external_unspecified`` (vLLM's member for a remote store and for "unknown") when only
    Redis may hold it, the CPU tier's breaker is open, or no tier holds it."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    if low == "lmdb":
        second = {
            "kind": "lmdb",
            "name": "low",
            "path": str(tmp_path / "lmdb"),
            "map_size_bytes": "64MiB",
            "size_cap_bytes": "32MiB",
        }
    else:
        url = request.getfixturevalue("redis_server").url
        second = {"kind": "redis", "name": "low", "url": url, "key_prefix": f"tkv-src-{tmp_path.name}"}
    cfg = {
        "version": 1,
        "namespace": {"model": "x"},
        "tiers": [{"kind": "cpu", "name": "cpu", "capacity_bytes": "16MiB"}, second],
        "pipeline": {"staging_bytes": "8MiB"},
    }
    (tmp_path / "t.yaml").write_text(json.dumps(cfg))
    runner = Runner(extra_config("TieredKVOffloadingSpec", tmp_path / "t.yaml"))
    try:
        m = runner.manager_obj
        ctx = ReqContext(req_id="x")
        fp = m.spec.namespace.fingerprint
        k = [make_offload_key(bytes([i + 1]) * 32, 0) for i in range(4)]
        store = m.store
        cpu, lower = store.tiers
        store.run(cpu.put_many([(fp + k[0], b"a" * 8)]))
        store.run(lower.put_many([(fp + k[0], b"a" * 8), (fp + k[1], b"b" * 8)]))
        host, disk, unspecified = CacheHitSource.HOST, CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
        m.prepare_load(k[:2], ctx)  # what vLLM does before it asks (a key being loaded)
        got = [m.get_load_source(key, ctx) for key in k[:3]]
        assert got == [host, disk if low == "lmdb" else unspecified, unspecified]
        lane = store.pipeline._lanes["cpu"]  # fault injection: the CPU tier's breaker opens
        lane.breaker.trip()
        assert m.get_load_source(k[0], ctx) is unspecified
        lane.breaker.success()
        assert m.get_load_source(k[0], ctx) is host
        m.complete_load(k[:2], ctx)
    finally:
        runner.shutdown()


def test_namespace_from_offloading_config() -> None:
    """The fingerprint follows model, dtype, tokens per block, blocks per chunk, window and layout."""
    import dataclasses

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from tieredkv.integrations.vllm import namespace_from_offloading_config

    base = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("a",), 0), OffloadingGroupConfig(16, ("b",), 1, 2)),
        worker_kv_bytes_per_block=2048,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig("m", "float16"),
        cache=OffloadingCacheConfig(16, 2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    ns = namespace_from_offloading_config(base)
    assert ns.model == "m" and ns.dtype == "float16"
    assert [g.kind for g in ns.groups] == ["full", "sliding_window"] and ns.groups[1].window_tokens == 64
    variants = [
        dataclasses.replace(base, model=OffloadingModelConfig("m2", "float16")),
        dataclasses.replace(base, model=OffloadingModelConfig("m", "bfloat16")),
        dataclasses.replace(base, cache=OffloadingCacheConfig(16, 4)),
        dataclasses.replace(base, groups=(OffloadingGroupConfig(32, ("a",), 0), base.groups[1])),
        dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tp_size=2, world_size=2)),
    ]
    fps = {namespace_from_offloading_config(v).fingerprint for v in variants} | {ns.fingerprint}
    assert len(fps) == len(variants) + 1


@pytest.mark.parametrize("mode", ["TieredKVOffloadingSpec", "TieringOffloadingSpec"])
@pytest.mark.parametrize("keep_on_reset", [False, True])
def test_cache_reset_starts_new_generation(
    mode: str, keep_on_reset: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM resets the connector on sleep and on weight updates: after it, nothing stored before
    may be hit (a new cache generation: a fresh namespace fingerprint). ``keep_on_reset`` keeps
    serving the old records (for resets that do not change the weights)."""
    if mode == "TieringOffloadingSpec":
        _tiering_on_cpu(monkeypatch)
    extra = extra_config(mode, write_tiers(tmp_path / "t.yaml", "lmdb", None))
    if mode == "TieredKVOffloadingSpec":
        extra["keep_on_reset"] = keep_on_reset
    else:
        extra["secondary_tiers"][0]["keep_on_reset"] = keep_on_reset
    runner = Runner(extra)
    try:
        prompt = [300 + (i * 53) % 700 for i in range(160)]
        runner.new_request(prompt)
        runner.run_until_done()
        assert runner.scheduler.reset_prefix_cache(reset_connector=True)
        for t in runner.kv.values():
            t.zero_()
        before = len(runner.recorded.prepare_load)
        b = runner.new_request(prompt + [5] * 12)
        runner.run_until_done()
        loads = [k for _, keys in runner.recorded.prepare_load[before:] for k in keys]
        if keep_on_reset:
            assert loads, "keep_on_reset: the records written before the reset must still hit"
            full = sum(1 for k in loads if key_group(k) == 0)
            assert runner.check_kv(b, 0, full * BLOCK, groups=(0,)) == full * BLOCK
        else:
            assert not loads, f"{len(loads)} chunks stored before the cache reset were loaded after it"
    finally:
        runner.shutdown()


def test_group_kinds_from_offloading_config() -> None:
    """Full attention has no window; a bounded window over attention layers is a sliding window;
    a one-chunk window over non-attention layers is Mamba (vLLM gives Mamba a window of one chunk
    and does not pass the KV spec). ``group_kinds`` overrides; a bad one names the fix."""
    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    from tieredkv.errors import ConfigError
    from tieredkv.integrations.vllm.namespace import group_kind, group_kinds

    full = OffloadingGroupConfig(16, ("model.layers.0.self_attn.attn",), 0)
    swa = OffloadingGroupConfig(16, ("model.layers.1.self_attn.attn",), 1, 2)
    swa1 = OffloadingGroupConfig(16, ("model.layers.1.self_attn.attn",), 1, 1)
    mamba = OffloadingGroupConfig(64, ("model.layers.2.mixer",), 2, 1)
    assert [group_kind(g) for g in (full, swa, swa1, mamba)] == ["full", "sliding_window", "sliding_window", "mamba"]
    assert group_kind(swa1, "mamba") == "mamba"

    class Cfg:
        groups = (full, mamba)

    assert group_kinds(Cfg()) == ["full", "mamba"]
    assert group_kinds(Cfg(), ["full", "sliding_window"]) == ["full", "sliding_window"]
    with pytest.raises(ConfigError, match="one of 'full'"):
        group_kinds(Cfg(), ["full"])
    with pytest.raises(ConfigError, match="allowed"):
        group_kinds(Cfg(), ["full", "ssm"])


def test_stored_keys_made_once_bounded_and_new_per_generation() -> None:
    """The manager's vLLM key -> stored key map: the same object for the same key (its hash
    computed once), never more than its limit (full, it starts again), always ``fingerprint +
    key``; a new cache generation gets a new map under its own fingerprint."""
    from tieredkv.integrations.vllm.shared import StoredKeys, _Shared

    fp = b"F" * 16
    sk = StoredKeys(fp, limit=4)
    keys = [bytes([i]) * 32 + (i % 3).to_bytes(4, "big") for i in range(9)]
    first = sk[keys[0]]
    assert first == fp + keys[0]
    assert sk[keys[0]] is first
    for k in keys[1:4]:
        assert sk[k] == fp + k
    assert len(sk) == 4
    assert sk[keys[4]] == fp + keys[4]
    assert len(sk) == 1, "a full map starts again"
    assert list(map(sk.__getitem__, keys)) == [fp + k for k in keys]
    assert len(sk) <= 4

    class _NS:
        def __init__(self, f: bytes) -> None:
            self.fingerprint = f

    sh = _Shared(None, _NS(fp))  # type: ignore[arg-type]
    old = sh.skeys
    assert sh.skeys[keys[0]] == fp + keys[0]
    sh.namespace = _NS(b"G" * 16)  # type: ignore[assignment]
    assert sh.skeys is not old and sh.skeys[keys[0]] == b"G" * 16 + keys[0]

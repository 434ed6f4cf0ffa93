"""tieredkv.metrics: the scrape-time collector, the latency histogram and the HTTP endpoint."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, MetricsConfig, load_config
from tieredkv.keys import Namespace
from tieredkv.metrics import TieredKVMetrics, start_metrics_server
from tieredkv.pipeline import GroupStats, KeyState, LaneStats, PipelineStats
from tieredkv.pipeline.stats import group_metric_fields
from tieredkv.policy import BreakerState
from tieredkv.store import TieredStore
from tieredkv.testing.faulty import FaultyTier

NS = Namespace(model="test/metrics")


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return samples(reg)[(name, tuple(sorted(labels.items())))]


@pytest.fixture
async def cpu() -> Any:
    tier = CPUTier(CPUTierConfig(capacity_bytes="4MiB", segment_bytes="1MiB", prefault=False))
    async with tier:
        yield tier


async def test_tier_counters_are_read_at_scrape_time(cpu: CPUTier) -> None:
    m = TieredKVMetrics([cpu])
    keys = [NS.key(bytes([i]) * 8, 0) for i in range(4)]
    await cpu.put_many([(k, b"x" * 1000) for k in keys])
    await cpu.get_many([*keys[:3], NS.key(b"missing!", 0)])
    reg = m.registry
    assert value(reg, "tieredkv_tier_hits_total", tier="cpu") == 3
    assert value(reg, "tieredkv_tier_misses_total", tier="cpu") == 1
    assert value(reg, "tieredkv_tier_stored_bytes_total", tier="cpu") == 4000
    assert value(reg, "tieredkv_tier_loaded_bytes_total", tier="cpu") == 3000
    await cpu.get_many(keys)  # no re-registration: the next scrape just reads the new counters
    assert value(reg, "tieredkv_tier_hits_total", tier="cpu") == 7
    assert value(reg, "tieredkv_tier_corrupt_records_total", tier="cpu") == 0  # present as zero


async def test_corrupt_records_and_evictions_are_counted(tmp_path: Path) -> None:
    cfg = LMDBTierConfig(path=str(tmp_path), map_size_bytes="8MiB", size_cap_bytes="64KiB")
    async with LMDBTier(cfg, name="nvme") as tier:
        m = TieredKVMetrics([tier])
        keys = [NS.key(i.to_bytes(8, "big"), 1) for i in range(12)]
        for k in keys:  # 12 x 8 KiB > 64 KiB cap: the oldest are evicted
            await tier.put_many([(k, b"y" * 8000)])
        (raw,) = await tier.raw_get_many([keys[-1]])
        bad = bytearray(raw)
        bad[-1] ^= 1
        await tier.raw_put_many([(keys[-1], bad)])
        assert await tier.get_many([keys[-1]]) == [None]
        assert value(m.registry, "tieredkv_tier_corrupt_records_total", tier="nvme") == 1
        assert value(m.registry, "tieredkv_tier_evictions_total", tier="nvme") >= 4
        await m.refresh_stats()
        st = await tier.stats()
        assert value(m.registry, "tieredkv_tier_records", tier="nvme") == st.records
        assert value(m.registry, "tieredkv_tier_capacity_bytes", tier="nvme") == 64 * 1024
        assert value(m.registry, "tieredkv_tier_used_bytes", tier="nvme") == st.used_bytes


async def test_latency_histogram_is_fed_by_the_tier_observer(cpu: CPUTier) -> None:
    m = TieredKVMetrics([cpu])
    k = NS.key(b"12345678", 0)
    for _ in range(3):
        await cpu.put_many([(k, b"z" * 100)])
    assert value(m.registry, "tieredkv_tier_op_seconds_count", tier="cpu", op="put_many", outcome="ok") == 3
    total = value(m.registry, "tieredkv_tier_op_seconds_sum", tier="cpu", op="put_many", outcome="ok")
    assert 0 < total < 5


async def test_failed_operations_are_labelled_with_their_outcome(cpu: CPUTier) -> None:
    faulty = FaultyTier(cpu, fail_with=OSError("disk gone"), ops={"get_many"})
    m = TieredKVMetrics([faulty])
    with pytest.raises(Exception, match="disk gone"):
        await faulty.get_many([NS.key(b"abcdefgh", 0)])
    assert value(m.registry, "tieredkv_tier_op_seconds_count", tier="faulty-cpu", op="get_many",
                 outcome="TierUnavailableError") == 1  # fmt: skip
    assert value(m.registry, "tieredkv_tier_errors_total", tier="faulty-cpu") == 1


def _store(tmp_path: Path, **pipeline: Any) -> tuple[TieredStore, FaultyTier]:
    """A real store: a CPU slab over an LMDB tier (wrapped to inject faults later), write-through."""
    cfg = load_config(
        {
            "namespace": {"model": "test/metrics-store"},
            "tiers": [{"kind": "cpu", "capacity_bytes": "8MiB", "segment_bytes": "1MiB"}],
            "pipeline": {"breaker_failures": 1, "breaker_reset_s": 3600, **pipeline},
        },
        env={},
    )
    cpu = CPUTier(CPUTierConfig(capacity_bytes="8MiB", segment_bytes="1MiB", prefault=False))
    nvme = FaultyTier(
        LMDBTier(LMDBTierConfig(path=str(tmp_path / "kv"), map_size_bytes="32MiB", size_cap_bytes="16MiB"), name="nvme")
    )
    return TieredStore(cfg, tiers=[cpu, nvme]).start(), nvme


def test_group_and_pipeline_metrics_come_from_a_real_store(tmp_path: Path) -> None:
    store, nvme = _store(tmp_path)
    with store:
        k = torch.randint(0, 256, (16, 8, 64), dtype=torch.uint8)  # 512-byte blocks
        store.register_group(0, [k], blocks_per_chunk=2)
        store.register_group(5, [torch.randint(0, 256, (8, 256), dtype=torch.uint8)])
        cb = 2 * 512
        keys = [store.key(bytes([i]) * 32, 0) for i in range(4)]
        job = store.store(0, [(keys[i], (2 * i + 1, 2 * i + 2)) for i in range(3)])
        assert job is not None and store.wait([job])[job].ok
        assert [s for s, _ in store.lookup(keys)] == [KeyState.HIT] * 3 + [KeyState.MISS]
        job = store.load(0, [(keys[0], (9, 10)), (keys[1], (11, 12))])
        assert job is not None and store.wait([job])[job].ok
        job = store.load(0, [(keys[2], (9, 10)), (keys[3], (11, 12))])  # keys[3] was never stored
        assert job is not None and not store.wait([job])[job].ok
        reg = store.metrics.registry
        assert value(reg, "tieredkv_group_hits_total", group="0") == 3
        assert value(reg, "tieredkv_group_misses_total", group="0") == 1
        assert value(reg, "tieredkv_group_stores_total", group="0") == 3
        assert value(reg, "tieredkv_group_stored_bytes_total", group="0") == 3 * cb
        assert value(reg, "tieredkv_group_loads_total", group="0") == 2
        assert value(reg, "tieredkv_group_loaded_bytes_total", group="0") == 2 * cb
        assert value(reg, "tieredkv_group_load_missing_total", group="0") == 1
        assert value(reg, "tieredkv_group_dropped_stores_total", group="0") == 0
        assert value(reg, "tieredkv_group_pending", group="0") == 0
        assert value(reg, "tieredkv_group_hits_total", group="5") == 0  # registered: present as zero
        assert value(reg, "tieredkv_pipeline_events_total", event="store_ok") == 1
        assert value(reg, "tieredkv_pipeline_events_total", event="load_failed") == 1
        assert value(reg, "tieredkv_staging_bytes", kind="capacity") == store.staging_capacity
        assert value(reg, "tieredkv_staging_bytes", kind="in_use") == 0
        assert value(reg, "tieredkv_pending") == 0
        assert value(reg, "tieredkv_tier_stored_bytes_total", tier="faulty-nvme") == 3 * cb  # write-through
        for tier in ("cpu", "faulty-nvme"):
            assert value(reg, "tieredkv_breaker_state", tier=tier, state="closed") == 1
            assert value(reg, "tieredkv_breaker_open", tier=tier) == 0
            assert value(reg, "tieredkv_dropped_stores_total", tier=tier) == 0

        nvme.fail_with = OSError("disk gone")  # the LMDB tier dies: its stores are dropped, the breaker opens
        more = [store.key(bytes([50 + i]) * 32, 0) for i in range(2)]
        job = store.store(0, [(more[i], (2 * i + 1, 2 * i + 2)) for i in range(2)])
        assert job is not None and store.wait([job])[job].ok  # the CPU slab still holds them
        assert value(reg, "tieredkv_breaker_state", tier="faulty-nvme", state="open") == 1
        assert value(reg, "tieredkv_breaker_state", tier="faulty-nvme", state="closed") == 0
        assert value(reg, "tieredkv_breaker_open", tier="faulty-nvme") == 1
        assert value(reg, "tieredkv_breaker_opens_total", tier="faulty-nvme") == 1
        assert value(reg, "tieredkv_dropped_stores_total", tier="faulty-nvme") == 2
        assert value(reg, "tieredkv_group_stores_total", group="0") == 5
        st = store.stats()  # the same numbers, typed
        assert st.groups[0].stores == 5 and st.lanes["faulty-nvme"].breaker == "open" and st.dropped["faulty-nvme"] == 2


def test_a_refused_store_counts_as_dropped_for_its_group(tmp_path: Path) -> None:
    store, _ = _store(tmp_path, staging_bytes="8KiB")
    with store:
        store.register_group(2, [torch.zeros(8, 16384, dtype=torch.uint8)])  # 16 KiB chunks > 8 KiB staging
        assert store.store(2, [(store.key(b"x" * 32, 2), (1,))]) is None
        assert value(store.metrics.registry, "tieredkv_group_dropped_stores_total", group="2") == 1
        assert value(store.metrics.registry, "tieredkv_pipeline_events_total", event="store_backpressure") == 1


def test_a_partial_or_failing_pipeline_never_breaks_a_scrape() -> None:
    class Broken:
        def stats(self) -> PipelineStats:
            raise RuntimeError("loop is gone")

    class Typed:  # a stand-in reporting the typed stats
        def stats(self) -> PipelineStats:
            return PipelineStats(
                lanes={"nvme": LaneStats(breaker=BreakerState.OPEN.value, dropped=7), "cpu": LaneStats()}
            )

    class Untyped:  # a plain dict is not the contract: the pipeline families are left out
        def stats(self) -> dict[str, Any]:
            return {"breakers": {}, "dropped": {}}

    class Tier:
        name, counters = "t", {"hits": 2, "custom_thing": 5}

        def add_observer(self, fn: Any) -> None:
            pass

    for pipe in (object(), Broken(), Untyped()):
        m = TieredKVMetrics([Tier()], pipeline=pipe)
        s = samples(m.registry)
        assert s[("tieredkv_tier_hits_total", (("tier", "t"),))] == 2
        assert s[("tieredkv_tier_events_total", (("event", "custom_thing"), ("tier", "t")))] == 5
        assert not any(name.startswith("tieredkv_breaker") for name, _ in s)
    m = TieredKVMetrics([Tier()], pipeline=Typed())
    assert value(m.registry, "tieredkv_breaker_open", tier="nvme") == 1
    assert value(m.registry, "tieredkv_breaker_state", tier="cpu", state="closed") == 1
    assert value(m.registry, "tieredkv_dropped_stores_total", tier="nvme") == 7


def test_every_group_stats_field_is_one_exported_metric() -> None:
    """The producer's fields and the collector's metric names are one list: a field added or
    renamed in GroupStats is exported under its metadata name, never silently dropped."""
    gs = GroupStats(**{f.name: i + 1 for i, f in enumerate(group_metric_fields())})
    m = TieredKVMetrics(pipeline=type("P", (), {"stats": lambda self: PipelineStats(groups={7: gs})})())
    s = samples(m.registry)
    for i, f in enumerate(group_metric_fields()):
        suffix = "_total" if f.metadata["type"] == "counter" else ""
        assert s[(f"tieredkv_{f.metadata['metric']}{suffix}", (("group", "7"),))] == i + 1, f.name


def test_each_metrics_object_has_its_own_registry_and_a_shared_one_works_too() -> None:
    from prometheus_client import REGISTRY

    a, b = TieredKVMetrics(), TieredKVMetrics()  # two stores in one process: no duplicate-name error
    assert a.registry is not b.registry
    assert not any(n.startswith("tieredkv_") for n in REGISTRY._names_to_collectors)  # global untouched
    shared = CollectorRegistry()
    TieredKVMetrics(registry=shared).collector.add_tier(type("T", (), {"name": "x", "counters": {"hits": 4}})())
    assert value(shared, "tieredkv_tier_hits_total", tier="x") == 4


def test_metrics_endpoint_serves_the_registry(tmp_path: Path) -> None:
    assert start_metrics_server(MetricsConfig(), CollectorRegistry()) is None  # no port: no endpoint
    cfg = load_config({"namespace": {"model": "test/endpoint"}, "metrics": {"port": 0}}, env={})
    store = TieredStore(cfg, tiers=[CPUTier(CPUTierConfig(capacity_bytes="4MiB", segment_bytes="1MiB"))]).start()
    with store:
        store.register_group(0, [torch.randint(0, 256, (4, 1000), dtype=torch.uint8)])
        job = store.store(0, [(store.key(b"8" * 32, 0), (1,))])
        assert job is not None and store.wait([job])[job].ok
        srv = store.metrics_server
        assert srv is not None and srv.port > 0
        with urllib.request.urlopen(srv.url, timeout=5) as resp:
            body = resp.read().decode()
        assert 'tieredkv_tier_puts_total{tier="cpu"}' not in body  # tier counters use their metric names
        assert 'tieredkv_tier_stored_records_total{tier="cpu"} 1.0' in body
        assert 'tieredkv_group_stored_bytes_total{group="0"} 1000.0' in body
        assert 'tieredkv_breaker_open{tier="cpu"} 0.0' in body
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url, timeout=2)


async def test_tenant_usage_is_reported_for_named_tenants_the_largest_and_records_without_one() -> None:
    from tieredkv.keys import tenant_id
    from tieredkv.tenants import TenantQuotas

    tier = CPUTier(CPUTierConfig(capacity_bytes="4MiB", segment_bytes="1MiB", min_slot_bytes="16KiB", prefault=False))
    quotas = load_config({"tenants": {"default_quota": "25%", "quotas": {"acme": "512KiB"}, "report_top": 2}})
    tier.set_quotas(TenantQuotas.from_config(quotas.tenants))
    async with tier:
        m = TieredKVMetrics([tier])
        chunk = b"x" * 16384
        for i, n in enumerate((1, 2, 3, 4)):  # t0..t3 hold 1..4 chunks; acme none yet
            keys = [NS.key(bytes([i, j]) * 4, 0) for j in range(n)]
            await tier.put_many([(k, chunk) for k in keys], tenants=[tenant_id(f"t{i}")] * n)
        await tier.put_many([(NS.key(b"plain!!!", 0), chunk)])
        await m.refresh_stats()
        used = {labels: v for (name, labels), v in samples(m.registry).items() if name == "tieredkv_tenant_used_bytes"}
        t2, t3 = f"{tenant_id('t2'):016x}", f"{tenant_id('t3'):016x}"
        assert used == {
            (("tenant", "-"), ("tier", "cpu")): 16384.0,
            (("tenant", "acme"), ("tier", "cpu")): 0.0,  # named in the config: reported, even empty
            (("tenant", t3), ("tier", "cpu")): 4 * 16384.0,  # report_top: the two largest others
            (("tenant", t2), ("tier", "cpu")): 3 * 16384.0,
        }
        assert value(m.registry, "tieredkv_tenant_quota_bytes", tier="cpu", tenant="acme") == 512 * 1024
        assert value(m.registry, "tieredkv_tenant_quota_bytes", tier="cpu", tenant=t3) == 1 << 20  # 25%
        assert ("tieredkv_tenant_quota_bytes", (("tenant", "-"), ("tier", "cpu"))) not in samples(m.registry)
        assert value(m.registry, "tieredkv_tier_tenant_refusals_total", tier="cpu") == 0  # present as zero

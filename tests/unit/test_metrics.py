"""tieredkv.metrics: the scrape-time collector, the latency histogram and the HTTP endpoint."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, MetricsConfig
from tieredkv.keys import Namespace
from tieredkv.metrics import TieredKVMetrics, start_metrics_server
from tieredkv.policy import BreakerState
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


class FakePipeline:
    """The duck-typed surface of tieredkv.pipeline.Pipeline that the collector reads."""

    def __init__(self) -> None:
        self.breakers: dict[str, Any] = {"cpu": "closed", "nvme": BreakerState.OPEN}
        self.group_counters = {0: {"hits": 5, "misses": 2, "store_bytes": 4096, "pending": 3, "odd": 1}, 1: {"hits": 1}}

    def stats(self) -> dict[str, Any]:
        return {
            "counters": {"store_ok": 9, "load_failed": 1},
            "dropped": {"cpu": 0, "nvme": 4},
            "breakers": self.breakers,
            "breaker_opens": {"cpu": 0, "nvme": 2},
            "staging": {"capacity": 1 << 20, "in_use": 4096, "high_water": 8192, "refusals": 1},
            "pending": 2,
        }


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


async def test_pipeline_breakers_dropped_stores_and_group_counters(cpu: CPUTier) -> None:
    pipe = FakePipeline()
    m = TieredKVMetrics([cpu], pipeline=pipe)
    reg = m.registry
    assert value(reg, "tieredkv_breaker_state", tier="nvme", state="open") == 1
    assert value(reg, "tieredkv_breaker_state", tier="nvme", state="closed") == 0
    assert value(reg, "tieredkv_breaker_open", tier="nvme") == 1
    assert value(reg, "tieredkv_breaker_open", tier="cpu") == 0
    assert value(reg, "tieredkv_breaker_opens_total", tier="nvme") == 2
    assert value(reg, "tieredkv_dropped_stores_total", tier="nvme") == 4
    assert value(reg, "tieredkv_pipeline_events_total", event="store_ok") == 9
    assert value(reg, "tieredkv_pending") == 2
    assert value(reg, "tieredkv_staging_bytes", kind="in_use") == 4096
    assert value(reg, "tieredkv_group_hits_total", group="0") == 5
    assert value(reg, "tieredkv_group_misses_total", group="0") == 2
    assert value(reg, "tieredkv_group_stored_bytes_total", group="0") == 4096
    assert value(reg, "tieredkv_group_pending", group="0") == 3
    assert value(reg, "tieredkv_group_events_total", group="0", event="odd") == 1
    pipe.breakers["nvme"] = "half_open"  # read live at the next scrape
    assert value(reg, "tieredkv_breaker_state", tier="nvme", state="half_open") == 1
    assert value(reg, "tieredkv_breaker_state", tier="nvme", state="open") == 0


def test_a_partial_or_failing_pipeline_never_breaks_a_scrape() -> None:
    class Broken:
        def stats(self) -> dict[str, Any]:
            raise RuntimeError("loop is gone")

        @property
        def group_counters(self) -> dict[int, dict[str, int]]:
            raise RuntimeError("also gone")

    class Tier:
        name, counters = "t", {"hits": 2, "custom_thing": 5}

        def add_observer(self, fn: Any) -> None:
            pass

    for pipe in (object(), Broken(), type("OnlyGroups", (), {"group_counters": {3: {"hits": 1}}})()):
        m = TieredKVMetrics([Tier()], pipeline=pipe)
        s = samples(m.registry)
        assert s[("tieredkv_tier_hits_total", (("tier", "t"),))] == 2
        assert s[("tieredkv_tier_events_total", (("event", "custom_thing"), ("tier", "t")))] == 5
        assert not any(name.startswith("tieredkv_breaker") for name, _ in s)
    assert s[("tieredkv_group_hits_total", (("group", "3"),))] == 1


def test_each_metrics_object_has_its_own_registry_and_a_shared_one_works_too() -> None:
    from prometheus_client import REGISTRY

    a, b = TieredKVMetrics(), TieredKVMetrics()  # two stores in one process: no duplicate-name error
    assert a.registry is not b.registry
    assert not any(n.startswith("tieredkv_") for n in REGISTRY._names_to_collectors)  # global untouched
    shared = CollectorRegistry()
    TieredKVMetrics(registry=shared).collector.add_tier(type("T", (), {"name": "x", "counters": {"hits": 4}})())
    assert value(shared, "tieredkv_tier_hits_total", tier="x") == 4


async def test_metrics_endpoint_serves_the_registry(cpu: CPUTier) -> None:
    assert start_metrics_server(MetricsConfig(), CollectorRegistry()) is None  # no port: no endpoint
    m = TieredKVMetrics([cpu], pipeline=FakePipeline())
    await cpu.put_many([(NS.key(b"87654321", 0), b"q" * 10)])
    srv = start_metrics_server(MetricsConfig(port=0), m.registry)
    assert srv is not None and srv.port > 0
    try:
        with urllib.request.urlopen(srv.url, timeout=5) as resp:  # noqa: ASYNC210
            body = resp.read().decode()
        assert 'tieredkv_tier_stored_bytes_total{tier="cpu"} 10.0' in body
        assert 'tieredkv_breaker_open{tier="nvme"} 1.0' in body
    finally:
        srv.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url, timeout=2)  # noqa: ASYNC210

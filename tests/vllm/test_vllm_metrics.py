"""tieredkv's counters on vLLM's own metrics: through vLLM's connector stats, aggregation and
Prometheus logger, with values equal to the store's.

One engine-loop run per mode (``tests/vllm/engine.py``: vLLM 0.33's real ``Scheduler``, the
connector's both roles built by vLLM's factory, every KV byte checked): tieredkv's spec (``spec``)
or vLLM's ``TieringOffloadingSpec`` with a tieredkv secondary tier (``secondary``), each behind
vLLM's own ``OffloadingConnector`` and behind ``TieredKVConnector``, over LMDB, full-attention +
sliding-window groups. The counters travel through the hooks vLLM's offloading connector calls
(the manager's and the secondary tier's ``get_stats``, the spec's ``build_metric_definitions``),
so no tieredkv connector is needed for them. Every ``SchedulerStats`` the
scheduler makes is kept, then fed to vLLM's own consumers: ``KVConnectorLogging`` (the interval
aggregation behind the "KV Transfer metrics" log line) and ``PrometheusStatLogger`` (what serves
``/metrics``). Both must carry tieredkv's hits, bytes, corrupt records, dropped stores and breaker
state per tier, and chunks and bytes per KV group, equal to what the store counted.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import Engine, RunResult, _drive, build_workload, cpu_workers
from tests.vllm.test_engine_loop import _tiers_file, secondary_extra, spec_extra

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "dashboards" / "vllm-tieredkv.json"
TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}
GROUPS = ("full", "swa")


class Run:
    """What one engine run left: every scheduler stats object, the store's own counts after the
    last report, and the engine's config (for vLLM's loggers)."""

    def __init__(self, result: RunResult, sched_stats: list[Any], tiers: dict[str, dict[str, int]], store: Any) -> None:
        self.result = result
        self.sched_stats = sched_stats
        self.tier_counters = tiers  # tier name -> Tier.counters
        self.store_stats = store  # store.stats()
        self.vllm_config: Any = None
        self.mode = ""


OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": None}


@pytest.fixture(
    scope="module",
    params=[("spec", "vllm"), ("secondary", "vllm"), ("spec", "tieredkv"), ("secondary", "tieredkv")],
    ids=lambda p: f"{p[0]}-{p[1]}-connector",
)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    mode, connector = request.param
    tiers = _tiers_file(tmp_path_factory.mktemp("metrics"), "lmdb")
    if mode == "spec":
        extra = spec_extra(2, tiers)
    else:  # a primary tier of 32 chunks: later phases' hits come back from tieredkv (promotions)
        extra = dict(secondary_extra(2, tiers), cpu_bytes_to_use=1 << 17)
    with cpu_workers(extra, tiering_cpu_worker=mode == "secondary"):
        yield engine_run(extra, tiers if mode == "spec" else None, TKC if connector == "tieredkv" else OFFLOADING)


def corrupt_one_record(store: Any, tiers_file: Path, num_blocks: int) -> None:
    """Flip a payload byte of one stored full-attention chunk in LMDB (through a second handle on
    the same environment, as another process would), then load it through the store: the read
    fails verification and the store's tier counts one corrupt record."""
    from tieredkv.backends import build_tier
    from tieredkv.config import load_config
    from tieredkv.format import HEADER_SIZE
    from tieredkv.keys import stored_key_group

    async def flip() -> bytes:
        tier = build_tier(load_config(tiers_file, env={}).tier("nvme"))
        await tier.open()
        try:
            full = [i.key async for i in tier.scan() if stored_key_group(i.key) == 0]
            key = full[len(full) // 2]
            (rec,) = await tier.raw_get_many([key])
            assert rec is not None
            bad = bytearray(rec)
            bad[HEADER_SIZE + 1] ^= 0xFF
            await tier.raw_put_many([(key, bad)])
            return key
        finally:
            await tier.close()

    key = asyncio.run(flip())
    job = store.load(0, [(key, (num_blocks - 2, num_blocks - 1))])
    assert job is not None
    (result,) = store.wait([job]).values()
    assert key in result.failed and key not in result.done, result  # never served


def engine_run(extra: dict[str, Any], corrupt_from: Path | None, connector: dict[str, Any]) -> Run:
    from tieredkv.integrations.vllm.stats import stores_of

    res = RunResult(GROUPS, 2, False)
    eng = Engine(extra, groups=GROUPS, blocks_per_chunk=2, result=res, **connector)
    kept: list[Any] = []
    update = eng.scheduler.update_from_output

    def keep(*args: Any, **kwargs: Any) -> Any:
        outs = update(*args, **kwargs)
        kept.extend(o.scheduler_stats for o in outs.values() if o.scheduler_stats is not None)
        return outs

    eng.scheduler.update_from_output = keep  # type: ignore[method-assign]
    try:
        _drive(eng, build_workload(0), step_budget=3000, idle_grace_steps=200, idle_sleep=0.001)
        eng.drain_batch_queue()
        assert res.ok, res.summary()
        (store,) = stores_of(eng.connector_scheduler.manager)
        if corrupt_from is not None:
            corrupt_one_record(store, corrupt_from, eng.num_blocks)
        # The engine is idle: one more scheduler step reports what is left, then nothing moves.
        last = eng.scheduler.connector.get_kv_connector_stats()
        from vllm.v1.metrics.stats import SchedulerStats

        if last is not None:
            kept.append(SchedulerStats(kv_connector_stats=last.to_dict()))
        counters = {t.name: dict(t.counters) for t in store.tiers}
        out = Run(res, kept, counters, store.stats())
        out.vllm_config = eng.vllm_config
        out.mode = "spec" if corrupt_from is not None else "secondary"
        return out
    finally:
        eng.shutdown()


def payloads(run: Run) -> list[dict[str, Any]]:
    """Copies: vLLM's aggregation takes the first payload as its accumulator and adds the rest
    into it, in place (harmless in vLLM, where each step's payload is observed before the next)."""
    return [copy.deepcopy(s.kv_connector_stats) for s in run.sched_stats if s.kv_connector_stats]


def expected(run: Run) -> dict[tuple[str, tuple[str, ...]], float]:
    """The store's own counts, named as vLLM shows them (``vllm:kv_offload_tieredkv_*``)."""
    p = "vllm:kv_offload_tieredkv_"
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for tier, c in run.tier_counters.items():
        for key, name in (
            ("hits", "tier_hits"),
            ("misses", "tier_misses"),
            ("put_bytes", "tier_stored_bytes"),
            ("get_bytes", "tier_loaded_bytes"),
            ("corrupt", "tier_corrupt_records"),
        ):
            out[(p + name, (tier,))] = c.get(key, 0)
    for tier, n in run.store_stats.dropped.items():
        out[(p + "dropped_stores", (tier,))] = n
    for tier, state in run.store_stats.breakers.items():
        out[(p + "breaker_open", (tier,))] = float(state != "closed")
    for g, gs in run.store_stats.groups.items():
        for key, name in (
            ("stores", "group_stored_chunks"),
            ("stored_bytes", "group_stored_bytes"),
            ("loads", "group_loaded_chunks"),
            ("loaded_bytes", "group_loaded_bytes"),
        ):
            out[(p + name, (str(g),))] = getattr(gs, key)
    return out


def test_the_run_moved_every_kind_of_counter(run: Run) -> None:
    """Stores and loads happened on both groups through the LMDB tier, so the comparisons below
    compare real, non-zero numbers."""
    nvme = run.tier_counters["nvme"]
    assert nvme["hits"] > 0 and nvme["put_bytes"] > 0 and nvme["get_bytes"] > 0
    groups = run.store_stats.groups
    assert set(groups) == {0, 1}
    assert all(groups[g].loads > 0 and groups[g].stored_bytes > 0 for g in groups), groups
    assert run.result.wrong_bytes == 0 and not run.result.wrong_outputs, run.result.summary()
    assert len(payloads(run)) > 1  # reported step by step, not once
    if run.mode == "spec":
        assert nvme["corrupt"] == 1  # the record corrupt_one_record flipped


def test_vllm_aggregation_carries_the_stores_counts(run: Run) -> None:
    """vLLM's ``KVConnectorLogging`` (interval aggregation, via the connector class's
    ``build_kv_connector_stats``) sums tieredkv's per-step increments to the store's totals."""
    aggregated_equals_store(run)


def aggregated_equals_store(run: Run) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(run.vllm_config.kv_transfer_config)
    for data in payloads(run):
        logging_.observe(data)
    acc = logging_.transfer_stats_accumulator
    assert acc is not None
    reduced = acc.reduce()
    want = expected(run)
    for (name, labels), value in want.items():
        got = reduced.get(f"{name}:{labels}", 0)
        assert got == value, f"{name}{labels}: vLLM aggregated {got}, the store counted {value}"
    # vLLM's own offload metrics travel in the same payload, untouched.
    assert any(k.startswith("vllm:kv_offload_store_bytes") for k in reduced), sorted(reduced)[:20]


def test_counters_read_every_step_report_the_same_totals(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``stats_interval_s`` (default 0.1 s, the fixture's runs) only delays counts while transfers
    are in flight; with 0 the counters are read every step and vLLM aggregates the same totals."""
    tiers = _tiers_file(tmp_path_factory.mktemp("interval0"), "lmdb")
    extra = spec_extra(2, tiers, stats_interval_s=0)
    with cpu_workers(extra, tiering_cpu_worker=False):
        run = engine_run(extra, None, OFFLOADING)
    assert len(payloads(run)) > 1
    aggregated_equals_store(run)


def test_a_bad_stats_interval_names_the_field_and_the_fix(tmp_path: Path) -> None:
    extra = spec_extra(2, _tiers_file(tmp_path, "lmdb"), stats_interval_s=-1)
    with pytest.raises(Exception, match=r"stats_interval_s: got -1; use a number >= 0"):
        Engine(extra, groups=GROUPS, blocks_per_chunk=2, result=RunResult(GROUPS, 2, False), **OFFLOADING)


def prom_samples(run: Run) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Everything vLLM's ``PrometheusStatLogger`` exports after recording every scheduler stats."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    logger = PrometheusStatLogger(run.vllm_config, engine_indexes=[0])
    try:
        for s in run.sched_stats:
            logger.record(scheduler_stats=copy.deepcopy(s), iteration_stats=None, engine_idx=0)
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in REGISTRY.collect()
            for sample in family.samples
            if sample.name.startswith("vllm:")
        }
    finally:
        unregister_vllm_metrics()


@pytest.fixture(scope="module")
def samples(run: Run) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return prom_samples(run)


def test_vllm_prometheus_metrics_carry_the_stores_counts(run: Run, samples: dict[Any, float]) -> None:
    """On vLLM's ``/metrics``: ``vllm:kv_offload_tieredkv_*`` with vLLM's connector labels
    (``model_name``, ``engine``) plus ``tier`` / ``group``, equal to the store's counts."""
    model = str(run.vllm_config.model_config.served_model_name)
    want = expected(run)
    assert len(want) >= 12
    for (name, labels), value in want.items():
        label = "tier" if "_tier_" in name or name.endswith(("dropped_stores", "breaker_open")) else "group"
        sample = name if name.endswith("breaker_open") else name + "_total"
        key = (sample, frozenset({"model_name": model, "engine": "0", label: labels[0]}.items()))
        assert key in samples, f"{sample}{{{label}={labels[0]!r}}} is not on vLLM's /metrics"
        assert samples[key] == value, f"{sample}{{{label}={labels[0]!r}}}: vLLM shows {samples[key]}, store {value}"


def test_dashboard_queries_only_metrics_vllm_exports(samples: dict[Any, float]) -> None:
    """``config/grafana/dashboards/vllm-tieredkv.json`` plots tieredkv's counters from vLLM's
    ``/metrics``; every metric it names exists there, and every tieredkv metric has a panel."""
    from tieredkv.integrations.vllm.stats import metric_definitions

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"vllm:kv_offload_tieredkv_\w+", e)}
    exported = {name for name, _ in samples}
    assert used and used <= exported, f"not exported by vLLM: {sorted(used - exported)}"
    defined = set(metric_definitions())
    plotted = {re.sub(r"_total$", "", n) for n in used}
    assert defined - {"vllm:kv_offload_tieredkv_tier_evictions", "vllm:kv_offload_tieredkv_tier_errors"} <= plotted, (
        sorted(defined - plotted)
    )
    assert all(p["datasource"]["uid"] == "prometheus" for p in dash["panels"])
    assert dash["uid"] != "tieredkv"  # the other dashboard's uid; both are provisioned from one folder


def test_reporter_sends_what_moved_new_series_once_and_nothing_on_quiet_steps(tmp_path: Path) -> None:
    """vLLM asks for stats on every step, so the reporter reads the live counters and compares:
    a quiet step builds nothing (None), a busy one reports just the series that moved, by how
    much; a new group's series appear once at 0; two stores with one tier name add up; a store
    replaced by a fresh one (a reset) counts from its own zero, never negative."""
    import torch

    import tieredkv
    from tieredkv.integrations.vllm.stats import PREFIX, StoreStatsReporter, values_by_metric

    def cfg(name: str) -> dict[str, Any]:
        return {
            "namespace": {"model": name},
            "tiers": [{"kind": "cpu", "capacity_bytes": "4MiB", "segment_bytes": "1MiB"}],
        }

    def put(store: Any, n: int, size: int) -> None:
        keys = [store.key(bytes([i]) * 32, 0) for i in range(n)]
        job = store.put_records([(k, bytes([i]) * size) for i, k in enumerate(keys)])
        assert job is not None and store.wait([job])[job].ok

    def moved(out: Any) -> dict[str, dict[tuple[str, ...], Any]]:
        assert out is not None
        return values_by_metric(out.data)

    with tieredkv.open_store(cfg("a")) as a, tieredkv.open_store(cfg("b")) as b:
        a.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        stores = [a]
        rep = StoreStatsReporter(lambda: list(stores), reread_s=3600.0)  # no time-based re-read here
        first = moved(rep.take())  # every series once, zeros included
        assert first[PREFIX + "group_stored_chunks"] == {("0",): 0}
        assert first[PREFIX + "tier_stored_bytes"] == {("cpu",): 0}
        assert first[PREFIX + "breaker_open"] == {("cpu",): 0.0}
        assert rep.take() is None and rep.take() is None  # quiet steps
        assert not rep.moved()  # nothing finished: not even read

        put(a, 3, 100)
        assert rep.moved()
        step = moved(rep.take())
        assert step[PREFIX + "group_stored_chunks"] == {("0",): 3}
        assert step[PREFIX + "group_stored_bytes"] == {("0",): 300}
        assert step[PREFIX + "tier_stored_bytes"] == {("cpu",): 300}
        assert PREFIX + "tier_hits" not in step and PREFIX + "breaker_open" not in step  # did not move
        assert rep.take() is None

        # A tier call made outside the pipeline moves no activity: it shows at the next re-read.
        a.run(a.tiers[0].put_many([(a.key(b"z" * 32, 0), b"z" * 7)]))
        assert not rep.moved() and rep.take() is None
        rep.reread_s = 0.0
        assert moved(rep.take())[PREFIX + "tier_stored_bytes"] == {("cpu",): 7}
        rep.reread_s = 3600.0
        assert rep.take() is None

        a.register_group(1, [torch.zeros(8, 32, dtype=torch.uint8)])
        step = moved(rep.take())
        assert step == {PREFIX + n: {("1",): 0} for n in (
            "group_stored_chunks", "group_stored_bytes", "group_store_refused",
            "group_loaded_chunks", "group_loaded_bytes", "group_load_misses",
            "group_admission_declined_chunks", "group_admission_declined_bytes",
        )}  # fmt: skip

        b.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        put(b, 2, 50)
        stores.append(b)  # a second store: its tier "cpu" and group 0 add to a's
        step = moved(rep.take())
        assert step[PREFIX + "tier_stored_bytes"] == {("cpu",): 100}
        assert step[PREFIX + "group_stored_chunks"] == {("0",): 2}

        stores[:] = [b]  # a gone: b's counts go on from where they were
        put(b, 1, 10)
        step = moved(rep.take())
        assert step[PREFIX + "tier_stored_bytes"] == {("cpu",): 10}
        assert rep.take() is None

    with tieredkv.open_store(cfg("c")) as c:  # b replaced by a fresh store (a reset): from its zero
        c.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        put(c, 1, 20)
        stores[:] = [c]
        step = moved(rep.take())
        assert step[PREFIX + "tier_stored_bytes"] == {("cpu",): 20}
        assert step[PREFIX + "group_stored_chunks"] == {("0",): 1}
        assert all(v >= 0 for series in step.values() for v in series.values())
        assert rep.take() is None

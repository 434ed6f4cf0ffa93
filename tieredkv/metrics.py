"""Prometheus metrics (prometheus_client), read at scrape time so the data path pays nothing.

Primitives:

* :class:`TieredKVCollector` — a custom collector. At each scrape it reads the tiers'
  counters (:meth:`Tier.counters_snapshot <tieredkv.backends.base.Tier.counters_snapshot>`: plain
  ints copied under the tier's lock), an optional cached :class:`~tieredkv.backends.base.TierStats`
  snapshot per tier and, for a tier that keeps tenants, its bytes per tenant (both refreshed by
  :meth:`TieredKVCollector.refresh_stats`, since ``stats()`` and ``tenant_usage()`` are async),
  and, when given, a pipeline whose ``stats()`` returns a typed
  :class:`~tieredkv.pipeline.stats.PipelineStats` (read by attribute: a renamed field breaks the
  tests, not the dashboards). Per-group metrics are one per :class:`~tieredkv.pipeline.stats.GroupStats`
  field, named by the field's metadata: to add a metric, add a field there and count it in the
  pipeline.
* :class:`TieredKVMetrics` — the registry, the collector and the per-operation latency
  histogram fed by :meth:`Tier.add_observer <tieredkv.backends.base.Tier.add_observer>`.
* :func:`start_metrics_server` — serve ``/metrics`` on ``metrics.port`` (``metrics.addr``).

Metric names (all prefixed ``tieredkv_``; ``tier`` / ``group`` labels):

=====================================  =====================================================
``tier_hits_total``                    ``get_many`` keys found and verified
``tier_misses_total``                  ``get_many`` keys not found (or corrupt)
``tier_stored_bytes_total``            payload bytes written by ``put_many``
``tier_loaded_bytes_total``            payload bytes read by ``get_many``
``tier_corrupt_records_total``         records that failed verification (deleted)
``tier_evictions_total``               records evicted by the tier's own policy
``tier_tenant_evictions_total``        of those, records evicted because their tenant was over its quota
``tier_tenant_refusals_total``         stores refused because they did not fit their tenant's quota
``tier_errors_total``                  operations that failed (``timeouts_total``: past deadline)
``tier_events_total{event}``           any other tier counter
``tier_used_bytes`` / ``capacity_bytes`` / ``records``   last stats snapshot
``tenant_used_bytes{tier,tenant}``     bytes a tenant holds in a tier (``-``: records without a
                                       tenant; the tenants the config names, and the
                                       ``tenants.report_top`` largest)
``tenant_quota_bytes{tier,tenant}``    those tenants' quotas in the tier (where one applies)
``tier_op_seconds{op,outcome}``        histogram of operation latency
``dropped_stores_total``               chunks a pipeline dropped for a tier (dead/full tier)
``breaker_state{state}``               1 for the breaker's current state (closed/open/half_open)
``breaker_open``                       1 while the breaker is not closed
``breaker_opens_total``                times the breaker opened
``pipeline_events_total{event}``       pipeline counters (store_ok, load_failed, ...)
``pending``                            pipeline jobs in flight (when the pipeline reports it)
``staging_bytes{kind}``                staging pool capacity / in_use / high_water
``group_hits_total`` / ``group_misses_total``   per KV group: lookups that found / missed a chunk
``group_stores_total`` / ``group_loads_total``  per KV group: chunks stored / loaded
``group_stored_bytes_total`` / ``group_loaded_bytes_total``   per KV group: bytes
``group_dropped_stores_total`` / ``group_load_missing_total``  per KV group: refused / missing
``group_pending``                      per KV group: chunks being written
``group_admission_declined_total`` / ``_bytes_total``   per KV group: what admission kept from being written
``control_events_total{control,outcome}``   what request controls did (vLLM's kv_hints actions)
``retention_chunks_total{event}`` / ``retained_chunks``   retention: what happened, chunks pinned now
=====================================  =====================================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tieredkv.backends.base import Tier
from tieredkv.pipeline.stats import GroupStats, PipelineStats, group_metric_fields
from tieredkv.tenants import DEFAULT_TENANT, TenantQuotas

__all__ = [
    "BREAKER_STATES",
    "LATENCY_BUCKETS",
    "MetricsServer",
    "TieredKVCollector",
    "TieredKVMetrics",
    "start_metrics_server",
]

log = logging.getLogger(__name__)

PREFIX = "tieredkv"
BREAKER_STATES = ("closed", "open", "half_open")
#: Seconds; tier operations are batches, from tens of microseconds (CPU) to seconds (remote).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# tier counter name -> (metric suffix, help)
_TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("tier_hits", "Keys found and verified by get_many."),
    "misses": ("tier_misses", "Keys get_many did not find (or found corrupt)."),
    "put_bytes": ("tier_stored_bytes", "Payload bytes written by put_many."),
    "get_bytes": ("tier_loaded_bytes", "Payload bytes read by get_many."),
    "puts": ("tier_stored_records", "Records written by put_many."),
    "corrupt": ("tier_corrupt_records", "Records that failed verification and were deleted."),
    "evictions": ("tier_evictions", "Records evicted by the tier's own capacity policy."),
    "tenant_evictions": (
        "tier_tenant_evictions",
        "Records evicted because their tenant was over its quota (the tenant's own, oldest first).",
    ),
    "tenant_refusals": ("tier_tenant_refusals", "Stores a tier refused because they did not fit their tenant's quota."),
    "errors": ("tier_errors", "Tier operations that failed."),
    "timeouts": ("tier_timeouts", "Tier operations that ran past their deadline."),
    "deletes": ("tier_deletes", "Records removed by delete_many."),
}


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


def _get(obj: Any, attr: str) -> Any:
    """``obj.attr`` (called when it is a method), or ``None`` when missing or failing."""
    try:
        value = getattr(obj, attr, None)
        return value() if callable(value) else value
    except Exception as e:  # noqa: BLE001 - a scrape must never fail because one source did
        log.debug("metrics: reading %s.%s failed: %s", type(obj).__name__, attr, e)
        return None


def _counters_of(tier: Any) -> dict[str, int]:
    """A tier's counters: :meth:`Tier.counters_snapshot <tieredkv.backends.base.Tier.counters_snapshot>`
    (taken under the tier's lock), or a stand-in's ``counters`` mapping as it is."""
    if isinstance(tier, Tier):
        return tier.counters_snapshot()
    return dict(tier.counters)


class TieredKVCollector(Collector):
    """Reads tier and pipeline state at scrape time.

    Args:
        tiers: tiers to report (each a :class:`~tieredkv.backends.base.Tier`, or a stand-in with
            ``name`` and a ``counters`` mapping); more can be added with :meth:`add_tier`.
        pipeline: optional object whose ``stats()`` returns a :class:`PipelineStats` (a
            :class:`~tieredkv.pipeline.Pipeline` or :class:`~tieredkv.store.TieredStore`).
        engine: optional object whose ``block_hashes_reproducible`` (True, False or None: not
            known) is reported (the :class:`~tieredkv.store.TieredStore`).
    """

    def __init__(self, tiers: Iterable[Any] = (), pipeline: Any = None, engine: Any = None) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, Any] = {}
        self._stats: dict[str, Any] = {}
        self._usage: dict[str, dict[int, int]] = {}  # tier -> bytes per tenant id (tiers that keep tenants)
        self.pipeline = pipeline
        self.engine = engine
        for t in tiers:
            self.add_tier(t)

    def add_tier(self, tier: Any) -> None:
        with self._lock:
            self._tiers[str(tier.name)] = tier

    @property
    def tiers(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._tiers)

    async def refresh_stats(self) -> None:
        """Cache one ``stats()`` snapshot per tier, and its bytes per tenant where it keeps
        tenants (call it periodically from the tiers' loop)."""
        for name, tier in self.tiers.items():
            try:
                usage = await tier.tenant_usage() if isinstance(tier, Tier) else None
                if usage is not None:
                    self._usage[name] = usage
                self._stats[name] = await tier.stats()
            except Exception as e:  # noqa: BLE001 - an unreachable tier keeps its last snapshot
                log.debug("metrics: stats of tier %s failed: %s", name, e)

    def set_stats(self, name: str, stats: Any) -> None:
        """Store a stats snapshot taken elsewhere."""
        self._stats[name] = stats

    def set_tenant_usage(self, name: str, usage: Mapping[int, int]) -> None:
        """Store a tier's bytes per tenant id taken elsewhere (``Tier.tenant_usage``)."""
        self._usage[name] = dict(usage)

    # ---- collection -------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        yield from self._collect_tiers()
        if self.pipeline is not None:
            yield from self._collect_pipeline(self.pipeline)
        yield from _control_families(self.engine)
        reproducible = getattr(self.engine, "block_hashes_reproducible", None)
        if reproducible is not None:
            yield GaugeMetricFamily(
                _name("block_hashes_reproducible"),
                "1 when the engine's block hashes are the same in every process (persistent tiers hit"
                " after a restart), 0 when they are not.",
                value=float(reproducible),
            )

    def describe(self) -> Iterator[Any]:  # no up-front description: names depend on sources
        return iter(())

    def _collect_tiers(self) -> Iterator[Any]:
        fams = {k: CounterMetricFamily(_name(s), h, labels=["tier"]) for k, (s, h) in _TIER_COUNTERS.items()}
        other = CounterMetricFamily(_name("tier_events"), "Other tier counters.", labels=["tier", "event"])
        used = GaugeMetricFamily(_name("tier_used_bytes"), "Bytes used (last stats snapshot).", labels=["tier"])
        cap = GaugeMetricFamily(_name("tier_capacity_bytes"), "Capacity (last stats snapshot).", labels=["tier"])
        recs = GaugeMetricFamily(_name("tier_records"), "Records held (last stats snapshot).", labels=["tier"])
        t_used = GaugeMetricFamily(
            _name("tenant_used_bytes"),
            "Bytes a tenant's records hold in a tier (last stats snapshot; tenant '-': records without one).",
            labels=["tier", "tenant"],
        )
        t_quota = GaugeMetricFamily(
            _name("tenant_quota_bytes"), "A tenant's quota in a tier (bytes).", labels=["tier", "tenant"]
        )
        for name, tier in self.tiers.items():
            counters = _counters_of(tier)
            for key in _TIER_COUNTERS:  # always present, so dashboards see zeros
                fams[key].add_metric([name], float(counters.get(key, 0)))
            for key, value in sorted(counters.items()):
                if key not in _TIER_COUNTERS:
                    other.add_metric([name, key], float(value))
            st = self._stats.get(name)
            if st is not None:
                used.add_metric([name], float(st.used_bytes))
                if st.capacity_bytes is not None:
                    cap.add_metric([name], float(st.capacity_bytes))
                if st.records is not None:
                    recs.add_metric([name], float(st.records))
            usage = self._usage.get(name)
            if usage is not None:
                quotas = tier.quotas if isinstance(tier, Tier) else TenantQuotas()
                capacity = st.capacity_bytes if st is not None else None
                for tid in dict.fromkeys((DEFAULT_TENANT, *quotas.reported(usage))):
                    label = quotas.label(tid)
                    t_used.add_metric([name, label], float(usage.get(tid, 0)))
                    limit = quotas.limit(tid, capacity)
                    if limit is not None:
                        t_quota.add_metric([name, label], float(limit))
        yield from fams.values()
        yield from (other, used, cap, recs, t_used, t_quota)

    def _collect_pipeline(self, p: Any) -> Iterator[Any]:
        stats = _get(p, "stats")
        if isinstance(stats, PipelineStats):
            yield from _pipeline_families(stats)
            yield from _group_families(stats.groups)


def _control_families(engine: Any) -> Iterator[Any]:
    """What request controls did (a store's ``control_counts``: vLLM's hint actions by outcome) and
    its retention (chunks pinned now; retained, refused, displaced, expired, released)."""
    counts = getattr(engine, "control_counts", None)
    retention = getattr(engine, "retention", None)
    if counts is None or retention is None:
        return
    fam = CounterMetricFamily(
        _name("control_events"),
        "What request controls did (e.g. kv_hints actions by outcome).",
        labels=["control", "outcome"],
    )
    for (control, outcome), n in sorted(dict(counts).items()):
        fam.add_metric([control, outcome], float(n))
    yield fam
    ret = CounterMetricFamily(
        _name("retention_chunks"), "Chunks retention retained, refused, ... (by event).", labels=["event"]
    )
    for event, n in retention.counts.items():
        ret.add_metric([event], float(n))
    yield ret
    yield GaugeMetricFamily(
        _name("retained_chunks"), "Chunks retention holds pinned against eviction now.", value=len(retention)
    )


def _pipeline_families(st: PipelineStats) -> Iterator[Any]:
    lanes = sorted(st.lanes.items())
    dropped = CounterMetricFamily(
        _name("dropped_stores"), "Chunks the pipeline dropped for a tier (dead, full or breaker open).", labels=["tier"]
    )
    state = GaugeMetricFamily(
        _name("breaker_state"), "1 for the circuit breaker's current state.", labels=["tier", "state"]
    )
    is_open = GaugeMetricFamily(_name("breaker_open"), "1 while the breaker is open or half-open.", labels=["tier"])
    opens = CounterMetricFamily(_name("breaker_opens"), "Times the tier's breaker opened.", labels=["tier"])
    for tier, lane in lanes:
        dropped.add_metric([tier], float(lane.dropped))
        for s in dict.fromkeys((*BREAKER_STATES, lane.breaker)):
            state.add_metric([tier, s], 1.0 if s == lane.breaker else 0.0)
        is_open.add_metric([tier], 0.0 if lane.breaker == "closed" else 1.0)
        opens.add_metric([tier], float(lane.breaker_opens))
    yield from (dropped, state, is_open, opens)
    events = CounterMetricFamily(_name("pipeline_events"), "Pipeline counters.", labels=["event"])
    for event, n in sorted(st.counters.items()):
        events.add_metric([str(event)], float(n))
    yield events
    if st.jobs_in_flight is not None:
        yield GaugeMetricFamily(_name("pending"), "Pipeline jobs in flight.", value=float(st.jobs_in_flight))
    if st.staging is not None:
        gauge = GaugeMetricFamily(_name("staging_bytes"), "Staging buffer pool bytes.", labels=["kind"])
        for kind in ("capacity", "in_use", "high_water"):
            gauge.add_metric([kind], float(getattr(st.staging, kind)))
        yield gauge
        yield CounterMetricFamily(
            _name("staging_refusals"), "Jobs refused because staging was full.", value=float(st.staging.refusals)
        )


def _group_families(groups: Mapping[int, GroupStats]) -> Iterator[Any]:
    """One family per :class:`GroupStats` field, named by the field's ``metric`` metadata."""
    fams = []
    for f in group_metric_fields():
        meta = f.metadata
        family = CounterMetricFamily if meta["type"] == "counter" else GaugeMetricFamily
        fam = family(_name(meta["metric"]), meta["help"], labels=["group"])
        for group, gs in sorted(groups.items()):
            fam.add_metric([str(group)], float(getattr(gs, f.name)))
        fams.append(fam)
    yield from fams


class TieredKVMetrics:
    """A registry with the tieredkv collector and the operation latency histogram.

    Example::

        metrics = TieredKVMetrics(tiers=[cpu, lmdb], pipeline=pipeline)
        server = start_metrics_server(cfg.metrics, metrics.registry)
    """

    def __init__(
        self,
        tiers: Iterable[Any] = (),
        pipeline: Any = None,
        registry: CollectorRegistry | None = None,
        engine: Any = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = TieredKVCollector(pipeline=pipeline, engine=engine)
        self.registry.register(self.collector)
        self.latency = Histogram(
            _name("tier_op_seconds"),
            "Tier operation latency (one batch).",
            ["tier", "op", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, str], Any] = {}
        for t in tiers:
            self.attach_tier(t)

    def attach_tier(self, tier: Any) -> None:
        """Report ``tier`` and feed its operations into the latency histogram."""
        self.collector.add_tier(tier)
        tier.add_observer(self.observe)

    def attach_pipeline(self, pipeline: Any) -> None:
        self.collector.pipeline = pipeline

    def observe(self, tier: str, op: str, nkeys: int, nbytes: int, seconds: float, outcome: str) -> None:
        """A :data:`~tieredkv.backends.base.OpObserver` (the hot path: one dict lookup + observe)."""
        key = (tier, op, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.latency.labels(tier, op, outcome)
        child.observe(seconds)

    async def refresh_stats(self) -> None:
        await self.collector.refresh_stats()


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    server: Any
    thread: threading.Thread
    addr: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(metrics_cfg: Any, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve ``registry`` on ``metrics_cfg.port`` / ``.addr``; ``None`` when no port is set.

    ``port: 0`` binds any free port (read it from the returned handle).
    """
    port = getattr(metrics_cfg, "port", None)
    if port is None:
        return None
    from prometheus_client import start_http_server

    addr = getattr(metrics_cfg, "addr", "127.0.0.1")
    server, thread = start_http_server(int(port), addr=addr, registry=registry)
    return MetricsServer(server, thread, addr, int(server.server_port))

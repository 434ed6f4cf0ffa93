"""Prometheus metrics (prometheus_client), read at scrape time so the data path pays nothing.

Primitives:

* :class:`TieredKVCollector` — a custom collector. At each scrape it reads the tiers'
  ``counters`` (plain ints under a lock), an optional cached :class:`~tieredkv.backends.base.TierStats`
  snapshot per tier (refreshed by :meth:`TieredKVCollector.refresh_stats`, since ``stats()`` is
  async), and, when given, a pipeline-like object (duck-typed: ``stats()`` with ``counters``,
  ``dropped``, ``breakers``, ``breaker_opens``, ``staging``; ``group_counters``). Anything missing
  is skipped, so it works for bare tiers now and for the full pipeline later.
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
``tier_errors_total``                  operations that failed (``timeouts_total``: past deadline)
``tier_events_total{event}``           any other tier counter
``tier_used_bytes`` / ``capacity_bytes`` / ``records``   last stats snapshot
``tier_op_seconds{op,outcome}``        histogram of operation latency
``dropped_stores_total``               chunks a pipeline dropped for a tier (dead/full tier)
``breaker_state{state}``               1 for the breaker's current state (closed/open/half_open)
``breaker_open``                       1 while the breaker is not closed
``breaker_opens_total``                times the breaker opened
``pipeline_events_total{event}``       pipeline counters (store_ok, load_failed, ...)
``pending``                            pipeline jobs in flight (when the pipeline reports it)
``staging_bytes{kind}``                staging pool capacity / in_use / high_water
``group_hits_total`` ...               per KV group: hits, misses, pending, store/load bytes
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
    "errors": ("tier_errors", "Tier operations that failed."),
    "timeouts": ("tier_timeouts", "Tier operations that ran past their deadline."),
    "deletes": ("tier_deletes", "Records removed by delete_many."),
}

# group counter name -> (metric suffix, help)
_GROUP_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("group_hits", "Chunks of this KV group found by lookups."),
    "misses": ("group_misses", "Chunks of this KV group not found by lookups."),
    "store_bytes": ("group_stored_bytes", "Bytes of this KV group stored."),
    "load_bytes": ("group_loaded_bytes", "Bytes of this KV group loaded."),
    "stores": ("group_stores", "Chunks of this KV group stored."),
    "loads": ("group_loads", "Chunks of this KV group loaded."),
    "dropped": ("group_dropped_stores", "Chunks of this KV group whose store was dropped."),
}
_GROUP_GAUGES = {"pending": ("group_pending", "Chunks of this KV group written but not yet durable.")}


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


class TieredKVCollector(Collector):
    """Reads tier and pipeline state at scrape time.

    Args:
        tiers: tiers to report (anything with ``name`` and ``counters``); more can be added
            with :meth:`add_tier`.
        pipeline: optional object with ``stats()`` and/or ``group_counters`` (duck-typed).
    """

    def __init__(self, tiers: Iterable[Any] = (), pipeline: Any = None) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, Any] = {}
        self._stats: dict[str, Any] = {}
        self.pipeline = pipeline
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
        """Cache one ``stats()`` snapshot per tier (call it periodically from the tiers' loop)."""
        for name, tier in self.tiers.items():
            try:
                self._stats[name] = await tier.stats()
            except Exception as e:  # noqa: BLE001 - an unreachable tier keeps its last snapshot
                log.debug("metrics: stats of tier %s failed: %s", name, e)

    def set_stats(self, name: str, stats: Any) -> None:
        """Store a stats snapshot taken elsewhere."""
        self._stats[name] = stats

    # ---- collection -------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        yield from self._collect_tiers()
        if self.pipeline is not None:
            yield from self._collect_pipeline(self.pipeline)

    def describe(self) -> Iterator[Any]:  # no up-front description: names depend on sources
        return iter(())

    def _collect_tiers(self) -> Iterator[Any]:
        fams = {k: CounterMetricFamily(_name(s), h, labels=["tier"]) for k, (s, h) in _TIER_COUNTERS.items()}
        other = CounterMetricFamily(_name("tier_events"), "Other tier counters.", labels=["tier", "event"])
        used = GaugeMetricFamily(_name("tier_used_bytes"), "Bytes used (last stats snapshot).", labels=["tier"])
        cap = GaugeMetricFamily(_name("tier_capacity_bytes"), "Capacity (last stats snapshot).", labels=["tier"])
        recs = GaugeMetricFamily(_name("tier_records"), "Records held (last stats snapshot).", labels=["tier"])
        for name, tier in self.tiers.items():
            counters = getattr(tier, "counters", None) or {}
            lock = getattr(tier, "_counter_lock", None)
            if lock is not None:
                with lock:
                    counters = dict(counters)
            else:
                counters = dict(counters)
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
        yield from fams.values()
        yield from (other, used, cap, recs)

    def _collect_pipeline(self, p: Any) -> Iterator[Any]:
        stats = _get(p, "stats")
        if isinstance(stats, Mapping):
            yield from _pipeline_families(stats)
        groups = _get(p, "group_counters")
        if isinstance(groups, Mapping):
            yield from _group_families(groups)


def _pipeline_families(stats: Mapping[str, Any]) -> Iterator[Any]:
    dropped = stats.get("dropped")
    if isinstance(dropped, Mapping):
        fam = CounterMetricFamily(
            _name("dropped_stores"),
            "Chunks the pipeline dropped for a tier (dead, full or breaker open).",
            labels=["tier"],
        )
        for tier, n in sorted(dropped.items()):
            fam.add_metric([str(tier)], float(n))
        yield fam
    breakers = stats.get("breakers")
    if isinstance(breakers, Mapping):
        state = GaugeMetricFamily(
            _name("breaker_state"), "1 for the circuit breaker's current state.", labels=["tier", "state"]
        )
        is_open = GaugeMetricFamily(_name("breaker_open"), "1 while the breaker is open or half-open.", labels=["tier"])
        for tier, value in sorted(breakers.items()):
            current = str(getattr(value, "value", value))
            for s in dict.fromkeys((*BREAKER_STATES, current)):
                state.add_metric([str(tier), s], 1.0 if s == current else 0.0)
            is_open.add_metric([str(tier)], 0.0 if current == "closed" else 1.0)
        yield state
        yield is_open
    opens = stats.get("breaker_opens")
    if isinstance(opens, Mapping):
        fam = CounterMetricFamily(_name("breaker_opens"), "Times the tier's breaker opened.", labels=["tier"])
        for tier, n in sorted(opens.items()):
            fam.add_metric([str(tier)], float(n))
        yield fam
    counters = stats.get("counters")
    if isinstance(counters, Mapping):
        fam = CounterMetricFamily(_name("pipeline_events"), "Pipeline counters.", labels=["event"])
        for event, n in sorted(counters.items()):
            fam.add_metric([str(event)], float(n))
        yield fam
    pending = stats.get("pending")
    if isinstance(pending, (int, float)):
        yield GaugeMetricFamily(_name("pending"), "Pipeline jobs in flight.", value=float(pending))
    staging = stats.get("staging")
    if isinstance(staging, Mapping):
        gauge = GaugeMetricFamily(_name("staging_bytes"), "Staging buffer pool bytes.", labels=["kind"])
        for kind in ("capacity", "in_use", "high_water"):
            if isinstance(staging.get(kind), (int, float)):
                gauge.add_metric([kind], float(staging[kind]))
        yield gauge
        if isinstance(staging.get("refusals"), (int, float)):
            yield CounterMetricFamily(
                _name("staging_refusals"), "Jobs refused because staging was full.", value=float(staging["refusals"])
            )


def _group_families(groups: Mapping[Any, Any]) -> Iterator[Any]:
    fams = {k: CounterMetricFamily(_name(s), h, labels=["group"]) for k, (s, h) in _GROUP_COUNTERS.items()}
    gauges = {k: GaugeMetricFamily(_name(s), h, labels=["group"]) for k, (s, h) in _GROUP_GAUGES.items()}
    other = CounterMetricFamily(_name("group_events"), "Other per-group counters.", labels=["group", "event"])
    for group, counters in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if not isinstance(counters, Mapping):
            continue
        g = str(group)
        for key, value in sorted(counters.items()):
            if key in fams:
                fams[key].add_metric([g], float(value))
            elif key in gauges:
                gauges[key].add_metric([g], float(value))
            else:
                other.add_metric([g, str(key)], float(value))
    yield from fams.values()
    yield from gauges.values()
    yield other


class TieredKVMetrics:
    """A registry with the tieredkv collector and the operation latency histogram.

    Example::

        metrics = TieredKVMetrics(tiers=[cpu, lmdb], pipeline=pipeline)
        server = start_metrics_server(cfg.metrics, metrics.registry)
    """

    def __init__(
        self, tiers: Iterable[Any] = (), pipeline: Any = None, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = TieredKVCollector(pipeline=pipeline)
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

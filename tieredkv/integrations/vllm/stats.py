"""tieredkv's counters on vLLM's own ``/metrics``, through vLLM 0.33's KV connector stats hooks.

Inside vLLM, tieredkv's Prometheus endpoint (``metrics.port``) is a second port to scrape. This
module reports the same counters through the path vLLM's offloading connector already uses, so
they appear on vLLM's ``/metrics`` next to ``vllm:kv_offload_*``, labelled the way vLLM labels
connector metrics (``model_name``, ``engine``) plus ``tier`` or ``group``:

* ``TieredKVManager.get_stats()`` (the whole spec) and ``TieredKVSecondaryTier.get_stats()`` (a
  secondary tier under vLLM's ``TieringOffloadingSpec``) return :meth:`StoreStatsReporter.take`,
  an ``OffloadingConnectorStats`` (self-describing: metric name -> type, label values -> value)
  that vLLM's offloading scheduler merges into its connector stats every step, so vLLM's
  aggregation (``KVConnectorLogging``) and IPC carry it unchanged — under vLLM's
  ``OffloadingConnector`` and under ``TieredKVConnector`` alike;
* the spec's and the secondary tier's ``build_metric_definitions`` return
  :func:`metric_definitions`, which vLLM's ``OffloadPromMetrics`` turns into
  ``vllm:kv_offload_tieredkv_*`` counters and gauges in vLLM's registry.

Counters are reported as increments since the previous report (vLLM sums them per interval; the
spec's manager reads them at most every ``stats_interval_s`` while transfers or lookups are in
flight, and on every call once nothing is, so an idle engine has reported everything), read
from the store's public API only: ``store.live_counts()`` (dropped stores, breakers, per-group
counters) and each ``store.tiers[i].counters`` (hits, bytes, corrupt records). A store
that is replaced (a reset, a restart) starts again from its own counts; nothing goes negative.

Where to add a metric: one entry in ``_TIER_COUNTERS`` / ``_GROUP_COUNTERS`` / ``_PER_TIER`` (the
definition and the report follow), and a panel in ``config/grafana/dashboards/vllm-tieredkv.json``.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, count
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.integrations.vllm.hashseed import check_block_hashes
from tieredkv.store import TieredStore

__all__ = [
    "PREFIX",
    "StoreStatsReporter",
    "metric_definitions",
    "stores_of",
]

log = logging.getLogger(__name__)

#: vLLM's offload metrics are ``vllm:kv_offload_*``; tieredkv's sit under the same prefix.
PREFIX = "vllm:kv_offload_tieredkv_"

# tier counter (Tier.counters) -> (metric suffix, help); label "tier"
_TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("tier_hits", "Chunks a tieredkv tier found and verified."),
    "misses": ("tier_misses", "Chunks a tieredkv tier did not find (or found corrupt)."),
    "put_bytes": ("tier_stored_bytes", "Payload bytes written to a tieredkv tier."),
    "get_bytes": ("tier_loaded_bytes", "Payload bytes read from a tieredkv tier."),
    "corrupt": ("tier_corrupt_records", "Records of a tieredkv tier that failed verification (deleted)."),
    "evictions": ("tier_evictions", "Records a tieredkv tier evicted by its own capacity policy."),
    "tenant_evictions": (
        "tier_tenant_evictions",
        "Records a tieredkv tier evicted because their tenant (cache_salt) was over its quota.",
    ),
    "tenant_refusals": (
        "tier_tenant_refusals",
        "Stores a tieredkv tier refused because they did not fit their tenant's (cache_salt's) quota.",
    ),
    "errors": ("tier_errors", "tieredkv tier operations that failed."),
}
# store.live_counts() lanes[tier] (LaneStats) field -> (metric suffix, help); label "tier"
_PER_TIER: dict[str, tuple[str, str]] = {
    "dropped": ("dropped_stores", "Chunks tieredkv dropped for a tier (tier dead, full or too slow)."),
    "breaker_opens": ("breaker_opens", "Times a tieredkv tier's circuit breaker opened."),
}
# store.live_counts() groups[g] (GroupStats) field -> (metric suffix, help); label "group" (vLLM's KV group index)
_GROUP_COUNTERS: dict[str, tuple[str, str]] = {
    "stores": ("group_stored_chunks", "Chunks of a KV group tieredkv stored."),
    "stored_bytes": ("group_stored_bytes", "Bytes of a KV group tieredkv stored."),
    "dropped_stores": ("group_store_refused", "Chunks of a KV group no tieredkv tier accepted."),
    "loads": ("group_loaded_chunks", "Chunks of a KV group tieredkv loaded (hits)."),
    "loaded_bytes": ("group_loaded_bytes", "Bytes of a KV group tieredkv loaded."),
    "load_missing": ("group_load_misses", "Chunks of a KV group a tieredkv load did not find."),
    "admission_declined": (
        "group_admission_declined_chunks",
        "Chunks of a KV group tieredkv's admission declined (seen fewer than its admit_after times).",
    ),
    "admission_declined_bytes": (
        "group_admission_declined_bytes",
        "Bytes of a KV group tieredkv's admission kept from being written.",
    ),
}
#: ``TieredStore.control_counts`` ``("hint:<action>", outcome)`` -> labels (action, outcome)
HINT_ACTIONS = PREFIX + "hint_actions"
#: ``store.retention.counts`` event -> label "event"; and the gauge of chunks retained now
RETENTION = PREFIX + "retention_chunks"
RETAINED = PREFIX + "retained_chunks"
_RETENTION_EVENTS = ("retained", "extended", "refused", "displaced", "expired", "released")
#: hint series reported from the start (at 0), so dashboards have them before the first hint
_HINT_SERIES = frozenset(
    {
        ("hint:tieredkv.retain", "accepted"),
        ("hint:tieredkv.no_store", "accepted"),
        ("hint:other", "ignored_unknown_type"),
    }
)
BREAKER_OPEN = PREFIX + "breaker_open"
HASHES_REPRODUCIBLE = PREFIX + "block_hashes_reproducible"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every ``vllm:kv_offload_tieredkv_*`` metric, in the form vLLM's offload metrics use."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for table, label in ((_TIER_COUNTERS, "tier"), (_PER_TIER, "tier"), (_GROUP_COUNTERS, "group")):
        for suffix, doc in table.values():
            out[PREFIX + suffix] = OffloadingCounterMetadata(documentation=doc, labelnames=(label,))
    out[HINT_ACTIONS] = OffloadingCounterMetadata(
        documentation="kv_hints actions tieredkv read, by action type (tieredkv.retain, tieredkv.no_store;"
        " 'other': any other type) and outcome (accepted, ignored_unknown_type, ignored_unknown_version,"
        " ignored_invalid, ignored_disabled).",
        labelnames=("action", "outcome"),
    )
    out[RETENTION] = OffloadingCounterMetadata(
        documentation="Chunks tieredkv's retention (kv_hints tieredkv.retain) retained, extended, refused"
        " (no room), displaced (by a higher priority), expired or released (cache reset).",
        labelnames=("event",),
    )
    out[RETAINED] = OffloadingGaugeMetadata(
        documentation="Chunks tieredkv's retention holds pinned against eviction now.", labelnames=()
    )
    out[BREAKER_OPEN] = OffloadingGaugeMetadata(
        documentation="1 while a tieredkv tier's circuit breaker is not closed (open or half open).",
        labelnames=("tier",),
    )
    out[HASHES_REPRODUCIBLE] = OffloadingGaugeMetadata(
        documentation="1 when vLLM's block hashes are the same in every process (persistent tiers hit"
        " after a restart), 0 when vLLM drew a random seed for this one.",
        labelnames=(),
    )
    return out


def stores_of(manager: Any) -> list[TieredStore]:
    """The tieredkv stores behind an offloading manager: tieredkv's own manager (``.store``) or
    tieredkv secondary tiers under vLLM's tiering manager (``.secondary_tiers[i].store``); none
    for other specs (vLLM's ``CPUOffloadingSpec``), which then report nothing extra."""
    found: list[TieredStore] = []
    for obj in (manager, *(getattr(manager, "secondary_tiers", None) or ())):
        store = getattr(obj, "store", None)
        if isinstance(store, TieredStore) and all(s is not store for s in found):
            found.append(store)
    return found


# A tier's medium (``TierCapabilities.medium``) as vLLM's cache-hit source. "remote" (Redis) and
# anything else: ``external_unspecified``, vLLM's member for a remote store.
_MEDIUM_SOURCE = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


def hit_source(medium: str) -> CacheHitSource:
    """vLLM's ``CacheHitSource`` for hits served from a tier of ``medium``."""
    return _MEDIUM_SOURCE.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)


Series = tuple[str, tuple[str, ...]]  # (metric name, label values)
Snapshot = dict[Series, float]
_TIER_KEYS = tuple(_TIER_COUNTERS)
_LANE_KEYS = tuple(_PER_TIER)
_GROUP_KEYS = tuple(_GROUP_COUNTERS)
# C calls per tier / lane / group. A tier's ``counters`` is a Counter: an absent key read by
# subscript calls its Python ``__missing__``, so they are read with ``get(key, 0)``.
_TIER_ZEROS = (0,) * len(_TIER_KEYS)
_lane_values = operator.attrgetter(*_LANE_KEYS)
_group_values = operator.attrgetter(*_GROUP_KEYS)
_name_of = operator.attrgetter("name")


def _layout(stores: Iterable[TieredStore]) -> tuple[tuple[Any, ...], list[int], Snapshot]:
    """What the stores report, cheaply: their shape (tier names, lanes, groups), every counter's
    cumulative value in the order :func:`_series` names them, and the gauges. Reads the live
    counters (``TieredStore.live_counts``, ``Tier.counters``), copies nothing."""
    shape: list[tuple[Any, ...]] = []
    values: list[int] = []
    gauges: Snapshot = {}
    for store in stores:
        lanes, groups = store.live_counts()
        tiers = store.tiers
        controls = store.control_counts
        hint_keys = tuple(sorted(_HINT_SERIES.union(controls)))
        shape.append((store, tuple(map(_name_of, tiers)), tuple(lanes), tuple(groups), hint_keys))
        for tier in tiers:
            values.extend(map(tier.counters.get, _TIER_KEYS, _TIER_ZEROS))
        for name, lane in lanes.items():
            values.extend(_lane_values(lane))
            gauges[(BREAKER_OPEN, (str(name),))] = float(lane.breaker != "closed")
        for gs in groups.values():
            values.extend(_group_values(gs))
        values.extend(controls[k] for k in hint_keys)
        counts = store.retention.counts
        values.extend(counts[e] for e in _RETENTION_EVENTS)
        gauges[(RETAINED, ())] = float(len(store.retention))
        if store.block_hashes_reproducible is not None:
            gauges[(HASHES_REPRODUCIBLE, ())] = float(store.block_hashes_reproducible)
    return tuple(shape), values, gauges


def _series(shape: tuple[Any, ...]) -> list[tuple[Any, str, tuple[str, ...]]]:
    """Per value of :func:`_layout`, in the same order: (its store, metric, label values)."""
    out: list[tuple[Any, str, tuple[str, ...]]] = []
    for store, tier_names, lane_names, group_ids, hint_keys in shape:
        for name in tier_names:
            out.extend((store, PREFIX + _TIER_COUNTERS[k][0], (name,)) for k in _TIER_KEYS)
        for name in lane_names:
            out.extend((store, PREFIX + _PER_TIER[k][0], (str(name),)) for k in _LANE_KEYS)
        for g in group_ids:
            out.extend((store, PREFIX + _GROUP_COUNTERS[k][0], (str(g),)) for k in _GROUP_KEYS)
        out.extend((store, HINT_ACTIONS, (control.removeprefix("hint:"), outcome)) for control, outcome in hint_keys)
        out.extend((store, RETENTION, (e,)) for e in _RETENTION_EVENTS)
    return out


class StoreStatsReporter:
    """Turns the stores' cumulative counters into the per-step increments vLLM's stats expect.

    ``stores`` is called at each :meth:`take` (the manager may open its store late, or replace
    it at a reset). vLLM calls this on every step, so it is cheap when nothing happened: while
    the stores' :meth:`~tieredkv.store.TieredStore.activity` stands still the counters are not
    read at all (but at least every ``reread_s``, for tier calls made outside the pipeline); when
    they are read, one pass over the live counters and a list comparison finds what moved."""

    def __init__(self, stores: Callable[[], list[TieredStore]], *, reread_s: float = 1.0) -> None:
        self._stores = stores
        self.reread_s = reread_s
        self._gauges: Snapshot = {}
        self._shape: tuple[Any, ...] = ()
        self._values: list[int] = []
        self._series: list[tuple[Any, str, tuple[str, ...]]] = []
        self._seen: list[tuple[TieredStore, int]] | None = None  # (store, activity) at the last read
        self._read_at = float("-inf")
        self._hashes_checked = False  # vLLM's block-hash seed looked at (it is set after the manager)

    def moved(self) -> bool:
        """May a counter have moved since the last :meth:`take` read them? (A clock read and one
        ``activity()`` per store: vLLM asks on every engine step.)"""
        seen = self._seen
        if seen is None or time.monotonic() - self._read_at >= self.reread_s:
            return True
        stores = self._stores()
        if len(stores) != len(seen):
            return True
        for store, (was, act) in zip(stores, seen):
            if store is not was or store.activity() + store.control_activity() != act:
                return True
        return False

    def _moved(self, stores: list[TieredStore]) -> tuple[bool, list[tuple[TieredStore, int]]]:
        seen = [(s, s.activity() + s.control_activity()) for s in stores]
        return seen != self._seen or time.monotonic() - self._read_at >= self.reread_s, seen

    def take(self) -> OffloadingConnectorStats | None:
        """The increments since the last call (a new series once, even at 0, so it exists on
        ``/metrics``; several stores' counters of one series add up) and the gauges that changed;
        ``None`` when nothing did."""
        stores = self._stores()
        if not self._hashes_checked and stores:
            self._hashes_checked = check_block_hashes(stores)
            if self._hashes_checked:
                self._read_at = float("-inf")  # report the gauge now
        moved, seen = self._moved(stores)  # taken before the read: a move during it reads again
        if not moved:
            return None
        try:
            shape, values, gauges = self._read(stores)
        except RuntimeError as e:  # a counter dict resized under us by the loop thread: next step
            log.debug("tieredkv stats skipped this step: %s", e)
            return None
        self._seen, self._read_at = seen, time.monotonic()
        series = self._series
        if shape == self._shape:
            if values == self._values and gauges == self._gauges:
                return None
            prev: Sequence[int | None] = self._values
            # the series that moved, found by C loops: a step moves a few of dozens
            changed: Iterable[int] = compress(count(), map(operator.ne, values, prev))
        else:  # a store, tier or group came or went: match the values by store and series
            old = dict(zip(series, self._values))
            series = self._series = _series(shape)
            prev = [old.get(k) for k in series]
            changed = range(len(values))
        out = OffloadingConnectorStats()
        for i in changed:
            _, name, labels = series[i]
            now, before = values[i], prev[i]
            if before is None:  # a new series shows its count (0 too) rather than nothing
                out.increase_counter(name, now, labels)
            elif now != before:  # per store: counts only grow (a store replaced is a new series)
                out.increase_counter(name, now - before if now > before else now, labels)
        for key, gauge in gauges.items():
            if self._gauges.get(key) != gauge:
                out.set_gauge(key[0], gauge, key[1])
        self._shape, self._values, self._gauges = shape, values, gauges
        return None if out.is_empty() else out

    def _read(self, stores: list[TieredStore]) -> tuple[tuple[Any, ...], list[int], Snapshot]:
        for attempt in range(3):
            try:
                return _layout(stores)
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def values_by_metric(payload: Mapping[str, Any]) -> dict[str, dict[tuple[str, ...], Any]]:
    """``{metric: {label values: value}}`` of tieredkv's metrics in an ``OffloadingConnectorStats``
    payload (``stats.data``), for logs and tests."""
    data = payload.get("data") or {}
    return {k: dict(v) for k, v in data.items() if k.startswith(PREFIX)}

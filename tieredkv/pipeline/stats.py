"""Typed pipeline statistics: what the pipeline counts and what :mod:`tieredkv.metrics` exports.

The producer (the pipeline) fills these dataclasses and the collector reads them by attribute,
so a renamed or removed field breaks at type-check and test time instead of leaving a metric
without samples. Each :class:`GroupStats` field carries its Prometheus name and help in its
``metadata`` (``metric``, ``help``, ``type``): adding a per-group metric is adding a field here
and counting it in the pipeline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GroupStats", "LaneStats", "PipelineStats", "StagingStats", "group_metric_fields"]


def _m(metric: str, help: str, kind: str = "counter") -> Any:
    return field(default=0, metadata={"metric": metric, "help": help, "type": kind})


@dataclass(slots=True)
class GroupStats:
    """Per KV group, in chunks (one key) and payload bytes."""

    hits: int = _m("group_hits", "Chunks of this KV group found by lookups.")
    misses: int = _m("group_misses", "Chunks of this KV group not found by lookups.")
    stores: int = _m("group_stores", "Chunks of this KV group stored (held by at least one tier).")
    stored_bytes: int = _m("group_stored_bytes", "Bytes of this KV group stored.")
    loads: int = _m("group_loads", "Chunks of this KV group loaded.")
    loaded_bytes: int = _m("group_loaded_bytes", "Bytes of this KV group loaded.")
    dropped_stores: int = _m(
        "group_dropped_stores", "Chunks of this KV group whose store was refused (back-pressure) or dropped."
    )
    load_missing: int = _m("group_load_missing", "Chunks of this KV group a load did not find in any tier.")
    pending: int = _m("group_pending", "Chunks of this KV group being written (lookups answer pending).", "gauge")
    admission_declined: int = _m(
        "group_admission_declined", "Chunks of this KV group admission declined (not yet seen admit_after times)."
    )
    admission_declined_bytes: int = _m(
        "group_admission_declined_bytes", "Bytes of this KV group admission kept from being written."
    )


def group_metric_fields() -> list[dataclasses.Field[Any]]:
    """The :class:`GroupStats` fields with their metric metadata (one metric each)."""
    return list(dataclasses.fields(GroupStats))


@dataclass(slots=True)
class LaneStats:
    """One tier as the pipeline sees it: its writer lane and circuit breaker."""

    breaker: str = "closed"  # closed | open | half_open
    breaker_opens: int = 0
    dropped: int = 0  # chunks dropped for this tier (dead tier or open breaker)
    batches: int = 0  # write batches the tier accepted


@dataclass(slots=True)
class StagingStats:
    capacity: int = 0
    in_use: int = 0
    high_water: int = 0
    refusals: int = 0


@dataclass(slots=True)
class PipelineStats:
    """A snapshot of the pipeline (taken on any thread; counters are plain ints)."""

    counters: dict[str, int] = field(default_factory=dict)
    """Pipeline events: ``store_ok``, ``load_failed``, ``promotions``, ``write_backs``, ..."""
    lanes: dict[str, LaneStats] = field(default_factory=dict)
    groups: dict[int, GroupStats] = field(default_factory=dict)
    staging: StagingStats | None = None
    jobs_in_flight: int | None = None

    @property
    def dropped(self) -> dict[str, int]:
        return {n: lane.dropped for n, lane in self.lanes.items()}

    @property
    def breakers(self) -> dict[str, str]:
        return {n: lane.breaker for n, lane in self.lanes.items()}

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON, logs, vLLM's tier stats)."""
        return dataclasses.asdict(self)

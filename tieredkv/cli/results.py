"""Typed results of the admin operations (:mod:`tieredkv.cli.ops`).

Each is a dataclass; :meth:`Result.to_json` gives the ``--json`` document (field names are the
JSON keys, except where a class renames one) and :mod:`tieredkv.cli.render` prints it for people.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ClusterDownResult",
    "ConfigInitResult",
    "ConfigResult",
    "CorruptRecord",
    "EvictResult",
    "EvictRow",
    "FlushResult",
    "FlushRow",
    "InspectEntry",
    "InspectResult",
    "ListResult",
    "MigrateResult",
    "RecordRow",
    "Result",
    "StatusResult",
    "StatusRow",
    "SummaryResult",
    "SummaryRow",
    "TenantUsage",
    "VerifyResult",
    "VerifyRow",
]


class Result:
    """Base of every result: ``to_json`` is the ``--json`` output."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class TenantUsage(Result):
    """One tenant's bytes in one tier and its quota there."""

    #: Its name where the config's ``tenants.quotas`` names it, else its id; ``-``: the default tenant.
    tenant: str
    #: Its id (:func:`tieredkv.keys.tenant_id`), 16 hex digits.
    id: str
    used_bytes: int
    #: Its quota in this tier, in bytes (None: unbounded).
    quota_bytes: int | None = None
    #: The quota as configured (bytes, or a share of the tier's capacity such as ``25%``).
    quota: str | None = None


@dataclass
class StatusRow(Result):
    tier: str
    kind: str
    #: ``None`` for an in-process tier (the CLI cannot reach it; numbers come from the engine).
    reachable: bool | None
    capacity_bytes: int | None = None
    used_bytes: int | None = None
    #: This tier's records (``None`` when unknown); ``records_scope`` says what was counted.
    records: int | None = None
    records_scope: str | None = None
    records_by_namespace: dict[str, int] | None = None
    where: str = ""
    error: str | None = None
    breaker: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Per-tenant usage, the largest first (the tenants the config names and the largest others;
    #: None: the tier does not keep tenants).
    tenants: list[TenantUsage] | None = None
    #: What to know about those figures (e.g. a share quota that is unbounded here).
    tenants_note: str | None = None


@dataclass
class StatusResult(Result):
    tiers: list[StatusRow]
    metrics_url: str | None
    metrics_error: str | None = None
    #: From the engine's metrics: whether its block hashes are the same in its next process
    #: (False: persistent tiers never hit after a restart); None when not reported.
    block_hashes_reproducible: bool | None = None

    @property
    def unreachable(self) -> bool:
        return any(r.reachable is False for r in self.tiers)


@dataclass
class RecordRow(Result):
    tier: str
    key: str
    namespace: str
    group: int
    size: int
    age_s: float | None
    #: The record's tenant: its name where the config names it, else its id in hex; ``-``: the
    #: default tenant; None: the tier cannot tell without touching the record.
    tenant: str | None = None


@dataclass
class ListResult(Result):
    """One page of records in scan order. ``total`` is known only when the scan ended on this
    page (``ls`` does work in proportion to ``offset + limit``, never a full scan)."""

    records: list[RecordRow]
    offset: int
    limit: int
    next_offset: int | None
    total: int | None


@dataclass
class SummaryRow(Result):
    tier: str
    namespace: str
    group: int | None
    records: int = 0
    bytes: int = 0
    oldest_age_s: float | None = None


@dataclass
class SummaryResult(Result):
    by: str
    summary: list[SummaryRow]


@dataclass
class InspectEntry(Result):
    tier: str
    present: bool
    record_bytes: int | None = None
    header: dict[str, Any] | None = None
    header_error: str | None = None
    verified: bool | None = None
    error: str | None = None


@dataclass
class InspectResult(Result):
    key: str
    namespace: str
    block_hash: str
    group: int
    tiers: list[InspectEntry]
    #: What the namespace is, from its catalog record (:mod:`tieredkv.catalog`): ``model``,
    #: ``revision``, ``weights`` (the weights fingerprint; ``""``: none), ``written_at``,
    #: ``namespace`` (every field) and ``tier`` (where it was read); None: no catalog record.
    namespace_info: dict[str, Any] | None = None
    #: Why the catalog record could not be used (None: it was, or there is none).
    namespace_error: str | None = None

    @property
    def ok(self) -> bool:
        present = [e for e in self.tiers if e.present]
        return bool(present) and all(e.verified for e in present)


@dataclass
class VerifyRow(Result):
    tier: str
    checked: int
    ok: int
    corrupt: int
    vanished: int
    repaired: int


@dataclass
class CorruptRecord(Result):
    tier: str
    key: str
    error: str


@dataclass
class VerifyResult(Result):
    tiers: list[VerifyRow]
    corrupt: list[CorruptRecord]
    repair: bool


@dataclass
class EvictRow(Result):
    tier: str
    selected: int
    victims: int
    evicted: int
    freed_bytes: int
    remaining_bytes: int
    #: Records with no age (the tier cannot tell) that ``--older-than`` therefore kept.
    no_age: int
    #: Records whose tenant the tier cannot tell that ``--tenant`` therefore kept.
    no_tenant: int = 0


@dataclass
class EvictResult(Result):
    tiers: list[EvictRow]
    dry_run: bool
    #: The tenant selected (``--tenant`` / ``--tenant-id``), as shown in ``status``; None: any.
    tenant: str | None = None


@dataclass
class FlushRow(Result):
    tier: str
    selected: int
    deleted: int
    bytes: int


@dataclass
class FlushResult(Result):
    tiers: list[FlushRow]
    namespace: str | None
    everything: bool

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["all"] = d.pop("everything")
        return d


@dataclass
class MigrateResult(Result):
    src: str
    dst: str
    total: int
    copied: int
    skipped: int
    corrupt: int
    vanished: int
    target_failed: int
    remaining: int
    complete: bool
    bytes: int
    seconds: float
    problems: list[dict[str, str]]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {"from": d.pop("src"), "to": d.pop("dst"), **d}


@dataclass
class ConfigResult(Result):
    config: dict[str, Any]
    sources: dict[str, str]
    file: str | None


@dataclass
class ConfigInitResult(Result):
    path: str
    bytes: int


@dataclass
class ClusterDownResult(Result):
    dir: str
    was_recorded: bool
    stopped_pids: list[int]

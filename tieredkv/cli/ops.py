"""The admin operations behind ``tieredkv status|ls|inspect|verify|evict|flush|migrate|config``.

Each is a plain (mostly async) function over a loaded config that returns a typed result from
:mod:`tieredkv.cli.results`; none prints (rendering is :mod:`tieredkv.cli.render`) or knows
about typer (wiring is :mod:`tieredkv.cli.app`). Progress goes through a ``Progress`` object the
caller passes (a disabled one prints nothing). Tiers are reached through :mod:`tieredkv.cli.tiers`.

* :func:`status` — per tier: reachable, capacity, usage, our records (per namespace where the
  count takes a scan), breaker state (from a running engine's metrics endpoint), and per-tenant
  usage against the quotas (the tenants the config names and the largest others).
* :func:`list_records` — one page of records in scan order, each with its tenant; work in
  proportion to the page.
* :func:`summarize` — records, bytes and oldest age per namespace or group (a full scan).
* :func:`inspect_key` — header fields of one stored key (its tenant among them) and whether it
  verifies, in each tier; what its namespace is (model, revision, weights fingerprint) from the
  namespace's catalog record (:mod:`tieredkv.catalog`).
* :func:`verify` — scrub every selected record; ``repair`` deletes the corrupt ones.
* :func:`evict` — delete by namespace, group, tenant, age or down to a size target
  (:func:`tieredkv.eviction.plan_eviction` picks the victims).

Namespace catalog records are hidden from ``status``, ``ls`` and ``evict`` (they describe the
records, they are not the engine's); ``verify``, ``flush`` and ``migrate`` treat them as records.
* :func:`flush` — delete a namespace, or every record of the tier.
* :func:`migrate` — copy records between tiers in verified batches; resumable.
* :func:`show_config` / :func:`init_config` — the effective config with provenance; the sample.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from rich.progress import Progress

from tieredkv.backends.base import RecordInfo, Tier
from tieredkv.catalog import catalog_key, is_catalog_key, parse_catalog
from tieredkv.cli.enginemetrics import NotMetrics, read_engine_metrics
from tieredkv.cli.exits import EXIT_BAD_INPUT, EXIT_PROBLEM, CLIError
from tieredkv.cli.results import (
    ConfigInitResult,
    ConfigResult,
    CorruptRecord,
    EvictResult,
    EvictRow,
    FlushResult,
    FlushRow,
    InspectEntry,
    InspectResult,
    ListResult,
    MigrateResult,
    RecordRow,
    StatusResult,
    StatusRow,
    SummaryResult,
    SummaryRow,
    TenantUsage,
    VerifyResult,
    VerifyRow,
)
from tieredkv.cli.tiers import (
    BATCH_BYTES,
    BATCH_RECORDS,
    DELETE_BATCH,
    batches,
    capabilities,
    delete_keys,
    open_tier,
    record_bytes,
    scan_records,
    select_tiers,
)
from tieredkv.config import TieredKVConfig, config_provenance, load_config, mask_secrets
from tieredkv.errors import ConfigError, CorruptRecordError, TierUnavailableError
from tieredkv.eviction import plan_eviction
from tieredkv.format import MAGIC, decode_header, verify_record
from tieredkv.keys import split_stored_key
from tieredkv.tenants import DEFAULT_TENANT, TenantQuotas

__all__ = [
    "evict",
    "flush",
    "init_config",
    "inspect_key",
    "list_records",
    "load",
    "migrate",
    "show_config",
    "status",
    "summarize",
    "verify",
]

#: Records per ``fill_stamps`` call while streaming a scan.
_STAMP_BATCH = 2048


def _quiet() -> Progress:
    return Progress(disable=True)


def load(path: Path | None) -> TieredKVConfig:
    """The config at ``path`` (or the defaults / ``TIEREDKV_CONFIG``); bad input exits 2."""
    try:
        return load_config(path)
    except ConfigError as e:
        raise CLIError(EXIT_BAD_INPUT, str(e)) from None


def _quotas(cfg: TieredKVConfig) -> TenantQuotas:
    return TenantQuotas.from_config(cfg.tenants)


def _row(tier: str, info: RecordInfo, now: float, quotas: TenantQuotas) -> RecordRow:
    fp, _block_hash, group = split_stored_key(info.key)
    age = None if info.stamp is None else round(max(now - info.stamp, 0.0), 3)
    tenant = None if info.tenant is None else quotas.label(info.tenant)
    return RecordRow(
        tier=tier, key=info.key.hex(), namespace=fp.hex(), group=group, size=info.size, age_s=age, tenant=tenant
    )


async def _all_records(
    tier: Tier, namespace: bytes | None, group: int | None, progress: Progress, label: str, *, catalog: bool = False
) -> list[RecordInfo]:
    """Every selected record of ``tier`` with its age, sorted by key (a full scan, shown as it
    runs); namespace catalog records only with ``catalog``."""
    task = progress.add_task(f"scan {label}", total=None)
    infos: list[RecordInfo] = []
    async for info in scan_records(tier, namespace, group, catalog=catalog):
        infos.append(info)
        if len(infos) % 1024 == 0:
            progress.update(task, completed=len(infos))
    progress.update(task, completed=len(infos), total=len(infos))
    infos.sort(key=lambda i: i.key)
    return infos


# ---- status ------------------------------------------------------------------------------


async def status(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    metrics_url: str | None = None,
    *,
    metrics_from: str = "--metrics-url",
    progress: Progress | None = None,
) -> StatusResult:
    """``metrics_from`` names where ``metrics_url`` came from: ``"--metrics-url"`` (a URL that does
    not serve Prometheus text is bad input, exit 2) or ``"metrics.port"`` (a warning, like an
    unreachable engine)."""
    progress = progress or _quiet()
    quotas = _quotas(cfg)
    rows = [await _status_row(tcfg, progress, quotas) for tcfg in select_tiers(cfg, names, allow_in_process=True)]
    breakers: dict[str, str] = {}
    engine: dict[str, dict[str, float]] = {}
    source_error: str | None = None
    hashes: bool | None = None
    if metrics_url:
        try:
            seen = read_engine_metrics(metrics_url)
            breakers, engine, source_error, hashes = (
                seen.breakers,
                seen.usage,
                seen.error,
                seen.block_hashes_reproducible,
            )
        except NotMetrics as e:
            if metrics_from == "--metrics-url":
                raise CLIError(
                    EXIT_BAD_INPUT,
                    f"--metrics-url: got {metrics_url!r} — {e}; give a running engine's metrics URL,"
                    " such as http://127.0.0.1:9400/metrics (the port is the engine's metrics.port)",
                ) from None
            source_error = f"{metrics_from}: {metrics_url} does not serve engine metrics: {e}"
    for row in rows:
        row.breaker = breakers.get(row.tier)
        em = engine.get(row.tier, {})
        if row.reachable is None:  # in-process: only the engine knows
            if "used" in em:
                row.used_bytes = int(em["used"])
            if "records" in em:
                row.records = int(em["records"])
                row.records_scope = "from the engine's metrics"
    return StatusResult(
        tiers=rows, metrics_url=metrics_url, metrics_error=source_error, block_hashes_reproducible=hashes
    )


async def _status_row(tcfg: Any, progress: Progress, quotas: TenantQuotas) -> StatusRow:
    caps = capabilities(tcfg)
    if caps is None or caps.in_process:
        where = "in-process (inside the engine)" if caps else "cannot load this tier kind here"
        return StatusRow(tcfg.label, tcfg.kind, None, tcfg.configured_capacity, where=where)
    try:
        async with open_tier(tcfg) as tier:
            st = await tier.stats()
            by_ns: dict[str, int] | None = None
            scope = "every record of the tier"
            records = st.records
            if records is None:  # the medium cannot count ours alone (Redis DBSIZE): scan our keys
                by_ns = await _count_by_namespace(tier, progress, tcfg.label)
                records = sum(by_ns.values())
                scope = f"keys of this tier's key space ({st.extra.get('key_prefix', tcfg.label)}:...), by scan"
            else:  # (namespace catalog records are not the engine's)
                records -= int(st.extra.get("catalog_records", 0))
            usage = await tier.tenant_usage()
    except TierUnavailableError as e:
        return StatusRow(tcfg.label, tcfg.kind, False, error=str(e))
    tenants, note = _tenant_rows(usage, quotas, st.capacity_bytes, st.extra.get("tenants_note"))
    where = str(st.extra.get("path") or st.extra.get("url") or "")
    if st.extra.get("nodes"):
        where = f"{where} ({st.extra['nodes']} primaries)"
    return StatusRow(
        tcfg.label,
        tcfg.kind,
        True,
        capacity_bytes=st.capacity_bytes,
        used_bytes=st.used_bytes,
        records=records,
        records_scope=scope,
        records_by_namespace=by_ns,
        where=where,
        extra=_jsonable(st.extra),
        tenants=tenants,
        tenants_note=note,
    )


def _tenant_rows(
    usage: dict[int, int] | None, quotas: TenantQuotas, capacity: int | None, said: str | None
) -> tuple[list[TenantUsage] | None, str | None]:
    """The per-tenant usage ``status`` shows for one tier: the default tenant, the tenants the
    config names and the ``report_top`` largest others, the largest first; and a note (with
    ``said``: what the tier says of its figures, ``extra["tenants_note"]``)."""
    if usage is None:
        return None, None
    if not quotas.enabled and not [t for t in usage if t != DEFAULT_TENANT]:
        return [], None  # no tenants here, none configured: nothing to show
    shown = {t for t in quotas.reported(usage) if t in usage or t in quotas.names}
    if DEFAULT_TENANT in usage:
        shown.add(DEFAULT_TENANT)
    rows = []
    for t in sorted(shown, key=lambda t: (-usage.get(t, 0), t)):
        configured = None if t == DEFAULT_TENANT else quotas.by_id.get(t, quotas.default)
        rows.append(
            TenantUsage(
                tenant=quotas.label(t),
                id=f"{t:016x}",
                used_bytes=usage.get(t, 0),
                quota_bytes=quotas.limit(t, capacity),
                quota=None if configured is None else str(configured),
            )
        )
    notes = []
    hidden = len([t for t in usage if t not in shown])
    if hidden:
        notes.append(f"{hidden} more tenant(s) not shown (tenants.report_top)")
    shares = [q for q in [quotas.default, *quotas.by_id.values()] if isinstance(q, str) and q.endswith("%")]
    if shares and capacity is None:
        notes.append(
            "quotas given as a share ('25%') are unbounded here: the tier's capacity is unknown"
            " (Redis: a primary without maxmemory)"
        )
    if said:
        notes.append(said)
    return rows, "; ".join(notes) or None


async def _count_by_namespace(tier: Tier, progress: Progress, label: str) -> dict[str, int]:
    task = progress.add_task(f"count {label}", total=None)
    counts: Counter[str] = Counter()
    n = 0
    async for info in scan_records(tier, None, None):
        counts[info.fingerprint.hex()] += 1
        n += 1
        if n % 1024 == 0:
            progress.update(task, completed=n)
    progress.update(task, completed=n, total=n)
    return dict(sorted(counts.items()))


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str))


# ---- ls ----------------------------------------------------------------------------------


async def list_records(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    limit: int = 50,
    offset: int = 0,
) -> ListResult:
    """Records ``offset`` to ``offset + limit`` in scan order (tiers in config order; LMDB scans in
    key order). Stops the scan one record past the page, so the work is O(offset + limit).
    Ages are taken right after the stamps are read (a Redis stamp is "now − idle time" at the
    read), so a slow scan does not make records look younger than they are."""
    rows: list[RecordRow] = []
    skipped = 0
    more = False
    quotas = _quotas(cfg)
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            page: list[RecordInfo] = []
            async with aclosing(scan_records(tier, namespace, group)) as records:
                async for info in records:
                    if skipped < offset:
                        skipped += 1
                    elif len(rows) + len(page) < limit:
                        page.append(info)
                    else:
                        more = True
                        break
            filled = await tier.fill_stamps(page)
            now = time.time()
            rows.extend(_row(tcfg.label, i, now, quotas) for i in filled)
        if more:
            break
    end = offset + len(rows)
    return ListResult(
        rows, offset, limit, next_offset=end if more else None, total=None if more else skipped + len(rows)
    )


async def summarize(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    by: str,
    progress: Progress | None = None,
) -> SummaryResult:
    """Records, bytes and the oldest age per tier and namespace (``by="group"``: and group)."""
    progress = progress or _quiet()
    acc: dict[tuple[str, str, int | None], SummaryRow] = {}
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            task = progress.add_task(f"scan {tcfg.label}", total=None)
            buf: list[RecordInfo] = []
            n = 0
            async for info in scan_records(tier, namespace, group):
                buf.append(info)
                if len(buf) == _STAMP_BATCH:
                    n += _add_summary(acc, tcfg.label, await tier.fill_stamps(buf), by)
                    buf = []
                    progress.update(task, completed=n)
            n += _add_summary(acc, tcfg.label, await tier.fill_stamps(buf), by)
            progress.update(task, completed=n, total=n)
    order = {t.label: i for i, t in enumerate(cfg.tiers)}
    return SummaryResult(by, [acc[k] for k in sorted(acc, key=lambda k: (order[k[0]], k[1], k[2] or 0))])


def _add_summary(
    acc: dict[tuple[str, str, int | None], SummaryRow], tier: str, infos: list[RecordInfo], by: str
) -> int:
    now = time.time()  # just after the stamps were read
    for info in infos:
        ns = info.fingerprint.hex()
        grp = info.group if by == "group" else None
        s = acc.setdefault((tier, ns, grp), SummaryRow(tier, ns, grp))
        s.records += 1
        s.bytes += info.size
        if info.stamp is not None:
            age = round(max(now - info.stamp, 0.0), 3)
            s.oldest_age_s = age if s.oldest_age_s is None else max(s.oldest_age_s, age)
    return len(infos)


# ---- inspect -----------------------------------------------------------------------------


async def inspect_key(cfg: TieredKVConfig, names: Sequence[str] | None, key: bytes) -> InspectResult:
    """The record of ``key`` in each tier (header, tenant, whether it verifies), and what its
    namespace is: the first catalog record of it that verifies and parses, in tier order."""
    fp, block_hash, group = split_stored_key(key)
    quotas = _quotas(cfg)
    found: list[InspectEntry] = []
    info: dict[str, Any] | None = None
    problem: str | None = None
    ckey = catalog_key(fp)
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            (raw,) = await tier.raw_get_many([key])
            why = None if raw is None else tier.check_record(raw, key)  # sealed records: opened with the keys
            # the catalog through a verified read (a sealed tier opens it; a damaged one is a miss)
            cat = None if info is not None else (await tier.get_many([ckey]))[0]
        found.append(
            InspectEntry(tcfg.label, False) if raw is None else _describe_record(tcfg.label, raw, key, why, quotas)
        )
        if info is None and cat is not None:
            try:
                info = {**parse_catalog(cat, fp), "tier": tcfg.label}
                problem = None
            except ValueError as e:
                problem = problem or f"{tcfg.label}: {e}"
    if info is None and problem is None and not is_catalog_key(key):
        problem = "no catalog record of this namespace (written by an engine the first time it stores under it)"
    return InspectResult(
        key.hex(), fp.hex(), block_hash.hex(), group, found, namespace_info=info, namespace_error=problem
    )


def _describe_record(
    tier: str, raw: bytes, key: bytes, why: str | None, quotas: TenantQuotas | None = None
) -> InspectEntry:
    entry = InspectEntry(tier, True, record_bytes=len(raw))
    try:
        h = decode_header(raw)
    except CorruptRecordError as e:
        entry.header_error = str(e)
    else:
        entry.header = {
            "magic": MAGIC.decode(),
            "version": h.version,
            "namespace": h.fingerprint.hex(),
            "group": h.group,
            "flags": h.flags,
            "payload_bytes": h.payload_len,
            "checksum": f"{h.checksum:016x}",
            "tenant": (quotas or TenantQuotas()).label(h.tenant),  # ("-": the default tenant)
            **({"tenant_id": f"{h.tenant:016x}"} if h.tenant else {}),
        }
    entry.verified, entry.error = why is None, why
    return entry


# ---- verify ------------------------------------------------------------------------------


async def verify(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    repair: bool = False,
    progress: Progress | None = None,
) -> VerifyResult:
    """Scrub the selected records. A record that fails is read once more before it is reported:
    one rewritten, replaced or deleted meanwhile (a live engine on the same medium) is judged
    by what it holds now. ``repair`` deletes a corrupt record by compare-and-delete
    (:meth:`~tieredkv.backends.base.Tier.delete_if_same`): only while it still holds the very
    bytes that failed, so a record written since, by anyone, is never lost."""
    progress = progress or _quiet()
    rows: list[VerifyRow] = []
    corrupt: list[CorruptRecord] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            infos = await _all_records(tier, namespace, group, progress, tcfg.label, catalog=True)
            task = progress.add_task(f"verify {tcfg.label}", total=len(infos))
            ok = vanished = 0
            bad: list[tuple[bytes, bytes]] = []
            for run in batches(infos, BATCH_BYTES, BATCH_RECORDS):
                keys = [i.key for i in run]
                failed: dict[bytes, bytes] = {}
                for k, raw in zip(keys, await tier.raw_get_many(keys), strict=True):
                    if raw is None:
                        vanished += 1
                    elif tier.check_record(raw, k) is None:
                        ok += 1
                    else:
                        failed[k] = raw
                if failed:  # read again: only a record that still holds what failed is corrupt
                    again = await tier.raw_get_many(list(failed))
                    for (k, first), raw in zip(failed.items(), again, strict=True):
                        err = None if raw is None else tier.check_record(raw, k)
                        if raw is None:
                            vanished += 1
                        elif err is None:
                            ok += 1
                        else:
                            bad.append((k, raw))
                            corrupt.append(CorruptRecord(tcfg.label, k.hex(), err))
                progress.advance(task, len(run))
            repaired = await _repair(tier, bad) if repair and bad else 0
        rows.append(VerifyRow(tcfg.label, len(infos), ok, len(bad), vanished, repaired))
    return VerifyResult(rows, corrupt, repair)


async def _repair(tier: Tier, bad: list[tuple[bytes, bytes]]) -> int:
    """Delete the corrupt records ``bad`` (key, the bytes that failed) that still hold those bytes."""
    n = 0
    for start in range(0, len(bad), DELETE_BATCH):
        try:
            n += await tier.delete_if_same(bad[start : start + DELETE_BATCH])
        except NotImplementedError as e:
            raise CLIError(
                EXIT_BAD_INPUT,
                f"tier {tier.name!r}: --repair needs a compare-and-delete, which tier kind {tier.kind!r}"
                f" does not offer ({e}); nothing was deleted there",
            ) from None
    return n


# ---- evict / flush -----------------------------------------------------------------------


async def evict(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    older_than: float | None = None,
    to_size: int | None = None,
    tenant: int | None = None,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> EvictResult:
    """Delete the selected records (namespace, group, ``tenant``), or of those the ones older
    than ``older_than`` and then the least recently used down to ``to_size`` bytes. With
    ``tenant``, records whose tenant the tier cannot tell are kept (counted ``no_tenant``)."""
    if namespace is None and group is None and older_than is None and to_size is None and tenant is None:
        raise CLIError(
            EXIT_BAD_INPUT,
            "evict needs at least one of --namespace, --group, --tenant, --older-than, --to-size"
            " (use `flush --all` to empty a tier)",
        )
    progress = progress or _quiet()
    quotas = _quotas(cfg)
    rows: list[EvictRow] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            infos = await _all_records(tier, namespace, group, progress, tcfg.label)
            no_tenant = 0
            if tenant is not None:
                no_tenant = sum(1 for i in infos if i.tenant is None)
                infos = [i for i in infos if i.tenant == tenant]
            if older_than is not None or to_size is not None:
                infos = await tier.fill_stamps(infos)
            victims = plan_eviction(
                infos, now=time.time(), older_than=older_than, to_size=to_size, record_bytes=record_bytes
            )
            total = sum(record_bytes(i) for i in infos)
            freed = sum(record_bytes(i) for i in victims)
            evicted = 0 if dry_run else await delete_keys(tier, [i.key for i in victims])
        no_age = sum(1 for i in infos if i.stamp is None) if older_than is not None else 0
        rows.append(EvictRow(tcfg.label, len(infos), len(victims), evicted, freed, total - freed, no_age, no_tenant))
    return EvictResult(rows, dry_run, None if tenant is None else quotas.label(tenant))


async def flush(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    *,
    everything: bool,
    confirm: Callable[[str], bool] | None,
    progress: Progress | None = None,
) -> FlushResult:
    """Delete a namespace (or, with ``everything``, every record of this tier's key space).

    ``confirm(question)`` is asked once with the counts; ``None`` means already confirmed.
    """
    if namespace is None and not everything:
        raise CLIError(EXIT_BAD_INPUT, "flush needs --namespace HEX or --all")
    if namespace is not None and everything:
        raise CLIError(EXIT_BAD_INPUT, "flush: give --namespace or --all, not both")
    progress = progress or _quiet()
    plan: list[tuple[Any, list[bytes], int]] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            infos = await _all_records(tier, namespace, None, progress, tcfg.label, catalog=True)
        plan.append((tcfg, [i.key for i in infos], sum(record_bytes(i) for i in infos)))
    what = f"namespace {namespace.hex()}" if namespace is not None else "EVERY record"
    summary = ", ".join(f"{len(keys)} in {t.label}" for t, keys, _ in plan)
    if confirm is not None and not confirm(f"Delete {what}: {summary} record(s)?"):
        raise CLIError(EXIT_PROBLEM, "aborted; nothing was deleted")
    rows = []
    for tcfg, keys, nbytes in plan:
        async with open_tier(tcfg) as tier:
            deleted = await delete_keys(tier, keys)
        rows.append(FlushRow(tcfg.label, len(keys), deleted, nbytes))
    return FlushResult(rows, namespace.hex() if namespace is not None else None, everything)


# ---- migrate -----------------------------------------------------------------------------


async def migrate(
    cfg: TieredKVConfig,
    src_name: str,
    dst_name: str,
    namespace: bytes | None,
    group: int | None,
    *,
    limit: int | None = None,
    batch_bytes: int = BATCH_BYTES,
    batch_records: int = BATCH_RECORDS,
    progress: Progress | None = None,
) -> MigrateResult:
    """Copy records from ``src_name`` to ``dst_name`` in batches: raw read, verify, raw write, read
    back and verify on the target. Keys the target already holds are skipped, so a migrate that
    was interrupted (or stopped by ``limit``) finishes the rest when run again."""
    (src_cfg,) = select_tiers(cfg, [src_name])
    (dst_cfg,) = select_tiers(cfg, [dst_name])
    if src_cfg.label == dst_cfg.label:
        raise CLIError(EXIT_BAD_INPUT, f"--from and --to name the same tier {src_name!r}")
    progress = progress or _quiet()
    n = Counter[str]()
    problems: list[dict[str, str]] = []
    stopped = False
    t0 = time.perf_counter()
    async with open_tier(src_cfg) as src, open_tier(dst_cfg, create=True) as dst:
        infos = await _all_records(src, namespace, group, progress, src_cfg.label, catalog=True)
        task = progress.add_task(f"migrate {src_cfg.label} → {dst_cfg.label}", total=len(infos))
        for run in batches(infos, batch_bytes, batch_records):
            keys = [i.key for i in run]
            present = await dst.contains_many(keys)
            todo = [k for k, p in zip(keys, present, strict=True) if not p]
            n["skipped"] += len(keys) - len(todo)
            if limit is not None and n["copied"] + len(todo) > limit:
                todo = todo[: max(limit - n["copied"], 0)]
                stopped = True
            await _copy(src, dst, todo, n, problems)
            progress.advance(task, len(run))
            if stopped:
                break
    done = sum(n[k] for k in ("skipped", "copied", "corrupt", "vanished", "target_failed"))
    return MigrateResult(
        src=src_cfg.label,
        dst=dst_cfg.label,
        total=len(infos),
        copied=n["copied"],
        skipped=n["skipped"],
        corrupt=n["corrupt"],
        vanished=n["vanished"],
        target_failed=n["target_failed"],
        remaining=len(infos) - done,
        complete=len(infos) == done,
        bytes=n["bytes"],
        seconds=round(time.perf_counter() - t0, 3),
        problems=problems,
    )


async def _copy(src: Tier, dst: Tier, todo: list[bytes], n: Counter[str], problems: list[dict[str, str]]) -> None:
    """Copy ``todo`` verified on both sides, counting into ``n``."""
    good: list[tuple[bytes, bytes]] = []
    for k, raw in zip(todo, await src.raw_get_many(todo) if todo else [], strict=True):
        if raw is None:
            n["vanished"] += 1
            continue
        try:
            verify_record(raw, k)
        except CorruptRecordError as e:
            n["corrupt"] += 1
            problems.append({"key": k.hex(), "error": str(e)})
            continue
        good.append((k, raw))
    if not good:
        return
    await dst.raw_put_many(good)
    back = await dst.raw_get_many([k for k, _ in good])
    for (k, raw), got in zip(good, back, strict=True):
        try:
            if got is None:
                raise CorruptRecordError("missing after write")
            verify_record(got, k)
        except CorruptRecordError as e:
            n["target_failed"] += 1
            problems.append({"key": k.hex(), "error": f"on target: {e}"})
        else:
            n["copied"] += 1
            n["bytes"] += len(raw)


# ---- config ------------------------------------------------------------------------------


def show_config(path: Path | None) -> ConfigResult:
    """The effective config, masked, with the origin of every leaf value."""
    try:
        cfg, origins = config_provenance(path)
    except ConfigError as e:
        raise CLIError(EXIT_BAD_INPUT, str(e)) from None
    data = mask_secrets(cfg.model_dump(mode="json"))
    return ConfigResult(data, origins, str(path) if path else None)


def init_config(path: Path, *, force: bool = False) -> ConfigInitResult:
    """Write the shipped sample config to ``path``; an existing file only with ``force``."""
    from tieredkv.samples import sample_config_text

    if path.is_dir():
        raise CLIError(
            EXIT_BAD_INPUT, f"PATH: {str(path)!r} is a directory; give a file name such as {path / 'tieredkv.yaml'}"
        )
    if path.exists() and not force:
        raise CLIError(
            EXIT_BAD_INPUT, f"PATH: {str(path)!r} exists; pass --force to overwrite it, or give another path"
        )
    text = sample_config_text()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise CLIError(
            EXIT_BAD_INPUT, f"PATH: cannot write {str(path)!r} ({e.strerror}); choose a writable path"
        ) from None
    return ConfigInitResult(str(path), len(text.encode()))

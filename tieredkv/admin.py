"""Tier administration behind the ``tieredkv`` CLI: status, ls, inspect, verify, evict, flush,
migrate, config show (with provenance) and a local Redis Cluster (``cluster up`` / ``down``).

Primitives (async, each returns a JSON-able dict; the CLI prints it as ``--json`` or as rich tables):

* :func:`status` — per tier: reachable, capacity, usage, records, breaker state (read from a
  running engine's metrics endpoint when one is given).
* :func:`list_records` — records of a namespace and/or group, with size and age; paged.
* :func:`inspect_key` — header fields of one stored key and whether it verifies, in each tier.
* :func:`verify` — scrub every selected record (raw read + :func:`~tieredkv.format.verify_record`);
  ``repair`` deletes the corrupt ones.
* :func:`evict` — delete by namespace, group, age (``older_than``) or down to a size target.
* :func:`flush` — delete a namespace, or every record of the tier.
* :func:`migrate` — copy records between tiers in batches: raw read, verify, raw write, read
  back and verify on the target. Keys the target already holds are skipped, so a migrate that
  was interrupted (or stopped by ``limit``) finishes the rest when run again.

The CLI reaches the *persistent* tiers (LMDB, Redis); a ``cpu`` tier lives inside the engine
process and is reported from the configuration (and the engine's metrics) only.

Exit codes: 0 ok; 1 a problem was found (corrupt records not repaired, key not found, failed
copy); 2 bad input (config, options, refused confirmation); 3 a tier could not be reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tieredkv.backends.base import RecordInfo, Tier
from tieredkv.config import (
    LMDBTierConfig,
    TieredKVConfig,
    config_provenance,
    load_config,
    mask_secrets,
)
from tieredkv.errors import ConfigError, CorruptRecordError, TieredKVError, TierUnavailableError
from tieredkv.format import HEADER_SIZE, MAGIC, decode_header, verify_record
from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, split_stored_key

__all__ = [
    "AdminError",
    "evict",
    "flush",
    "inspect_key",
    "list_records",
    "migrate",
    "register",
    "status",
    "verify",
]

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3
IN_PROCESS_KINDS = frozenset({"cpu"})
DEFAULT_CLUSTER_DIR = "./tieredkv-data/redis-cluster"
_BATCH_BYTES = 32 << 20
_BATCH_RECORDS = 256
_DELETE_BATCH = 1024

out = Console()
err = Console(stderr=True)


class AdminError(Exception):
    """A command cannot go on; ``code`` is the process exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------
# parsing user input


def parse_namespace(text: str | None) -> bytes | None:
    """A namespace fingerprint given as 32 hex digits (as ``ls`` prints it)."""
    if text is None:
        return None
    try:
        fp = bytes.fromhex(text.strip())
    except ValueError:
        fp = b""
    if len(fp) != FINGERPRINT_BYTES:
        raise AdminError(EXIT_BAD_INPUT, f"--namespace: got {text!r} — expected {2 * FINGERPRINT_BYTES} hex digits")
    return fp


def parse_key(text: str) -> bytes:
    """A stored key given as hex (fingerprint + block hash + 4-byte group)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise AdminError(EXIT_BAD_INPUT, f"KEY: got {text!r} — not hex; copy a key from `tieredkv ls`") from None
    if len(key) < FINGERPRINT_BYTES + GROUP_BYTES + 1:
        raise AdminError(
            EXIT_BAD_INPUT,
            f"KEY: {len(key)} bytes is too short for a stored key (16-byte namespace + hash + 4-byte group)",
        )
    return key


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)?\s*$")
_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | None) -> float | None:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"`` → seconds."""
    if text is None:
        return None
    m = _DURATION.match(text)
    if not m:
        raise AdminError(EXIT_BAD_INPUT, f"--older-than: got {text!r} — use seconds or 90s / 15m / 2h / 1d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_size(text: str | None, option: str) -> int | None:
    """``"512MiB"``, ``"2GB"``, ``"1000"`` → bytes (pydantic ByteSize syntax).

    At least 1 byte; a fraction of a byte (``0.5``, ``2.7B``) is refused rather than truncated
    (pydantic turns ``"0.5"`` into 0, which for ``evict --to-size`` meant "evict everything").
    A fraction with a larger unit (``1.5GiB``) is rounded down to whole bytes.
    """
    if text is None:
        return None
    from decimal import Decimal

    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        n = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise AdminError(EXIT_BAD_INPUT, f"{option}: got {text!r} — use a size such as 512MiB or 2GB") from None
    m = ByteSize.byte_string_re.match(text)
    unit = (m.group(2) or "b").lower() if m else ""
    if m and unit in ByteSize.byte_sizes:
        exact = Decimal(m.group(1)) * Decimal(str(ByteSize.byte_sizes[unit]))
    else:  # a plain int pydantic read another way ('1_000')
        exact = Decimal(n)
    if exact < 1:
        hint = (
            "; to delete every selected record leave out --to-size (e.g. `tieredkv evict --namespace HEX`)"
            " or use `tieredkv flush`"
            if option == "--to-size"
            else ""
        )
        raise AdminError(
            EXIT_BAD_INPUT,
            f"{option}: got {text!r} — that is {exact.normalize():f} bytes, below 1 byte;"
            f" give a size of at least 1 byte such as 512MiB or 2GB{hint}",
        )
    if exact != exact.to_integral_value() and unit in ("b", "bit"):
        raise AdminError(
            EXIT_BAD_INPUT,
            f"{option}: got {text!r} — not a whole number of bytes; give whole bytes ({int(exact)})"
            " or a unit such as 512MiB or 2GB",
        )
    return n


# ---------------------------------------------------------------------------------------
# tiers


def select_tiers(cfg: TieredKVConfig, names: Sequence[str] | None, *, allow_in_process: bool = False) -> list[Any]:
    """Tier configs named by ``--tier`` (default: every tier the CLI can reach)."""
    if not names:
        chosen = [t for t in cfg.tiers if allow_in_process or t.kind not in IN_PROCESS_KINDS]
        if not chosen:
            raise AdminError(
                EXIT_BAD_INPUT,
                "the config has no tier the CLI can reach (only in-process cpu tiers); configure an lmdb or redis tier",
            )
        return chosen
    chosen = []
    for name in names:
        try:
            t = cfg.tier(name)
        except ConfigError as e:
            raise AdminError(EXIT_BAD_INPUT, f"--tier: {e}") from None
        if t.kind in IN_PROCESS_KINDS and not allow_in_process:
            raise AdminError(
                EXIT_BAD_INPUT,
                f"--tier {name}: a {t.kind} tier lives inside the engine process; the CLI reaches lmdb and redis"
                " tiers only (see the engine's metrics for this one)",
            )
        chosen.append(t)
    return chosen


def _lmdb_missing(tcfg: LMDBTierConfig) -> str | None:
    """The LMDB directory when it holds no environment (``data.mdb``), else ``None``."""
    path = os.path.abspath(os.path.expanduser(tcfg.path))
    return None if os.path.exists(os.path.join(path, "data.mdb")) else path


@asynccontextmanager
async def open_tier(tcfg: Any, *, create: bool = False) -> AsyncIterator[Tier]:
    """Open one tier; an LMDB directory that holds no environment is "unreachable" unless ``create``."""
    from tieredkv.backends.registry import build_tier

    missing = _lmdb_missing(tcfg) if isinstance(tcfg, LMDBTierConfig) and not create else None
    if missing is not None:
        raise TierUnavailableError(f"tier {tcfg.label!r} (lmdb): no LMDB environment at {missing}; check the path")
    tier: Tier = build_tier(tcfg)
    try:
        await tier.open()
        yield tier
    finally:
        await tier.close()


async def select_records(tier: Tier, namespace: bytes | None, group: int | None) -> list[RecordInfo]:
    """Every record of ``tier`` in ``namespace`` / ``group``, sorted by key."""
    infos = [i async for i in tier.scan(namespace) if group is None or i.group == group]
    infos.sort(key=lambda i: i.key)
    return infos


async def with_stamps(tier: Tier, infos: list[RecordInfo]) -> list[RecordInfo]:
    """Fill ``stamp`` where the tier's scan leaves it out (Redis: ``OBJECT IDLETIME``).

    For Redis the stamp is the last write or read, as LMDB's access stamp; it stays ``None``
    when the server cannot tell (an LFU ``maxmemory-policy``).
    """
    if tier.kind != "redis" or not infos or all(i.stamp is not None for i in infos):
        return infos
    client = getattr(tier, "_client", None)
    if client is None:
        return infos
    now = time.time()
    out: list[RecordInfo] = []
    for start in range(0, len(infos), _DELETE_BATCH):
        run = infos[start : start + _DELETE_BATCH]
        pipe = client.pipeline(transaction=False)
        for info in run:
            pipe.object("idletime", tier.redis_key(info.key))  # type: ignore[attr-defined]
        replies = await pipe.execute(raise_on_error=False)
        for info, idle in zip(run, replies, strict=True):
            stamp = now - float(idle) if isinstance(idle, (int, float)) else None
            out.append(RecordInfo(info.key, info.size, stamp))
    return out


async def delete_keys(tier: Tier, keys: Sequence[bytes], progress: Callable[[int], None] | None = None) -> int:
    n = 0
    for start in range(0, len(keys), _DELETE_BATCH):
        run = keys[start : start + _DELETE_BATCH]
        n += await tier.delete_many(run)
        if progress is not None:
            progress(len(run))
    return n


def _batches(infos: Sequence[RecordInfo], max_bytes: int, max_records: int) -> Iterable[list[RecordInfo]]:
    run: list[RecordInfo] = []
    size = 0
    for info in infos:
        n = HEADER_SIZE + info.size
        if run and (size + n > max_bytes or len(run) >= max_records):
            yield run
            run, size = [], 0
        run.append(info)
        size += n
    if run:
        yield run


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        disable=not show,
        transient=False,
    )


def _record_row(tier: str, info: RecordInfo, now: float) -> dict[str, Any]:
    fp, block_hash, group = split_stored_key(info.key)
    return {
        "tier": tier,
        "key": info.key.hex(),
        "namespace": fp.hex(),
        "group": group,
        "size": info.size,
        "age_s": None if info.stamp is None else round(max(now - info.stamp, 0.0), 3),
    }


# ---------------------------------------------------------------------------------------
# status


async def status(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    metrics_url: str | None = None,
    *,
    metrics_from: str = "--metrics-url",
) -> dict[str, Any]:
    """``metrics_from`` names where ``metrics_url`` came from: ``"--metrics-url"`` (a URL that does
    not serve Prometheus text is bad input, exit 2) or ``"metrics.port"`` (a warning, like an
    unreachable engine)."""
    rows: list[dict[str, Any]] = []
    for tcfg in select_tiers(cfg, names, allow_in_process=True):
        row: dict[str, Any] = {"tier": tcfg.label, "kind": tcfg.kind}
        if tcfg.kind in IN_PROCESS_KINDS:
            row.update(
                reachable=None,
                capacity_bytes=int(getattr(tcfg, "capacity_bytes", 0)) or None,
                used_bytes=None,
                records=None,
                where="in-process (inside the engine)",
            )
            rows.append(row)
            continue
        try:
            async with open_tier(tcfg) as tier:
                st = await tier.stats()
        except TierUnavailableError as e:
            row.update(reachable=False, error=str(e), capacity_bytes=None, used_bytes=None, records=None)
        else:
            where = st.extra.get("path") or st.extra.get("url") or ""
            if st.extra.get("nodes"):
                where = f"{where} ({st.extra['nodes']} primaries)"
            row.update(
                reachable=True,
                capacity_bytes=st.capacity_bytes,
                used_bytes=st.used_bytes,
                records=st.records,
                where=where,
                extra=_jsonable(st.extra),
            )
        rows.append(row)
    breakers: dict[str, str] = {}
    source_error: str | None = None
    engine: dict[str, dict[str, float]] = {}
    if metrics_url:
        try:
            breakers, engine, source_error = _read_engine_metrics(metrics_url)
        except _NotMetrics as e:
            if metrics_from == "--metrics-url":
                raise AdminError(
                    EXIT_BAD_INPUT,
                    f"--metrics-url: got {metrics_url!r} — {e}; give a running engine's metrics URL,"
                    " such as http://127.0.0.1:9400/metrics (the port is the engine's metrics.port)",
                ) from None
            source_error = f"{metrics_from}: {metrics_url} does not serve engine metrics: {e}"
    for row in rows:
        row["breaker"] = breakers.get(row["tier"])
        em = engine.get(row["tier"], {})
        if row["kind"] in IN_PROCESS_KINDS:
            if "used" in em:
                row["used_bytes"] = int(em["used"])
            if "records" in em:
                row["records"] = int(em["records"])
    result: dict[str, Any] = {"tiers": rows, "metrics_url": metrics_url}
    if source_error:
        result["metrics_error"] = source_error
    return result


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


#: The most bytes read from a metrics endpoint (tieredkv's /metrics is a few KiB).
_MAX_METRICS_BYTES = 16 << 20


class _NotMetrics(Exception):
    """The URL answered, but not with Prometheus text."""


def _read_engine_metrics(url: str) -> tuple[dict[str, str], dict[str, dict[str, float]], str | None]:
    """Breaker states and usage gauges from a running engine's ``/metrics``.

    An unreachable URL is reported as the third item (breaker state unknown). A body that is
    not Prometheus text (an HTML page, garbage, over 16 MiB) raises :class:`_NotMetrics`.
    """
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            body = resp.read(_MAX_METRICS_BYTES + 1)
    except OSError as e:
        return {}, {}, f"cannot read engine metrics at {url}: {e}"
    if len(body) > _MAX_METRICS_BYTES:
        raise _NotMetrics(f"the response is over {_MAX_METRICS_BYTES >> 20} MiB")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _NotMetrics(f"the response is not UTF-8 text (byte {body[e.start]:#04x} at offset {e.start})") from None
    try:
        families = _parse_metrics(text)
    except Exception as e:  # noqa: BLE001 - the parser's errors on garbage are ValueError, IndexError, ...
        first = text.lstrip()[:40].splitlines()[0] if text.strip() else ""
        detail = f"{e}" if str(e) else type(e).__name__
        raise _NotMetrics(
            f"the response is not Prometheus text format ({_clip(detail)}; it starts {first!r})"
        ) from None
    breakers: dict[str, str] = {}
    engine: dict[str, dict[str, float]] = {}
    for fam in families:
        for s in fam.samples:
            tier = s.labels.get("tier")
            if tier is None:
                continue
            if s.name == "tieredkv_breaker_state" and s.value == 1:
                breakers[tier] = s.labels.get("state", "?")
            elif s.name == "tieredkv_tier_used_bytes":
                engine.setdefault(tier, {})["used"] = s.value
            elif s.name == "tieredkv_tier_records":
                engine.setdefault(tier, {})["records"] = s.value
    return breakers, engine, None


def _parse_metrics(text: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def parse_metrics_url(text: str | None) -> str | None:
    """``--metrics-url``: an http(s) URL with a host."""
    if text is None:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # a bad port raises ValueError
    except ValueError:
        ok = False
    if not ok:
        raise AdminError(
            EXIT_BAD_INPUT,
            f"--metrics-url: got {text!r} — expected the http:// URL of a running engine's metrics,"
            " such as http://127.0.0.1:9400/metrics",
        )
    return text.strip()


# ---------------------------------------------------------------------------------------
# ls


async def list_records(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    limit: int = 50,
    offset: int = 0,
    by: str | None = None,
) -> dict[str, Any]:
    now = time.time()
    rows: list[dict[str, Any]] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            infos = await with_stamps(tier, await select_records(tier, namespace, group))
        rows.extend(_record_row(tcfg.label, i, now) for i in infos)
    if by is not None:
        return {"by": by, "summary": _summarize(rows, by)}
    page = rows[offset : offset + limit]
    nxt = offset + len(page)
    return {
        "records": page,
        "total": len(rows),
        "offset": offset,
        "limit": limit,
        "next_offset": nxt if nxt < len(rows) else None,
    }


def _summarize(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    fields = ("tier", "namespace") if by == "namespace" else ("tier", "namespace", "group")
    acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        k = tuple(r[f] for f in fields)
        s = acc.setdefault(k, {**{f: r[f] for f in fields}, "records": 0, "bytes": 0, "oldest_age_s": None})
        s["records"] += 1
        s["bytes"] += r["size"]
        if r["age_s"] is not None and (s["oldest_age_s"] is None or r["age_s"] > s["oldest_age_s"]):
            s["oldest_age_s"] = r["age_s"]
    order = {t: i for i, t in enumerate(dict.fromkeys(r["tier"] for r in rows))}  # config order
    return [acc[k] for k in sorted(acc, key=lambda k: (order[k[0]], k[1:]))]


# ---------------------------------------------------------------------------------------
# inspect


async def inspect_key(cfg: TieredKVConfig, names: Sequence[str] | None, key: bytes) -> dict[str, Any]:
    fp, block_hash, group = split_stored_key(key)
    found: list[dict[str, Any]] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            (raw,) = await tier.raw_get_many([key])
        entry: dict[str, Any] = {"tier": tcfg.label, "present": raw is not None}
        if raw is not None:
            entry.update(_describe_record(raw, key))
        found.append(entry)
    return {
        "key": key.hex(),
        "namespace": fp.hex(),
        "block_hash": block_hash.hex(),
        "group": group,
        "tiers": found,
    }


def _describe_record(raw: bytes, key: bytes) -> dict[str, Any]:
    d: dict[str, Any] = {"record_bytes": len(raw)}
    try:
        h = decode_header(raw)
    except CorruptRecordError as e:
        d["header"] = None
        d["header_error"] = str(e)
        d["magic"] = bytes(raw[:4]).hex() if len(raw) >= 4 else None
    else:
        d["header"] = {
            "magic": MAGIC.decode(),
            "version": h.version,
            "namespace": h.fingerprint.hex(),
            "group": h.group,
            "flags": h.flags,
            "payload_bytes": h.payload_len,
            "checksum": f"{h.checksum:016x}",
        }
    try:
        verify_record(raw, key)
    except CorruptRecordError as e:
        d["verified"] = False
        d["error"] = str(e)
    else:
        d["verified"] = True
    return d


# ---------------------------------------------------------------------------------------
# verify


async def verify(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    repair: bool = False,
    show_progress: bool = False,
) -> dict[str, Any]:
    tiers_out: list[dict[str, Any]] = []
    corrupt_out: list[dict[str, Any]] = []
    with _progress(show_progress) as progress:
        for tcfg in select_tiers(cfg, names):
            async with open_tier(tcfg) as tier:
                infos = await select_records(tier, namespace, group)
                task = progress.add_task(f"verify {tcfg.label}", total=len(infos))
                ok = vanished = 0
                bad: list[bytes] = []
                for run in _batches(infos, _BATCH_BYTES, _BATCH_RECORDS):
                    keys = [i.key for i in run]
                    for k, raw in zip(keys, await tier.raw_get_many(keys), strict=True):
                        if raw is None:
                            vanished += 1
                            continue
                        try:
                            verify_record(raw, k)
                        except CorruptRecordError as e:
                            bad.append(k)
                            corrupt_out.append({"tier": tcfg.label, "key": k.hex(), "error": str(e)})
                        else:
                            ok += 1
                    progress.advance(task, len(run))
                repaired = await delete_keys(tier, bad) if repair and bad else 0
            tiers_out.append(
                {
                    "tier": tcfg.label,
                    "checked": len(infos),
                    "ok": ok,
                    "corrupt": len(bad),
                    "vanished": vanished,
                    "repaired": repaired,
                }  # fmt: skip
            )
    return {"tiers": tiers_out, "corrupt": corrupt_out, "repair": repair}


# ---------------------------------------------------------------------------------------
# evict / flush


async def evict(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    group: int | None,
    *,
    older_than: float | None = None,
    to_size: int | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    if namespace is None and group is None and older_than is None and to_size is None:
        raise AdminError(
            EXIT_BAD_INPUT,
            "evict needs at least one of --namespace, --group, --older-than, --to-size"
            " (use `flush --all` to empty a tier)",
        )
    now = time.time()
    rows: list[dict[str, Any]] = []
    for tcfg in select_tiers(cfg, names):
        async with open_tier(tcfg) as tier:
            infos = await select_records(tier, namespace, group)
            if older_than is not None or to_size is not None:
                infos = await with_stamps(tier, infos)
            victims = _pick_victims(infos, now, older_than, to_size)
            total = sum(HEADER_SIZE + i.size for i in infos)
            freed = sum(HEADER_SIZE + i.size for i in victims)
            evicted = 0 if dry_run else await delete_keys(tier, [i.key for i in victims])
            rows.append(
                {
                    "tier": tcfg.label,
                    "selected": len(infos),
                    "victims": len(victims),
                    "evicted": evicted,
                    "freed_bytes": freed,
                    "remaining_bytes": total - freed,
                    "no_age": sum(1 for i in infos if i.stamp is None) if older_than is not None else 0,
                }  # fmt: skip
            )
    return {"tiers": rows, "dry_run": dry_run}


def _pick_victims(
    infos: list[RecordInfo], now: float, older_than: float | None, to_size: int | None
) -> list[RecordInfo]:
    if older_than is None and to_size is None:
        return list(infos)  # namespace / group selection only
    victims: dict[bytes, RecordInfo] = {}
    if older_than is not None:
        victims = {i.key: i for i in infos if i.stamp is not None and now - i.stamp > older_than}
    if to_size is not None:
        left = sum(HEADER_SIZE + i.size for i in infos if i.key not in victims)
        # least recently used first; records without a stamp count as oldest
        for i in sorted(infos, key=lambda i: (i.stamp is not None, i.stamp or 0.0, i.key)):
            if left <= to_size:
                break
            if i.key not in victims:
                victims[i.key] = i
                left -= HEADER_SIZE + i.size
    return list(victims.values())


async def flush(
    cfg: TieredKVConfig,
    names: Sequence[str] | None,
    namespace: bytes | None,
    *,
    everything: bool,
    confirm: Callable[[str], bool] | None,
) -> dict[str, Any]:
    """Delete a namespace (or, with ``everything``, every record of this tier's key space).

    ``confirm(question)`` is asked once with the counts; ``None`` means already confirmed.
    """
    if namespace is None and not everything:
        raise AdminError(EXIT_BAD_INPUT, "flush needs --namespace HEX or --all")
    if namespace is not None and everything:
        raise AdminError(EXIT_BAD_INPUT, "flush: give --namespace or --all, not both")
    selected = select_tiers(cfg, names)
    plan: list[tuple[Any, list[bytes], int]] = []
    for tcfg in selected:
        async with open_tier(tcfg) as tier:
            infos = await select_records(tier, namespace, None)
        plan.append((tcfg, [i.key for i in infos], sum(HEADER_SIZE + i.size for i in infos)))
    what = f"namespace {namespace.hex()}" if namespace is not None else "EVERY record"
    summary = ", ".join(f"{len(keys)} in {t.label}" for t, keys, _ in plan)
    if confirm is not None and not confirm(f"Delete {what}: {summary} record(s)?"):
        raise AdminError(EXIT_PROBLEM, "aborted; nothing was deleted")
    rows = []
    for tcfg, keys, nbytes in plan:
        async with open_tier(tcfg) as tier:
            deleted = await delete_keys(tier, keys)
        rows.append({"tier": tcfg.label, "selected": len(keys), "deleted": deleted, "bytes": nbytes})
    return {"tiers": rows, "namespace": namespace.hex() if namespace is not None else None, "all": everything}


# ---------------------------------------------------------------------------------------
# migrate


async def migrate(
    cfg: TieredKVConfig,
    src_name: str,
    dst_name: str,
    namespace: bytes | None,
    group: int | None,
    *,
    limit: int | None = None,
    batch_bytes: int = _BATCH_BYTES,
    batch_records: int = _BATCH_RECORDS,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Copy records from ``src_name`` to ``dst_name``; see the module docstring."""
    (src_cfg,) = select_tiers(cfg, [src_name])
    (dst_cfg,) = select_tiers(cfg, [dst_name])
    if src_cfg.label == dst_cfg.label:
        raise AdminError(EXIT_BAD_INPUT, f"--from and --to name the same tier {src_name!r}")
    copied = skipped = corrupt = vanished = target_bad = 0
    corrupt_keys: list[dict[str, Any]] = []
    stopped = False
    t0 = time.perf_counter()
    nbytes = 0
    async with open_tier(src_cfg) as src, open_tier(dst_cfg, create=True) as dst:
        infos = await select_records(src, namespace, group)
        with _progress(show_progress) as progress:
            task = progress.add_task(f"migrate {src_cfg.label} → {dst_cfg.label}", total=len(infos))
            for run in _batches(infos, batch_bytes, batch_records):
                keys = [i.key for i in run]
                present = await dst.contains_many(keys)
                todo = [k for k, p in zip(keys, present, strict=True) if not p]
                skipped += len(keys) - len(todo)
                if limit is not None and copied + len(todo) > limit:
                    todo = todo[: max(limit - copied, 0)]
                    stopped = True
                good: list[tuple[bytes, bytes]] = []
                for k, raw in zip(todo, await src.raw_get_many(todo) if todo else [], strict=True):
                    if raw is None:
                        vanished += 1
                        continue
                    try:
                        verify_record(raw, k)
                    except CorruptRecordError as e:
                        corrupt += 1
                        corrupt_keys.append({"key": k.hex(), "error": str(e)})
                        continue
                    good.append((k, raw))
                if good:
                    await dst.raw_put_many(good)
                    back = await dst.raw_get_many([k for k, _ in good])
                    for (k, raw), got in zip(good, back, strict=True):
                        try:
                            if got is None:
                                raise CorruptRecordError("missing after write")
                            verify_record(got, k)
                        except CorruptRecordError as e:
                            target_bad += 1
                            corrupt_keys.append({"key": k.hex(), "error": f"on target: {e}"})
                        else:
                            copied += 1
                            nbytes += len(raw)
                progress.advance(task, len(run))
                if stopped:
                    break
    done = skipped + copied + corrupt + vanished + target_bad
    return {
        "from": src_cfg.label,
        "to": dst_cfg.label,
        "total": len(infos),
        "copied": copied,
        "skipped": skipped,
        "corrupt": corrupt,
        "vanished": vanished,
        "target_failed": target_bad,
        "remaining": len(infos) - done,
        "complete": len(infos) == done,
        "bytes": nbytes,
        "seconds": round(time.perf_counter() - t0, 3),
        "problems": corrupt_keys,
    }


# ---------------------------------------------------------------------------------------
# config show


def show_config(path: Path | None) -> dict[str, Any]:
    """The effective config, masked, with the origin of every leaf value."""
    try:
        cfg, origins = config_provenance(path)
    except ConfigError as e:
        raise AdminError(EXIT_BAD_INPUT, str(e)) from None
    data = mask_secrets(cfg.model_dump(mode="json"))
    return {"config": data, "sources": origins, "file": str(path) if path else None}


def _leaves(data: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, list) and data:
        for i, v in enumerate(data):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, data


# ---------------------------------------------------------------------------------------
# human output


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def human_age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _table(title: str | None, cols: Sequence[str], right: Iterable[str] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    r = set(right)
    for c in cols:
        t.add_column(c, justify="right" if c in r else "left", overflow="fold")
    return t


def print_status(s: dict[str, Any]) -> None:
    t = _table(None, ("tier", "kind", "state", "capacity", "used", "records", "breaker", "where"),
               right=("capacity", "used", "records"))  # fmt: skip
    for r in s["tiers"]:
        if r["reachable"] is None:
            state = "in-process"
        elif r["reachable"]:
            state = "[green]reachable[/]"
        else:
            state = "[red]unreachable[/]"
        t.add_row(
            r["tier"],
            r["kind"],
            state,
            human_bytes(r["capacity_bytes"]),
            human_bytes(r["used_bytes"]),
            "-" if r["records"] is None else str(r["records"]),
            r.get("breaker") or "-",
            r.get("where") or r.get("error", ""),
        )
    out.print(t)
    for r in s["tiers"]:
        if r["reachable"] is False:
            err.print(f"[red]unreachable:[/] {r['error']}", highlight=False)
    if s.get("metrics_error"):
        err.print(f"[yellow]breaker state unknown:[/] {s['metrics_error']}", highlight=False)


def print_ls(s: dict[str, Any]) -> None:
    if "summary" in s:
        cols = ["tier", "namespace"] + (["group"] if s["by"] == "group" else []) + ["records", "bytes", "oldest"]
        t = _table(None, cols, right=("group", "records", "bytes", "oldest"))
        for r in s["summary"]:
            row = [r["tier"], r["namespace"]] + ([str(r["group"])] if s["by"] == "group" else [])
            t.add_row(*row, str(r["records"]), human_bytes(r["bytes"]), human_age(r["oldest_age_s"]))
        out.print(t)
        return
    t = _table(None, ("tier", "key", "group", "size", "age"), right=("group", "size", "age"))
    for r in s["records"]:
        t.add_row(r["tier"], r["key"], str(r["group"]), human_bytes(r["size"]), human_age(r["age_s"]))
    out.print(t)
    last = s["offset"] + len(s["records"])
    more = f"; next page: --offset {s['next_offset']}" if s["next_offset"] is not None else ""
    out.print(f"records {s['offset'] + 1 if s['records'] else 0}–{last} of {s['total']}{more}", highlight=False)


def print_inspect(s: dict[str, Any]) -> None:
    for label, field in (("key", "key"), ("namespace", "namespace"), ("block hash", "block_hash"), ("group", "group")):
        out.print(f"{label:<11}{s[field]}", highlight=False)
    for e in s["tiers"]:
        if not e["present"]:
            out.print(f"[bold]{e['tier']}[/]: not present")
            continue
        verdict = "[green]checksum verifies[/]" if e["verified"] else f"[red]CORRUPT[/]: {e['error']}"
        out.print(f"[bold]{e['tier']}[/]: {e['record_bytes']} bytes, {verdict}", highlight=False)
        h = e.get("header")
        if h:
            for k, v in h.items():
                out.print(f"  {k:<14}{v}", highlight=False)
        else:
            out.print(f"  header unreadable: {e['header_error']}", highlight=False)


def print_verify(s: dict[str, Any]) -> None:
    t = _table(None, ("tier", "checked", "ok", "corrupt", "repaired"), right=("checked", "ok", "corrupt", "repaired"))
    for r in s["tiers"]:
        bad = f"[red]{r['corrupt']}[/]" if r["corrupt"] else "0"
        t.add_row(r["tier"], str(r["checked"]), str(r["ok"]), bad, str(r["repaired"]))
    out.print(t)
    for c in s["corrupt"]:
        out.print(f"[red]corrupt[/] {c['tier']} {c['key']}: {c['error']}", highlight=False)
    n = sum(r["corrupt"] for r in s["tiers"])
    if n and not s["repair"]:
        out.print(f"{n} corrupt record(s); run again with --repair to delete them", highlight=False)
    elif n:
        out.print(f"deleted {sum(r['repaired'] for r in s['tiers'])} corrupt record(s)", highlight=False)
    else:
        out.print("[green]every record verifies[/]")


def print_evict(s: dict[str, Any]) -> None:
    cols = ("tier", "selected", "evicted", "freed", "remaining")
    t = _table("dry run: nothing deleted" if s["dry_run"] else None, cols, right=cols[1:])
    for r in s["tiers"]:
        t.add_row(r["tier"], str(r["selected"]), str(r["victims"] if s["dry_run"] else r["evicted"]),
                  human_bytes(r["freed_bytes"]), human_bytes(r["remaining_bytes"]))  # fmt: skip
    out.print(t)


def print_flush(s: dict[str, Any]) -> None:
    for r in s["tiers"]:
        out.print(f"{r['tier']}: deleted {r['deleted']} record(s), {human_bytes(r['bytes'])}", highlight=False)


def print_migrate(s: dict[str, Any]) -> None:
    state = "complete" if s["complete"] else f"[yellow]stopped, {s['remaining']} left — run again to resume[/]"
    out.print(
        f"{s['from']} → {s['to']}: {s['copied']} copied and verified ({human_bytes(s['bytes'])}),"
        f" {s['skipped']} already there, {s['corrupt']} corrupt in source, {s['target_failed']} failed on target"
        f" — {state}",
        highlight=False,
    )
    for p in s["problems"]:
        out.print(f"[red]problem[/] {p['key']}: {p['error']}", highlight=False)


def print_config(s: dict[str, Any]) -> None:
    t = _table(f"effective config{' from ' + s['file'] if s['file'] else ' (no file: defaults)'}",
               ("field", "value", "source"))  # fmt: skip
    for path, value in _leaves(s["config"]):
        t.add_row(path, json.dumps(value) if not isinstance(value, str) else value, s["sources"].get(path, "default"))
    out.print(t)


# ---------------------------------------------------------------------------------------
# CLI wiring


def load(path: Path | None) -> TieredKVConfig:
    try:
        return load_config(path)
    except ConfigError as e:
        raise AdminError(EXIT_BAD_INPUT, str(e)) from None


def fail(code: int, message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def run(fn: Callable[[], Any]) -> Any:
    """Run one command body (sync, or returning a coroutine), mapping errors to exit codes."""
    try:
        result = fn()
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return result
    except AdminError as e:
        fail(e.code, str(e))
    except TierUnavailableError as e:
        fail(EXIT_UNAVAILABLE, f"tier unavailable: {e}")
    except ConfigError as e:
        fail(EXIT_BAD_INPUT, str(e))
    except TieredKVError as e:
        fail(EXIT_PROBLEM, str(e))
    except KeyboardInterrupt:
        fail(130, "interrupted (a migrate resumes where it stopped when run again)")


def emit(data: dict[str, Any], as_json: bool, printer: Callable[[dict[str, Any]], None]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        sys.stdout.flush()
    else:
        printer(data)


ConfigOpt = typer.Option(None, "--config", "-c", envvar="TIEREDKV_CONFIG", help="tieredkv YAML config file.")
TierOpt = typer.Option(None, "--tier", "-t", help="Tier name (repeatable); default: every lmdb/redis tier.")
NsOpt = typer.Option(None, "--namespace", "-n", help="Namespace fingerprint, 32 hex digits (see `ls --by namespace`).")
GroupOpt = typer.Option(None, "--group", "-g", min=0, help="KV group index.")
JsonOpt = typer.Option(False, "--json", help="Print JSON on stdout (for scripts).")


def _show_progress(as_json: bool, quiet: bool) -> bool:
    return not as_json and not quiet and err.is_terminal


def register(app: typer.Typer) -> None:
    """Add the admin commands (and the ``cluster`` group) to the ``tieredkv`` app."""

    @app.command("status")
    def status_cmd(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        metrics_url: str | None = typer.Option(
            None,
            "--metrics-url",
            help="A running engine's /metrics, for breaker state (default: the config's metrics.port on 127.0.0.1).",
        ),  # fmt: skip
        as_json: bool = JsonOpt,
    ) -> None:
        """Tiers, capacity, usage, record counts, breaker state. Exit 3 if a tier is unreachable."""

        def body() -> Any:
            url = parse_metrics_url(metrics_url)
            cfg = load(config)
            if url is None and cfg.metrics.port:
                return status(cfg, tier, f"http://127.0.0.1:{cfg.metrics.port}/metrics", metrics_from="metrics.port")
            return status(cfg, tier, url)

        s = run(body)
        emit(s, as_json, print_status)
        if any(r["reachable"] is False for r in s["tiers"]):
            raise typer.Exit(EXIT_UNAVAILABLE)

    @app.command("ls")
    def ls_cmd(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        namespace: str | None = NsOpt,
        group: int | None = GroupOpt,
        limit: int = typer.Option(50, "--limit", min=1, help="Records per page."),
        offset: int = typer.Option(0, "--offset", min=0, help="Skip this many records (paging)."),
        by: str | None = typer.Option(None, "--by", help="Summarize per 'namespace' or 'group' instead."),
        as_json: bool = JsonOpt,
    ) -> None:
        """Records (sorted by key) with size and age, or a summary per namespace / group."""
        if by not in (None, "namespace", "group"):
            fail(EXIT_BAD_INPUT, f"--by: got {by!r} — use 'namespace' or 'group'")
        s = run(lambda: list_records(load(config), tier, parse_namespace(namespace), group,
                                     limit=limit, offset=offset, by=by))  # fmt: skip
        emit(s, as_json, print_ls)

    @app.command("inspect")
    def inspect_cmd(
        key: str = typer.Argument(..., help="Stored key as hex (from `tieredkv ls`)."),
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Header fields of KEY in each tier and whether its checksum verifies. Exit 1: absent or corrupt."""
        s = run(lambda: inspect_key(load(config), tier, parse_key(key)))
        emit(s, as_json, print_inspect)
        present = [e for e in s["tiers"] if e["present"]]
        if not present or not all(e["verified"] for e in present):
            raise typer.Exit(EXIT_PROBLEM)

    @app.command("verify")
    def verify_cmd(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        namespace: str | None = NsOpt,
        group: int | None = GroupOpt,
        repair: bool = typer.Option(False, "--repair", help="Delete the corrupt records found."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
        as_json: bool = JsonOpt,
    ) -> None:
        """Scrub every record (header, namespace, group, checksum). Exit 1 if corrupt ones remain."""
        s = run(lambda: verify(load(config), tier, parse_namespace(namespace), group, repair=repair,
                               show_progress=_show_progress(as_json, quiet)))  # fmt: skip
        emit(s, as_json, print_verify)
        if s["corrupt"] and not repair:
            raise typer.Exit(EXIT_PROBLEM)

    @app.command("evict")
    def evict_cmd(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        namespace: str | None = NsOpt,
        group: int | None = GroupOpt,
        older_than: str | None = typer.Option(
            None, "--older-than", help="Records not written or read for this long (90s, 15m, 2h, 1d)."
        ),
        to_size: str | None = typer.Option(
            None, "--to-size", help="Evict least recently used records until the selection holds at most this (512MiB)."
        ),
        dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be evicted."),
        as_json: bool = JsonOpt,
    ) -> None:
        """Delete records by namespace, group, age or down to a size target."""
        s = run(lambda: evict(load(config), tier, parse_namespace(namespace), group,
                              older_than=parse_duration(older_than), to_size=parse_size(to_size, "--to-size"),
                              dry_run=dry_run))  # fmt: skip
        emit(s, as_json, print_evict)

    @app.command("flush")
    def flush_cmd(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = TierOpt,
        namespace: str | None = NsOpt,
        everything: bool = typer.Option(False, "--all", help="Every record of the tier (its key space only)."),
        yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
        as_json: bool = JsonOpt,
    ) -> None:
        """Delete a namespace or everything. Asks first unless --yes; with no terminal, --yes is required."""

        def ask(question: str) -> bool:
            if not sys.stdin.isatty():
                raise AdminError(
                    EXIT_BAD_INPUT, "refusing to flush without confirmation: no terminal to ask on; pass --yes"
                )
            return typer.confirm(question, default=False, err=True)

        s = run(lambda: flush(load(config), tier, parse_namespace(namespace), everything=everything,
                              confirm=None if yes else ask))  # fmt: skip
        emit(s, as_json, print_flush)

    @app.command("migrate")
    def migrate_cmd(
        src: str = typer.Option(..., "--from", help="Source tier name."),
        dst: str = typer.Option(..., "--to", help="Target tier name."),
        config: Path | None = ConfigOpt,
        namespace: str | None = NsOpt,
        group: int | None = GroupOpt,
        limit: int | None = typer.Option(None, "--limit", min=0, help="Copy at most this many records, then stop."),
        batch_bytes: str = typer.Option("32MiB", "--batch-bytes", help="Bytes per copy batch."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
        as_json: bool = JsonOpt,
    ) -> None:
        """Copy records between tiers, verified on both sides; resumable (records already there are skipped)."""
        s = run(lambda: migrate(load(config), src, dst, parse_namespace(namespace), group, limit=limit,
                                batch_bytes=parse_size(batch_bytes, "--batch-bytes") or _BATCH_BYTES,
                                show_progress=_show_progress(as_json, quiet)))  # fmt: skip
        emit(s, as_json, print_migrate)
        if s["corrupt"] or s["target_failed"]:
            raise typer.Exit(EXIT_PROBLEM)

    cluster_app = typer.Typer(no_args_is_help=True, help="A local Redis Cluster on loopback (no Docker needed).")
    app.add_typer(cluster_app, name="cluster")
    DirOpt = typer.Option(DEFAULT_CLUSTER_DIR, "--dir", help="Where node files and the pid/port state live.")

    @cluster_app.command("up")
    def cluster_up(
        masters: int = typer.Option(3, "--masters", min=3, help="Number of primaries."),
        base_port: int = typer.Option(7001, "--base-port", min=0, max=55535, help="First port (0: any free ports)."),
        state_dir: Path = DirOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Start a Redis Cluster of detached redis-server processes on 127.0.0.1 and print its URL."""
        from tieredkv.testing.servers import start_detached_cluster

        try:
            state = start_detached_cluster(state_dir, masters, base_port or None)
        except RuntimeError as e:
            fail(EXIT_PROBLEM, str(e))
        state["dir"] = str(Path(state_dir).resolve())
        if as_json:
            emit(state, True, print)
            return
        ports = ", ".join(str(n["port"]) for n in state["nodes"])
        out.print(f"Redis Cluster up: {len(state['nodes'])} masters on 127.0.0.1 ports {ports}", highlight=False)
        out.print(f"url: {state['url']}  (cluster: true)", highlight=False)
        out.print(
            "use it with config/tieredkv-redis-cluster.yaml:\n"
            f"  export TIEREDKV_TIERS__cluster__URL={state['url']}\n"
            f"stop it with: tieredkv cluster down --dir {state_dir}",
            highlight=False,
        )

    @cluster_app.command("down")
    def cluster_down(state_dir: Path = DirOpt, as_json: bool = JsonOpt) -> None:
        """Stop the cluster recorded in --dir (by pid) and remove its files."""
        from tieredkv.testing.servers import detached_cluster_state, stop_detached_cluster

        state = detached_cluster_state(state_dir)
        stopped = stop_detached_cluster(state_dir)
        result = {"dir": str(state_dir), "was_recorded": state is not None, "stopped_pids": stopped}
        if as_json:
            emit(result, True, print)
        elif state is None:
            out.print(f"no cluster recorded in {state_dir}", highlight=False)
        else:
            out.print(f"stopped {len(stopped)} redis-server process(es) {stopped}", highlight=False)


def config_show_command(config: Path | None, as_json: bool, sources: bool) -> None:
    """``tieredkv config show``: JSON is the masked config itself unless ``--sources``."""
    s = run(lambda: show_config(config))
    if as_json:
        emit(s if sources else s["config"], True, print)
    else:
        print_config(s)

"""Output for people: rich tables on a terminal, plain tab-separated rows in a pipe (never a
truncated or wrapped cell), ``--json`` documents, and one-line errors.

User text (paths, tier names, keys, error messages) is never read as rich markup: everything is
built from :class:`rich.text.Text`, so ``kv[prod].yaml`` prints as is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from tieredkv.cli.results import (
    ClusterDownResult,
    ConfigInitResult,
    ConfigResult,
    EvictResult,
    FlushResult,
    InspectResult,
    ListResult,
    MigrateResult,
    Result,
    StatusResult,
    SummaryResult,
    VerifyResult,
)

__all__ = [
    "Cell",
    "emit_json",
    "error",
    "human_age",
    "human_bytes",
    "progress",
    "say",
    "table",
    "warn",
]

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

#: A cell or message part: plain text, or ``(text, rich style)``.
Cell = str | tuple[str, str]


def _text(parts: Iterable[Cell]) -> Text:
    return Text.assemble(*parts)


def say(*parts: Cell, console: Console | None = None) -> None:
    """One line of output (stdout unless ``console``); plain and unwrapped in a pipe."""
    con = console or out
    text = _text(parts)
    if con.is_terminal:
        con.print(text)
    else:
        stream = sys.stderr if con.stderr else sys.stdout
        stream.write(text.plain + "\n")
        stream.flush()


def error(message: str) -> None:
    """``error: MESSAGE`` on stderr: on one line when stderr is not a terminal (no hard wrap)."""
    say(("error: ", "bold red"), message, console=err)


def warn(label: str, message: str) -> None:
    say((f"{label}: ", "yellow"), message, console=err)


def table(title: str | None, cols: Sequence[str], rows: Iterable[Sequence[Cell]], right: Iterable[str] = ()) -> None:
    """A table: rich (cells fold, never truncated) on a terminal; in a pipe a ``# title`` line,
    a header line and one tab-separated line per row."""
    cells: list[list[tuple[str, str]]] = [[c if isinstance(c, tuple) else (c, "") for c in row] for row in rows]
    if not out.is_terminal:
        lines = ([f"# {title}"] if title else []) + ["\t".join(cols)]
        lines += ["\t".join(text for text, _ in row) for row in cells]
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        return
    t = Table(title=title, title_justify="left")
    r = set(right)
    for c in cols:
        t.add_column(c, justify="right" if c in r else "left", overflow="fold")
    for row in cells:
        t.add_row(*(Text(text, style=style) for text, style in row))
    out.print(t)


def emit_json(data: Result | dict[str, Any]) -> None:
    doc = data.to_json() if isinstance(data, Result) else data
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def progress(enabled: bool) -> Progress:
    """A progress display on stderr, shown only when ``enabled`` and stderr is a terminal."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=not (enabled and err.is_terminal),
        transient=True,
    )


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


# ---- one printer per result --------------------------------------------------------------


def print_status(s: StatusResult) -> None:
    def state(reachable: bool | None) -> Cell:
        return "in-process" if reachable is None else ("reachable", "green") if reachable else ("unreachable", "red")

    table(
        None,
        ("tier", "kind", "state", "capacity", "used", "records", "breaker", "where"),
        [
            (
                r.tier,
                r.kind,
                state(r.reachable),
                human_bytes(r.capacity_bytes),
                human_bytes(r.used_bytes),
                "-" if r.records is None else str(r.records),
                r.breaker or "-",
                r.where or r.error or "",
            )
            for r in s.tiers
        ],
        right=("capacity", "used", "records"),
    )
    for r in s.tiers:
        if r.records_by_namespace is not None:
            say(f"{r.tier}: records = {r.records_scope}", console=err)
            for ns, n in r.records_by_namespace.items():
                say(f"  {ns}  {n}")
    for r in s.tiers:
        if r.tenants:
            table(
                f"{r.tier}: tenants",
                ("tenant", "id", "used", "quota", "of quota"),
                [
                    (
                        t.tenant,
                        t.id,
                        human_bytes(t.used_bytes),
                        "-" if t.quota_bytes is None else human_bytes(t.quota_bytes),
                        _of_quota(t.used_bytes, t.quota_bytes),
                    )
                    for t in r.tenants
                ],
                right=("used", "quota", "of quota"),
            )
        if r.tenants_note:
            warn(f"{r.tier}: tenants", r.tenants_note)
        if r.reachable is False:
            say(("unreachable: ", "red"), r.error or "", console=err)
    if s.metrics_error:
        warn("breaker state unknown", s.metrics_error)
    if s.block_hashes_reproducible is False:
        warn(
            "block hashes not reproducible",
            "the engine's block hashes differ in every process (a non-cryptographic prefix_caching_hash_algo"
            " without PYTHONHASHSEED): records on persistent tiers will never hit after a restart or on"
            " another node; set PYTHONHASHSEED on every node or use sha256",
        )


def _of_quota(used: int, quota: int | None) -> Cell:
    if quota is None:
        return "-"
    pct = 100.0 * used / quota if quota else float("inf")
    return (f"{pct:.0f}%", "red") if used > quota else f"{pct:.0f}%"


def print_ls(s: ListResult) -> None:
    table(
        None,
        ("tier", "key", "group", "size", "age", "tenant"),
        [
            (
                r.tier,
                r.key,
                str(r.group),
                human_bytes(r.size),
                human_age(r.age_s),
                "?" if r.tenant is None else r.tenant,
            )
            for r in s.records
        ],
        right=("group", "size", "age"),
    )
    first = s.offset + 1 if s.records else 0
    last = s.offset + len(s.records)
    if s.next_offset is not None:
        say(f"records {first}–{last}; next page: --offset {s.next_offset}")
    else:
        say(f"records {first}–{last} of {s.total}")


def print_summary(s: SummaryResult) -> None:
    by_group = s.by == "group"
    cols = ["tier", "namespace"] + (["group"] if by_group else []) + ["records", "bytes", "oldest"]
    table(
        None,
        cols,
        [
            [
                r.tier,
                r.namespace,
                *([str(r.group)] if by_group else []),
                str(r.records),
                human_bytes(r.bytes),
                human_age(r.oldest_age_s),
            ]
            for r in s.summary
        ],
        right=("group", "records", "bytes", "oldest"),
    )


def print_inspect(s: InspectResult) -> None:
    for label, value in (("key", s.key), ("namespace", s.namespace), ("block hash", s.block_hash), ("group", s.group)):
        say(f"{label:<11}{value}")
    if s.namespace_info is not None:
        ns = s.namespace_info
        say(f"{'model':<11}{ns['model']}" + (f" @ {ns['revision']}" if ns.get("revision") else ""))
        say(f"{'weights':<11}{ns['weights'] or '- (no weights fingerprint: bound to the model name and revision)'}")
    elif s.namespace_error:
        say(f"{'model':<11}? ({s.namespace_error})")
    for e in s.tiers:
        if not e.present:
            say((e.tier, "bold"), ": not present")
            continue
        verdict: Cell = ("checksum verifies", "green") if e.verified else ("CORRUPT", "red")
        say((e.tier, "bold"), f": {e.record_bytes} bytes, ", verdict, "" if e.verified else f": {e.error}")
        if e.header:
            for k, v in e.header.items():
                say(f"  {k:<14}{v}")
        else:
            say(f"  header unreadable: {e.header_error}")


def print_verify(s: VerifyResult) -> None:
    table(
        None,
        ("tier", "checked", "ok", "corrupt", "repaired"),
        [
            (r.tier, str(r.checked), str(r.ok), (str(r.corrupt), "red" if r.corrupt else ""), str(r.repaired))
            for r in s.tiers
        ],
        right=("checked", "ok", "corrupt", "repaired"),
    )
    for c in s.corrupt:
        say(("corrupt", "red"), f" {c.tier} {c.key}: {c.error}")
    n = sum(r.corrupt for r in s.tiers)
    if n and not s.repair:
        say(f"{n} corrupt record(s); run again with --repair to delete them")
    elif n:
        say(f"deleted {sum(r.repaired for r in s.tiers)} corrupt record(s)")
    else:
        say(("every record verifies", "green"))


def print_evict(s: EvictResult) -> None:
    cols = ("tier", "selected", "evicted", "freed", "remaining")
    title = "dry run: nothing deleted" if s.dry_run else None
    if s.tenant is not None:
        title = f"tenant {s.tenant}" + (f"; {title}" if title else "")
    table(
        title,
        cols,
        [
            (
                r.tier,
                str(r.selected),
                str(r.victims if s.dry_run else r.evicted),
                human_bytes(r.freed_bytes),
                human_bytes(r.remaining_bytes),
            )
            for r in s.tiers
        ],
        right=cols[1:],
    )
    for r in s.tiers:
        if r.no_age:
            warn("note", f"{r.tier}: {r.no_age} record(s) have no age (the tier cannot tell); --older-than kept them")
        if r.no_tenant:
            warn(
                "note",
                f"{r.tier}: {r.no_tenant} record(s) have no known tenant (on Redis, tenants are known from the"
                " quota books, kept while quotas are configured); --tenant kept them",
            )


def print_flush(s: FlushResult) -> None:
    for r in s.tiers:
        say(f"{r.tier}: deleted {r.deleted} record(s), {human_bytes(r.bytes)}")


def print_migrate(s: MigrateResult) -> None:
    state: Cell = "complete" if s.complete else (f"stopped, {s.remaining} left — run again to resume", "yellow")
    say(
        f"{s.src} → {s.dst}: {s.copied} copied and verified ({human_bytes(s.bytes)}), {s.skipped} already there,"
        f" {s.corrupt} corrupt in source, {s.target_failed} failed on target — ",
        state,
    )
    for p in s.problems:
        say(("problem", "red"), f" {p['key']}: {p['error']}")


def print_config(s: ConfigResult) -> None:
    title = f"effective config{' from ' + s.file if s.file else ' (no file: defaults)'}"
    table(
        title,
        ("field", "value", "source"),
        [
            (path, value if isinstance(value, str) else json.dumps(value), s.sources.get(path, "default"))
            for path, value in _leaves(s.config)
        ],
    )


def print_config_init(s: ConfigInitResult) -> None:
    say(("wrote ", "green"), f"{s.path} ({s.bytes} bytes); check it with: tieredkv config check {s.path}")


def print_cluster_down(s: ClusterDownResult) -> None:
    if not s.was_recorded:
        say(f"no cluster recorded in {s.dir}")
    else:
        say(f"stopped {len(s.stopped_pids)} redis-server process(es) {s.stopped_pids}")


def _leaves(data: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, list) and data:
        for i, v in enumerate(data):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, data

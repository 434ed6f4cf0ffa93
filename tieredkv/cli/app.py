"""The ``tieredkv`` typer app: one small function per command, wiring options to an operation
(:mod:`tieredkv.cli.ops`) and its result to a printer (:mod:`tieredkv.cli.render`) or ``--json``.

Everything a command raises goes through :func:`~tieredkv.cli.common.run`, which prints one
``error:`` line and exits with the code from :func:`tieredkv.cli.exits.exit_code` (the only
error → exit-code map). Engine-side commands (``demo``, ``bench``; they need torch) live in
:mod:`tieredkv.cli.engine` and import the engine only when they run, so the admin verbs work in
an install without torch; both modules take what they share from :mod:`tieredkv.cli.common`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from tieredkv import __version__
from tieredkv.cli import engine, ops, render
from tieredkv.cli.common import ConfigOpt, fail, run
from tieredkv.cli.exits import EXIT_BAD_INPUT, EXIT_PROBLEM, EXIT_UNAVAILABLE, CLIError, exit_code, message_for
from tieredkv.cli.parse import (
    parse_duration,
    parse_key,
    parse_metrics_url,
    parse_namespace,
    parse_size,
    parse_tenant,
)
from tieredkv.cli.results import ClusterDownResult, Result
from tieredkv.cli.tiers import BATCH_BYTES
from tieredkv.errors import TieredKVError

__all__ = ["app", "fail", "main", "run"]

T = TypeVar("T")

_HELP = (
    "tieredkv: tiered KV-cache store admin and demo.\n\n"
    "Exit codes: 0 ok; 1 a problem was found (e.g. corrupt records not repaired); 2 bad input"
    " (config, options); 3 a tier could not be reached."
)
DEFAULT_CLUSTER_DIR = "./tieredkv-data/redis-cluster"

app = typer.Typer(add_completion=False, no_args_is_help=True, help=_HELP, rich_markup_mode=None)
config_app = typer.Typer(no_args_is_help=True, help="Check, show and create configuration.")
cluster_app = typer.Typer(no_args_is_help=True, help="A local Redis Cluster on loopback (no Docker needed).")
app.add_typer(config_app, name="config")
app.add_typer(cluster_app, name="cluster")

TierOpt = typer.Option(None, "--tier", "-t", help="Tier name (repeatable); default: every tier outside the engine.")
NsOpt = typer.Option(None, "--namespace", "-n", help="Namespace fingerprint, 32 hex digits (see `ls --by namespace`).")
GroupOpt = typer.Option(None, "--group", "-g", min=0, help="KV group index.")
JsonOpt = typer.Option(False, "--json", help="Print JSON on stdout (for scripts).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress display.")
_CheckFileArg = typer.Argument(..., help="Config file to validate.")
_InitPathArg = typer.Argument(Path("tieredkv.yaml"), help="Where to write the sample config.")


def emit(result: Result, as_json: bool, printer: Callable[[Any], None]) -> None:
    if as_json:
        render.emit_json(result)
    else:
        printer(result)


def _progress(as_json: bool, quiet: bool = False) -> Any:
    return render.progress(enabled=not as_json and not quiet)


def _version(value: bool) -> None:
    if value:
        render.say(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the tieredkv version and exit."
    ),
) -> None:
    """tieredkv: tiered KV-cache store admin and demo."""


@app.command()
def version() -> None:
    """Print the tieredkv version."""
    render.say(__version__)


# ---- config ------------------------------------------------------------------------------


@config_app.command("check")
def config_check(file: Path = _CheckFileArg) -> None:
    """Validate FILE; exit 2 with one message per bad field."""
    cfg = run(lambda: ops.load(file))
    render.say(("ok", "green"), f": {file} — {len(cfg.tiers)} tier(s): {', '.join(t.label for t in cfg.tiers)}")


@config_app.command("show")
def config_show(
    config: Path | None = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the effective config as JSON."),
    sources: bool = typer.Option(False, "--sources", help="With --json: {config, sources} with each value's origin."),
) -> None:
    """Print the effective config and where each value came from (default / file / env var); secrets masked."""
    s = run(lambda: ops.show_config(config))
    if as_json:
        render.emit_json(s if sources else s.config)
    else:
        render.print_config(s)


@config_app.command("init")
def config_init(
    path: Path = _InitPathArg,
    force: bool = typer.Option(False, "--force", help="Overwrite PATH if it exists."),
    as_json: bool = JsonOpt,
) -> None:
    """Write the sample config shipped with tieredkv to PATH (default ./tieredkv.yaml)."""
    emit(run(lambda: ops.init_config(path, force=force)), as_json, render.print_config_init)


# ---- admin -------------------------------------------------------------------------------


@app.command("status")
def status_cmd(
    config: Path | None = ConfigOpt,
    tier: list[str] | None = TierOpt,
    metrics_url: str | None = typer.Option(
        None,
        "--metrics-url",
        help="A running engine's /metrics, for breaker state (default: the config's metrics.port on 127.0.0.1).",
    ),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Tiers, capacity, usage, our record counts, breaker state, per-tenant usage and quotas. Exit 3 if a tier
    is unreachable."""

    async def body() -> Any:
        url = parse_metrics_url(metrics_url)
        cfg = ops.load(config)
        with _progress(as_json, quiet) as progress:
            if url is None and cfg.metrics.port:
                url = f"http://127.0.0.1:{cfg.metrics.port}/metrics"
                return await ops.status(cfg, tier, url, metrics_from="metrics.port", progress=progress)
            return await ops.status(cfg, tier, url, progress=progress)

    s = run(body)
    emit(s, as_json, render.print_status)
    if s.unreachable:
        raise typer.Exit(EXIT_UNAVAILABLE)


@app.command("ls")
def ls_cmd(
    config: Path | None = ConfigOpt,
    tier: list[str] | None = TierOpt,
    namespace: str | None = NsOpt,
    group: int | None = GroupOpt,
    limit: int = typer.Option(50, "--limit", min=1, help="Records per page (the scan stops after them)."),
    offset: int = typer.Option(0, "--offset", min=0, help="Skip this many records (paging)."),
    by: str | None = typer.Option(None, "--by", help="Summarize per 'namespace' or 'group' instead (a full scan)."),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Records (in scan order) with tenant, size and age, or a summary per namespace / group."""
    if by not in (None, "namespace", "group"):
        fail(EXIT_BAD_INPUT, f"--by: got {by!r} — use 'namespace' or 'group'")

    async def body() -> Any:
        cfg, ns = ops.load(config), parse_namespace(namespace)
        if by is None:
            return await ops.list_records(cfg, tier, ns, group, limit=limit, offset=offset)
        with _progress(as_json, quiet) as progress:
            return await ops.summarize(cfg, tier, ns, group, by=by, progress=progress)

    s = run(body)
    emit(s, as_json, render.print_ls if by is None else render.print_summary)


@app.command("inspect")
def inspect_cmd(
    key: str = typer.Argument(..., help="Stored key as hex (from `tieredkv ls`)."),
    config: Path | None = ConfigOpt,
    tier: list[str] | None = TierOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Header fields of KEY in each tier (its tenant among them), whether its checksum verifies, and what its
    namespace is (model, revision, weights fingerprint). Exit 1: absent or corrupt."""
    s = run(lambda: ops.inspect_key(ops.load(config), tier, parse_key(key)))
    emit(s, as_json, render.print_inspect)
    if not s.ok:
        raise typer.Exit(EXIT_PROBLEM)


@app.command("verify")
def verify_cmd(
    config: Path | None = ConfigOpt,
    tier: list[str] | None = TierOpt,
    namespace: str | None = NsOpt,
    group: int | None = GroupOpt,
    repair: bool = typer.Option(False, "--repair", help="Delete the corrupt records found."),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Scrub every record (header, namespace, group, checksum). Exit 1 if corrupt ones remain."""

    async def body() -> Any:
        cfg, ns = ops.load(config), parse_namespace(namespace)
        with _progress(as_json, quiet) as progress:
            return await ops.verify(cfg, tier, ns, group, repair=repair, progress=progress)

    s = run(body)
    emit(s, as_json, render.print_verify)
    if s.corrupt and not repair:
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
    tenant: str | None = typer.Option(
        None,
        "--tenant",
        help="Records of this tenant (vLLM's cache_salt / the library's tenant=; as `status` names it).",
    ),
    tenant_id: str | None = typer.Option(
        None, "--tenant-id", help="Records of the tenant of this id (16 hex digits, as `status` and `inspect` show it)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be evicted."),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete records by namespace, group, tenant, age or down to a size target."""

    async def body() -> Any:
        cfg, ns = ops.load(config), parse_namespace(namespace)
        age, size = parse_duration(older_than), parse_size(to_size, "--to-size")
        who = parse_tenant(tenant, tenant_id)
        with _progress(as_json, quiet) as progress:
            return await ops.evict(
                cfg, tier, ns, group, older_than=age, to_size=size, tenant=who, dry_run=dry_run, progress=progress
            )

    emit(run(body), as_json, render.print_evict)


@app.command("flush")
def flush_cmd(
    config: Path | None = ConfigOpt,
    tier: list[str] | None = TierOpt,
    namespace: str | None = NsOpt,
    everything: bool = typer.Option(False, "--all", help="Every record of the tier (its key space only)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete a namespace or everything. Asks first unless --yes; with no terminal, --yes is required."""

    def ask(question: str) -> bool:
        if not sys.stdin.isatty():
            raise CLIError(EXIT_BAD_INPUT, "refusing to flush without confirmation: no terminal to ask on; pass --yes")
        return typer.confirm(question, default=False, err=True)

    async def body() -> Any:
        cfg, ns = ops.load(config), parse_namespace(namespace)
        with _progress(as_json, quiet) as progress:
            return await ops.flush(
                cfg, tier, ns, everything=everything, confirm=None if yes else ask, progress=progress
            )

    emit(run(body), as_json, render.print_flush)


@app.command("migrate")
def migrate_cmd(
    src: str = typer.Option(..., "--from", help="Source tier name."),
    dst: str = typer.Option(..., "--to", help="Target tier name."),
    config: Path | None = ConfigOpt,
    namespace: str | None = NsOpt,
    group: int | None = GroupOpt,
    limit: int | None = typer.Option(None, "--limit", min=0, help="Copy at most this many records, then stop."),
    batch_bytes: str = typer.Option("32MiB", "--batch-bytes", help="Bytes per copy batch."),
    quiet: bool = QuietOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Copy records between tiers, verified on both sides; resumable (records already there are skipped)."""

    async def body() -> Any:
        cfg, ns = ops.load(config), parse_namespace(namespace)
        nbytes = parse_size(batch_bytes, "--batch-bytes") or BATCH_BYTES
        with _progress(as_json, quiet) as progress:
            return await ops.migrate(cfg, src, dst, ns, group, limit=limit, batch_bytes=nbytes, progress=progress)

    s = run(body)
    emit(s, as_json, render.print_migrate)
    if s.corrupt or s.target_failed:
        raise typer.Exit(EXIT_PROBLEM)


# ---- cluster -----------------------------------------------------------------------------

DirOpt = typer.Option(DEFAULT_CLUSTER_DIR, "--dir", help="Where node files and the pid/port state live.")


@cluster_app.command("up")
def cluster_up(
    masters: int = typer.Option(3, "--masters", min=3, help="Number of primaries."),
    base_port: int = typer.Option(7001, "--base-port", min=0, max=55535, help="First port (0: any free ports)."),
    state_dir: Path = DirOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Start a Redis Cluster of detached redis-server processes on 127.0.0.1 and print its URL."""
    from tieredkv.localcluster import start_detached_cluster

    try:
        state = start_detached_cluster(state_dir, masters, base_port or None)
    except RuntimeError as e:
        fail(EXIT_PROBLEM, str(e))
    state["dir"] = str(Path(state_dir).resolve())
    if as_json:
        render.emit_json(state)
        return
    ports = ", ".join(str(n["port"]) for n in state["nodes"])
    render.say(f"Redis Cluster up: {len(state['nodes'])} masters on 127.0.0.1 ports {ports}")
    render.say(f"url: {state['url']}  (cluster: true)")
    render.say("use it with config/tieredkv-redis-cluster.yaml:")
    render.say(f"  export TIEREDKV_TIERS__cluster__URL={state['url']}")
    render.say(f"stop it with: tieredkv cluster down --dir {state_dir}")


@cluster_app.command("down")
def cluster_down(state_dir: Path = DirOpt, as_json: bool = JsonOpt) -> None:
    """Stop the cluster recorded in --dir (by pid) and remove its files."""
    from tieredkv.localcluster import detached_cluster_state, stop_detached_cluster

    state = detached_cluster_state(state_dir)
    stopped = stop_detached_cluster(state_dir)
    emit(ClusterDownResult(str(state_dir), state is not None, stopped), as_json, render.print_cluster_down)


engine.register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except TieredKVError as e:  # last resort: never a traceback for a known error
        render.error(message_for(e))
        raise SystemExit(exit_code(e)) from None

"""The ``tieredkv`` command.

Commands: ``status``, ``ls``, ``inspect``, ``verify``, ``evict``, ``flush``, ``migrate`` (tier
admin, implemented in :mod:`tieredkv.admin`), ``config check`` / ``config show``, ``cluster up`` /
``cluster down`` (a local Redis Cluster on loopback), ``demo`` and ``version``. Every read
command takes ``--json`` (machine output on stdout); errors go to stderr.

Exit codes: 0 success; 1 the job ran and found a problem (e.g. bytes that did not verify);
2 bad input (config file, option values); 3 a tier could not be reached.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from tieredkv import __version__, admin
from tieredkv.config import LMDBTierConfig, TieredKVConfig, load_config
from tieredkv.errors import ConfigError, TieredKVError, TierUnavailableError

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3

_HELP = (
    "tieredkv: tiered KV-cache store admin and demo.\n\n"
    "Exit codes: 0 ok; 1 a problem was found (e.g. corrupt records not repaired); 2 bad input"
    " (config, options); 3 a tier could not be reached."
)
app = typer.Typer(add_completion=False, no_args_is_help=True, help=_HELP)
config_app = typer.Typer(no_args_is_help=True, help="Check and show configuration.")
app.add_typer(config_app, name="config")

err = Console(stderr=True)
out = Console()

ConfigOpt = typer.Option(None, "--config", "-c", envvar="TIEREDKV_CONFIG", help="tieredkv YAML config file.")


def _load(path: Path | None) -> TieredKVConfig:
    try:
        return load_config(path)
    except ConfigError as e:
        err.print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


@app.command()
def version() -> None:
    """Print the tieredkv version."""
    out.print(__version__)


@config_app.command("check")
def config_check(file: Path = typer.Argument(..., help="Config file to validate.")) -> None:
    """Validate FILE; exit 2 with one message per bad field."""
    cfg = _load(file)
    out.print(f"[green]ok[/]: {file} — {len(cfg.tiers)} tier(s): {', '.join(t.label for t in cfg.tiers)}")


@config_app.command("show")
def config_show(
    config: Path | None = ConfigOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the effective config as JSON."),
    sources: bool = typer.Option(False, "--sources", help="With --json: {config, sources} with each value's origin."),
) -> None:
    """Print the effective config and where each value came from (default / file / env var); secrets masked."""
    admin.config_show_command(config, as_json, sources)


admin.register(app)


@app.command()
def demo(
    config: Path | None = ConfigOpt,
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Where the LMDB tier lives (default: a fresh temporary directory)."
    ),
    conversations: int = typer.Option(24, min=1, help="Multi-turn conversations in the trace."),
    turns: int = typer.Option(4, min=1, help="Turns per conversation."),
    mamba: bool = typer.Option(False, "--mamba", help="Add a mamba (SSM state) group to the model."),
    seed: int = typer.Option(0, help="Trace seed (same seed, same trace: a second run hits the first's chunks)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Replay a hybrid-model serving trace through the adapter, the pipeline and the tiers
    (default: CPU + LMDB), checking every loaded block against what was stored."""
    from tieredkv.demo import DemoOptions, run_demo

    cfg = _load(config)
    tmp = None
    if data_dir is None and config is None:
        tmp = tempfile.TemporaryDirectory(prefix="tieredkv-demo-")
        data_dir = Path(tmp.name)
    if data_dir is not None:
        cfg = _with_lmdb_dir(cfg, data_dir)
    opts = DemoOptions(conversations=conversations, turns=turns, mamba=mamba, seed=seed)
    try:
        with _progress(enabled=not as_json, total=conversations * turns) as advance:
            summary = run_demo(cfg, opts, progress=advance)
    except TierUnavailableError as e:
        err.print(f"[bold red]tier unavailable:[/] {e}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    except ConfigError as e:
        err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    finally:
        if tmp is not None:
            tmp.cleanup()
    if as_json:
        out.print_json(json.dumps(summary))
    else:
        _print_demo(summary, data_dir if tmp is None else None)
    if summary["mismatches"]:
        raise typer.Exit(EXIT_PROBLEM)


def _with_lmdb_dir(cfg: TieredKVConfig, data_dir: Path) -> TieredKVConfig:
    tiers = [
        t.model_copy(update={"path": str(data_dir / t.label)}) if isinstance(t, LMDBTierConfig) else t
        for t in cfg.tiers
    ]
    return cfg.model_copy(update={"tiers": tiers})


class _progress:
    """A rich progress bar over requests on stderr (off for --json or when stderr is no terminal)."""

    def __init__(self, enabled: bool, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("replaying trace"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            disable=not (enabled and err.is_terminal),
            transient=True,
        )
        self.task = self.bar.add_task("requests", total=total)

    def __enter__(self) -> Any:
        self.bar.start()
        return lambda done, total: self.bar.update(self.task, completed=done)

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def _print_demo(s: dict[str, Any], data_dir: Path | None) -> None:
    out.print(
        f"[bold]tieredkv demo[/] — {s['requests']} requests, {s['prompt_tokens']:,} prompt tokens, {s['wall_s']} s",
        highlight=False,
    )
    g = Table(title="tokens per KV group", title_justify="left")
    for col in ("group", "kind", "tokens/chunk", "from cache", "recomputed", "hit rate", "chunks stored", "loaded"):
        g.add_column(col, justify="left" if col in ("kind",) else "right")
    for row in s["groups"]:
        total = row["tokens_from_cache"] + row["tokens_recomputed"]
        rate = row["tokens_from_cache"] / total if total else 0.0
        g.add_row(
            str(row["group"]),
            row["kind"],
            str(row["tokens_per_chunk"]),
            f"{row['tokens_from_cache']:,}",
            f"{row['tokens_recomputed']:,}",
            f"{rate:.0%}",
            str(row["stored_chunks"]),
            str(row["loaded_chunks"]),
        )
    out.print(g)
    t = Table(title="tiers", title_justify="left")
    for col in ("tier", "kind", "records", "MiB held", "MiB written", "hits", "dropped", "breaker"):
        t.add_column(col, justify="left" if col in ("tier", "kind", "breaker") else "right")
    for name, row in s["tiers"].items():
        t.add_row(
            name,
            row["kind"],
            "-" if row["records"] is None else str(row["records"]),
            f"{row['used_bytes'] / 2**20:.1f}",
            f"{row['put_bytes'] / 2**20:.1f}",
            str(row["hits"]),
            str(row["dropped_stores"]),
            row["breaker"],
        )
    out.print(t)
    j = Table(title="pipeline jobs", title_justify="left")
    for col in ("", "jobs", "failed", "MiB", "GB/s", "p50 ms", "p99 ms"):
        j.add_column(col, justify="left" if not col else "right")
    for kind in ("store", "load"):
        r = s[kind]
        j.add_row(
            kind,
            str(r["jobs"]),
            str(r["failed"]),
            f"{r['bytes'] / 2**20:.1f}",
            f"{r['gbps']:.2f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
        )
    out.print(j)
    drops = sum(s["drops"].values())
    out.print(
        f"drops: {drops} (staging back-pressure {s['drops']['staging_backpressure']});"
        f" requests deferred for pending stores: {s['deferred_for_pending']}",
        highlight=False,
    )
    if s["mismatches"]:
        out.print(f"[red]FAILED[/]: {s['mismatches']} loaded blocks differ from what was stored.")
    else:
        out.print(f"[green]OK[/]: all {s['verified_blocks']:,} loaded blocks equal what was stored.")
    if data_dir is not None:
        out.print(
            f"LMDB data kept in {data_dir}; run again with --data-dir {data_dir} to start from it.", highlight=False
        )


@app.command()
def bench(
    config: Path | None = ConfigOpt,
    sizes: str = typer.Option("64,256,1024,4096", help="Chunk sizes in KiB, comma-separated."),
    total_mib: int = typer.Option(256, min=1, help="MiB moved per size and figure."),
    reps: int = typer.Option(3, min=1, help="Repetitions; each figure is their median."),
    out_dir: Path = typer.Option(Path("tieredkv-bench"), "--out", help="Where the JSON and PNG go."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Measure the configured tiers through the pipeline against their media's raw limits
    (memcpy, file and py-lmdb writes/reads, redis-py and redis-benchmark). LMDB runs in temporary
    directories beside the configured path; Redis runs under a fresh namespace and deletes only
    its own keys. Writes results JSON and a PNG plot."""
    import datetime as dt
    from urllib.parse import urlsplit

    from tieredkv import bench as b

    cfg = _load(config)
    kinds = tuple(dict.fromkeys(t.kind for t in cfg.tiers))
    redis_cfg = next((t for t in cfg.tiers if t.kind == "redis"), None)
    redis_url = getattr(redis_cfg, "url", None)
    if redis_cfg is not None and getattr(redis_cfg, "cluster", False):
        err.print("note: the raw Redis figures use one node of the cluster")
    port = urlsplit(redis_url).port if redis_url else None
    lmdb_cfg = next((t for t in cfg.tiers if isinstance(t, LMDBTierConfig)), None)
    workdir = None
    if lmdb_cfg is not None:
        parent = Path(lmdb_cfg.path).expanduser().resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="tieredkv-bench-", dir=parent)
    try:
        size_list = [int(x) * 1024 for x in sizes.split(",")]
    except ValueError:
        err.print(f"[bold red]error:[/] --sizes: got {sizes!r}; expected KiB numbers like 64,256,1024")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    try:
        results = b.run_tier_bench(
            size_list,
            total_mib << 20,
            reps,
            kinds,
            redis_url=redis_url,
            redis_port=port,
            workdir=workdir,
            log=lambda m: err.print(m, highlight=False),
        )
    except TierUnavailableError as e:
        err.print(f"[bold red]tier unavailable:[/] {e}")
        raise typer.Exit(EXIT_UNAVAILABLE) from None
    finally:
        if workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    rows = [{"size": r.size, "gbps": r.gbps, "ratios": b.ratios(r)} for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"tiers-{stamp}.json"
    path.write_text(json.dumps({"machine": b.machine_info(), "results": rows}, indent=1))
    png = out_dir / f"tiers-{stamp}.png"
    try:
        b.plot(results, str(png))
    except ImportError:
        png = None  # type: ignore[assignment]
    if as_json:
        out.print_json(json.dumps({"results": rows, "json": str(path), "png": str(png) if png else None}))
        return
    t = Table(title="tier GB/s vs raw GB/s (ratio)", title_justify="left")
    t.add_column("size", justify="right")
    for k in b.BASELINES:
        t.add_column(k, justify="right")
    for r in results:
        cells = []
        for k, base in b.BASELINES.items():
            ok = k in r.gbps and base in r.gbps
            cells.append(f"{r.gbps[k]:.2f}/{r.gbps[base]:.2f} ({r.gbps[k] / r.gbps[base]:.2f}x)" if ok else "")
        t.add_row(f"{r.size // 1024} KiB", *cells)
    out.print(t)
    out.print(f"wrote {path}" + (f" and {png}" if png else " (pip install 'tieredkv[bench]' for the PNG plot)"))


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except TieredKVError as e:  # last resort: never a traceback for a known error
        err.print(f"[bold red]error:[/] {e}")
        raise SystemExit(EXIT_BAD_INPUT if isinstance(e, ConfigError) else EXIT_PROBLEM) from None


if __name__ == "__main__":
    main()

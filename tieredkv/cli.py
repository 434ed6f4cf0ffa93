"""The ``tieredkv`` command.

Exit codes: 0 success; 1 the job ran and found a problem (e.g. bytes that did not verify);
2 bad input (config file, option values); 3 a tier could not be reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from tieredkv import __version__
from tieredkv.config import LMDBTierConfig, TieredKVConfig, load_config
from tieredkv.errors import ConfigError, TieredKVError, TierUnavailableError

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3

app = typer.Typer(add_completion=False, no_args_is_help=True, help="tieredkv: tiered KV-cache store admin and demo.")
config_app = typer.Typer(no_args_is_help=True, help="Check and show configuration.")
app.add_typer(config_app, name="config")

err = Console(stderr=True)
out = Console()

ConfigOpt = typer.Option(None, "--config", "-c", envvar="TIEREDKV_CONFIG", help="tieredkv YAML config file.")


def _load(path: Optional[Path]) -> TieredKVConfig:
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
def config_show(config: Optional[Path] = ConfigOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Print the effective config (file + TIEREDKV_* overrides + defaults); secrets masked."""
    cfg = _load(config)
    data = cfg.model_dump(mode="json")
    for t in data["tiers"]:
        if t.get("password"):
            t["password"] = "***"
    if as_json:
        out.print_json(json.dumps(data))
    else:
        import yaml

        out.print(yaml.safe_dump(data, sort_keys=False), highlight=False)


@app.command()
def demo(
    config: Optional[Path] = ConfigOpt,
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="Where the LMDB tier lives (default: a fresh temporary directory)."
    ),
    chunks: int = typer.Option(64, min=1, help="Chunks per KV group."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Round-trip real KV blocks through every configured tier (default: CPU + LMDB) and verify them."""
    cfg = _load(config)
    tmp = None
    if data_dir is None and config is None:
        tmp = tempfile.TemporaryDirectory(prefix="tieredkv-demo-")
        data_dir = Path(tmp.name)
    if data_dir is not None:
        cfg = _with_lmdb_dir(cfg, data_dir)
    try:
        summary = asyncio.run(_demo(cfg, chunks))
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
        _print_demo(summary)
    if summary["mismatches"]:
        raise typer.Exit(EXIT_PROBLEM)


def _with_lmdb_dir(cfg: TieredKVConfig, data_dir: Path) -> TieredKVConfig:
    tiers = [
        t.model_copy(update={"path": str(data_dir / t.label)}) if isinstance(t, LMDBTierConfig) else t
        for t in cfg.tiers
    ]
    return cfg.model_copy(update={"tiers": tiers})


# Two KV groups of a hybrid model: full attention (4 blocks of 64 KiB per chunk) and sliding
# window (1 block of 32 KiB per chunk). Bytes are seeded by (group, chunk), so a second run on
# the same LMDB directory can verify what the first one stored.
_DEMO_GROUPS = ((0, 4 * 64 * 1024), (1, 32 * 1024))


async def _demo(cfg: TieredKVConfig, chunks: int) -> dict[str, Any]:
    import torch

    from tieredkv.backends.registry import build_tier
    from tieredkv.keys import Namespace

    ns = Namespace(
        model=cfg.namespace.model, revision=cfg.namespace.revision, dtype=cfg.namespace.dtype,
        tenant_salt=cfg.namespace.tenant_salt,
    )
    items = []
    for group, nbytes in _DEMO_GROUPS:
        for c in range(chunks):
            gen = torch.Generator().manual_seed(group * 1_000_003 + c)
            block_hash = (group * 1_000_003 + c).to_bytes(32, "big")
            items.append((ns.key(block_hash, group), torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)))
    total = sum(int(v.numel()) for _, v in items)
    rows = []
    for tcfg in cfg.tiers:
        async with build_tier(tcfg) as tier:
            keys = [k for k, _ in items]
            found_before = sum(await tier.contains_many(keys))
            t0 = time.perf_counter()
            await tier.put_many(items)
            t_put = time.perf_counter() - t0
            outs = [torch.zeros_like(v) for _, v in items]  # caller buffers, already faulted in
            t0 = time.perf_counter()
            got = await tier.get_many(keys, into=outs)
            t_get = time.perf_counter() - t0
            bad = sum(1 for (_, v), n, o in zip(items, got, outs) if n != v.numel() or not torch.equal(v, o))
            st = await tier.stats()
            rows.append({
                "tier": tier.name, "kind": tier.kind, "records": len(items), "bytes": total,
                "found_from_earlier_run": found_before, "put_gbps": total / t_put / 1e9,
                "get_gbps": total / t_get / 1e9, "mismatches": bad, "used_bytes": st.used_bytes,
                "where": st.extra.get("path", "in-process"),
            })
    return {"namespace": ns.fingerprint.hex(), "groups": len(_DEMO_GROUPS), "chunks_per_group": chunks,
            "tiers": rows, "mismatches": sum(r["mismatches"] for r in rows)}


def _print_demo(s: dict[str, Any]) -> None:
    table = Table(title=f"tieredkv demo — {s['groups']} KV groups × {s['chunks_per_group']} chunks, namespace {s['namespace'][:12]}…")
    for col in ("tier", "records", "MiB", "put GB/s", "get GB/s", "verified", "from earlier run"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for r in s["tiers"]:
        ok = "[green]yes[/]" if not r["mismatches"] else f"[red]{r['mismatches']} bad[/]"
        table.add_row(r["tier"], str(r["records"]), f"{r['bytes'] / 2**20:.1f}", f"{r['put_gbps']:.2f}",
                      f"{r['get_gbps']:.2f}", ok, str(r["found_from_earlier_run"]))
    out.print(table)
    for r in s["tiers"]:
        out.print(f"  {r['tier']}: {r['kind']} tier, {r['where']}", highlight=False)
    out.print("[green]OK[/]: every chunk read back equals what was stored." if not s["mismatches"]
              else f"[red]FAILED[/]: {s['mismatches']} chunk(s) differ.")


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except TieredKVError as e:  # last resort: never a traceback for a known error
        err.print(f"[bold red]error:[/] {e}")
        raise SystemExit(EXIT_BAD_INPUT if isinstance(e, ConfigError) else EXIT_PROBLEM) from None


if __name__ == "__main__":
    main()

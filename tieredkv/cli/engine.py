"""Engine-side commands: ``demo`` (replays a serving trace through the adapter, pipeline and
tiers) and ``bench`` (tiers against their media's raw limits). Both need torch: they import the
engine inside the command, and without torch say what to install instead of a traceback."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import typer

from tieredkv import ENGINE_HINT
from tieredkv.cli import render
from tieredkv.cli.common import ConfigOpt, run
from tieredkv.cli.exits import EXIT_BAD_INPUT, EXIT_PROBLEM, CLIError
from tieredkv.cli.tiers import local_path, select_tiers, with_data_dir

__all__ = ["ENGINE_HINT", "register", "require_engine"]

_DataDirOpt = typer.Option(None, "--data-dir", help="Where the LMDB tier lives (default: a fresh temporary directory).")
_BenchTierOpt = typer.Option(
    None, "--tier", "-t", help="Tier name to bench (repeatable); default: every tier of the config."
)
_OutDirOpt = typer.Option(Path("tieredkv-bench"), "--out", help="Where the JSON and PNG go.")
_PrefillOpt = typer.Option(
    10_000.0,  # tieredkv.demo.DEFAULT_PREFILL_TOKENS_PER_S (not imported here: the CLI starts without torch)
    "--prefill-tokens-per-s",
    min=1.0,
    help="Prefill rate that prices tokens served from cache as time saved. Default 10,000 tokens/s: "
    "about an 8B model's prefill on one A100-class GPU (2 x 8e9 FLOPs per token at ~50% of 312 "
    "dense bf16 TFLOP/s); an H100 does roughly 2-3x that. Use your engine's measured figure.",
)


def require_engine(command: str) -> None:
    """Exit 2 with the install hint when torch (the engine side) is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise CLIError(
            EXIT_BAD_INPUT,
            f"`tieredkv {command}` runs the engine side, which needs torch; install it with: {ENGINE_HINT}",
        ) from None


def register(app: typer.Typer) -> None:
    """Add ``demo`` and ``bench`` to ``app``."""

    @app.command()
    def demo(
        config: Path | None = ConfigOpt,
        data_dir: Path | None = _DataDirOpt,
        conversations: int = typer.Option(24, min=1, help="Multi-turn conversations in the trace."),
        turns: int = typer.Option(4, min=1, help="Turns per conversation."),
        mamba: bool = typer.Option(False, "--mamba", help="Add a mamba (SSM state) group to the model."),
        seed: int = typer.Option(0, help="Trace seed (same seed, same trace: a second run hits the first's chunks)."),
        prefill_tokens_per_s: float = _PrefillOpt,
        admit_after: int | None = typer.Option(
            None,
            "--admit-after",
            min=1,
            max=64,
            help="Admission: store a chunk on its Nth sighting, in every KV group (default: the config's"
            " policy[].admit_after, 1 = always). The summary says what it kept from being written.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Replay a hybrid-model serving trace through the adapter, the pipeline and the tiers
        (default: CPU + LMDB), checking every loaded block against what was stored. Reports prompt
        tokens served from cache, the time that saved vs recomputing them at --prefill-tokens-per-s
        (minus the time spent loading them), store/load throughput over busy time, and the bytes
        admission kept from being written."""
        summary, kept = run(
            lambda: _demo(
                config, data_dir, conversations, turns, mamba, seed, prefill_tokens_per_s, as_json, admit_after
            )
        )
        if as_json:
            render.emit_json(summary)
        else:
            _print_demo(summary, kept)
        if summary["mismatches"]:
            raise typer.Exit(EXIT_PROBLEM)

    @app.command()
    def bench(
        config: Path | None = ConfigOpt,
        tier: list[str] | None = _BenchTierOpt,
        sizes: str = typer.Option("64,256,1024,4096", help="Chunk sizes in KiB, comma-separated."),
        total_mib: int = typer.Option(256, min=1, help="MiB moved per size and figure."),
        reps: int = typer.Option(
            5, min=1, help="Repetitions, interleaved with the raw runs; each figure is their median."
        ),
        layouts: str = typer.Option(
            "permuted,fragmented,consecutive",
            help="Block-id layouts, comma-separated, the first the default figure: permuted (a churned"
            " engine pool), fragmented (short runs), consecutive (a fresh pool, the best case).",
        ),
        out_dir: Path = _OutDirOpt,
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    ) -> None:
        """Measure the configured tiers through the pipeline, on the block ids a churned engine
        pool hands out, against the strongest raw figure of each medium measured in the same run
        (host memory: one gather of scattered blocks, one copy, two threads' non-temporal copy;
        disk: a page-cache file write, py-lmdb, one file per record; Redis: redis-py and
        redis-benchmark), the raw figures and each tier's integrity floor printed too. Local tiers
        run in temporary directories beside the configured path; shared ones under a fresh
        namespace, deleting only their own keys. Writes results JSON and a PNG plot."""
        run(lambda: _bench(config, tier, sizes, total_mib, reps, out_dir, as_json, layouts))


def _demo(
    config: Path | None,
    data_dir: Path | None,
    conversations: int,
    turns: int,
    mamba: bool,
    seed: int,
    prefill_tokens_per_s: float,
    as_json: bool,
    admit_after: int | None = None,
) -> tuple[dict[str, Any], Path | None]:
    from tieredkv.cli.ops import load

    require_engine("demo")
    from tieredkv.demo import DemoOptions, run_demo

    cfg = load(config)
    tmp = None
    if data_dir is None and config is None:
        tmp = tempfile.TemporaryDirectory(prefix="tieredkv-demo-")
        data_dir = Path(tmp.name)
    if data_dir is not None:
        cfg = with_data_dir(cfg, data_dir)
    opts = DemoOptions(
        conversations=conversations,
        turns=turns,
        mamba=mamba,
        seed=seed,
        prefill_tokens_per_s=prefill_tokens_per_s,
        admit_after=admit_after,
    )
    try:
        with render.progress(enabled=not as_json) as bar:
            task = bar.add_task("replaying trace", total=conversations * turns)
            summary = run_demo(cfg, opts, progress=lambda done, total: bar.update(task, completed=done))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return summary, (data_dir if tmp is None else None)


def _print_demo(s: dict[str, Any], data_dir: Path | None) -> None:
    render.say(
        ("tieredkv demo", "bold"),
        f" — {s['requests']} requests, {s['prompt_tokens']:,} prompt tokens, {s['wall_s']:.2f} s wall",
    )
    prompt, cached, load, store = s["prompt_tokens"], s["tokens_from_cache"], s["load"], s["store"]
    share = cached / prompt if prompt else 0.0
    recompute, busy = round(s["recompute_s"], 3), round(load["busy_s"], 3)  # as shown, so the line adds up
    prefill = f"{recompute:.3f} s to prefill them at {s['prefill_tokens_per_s']:,.0f} tokens/s"
    loading = f"{busy:.3f} s loading them"
    saved = f"{recompute - busy:.3f} s = {prefill} - {loading}" if recompute >= busy else f"none: {loading} > {prefill}"
    render.say(
        ("  from cache  ", "bold"), f"{cached:,} of {prompt:,} prompt tokens ({share:.0%}) loaded, not recomputed"
    )
    render.say(("  time saved  ", "bold"), saved)
    for label, r in (("  loads       ", load), ("  stores      ", store)):
        render.say(
            (label, "bold"),
            f"{r['busy_gbps']:.2f} GB/s over busy time: {r['bytes'] / 2**20:.1f} MiB in {r['busy_s']:.3f} s busy,"
            f" {r['jobs']} jobs, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms",
        )
    if s["mismatches"]:
        render.say(
            ("  integrity   ", "bold"),
            ("FAILED", "red"),
            f": {s['mismatches']} loaded blocks differ from what was stored",
        )
    else:
        render.say(
            ("  integrity   ", "bold"),
            ("OK", "green"),
            f": all {s['verified_blocks']:,} loaded blocks equal what was stored",
        )
    adm = s["admission"]
    if any(n > 1 for n in adm["admit_after"].values()):
        after = ", ".join(f"group {g}: {n}" for g, n in adm["admit_after"].items())
        base = adm.get("baseline")
        never = f"{adm['chunks_never_written']:,} chunks ({adm['bytes_not_written'] / 2**20:.1f} MiB) never written"
        if base is not None:
            fewer, written, cost = adm["bytes_saved"], adm["bytes_written"], base["tokens_from_cache"] - cached
            render.say(
                ("  admission   ", "bold"),
                f"admit_after {after}: {never}; this run wrote {written / 2**20:.1f} MiB, the same trace storing"
                f" every chunk {base['bytes_written'] / 2**20:.1f} MiB ({-fewer / 2**20:+.1f} MiB,"
                f" {-fewer / max(1, base['bytes_written']):+.0%}); it cost {cost:,} tokens from cache"
                f" ({cached:,} vs {base['tokens_from_cache']:,})",
            )
        else:
            render.say(
                ("  admission   ", "bold"),
                f"admit_after {after}: {never} (no replay without admission to compare: a tier keeps its"
                " records outside this process and its directory)",
            )
    else:
        render.say(("  admission   ", "bold"), "every chunk offered is stored (admit_after 1; try --admit-after 2)")
    render.say(
        "  (busy: time at least one job of that kind was in flight, submit to completion; the prefill rate"
        " is --prefill-tokens-per-s)"
    )
    cols = ("group", "kind", "tokens/chunk", "from cache", "recomputed", "hit rate", "chunks stored", "loaded")
    rows = []
    for row in s["groups"]:
        total = row["tokens_from_cache"] + row["tokens_recomputed"]
        hit = row["tokens_from_cache"] / total if total else 0.0
        rows.append((str(row["group"]), row["kind"], str(row["tokens_per_chunk"]), f"{row['tokens_from_cache']:,}",
                     f"{row['tokens_recomputed']:,}", f"{hit:.0%}", str(row["stored_chunks"]),
                     str(row["loaded_chunks"])))  # fmt: skip
    render.table("tokens per KV group", cols, rows, right=[c for c in cols if c != "kind"])
    cols = ("tier", "kind", "records", "MiB held", "MiB written", "hits", "dropped", "breaker")
    tier_rows = [
        (name, row["kind"], "-" if row["records"] is None else str(row["records"]), f"{row['used_bytes'] / 2**20:.1f}",
         f"{row['put_bytes'] / 2**20:.1f}", str(row["hits"]), str(row["dropped_stores"]), row["breaker"])
        for name, row in s["tiers"].items()
    ]  # fmt: skip
    render.table("tiers", cols, tier_rows, right=("records", "MiB held", "MiB written", "hits", "dropped"))
    job_cols = ("", "jobs", "failed", "MiB", "busy s", "busy GB/s", "p50 ms", "p99 ms")
    job_rows = [
        (kind, str(r["jobs"]), str(r["failed"]), f"{r['bytes'] / 2**20:.1f}", f"{r['busy_s']:.3f}",
         f"{r['busy_gbps']:.2f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}")
        for kind in ("store", "load") for r in (s[kind],)
    ]  # fmt: skip
    render.table("pipeline jobs", job_cols, job_rows, right=job_cols[1:])
    drops = sum(s["drops"].values())
    render.say(
        f"drops: {drops} (staging back-pressure {s['drops']['staging_backpressure']});"
        f" requests deferred for pending stores: {s['deferred_for_pending']}"
    )
    if data_dir is not None:
        render.say(f"LMDB data kept in {data_dir}; run again with --data-dir {data_dir} to start from it.")


def _bench(
    config: Path | None,
    names: list[str] | None,
    sizes: str,
    total_mib: int,
    reps: int,
    out_dir: Path,
    as_json: bool,
    layouts: str = "permuted,fragmented,consecutive",
) -> None:
    import datetime as dt
    import shutil

    from tieredkv.cli.ops import load

    require_engine("bench")
    from tieredkv import bench as b

    cfg = load(config)
    tiers = select_tiers(cfg, names, allow_in_process=True)
    try:
        size_list = b.parse_sizes(sizes)
    except ValueError as e:
        raise CLIError(EXIT_BAD_INPUT, f"--sizes: {e}") from None
    lays = [x.strip() for x in layouts.split(",") if x.strip()]
    if not lays or any(x not in b.LAYOUTS for x in lays):
        raise CLIError(
            EXIT_BAD_INPUT, f"--layouts: got {layouts!r}; expected some of {','.join(b.LAYOUTS)}, comma-separated"
        )
    local = next((p for t in tiers if (p := local_path(t))), None)
    workdir = None
    if local is not None:  # raw disk figures and bench copies of local tiers on the configured disk
        parent = Path(local).parent
        parent.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="tieredkv-bench-", dir=parent)
    b.steady_malloc()  # this process is a bench: raw baselines at the medium's limit
    try:
        results = b.run_tier_bench(
            tiers,
            size_list,
            total_mib << 20,
            reps,
            workdir=workdir,
            log=lambda m: render.say(m, console=render.err),
            layouts=lays,
        )
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = [b.result_row(r) for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"tiers-{stamp}.json"
    path.write_text(json.dumps({"machine": b.machine_info(), "results": rows}, indent=1))
    png: Path | None = out_dir / f"tiers-{stamp}.png"
    try:
        b.plot(results, str(png))
    except ImportError:
        png = None
    if as_json:
        render.emit_json({"results": rows, "json": str(path), "png": str(png) if png else None})
        return
    for title, cols, table in b.tier_tables(results):
        render.table(title, ("size", *cols), table, right=("size", *cols))
    for line in b.judged_lines(results):
        render.say(line)
    floored = b.floored_figures(results, layouts=False)
    if floored:
        render.table(
            "tier GB/s vs integrity floor GB/s (ratio): the raw work plus a checksum of every payload",
            ("size", *floored),
            b.ratio_rows(results, floored, floors=True),
            right=("size", *floored),
        )
    raw = b.raw_figures(results)
    if raw:
        sizes_shown = [b.size_label(r.size) for r in results]
        render.table(
            "raw limits GB/s: each medium without tieredkv, on the same bytes",
            ("figure", *sizes_shown),
            b.raw_rows(results, raw),
            right=sizes_shown,
        )
    render.say(f"wrote {path}" + (f" and {png}" if png else " (pip install 'tieredkv[bench]' for the PNG plot)"))

"""Throughput of each configured tier through the real pipeline, next to its medium's raw limit
measured in the same run.

Used by ``benchmarks/bench_tiers.py`` and ``tieredkv bench``. For each chunk size it measures:

* through tieredkv (a :class:`~tieredkv.store.TieredStore` over one tier, a KV "device" tensor of
  CPU memory, bytes verified): ``<tier label>.store`` GB/s (device blocks → tier) and
  ``<tier label>.load`` GB/s (tier → device blocks);
* the raw limit of each tier's medium on the same bytes, from the tier class's
  :meth:`~tieredkv.backends.base.Tier.raw_limits` (built-ins: ``memcpy``; ``file_pagecache.store``,
  ``file_durable.store``, ``file.load``, ``lmdb_raw.store|load``, ``lmdb_checked.store|load``;
  ``redis_py.store|load``, ``redis_benchmark.store|load``), which also names the figure the tier
  is judged against (:attr:`BenchResult.baselines`, :func:`ratios`) and, where records leave the
  process, the medium's integrity floor (:attr:`BenchResult.floors`, :func:`floor_ratios`: the
  same raw work plus a checksum over every payload). A tier class without the hook gets its
  figures and no ratio. Nothing here knows a tier kind: a tier's bench copy comes from its config
  model (:func:`make_tier`), its raw limit from its class.

Each figure is the median of ``reps`` runs, after one untimed warm-up run of everything; every
tier run starts from an empty store in a directory of its own (removed right after, as each raw
run removes its file), as does each raw run (first-touch costs are paid by both).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tieredkv.backends._rawbench import (  # re-exported: their old home
    BATCH_BYTES,
    REDIS_BENCHMARK_KEYS,
    raw_file,
    raw_lmdb,
    raw_redis,
    redis_benchmark,
    warm_free_pages,
)
from tieredkv.backends.base import Tier
from tieredkv.backends.registry import build_tier, get_tier_class
from tieredkv.config import NamespaceConfig, PipelineConfig, TierConfigBase, TieredKVConfig
from tieredkv.keys import Namespace
from tieredkv.layouts import BLOCKS_PER_CHUNK, LAYOUTS, block_ids, round_ids
from tieredkv.store import TieredStore

__all__ = [
    "BATCH_BYTES",
    "BENCH_SETTINGS",
    "BLOCKS_PER_CHUNK",
    "LAYOUTS",
    "REDIS_BENCHMARK_KEYS",
    "SIZES",
    "BenchResult",
    "add_run_args",
    "bench_config",
    "block_ids",
    "cell",
    "make_tier",
    "parse_sizes",
    "ratios",
    "raw_figures",
    "raw_file",
    "raw_lmdb",
    "raw_redis",
    "raw_rows",
    "redis_benchmark",
    "run_plan",
    "run_tier_bench",
    "sizes_option",
    "tier_figures",
]

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
OPS = ("store", "load")


@dataclass
class BenchResult:
    size: int
    chunks: int
    gbps: dict[str, float] = field(default_factory=dict)  # "<label or raw figure>[.store|.load]" -> GB/s
    reps: dict[str, list[float]] = field(default_factory=dict)
    #: Tier labels benched, in config order (their figures are ``<label>.store`` / ``.load``).
    tiers: list[str] = field(default_factory=list)
    #: ``"<label>.store|load"`` → the raw figure that tier is judged against (its class's
    #: :attr:`~tieredkv.backends.base.RawLimits.baseline`); absent when it declares none.
    baselines: dict[str, str] = field(default_factory=dict)
    #: ``"<label>.store|load"`` → the raw figure of the same medium with the integrity work alone
    #: (:attr:`~tieredkv.backends.base.RawLimits.floor`): the most a checked tier could do there.
    floors: dict[str, str] = field(default_factory=dict)
    #: Block-id layouts measured (:data:`LAYOUTS`), the default first.
    layouts: list[str] = field(default_factory=lambda: [LAYOUTS[0]])
    #: ``"<label>.store|load"`` → the raw figures its limit is the strongest of (each tier's
    #: :attr:`~tieredkv.backends.base.RawLimits.baseline`); :attr:`baselines` names the one that
    #: measured highest at this size.
    candidates: dict[str, list[str]] = field(default_factory=dict)

    def add(self, name: str, samples: list[float]) -> None:
        self.reps[name] = [round(x, 3) for x in samples]
        self.gbps[name] = round(statistics.median(samples), 3)

    def settle_limits(self) -> None:
        """Each tier figure's limit: the strongest (highest median) of its candidates measured."""
        for key, names in self.candidates.items():
            got = [c for c in names if c in self.gbps]
            if got:
                self.baselines[key] = max(got, key=self.gbps.__getitem__)


def figure(label: str, layout: str, op: str, default: str = LAYOUTS[0]) -> str:
    """A tier figure's name: ``<label>.<op>`` for the default layout, else ``<label>@<layout>.<op>``."""
    return f"{label}.{op}" if layout == default else f"{label}@{layout}.{op}"


# ---- through the pipeline -----------------------------------------------------------------------


def bench_blocks(src: torch.Tensor, blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> torch.Tensor:
    """The engine's block tensor for :func:`pipeline_store_load`: the null block, room for the
    chunks of ``src`` as blocks of ``size / blocks_per_chunk`` bytes, and room for the load.
    Allocate it once per size and pass it to every run (the raw baselines copy into
    preallocated tensors too; a fresh 3 x 256 MiB per run costs page faults that land on the
    next run's time here)."""
    n, size = src.shape
    if size % blocks_per_chunk:
        raise ValueError(f"chunk size {size} is not a multiple of {blocks_per_chunk} blocks")
    return torch.zeros(1 + 2 * n * blocks_per_chunk, size // blocks_per_chunk, dtype=torch.uint8)


def pipeline_store_load(
    tier: Tier,
    src: torch.Tensor,
    dst: torch.Tensor,
    ns: Namespace,
    blocks: torch.Tensor | None = None,
    *,
    layout: str = LAYOUTS[0],
    seed: int = 0,
    phase: Callable[[str, bool], None] | None = None,
    full: bool = False,
) -> tuple[float, float]:
    """(store seconds, load seconds) of every chunk of ``src`` through a one-tier store; bytes verified.

    The KV group is ``blocks`` (:func:`bench_blocks`; block 0 is the engine's null block), chunks
    of :data:`BLOCKS_PER_CHUNK` blocks. Chunk ``i`` of ``src`` is placed (untimed) in the blocks a
    pool of ``layout`` hands out (:func:`~tieredkv.layouts.round_ids`, drawn from ``seed``) among blocks
    ``1 .. N``, stored from there, and loaded into blocks drawn the same way among ``N+1 .. 2N``,
    zeroed first. Every key it writes is deleted again (a shared tier is left as it was found).
    ``phase(op, started)``, if given, is called right before each timed phase (``op``: ``store``
    or ``load``) starts its clock and right after it stops it (a profiler's marks). ``full``: the
    tier is first filled (untimed) with as many chunks under other keys, so the timed store
    evicts them as a full tier in an engine does (:func:`bench_config` gives it room for ``src``
    and 8 MiB), and the loads read what evictions and overwrites left where it lies."""
    import numpy as np

    n, size = src.shape
    if blocks is None:
        blocks = bench_blocks(src)
    bpc = (blocks.shape[0] - 1) // (2 * n)
    nb = n * bpc
    if bpc < 1 or blocks.shape[1] * bpc != size:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)} do not hold {n} chunks of {size} bytes")
    store_ids, load_ids = round_ids(layout, nb, seed)
    rows = blocks.numpy()
    rows[np.asarray(store_ids)] = src.numpy().reshape(nb, -1)  # the engine wrote its KV here
    blocks[1 + nb :].zero_()
    per = max(1, BATCH_BYTES // size)
    pipeline = PipelineConfig(
        max_batch_bytes=BATCH_BYTES,
        max_batch_items=max(per, 1),
        job_timeout_s=600,
        staging_bytes=min(n * size, 512 * MiB) + BATCH_BYTES,
    )
    cfg = TieredKVConfig(namespace=NamespaceConfig(model=ns.model), pipeline=pipeline)
    store = TieredStore(cfg, namespace=ns, tiers=[tier])
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
    fill = [ns.key((n + i).to_bytes(32, "big"), 0) for i in range(n)] if full else []
    with store.start():
        store.register_group(0, [blocks], blocks_per_chunk=bpc)
        store.prefault_staging()  # an engine's pool is faulted in once, not per run

        def run(op: str, ids: list[int], names: list[bytes] = keys) -> float:
            submit: Callable[[int, list[tuple[bytes, Sequence[int]]]], int | None] = getattr(store, op)
            chunked = [tuple(ids[i * bpc : (i + 1) * bpc]) for i in range(n)]  # as the scheduler holds them
            if phase is not None and names is keys:
                phase(op, True)
            t0 = time.perf_counter()
            for b in range(0, n, per):
                chunks: list[tuple[bytes, Sequence[int]]] = list(zip(names[b : b + per], chunked[b : b + per]))
                while submit(0, chunks) is None:  # staging full: wait for room (back-pressure)
                    time.sleep(0.0005)
            if not store.drain(600):
                raise RuntimeError("pipeline did not drain")
            dt = time.perf_counter() - t0
            if phase is not None and names is keys:
                phase(op, False)
            bad = [r for r in store.poll() if not r.ok]
            if bad:
                raise RuntimeError(f"{len(bad)} jobs failed: {bad[0].error}")
            return dt

        try:
            if fill:
                run("store", store_ids, fill)
            if writes_fresh_pages(tier):
                warm_free_pages(src)  # as every raw baseline does before it writes
            ts = run("store", store_ids)
            tl = run("load", load_ids)
        finally:
            store.run(tier.delete_many(keys + fill), timeout=120)
    if not np.array_equal(rows[np.asarray(load_ids)].reshape(n, size), src.numpy()):
        raise RuntimeError(f"tier {tier.name!r}: loaded bytes differ from stored bytes")
    return ts, tl


def writes_fresh_pages(tier: Tier) -> bool:
    """Whether a store into ``tier`` writes pages the kernel hands out as it goes (the page
    cache, a heap, a server's memory): then the bench warms free pages before its timed stores,
    as the raw baselines of those media do (:func:`warm_free_pages`); the tier class says
    (:meth:`Tier.bench_writes_fresh_pages`). A tier that stores into its own memory, touched
    when it opened (the CPU slab with ``prefault``), writes no fresh page, and its raw baseline
    (host memory copies) warms none: warming before it would be a handicap its limit does not
    carry (a 256 MiB copy right after faulting in 264 MiB of fresh memory ran 30 % slower here,
    with 40 % more CPU)."""
    return type(tier).bench_writes_fresh_pages(tier.config)


#: Settings a bench copy of a tier takes where its config model has the field (by field, never by
#: kind): slab pages touched at open (the steady state a server runs in, not first-touch faults),
#: and deadlines long enough for 16 MiB batches on a busy machine. Numbers are lower bounds.
BENCH_SETTINGS: dict[str, Any] = {"prefault": True, "op_timeout_s": 120.0, "socket_timeout_s": 30.0}


def bench_config(tcfg: TierConfigBase, size: int, n: int, workdir: str) -> TierConfigBase:
    """The bench copy of ``tcfg``: local data in a fresh directory under ``workdir``, room for
    ``n`` records of ``size`` bytes plus 8 MiB, and :data:`BENCH_SETTINGS`."""
    cfg = tcfg.with_local_dir(tempfile.mkdtemp(dir=workdir)).with_capacity(
        n * size + 8 * MiB, largest_record_bytes=size + 64
    )
    fields = type(cfg).model_fields
    update: dict[str, Any] = {}
    for name, value in BENCH_SETTINGS.items():
        if name in fields:
            current = getattr(cfg, name)
            update[name] = value if isinstance(value, bool) or current is None else max(current, value)
    return type(cfg).model_validate({**cfg.model_dump(), **update}) if update else cfg


def make_tier(tcfg: TierConfigBase, size: int, n: int, workdir: str) -> Tier:
    """A fresh tier (not opened) built from :func:`bench_config` of the user's ``tcfg``."""
    return build_tier(bench_config(tcfg, size, n, workdir))


def run_tier_bench(
    tiers: Sequence[TierConfigBase],
    sizes: Sequence[int] = SIZES,
    total_bytes: int = 256 * MiB,
    reps: int = 3,
    *,
    workdir: str | None = None,
    log: Callable[[str], None] = print,
    layouts: Sequence[str] = LAYOUTS,
) -> list[BenchResult]:
    """Bench every tier config of ``tiers`` (a config's ``tiers``) at each chunk size, with the
    block ids of each of ``layouts`` (the first is the default figure); returns one
    :class:`BenchResult` per size. Raw limits are measured once per tier class and repetition
    (with the first config of that class)."""
    for lay in layouts:
        if lay not in LAYOUTS:
            raise ValueError(f"layout {lay!r}: expected one of {', '.join(LAYOUTS)}")
    torch.set_num_threads(1)  # the copy path runs single-threaded (machine-limits finding 3)
    work = workdir or tempfile.mkdtemp(prefix="tieredkv-bench-")
    ns = Namespace(model="tieredkv-bench", tenant_salt=uuid.uuid4().hex)
    notes: set[str] = set()
    out = []
    for size in sizes:
        n = max(4, total_bytes // size)
        res = BenchResult(size, n, tiers=[t.label for t in tiers], layouts=list(layouts))
        _bench_size(res, tiers, reps, work, ns, notes, log)
        log(f"{size // KiB:>5} KiB: " + ", ".join(f"{k}={v:.2f}" for k, v in res.gbps.items()))
        out.append(res)
    if workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return out


#: glibc ``mallopt`` parameters (see ``mallopt(3)``) and what :func:`steady_malloc` sets them to.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
STEADY_MALLOC = {"M_TRIM_THRESHOLD": 1 << 30, "M_TOP_PAD": 64 * MiB, "M_MMAP_THRESHOLD": 32 * MiB}
#: How this process was set up for the bench, reported by :func:`machine_info`.
_SETUP: dict[str, Any] = {"malloc": "glibc defaults"}


def steady_malloc() -> bool:
    """Keep freed heap memory in this process (glibc only; False elsewhere). For a bench
    process's entry point, never for an engine's: it is process-wide, and for good.

    py-lmdb's write path mallocs every dirty page of a transaction and frees it at commit. In a
    process that holds torch and a few 256 MiB tensors, glibc then returns the top of the heap to
    the kernel after each commit and faults it in again in the next transaction's puts: the raw
    py-lmdb put of 4 MiB values spent 200-320 ms per 256 MiB in its puts instead of 35-50, and
    read 0.3-0.85 GB/s against 2.1-2.2 run alone. The raw baselines are meant to be the medium's
    limit, so the bench keeps the heap; it applies to the tier runs in the same process alike
    (the CPU tier measured the same with and without, interleaved in one process)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    codes = {"M_TRIM_THRESHOLD": _M_TRIM_THRESHOLD, "M_TOP_PAD": _M_TOP_PAD, "M_MMAP_THRESHOLD": _M_MMAP_THRESHOLD}
    ok = all(mallopt(codes[k], v) == 1 for k, v in STEADY_MALLOC.items())
    if ok:
        _SETUP["malloc"] = dict(STEADY_MALLOC)
    return ok


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Runs with the heap set up so far out of the garbage collector's view, as vLLM's engine
    does after start-up (``gc.collect(); gc.freeze()``). Otherwise a full collection set off by
    a tier run's per-chunk objects walks torch's whole heap: ~100 ms here, as long as a whole
    256 MiB load, in every other run (64 KiB LMDB loads read 1.2 and 2.0-2.4 GB/s in turn)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _bench_size(
    res: BenchResult,
    tiers: Sequence[TierConfigBase],
    reps: int,
    work: str,
    ns: Namespace,
    notes: set[str],
    log: Callable[[str], None],
) -> None:
    """Fill ``res`` (one chunk size) with the median of ``reps`` runs of every figure."""
    n, size = res.chunks, res.size
    src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    blocks = bench_blocks(src)  # one engine block tensor for every tier run of this size
    samples: dict[str, list[float]] = {}
    # Each rep measures every figure once, and each medium's raw limits right beside the tiers
    # judged against them, in turn first and second (raw, tiers on even reps; tiers, raw on odd):
    # this box's disk, memory and neighbours swing by 2x over a minute, and what ran just before
    # sets the state a run starts in (a page-cache write here runs at 0.25 or 1 GB/s by it).
    by_label = {t.label: t for t in tiers}
    media = _by_class(tiers, size, n, work)
    with frozen_heap():
        for rep in range(reps + 1):  # rep 0 warms up every figure (first-run costs of the process) and is not kept
            for raw_cfg, labels, suffix in media:

                def measure_raw(
                    raw_cfg: TierConfigBase = raw_cfg,
                    labels: list[str] = labels,
                    suffix: str = suffix,
                    keep: bool = rep > 0,
                ) -> None:
                    raw = get_tier_class(raw_cfg.kind).raw_limits(raw_cfg, src, dst, workdir=work)
                    if raw is None:
                        return
                    for name, value in raw.gbps.items():
                        if keep:
                            samples.setdefault(_suffixed(name, suffix), []).append(value)
                    for note in set(raw.notes) - notes:
                        notes.add(note)
                        log(f"note: {note}")
                    for label in labels:
                        for op in OPS:
                            for lay in res.layouts:
                                key = figure(label, lay, op, res.layouts[0])
                                if op in raw.baseline:
                                    res.candidates[key] = [_suffixed(c, suffix) for c in raw.limit(op)]
                                if op in raw.floor:
                                    res.floors[key] = _suffixed(raw.floor[op], suffix)

                if rep % 2 == 0:
                    measure_raw()
                for label in labels:
                    tcfg = by_label[label]
                    for lay in res.layouts:
                        # Its own directory, removed right after (as each raw run removes its file):
                        # dirty pages of one run are never written back on the next run's time.
                        own = tempfile.mkdtemp(dir=work)
                        try:
                            tier = make_tier(tcfg, size, n, own)
                            ts, tl = pipeline_store_load(tier, src, dst, ns, blocks, layout=lay, seed=rep)
                        finally:
                            shutil.rmtree(own, ignore_errors=True)
                        if rep:
                            for op, secs in (("store", ts), ("load", tl)):
                                samples.setdefault(figure(label, lay, op, res.layouts[0]), []).append(
                                    n * size / secs / 1e9
                                )
                if rep % 2 == 1:
                    measure_raw()

    for name, xs in samples.items():
        res.add(name, xs)
    res.settle_limits()


def _by_class(
    tiers: Sequence[TierConfigBase], size: int, n: int, work: str
) -> list[tuple[TierConfigBase, list[str], str]]:
    """Per raw baseline, in order: the bench config it is measured with, the labels of the tiers
    judged against it, and the suffix its figures carry. Tiers of one class share a baseline while
    their configs agree beyond name and directory; one that differs (an LMDB tier in durable mode
    beside a fast one: its raw put syncs too) gets its own, named ``<figure>[<its label>]``."""
    groups: dict[tuple[type[Tier], str], tuple[TierConfigBase, list[str], str]] = {}
    for tcfg in tiers:
        cls = get_tier_class(tcfg.kind)
        skip = {"name", tcfg.local_dir_field}
        settings = json.dumps({k: v for k, v in tcfg.model_dump(mode="json").items() if k not in skip}, sort_keys=True)
        if (cls, settings) not in groups:
            suffix = f"[{tcfg.label}]" if any(c is cls for c, _ in groups) else ""
            groups[(cls, settings)] = (bench_config(tcfg, size, n, work), [], suffix)
        groups[(cls, settings)][1].append(tcfg.label)
    return list(groups.values())


def _suffixed(figure: str, suffix: str) -> str:
    """``"lmdb_raw.store"`` with suffix ``"[lmdb-durable]"``: ``"lmdb_raw[lmdb-durable].store"``."""
    if not suffix:
        return figure
    base, _, op = figure.rpartition(".")
    return f"{base}{suffix}.{op}"


def ratios(res: BenchResult) -> dict[str, float]:
    """``"<label>.store|load"`` → tier GB/s / its baseline's GB/s, for tiers that declare one."""
    return _over(res, res.baselines)


def floor_ratios(res: BenchResult) -> dict[str, float]:
    """``"<label>.store|load"`` → tier GB/s / its medium's integrity floor, for tiers that have one."""
    return _over(res, res.floors)


def _over(res: BenchResult, against: dict[str, str]) -> dict[str, float]:
    return {k: round(res.gbps[k] / res.gbps[b], 2) for k, b in against.items() if k in res.gbps and b in res.gbps}


def result_row(res: BenchResult) -> dict[str, Any]:
    """One size's results as the JSON files hold them."""
    return {
        "size": res.size,
        "chunks": res.chunks,
        "gbps": res.gbps,
        "reps": res.reps,
        "ratios": ratios(res),
        "baselines": res.baselines,
        "floor_ratios": floor_ratios(res),
        "floors": res.floors,
        "layouts": res.layouts,
        "limit_candidates": res.candidates,
    }


def tier_figures(results: Sequence[BenchResult], *, layouts: bool = True) -> list[str]:
    """Every tier figure of ``results`` (:func:`figure`), tier by tier in config order, each
    layout's after the default's (``layouts`` False: the default layout's only)."""
    labels = list(dict.fromkeys(label for r in results for label in r.tiers))
    lays = list(dict.fromkeys(lay for r in results for lay in r.layouts)) or [LAYOUTS[0]]
    first = lays[0]
    return [figure(label, lay, op, first) for label in labels for lay in (lays if layouts else lays[:1]) for op in OPS]


def raw_figures(results: Sequence[BenchResult]) -> list[str]:
    """Every raw-limit figure of ``results`` (what is not a tier's ``<label>.store|load``), in the
    order the runs measured them: the media without tieredkv, baselines and floors among them."""
    tiers = set(tier_figures(results))
    return list(dict.fromkeys(k for r in results for k in r.gbps if k not in tiers))


def raw_rows(results: Sequence[BenchResult], figures: Sequence[str]) -> list[list[str]]:
    """Per raw figure, its name and its GB/s at each size of ``results`` (``""`` where absent);
    a figure some tier is judged against is marked ``(baseline)``, an integrity floor ``(floor)``."""
    base = {v for r in results for v in r.baselines.values()}
    floor = {v for r in results for v in r.floors.values()}
    rows = []
    for k in figures:
        mark = " (baseline)" if k in base else " (floor)" if k in floor else ""
        rows.append([k + mark, *(f"{r.gbps[k]:.2f}" if k in r.gbps else "" for r in results)])
    return rows


def tier_tables(results: Sequence[BenchResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per tier, a table to print: (title, column names, rows). A row per size, its label then,
    per layout, the store and load :func:`cell` (tier GB/s / limit GB/s (ratio)); the title names
    the figures its limit is the strongest of, and which one that was at each size."""
    lays = list(dict.fromkeys(lay for r in results for lay in r.layouts)) or [LAYOUTS[0]]
    first = lays[0]
    out = []
    for label in dict.fromkeys(label for r in results for label in r.tiers):
        cols = [f"{op} {lay}" for lay in lays for op in OPS]
        rows = [
            [size_label(r.size), *(cell(r, figure(label, lay, op, first)) for lay in lays for op in OPS)]
            for r in results
        ]
        cands = list(dict.fromkeys(c for r in results for op in OPS for c in r.candidates.get(f"{label}.{op}", [])))
        picked = [
            f"{size_label(r.size)} {op} {r.baselines[f'{label}.{op}']}"
            for r in results
            for op in OPS
            if f"{label}.{op}" in r.baselines
        ]
        title = f"{label}: tieredkv GB/s / limit GB/s (ratio)"
        if cands:
            title += f"; limit: the strongest of {', '.join(cands)} ({'; '.join(picked)})"
        out.append((title, cols, rows))
    return out


def judged_lines(results: Sequence[BenchResult]) -> list[str]:
    """Which raw figure each tier figure of the default layout is judged against (its limit,
    the same for every layout), and which is its integrity floor."""
    plain = set(tier_figures(results, layouts=False))
    base = {k: v for r in results for k, v in r.baselines.items() if k in plain}
    floor = {k: v for r in results for k, v in r.floors.items() if k in plain}
    return [
        "baselines: " + (", ".join(f"{k} vs {v}" for k, v in base.items()) or "none declared"),
        *(["floors: " + ", ".join(f"{k} vs {v}" for k, v in floor.items())] if floor else []),
    ]


def add_run_args(ap: Any, *, total_mib: int, per: str, reps: int, quick_sizes: Sequence[int], quick_mib: int) -> None:
    """The options every bench script takes for what it runs: ``--sizes`` (KiB), ``--total-mib``
    (bytes moved per size and ``per``), ``--reps`` and ``--quick`` (a smoke run of
    ``quick_sizes``, ``quick_mib`` MiB, one rep); :func:`run_plan` reads them back."""
    ap.add_argument(
        "--sizes", type=sizes_option, default=",".join(str(s // KiB) for s in SIZES), help="chunk sizes in KiB"
    )
    ap.add_argument("--total-mib", type=int, default=total_mib, help=f"bytes moved per size, {per}")
    ap.add_argument("--reps", type=int, default=reps, help="repetitions per size (the median is reported)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {', '.join(size_label(s) for s in quick_sizes)}, {quick_mib} MiB, 1 rep",
    )
    ap.set_defaults(quick_plan=(list(quick_sizes), quick_mib * MiB))


def run_plan(a: Any) -> tuple[list[int], int, int]:
    """(chunk sizes in bytes, bytes per size, reps) from the options of :func:`add_run_args`."""
    if a.quick:
        sizes, total = a.quick_plan
        return sizes, total, 1
    return list(a.sizes), a.total_mib * MiB, a.reps


def parse_sizes(text: str) -> list[int]:
    """Chunk sizes given in KiB, comma-separated (``64,256,1024``), in bytes; ValueError saying
    what was given and what is expected otherwise."""
    try:
        sizes = [int(x) * KiB for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"got {text!r}; expected chunk sizes in KiB, comma-separated, like 64,256,1024")
    return sizes


def sizes_option(text: str) -> list[int]:
    """argparse ``type`` of every bench script's ``--sizes``: :func:`parse_sizes`, a bad list
    argparse's usage error naming what was given and the form expected (a string default is
    parsed the same way)."""
    import argparse

    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_label(size: int) -> str:
    """A chunk size as the tables and the plot print it: ``64 KiB``, ``4 MiB``."""
    return f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"


def ratio_rows(results: Sequence[BenchResult], figures: Sequence[str], *, floors: bool = False) -> list[list[str]]:
    """Per size, its label and the :func:`cell` of each figure: against its baseline, or with
    ``floors`` against its medium's integrity floor (:attr:`BenchResult.floors`)."""
    return [[size_label(r.size), *(cell(r, k, r.floors if floors else None) for k in figures)] for r in results]


def floored_figures(results: Sequence[BenchResult], *, layouts: bool = True) -> list[str]:
    """The :func:`tier_figures` that have an integrity floor (:attr:`BenchResult.floors`)."""
    return [k for k in tier_figures(results, layouts=layouts) if any(k in r.floors for r in results)]


def cell(res: BenchResult, key: str, against: dict[str, str] | None = None) -> str:
    """``tier/raw (ratio x)`` for a figure with a baseline (or with an entry in ``against``, e.g.
    :attr:`BenchResult.floors`), ``tier`` without, ``""`` when absent."""
    if key not in res.gbps:
        return ""
    base = (res.baselines if against is None else against).get(key)
    if base is None or base not in res.gbps:
        return f"{res.gbps[key]:.2f}"
    return f"{res.gbps[key]:.2f}/{res.gbps[base]:.2f} ({res.gbps[key] / res.gbps[base]:.2f}x)"


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    redis_v = ""
    if shutil.which("redis-server"):
        redis_v = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
    import tieredkv

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tieredkv": tieredkv.__version__,
        "redis_server": redis_v,
        "loadavg": os.getloadavg(),
        "malloc": _SETUP["malloc"],
        "page_reporting": _page_reporting(),
    }


def _page_reporting() -> str:
    """The kernel's free page reporting setting (``page_reporting.*`` on its command line; see
    :func:`~tieredkv.backends._rawbench.warm_free_pages`), or "" when none is given."""
    try:
        with open("/proc/cmdline") as f:
            return " ".join(w for w in f.read().split() if w.startswith("page_reporting"))
    except OSError:
        return ""


def plot(results: list[BenchResult], path: str) -> None:
    """Bar chart per chunk size: each tier's store/load GB/s next to its raw limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        keys = [k for k in tier_figures(results, layouts=False) if k.endswith(f".{op}")]
        width = 0.8 / (2 * max(1, len(keys)))
        floor_label: str | None = "integrity floor"
        for j, key in enumerate(keys):
            xs = [i + (2 * j) * width for i in range(len(results))]
            ax.bar(xs, [r.gbps.get(key, 0) for r in results], width, label=f"tieredkv {key.rsplit('.', 1)[0]}")
            base = next((r.baselines[key] for r in results if key in r.baselines), None)
            if base is not None:
                raw = [r.gbps.get(base, 0) for r in results]
                ax.bar([x + width for x in xs], raw, width, alpha=0.45, label=f"raw {base.split('.')[0]}")
            floor = next((r.floors[key] for r in results if key in r.floors), None)
            if floor is not None:  # the raw work plus a checksum of every payload: a tick on the raw bar
                ticks = [(x + width, r.gbps[floor]) for x, r in zip(xs, results) if floor in r.gbps]
                ax.scatter(*zip(*ticks), marker="_", s=90, color="black", zorder=3, label=floor_label)
                floor_label = None  # one legend entry per axis
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
        ax.set_xticklabels([size_label(r.size) for r in results])
        ax.set_title(f"{op} GB/s (median of reps)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The bench seam: a tier's raw limit lives with its tier class, the bench knows no tier kind."""

from __future__ import annotations

import importlib.util
import itertools
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from tieredkv import bench
from tieredkv.backends import registry as reg
from tieredkv.backends.base import Tier
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.fs import FSTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import CPUTierConfig, FSTierConfig, LMDBTierConfig, RedisTierConfig, TierConfigBase
from tieredkv.testing.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
KiB = 1 << 10


@pytest.fixture
def dir_tier() -> Iterator[type[Tier]]:
    """The sample third-party tier (tests/plugin_sample), registered as ``dir``: no raw_limits."""
    spec = importlib.util.spec_from_file_location("tieredkv_dirtier", ROOT / "tests/plugin_sample/tieredkv_dirtier.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tieredkv_dirtier"] = module
    spec.loader.exec_module(module)
    saved = dict(reg._registry)
    reg.register_tier("dir", module.DirTier, clobber=True)
    try:
        yield module.DirTier
    finally:
        reg._registry.clear()
        reg._registry.update(saved)
        sys.modules.pop("tieredkv_dirtier", None)


def test_a_tier_class_without_the_hook_gets_figures_and_no_ratio(tmp_path: Path, dir_tier: type[Tier]) -> None:
    assert dir_tier.raw_limits.__func__ is Tier.raw_limits.__func__  # type: ignore[attr-defined]  # inherited default
    plain = dir_tier.config_model.model_validate({"kind": "dir", "name": "files", "root": str(tmp_path / "files")})  # type: ignore[union-attr]
    tiers: list[TierConfigBase] = [CPUTierConfig(name="slab"), plain, LMDBTierConfig(name="nvme")]
    (res,) = bench.run_tier_bench(tiers, [64 * KiB], 1 << 20, 1, workdir=str(tmp_path), log=lambda m: None)
    assert res.tiers == ["slab", "files", "nvme"] and res.chunks == 16
    for key in ("slab.store", "slab.load", "files.store", "files.load", "nvme.store", "nvme.load"):
        assert res.gbps[key] > 0, key
    # every layout of each tier with a hook is judged against the strongest of its medium's figures
    assert res.layouts == list(bench.LAYOUTS) == ["permuted", "fragmented", "consecutive"]
    judged = {bench.figure(t, lay, op) for t in ("slab", "nvme") for lay in bench.LAYOUTS for op in ("store", "load")}
    assert set(res.baselines) == set(res.candidates) == judged
    assert res.candidates["slab.store"] == res.candidates["slab@consecutive.load"] == ["gather", "copy", "copy_2t_nt"]
    assert res.candidates["nvme.store"] == ["file_pagecache.store", "lmdb_raw.store"]
    assert res.candidates["nvme@fragmented.load"] == ["file.load", "lmdb_raw.load"]
    for key, names in res.candidates.items():
        assert res.baselines[key] == max(names, key=res.gbps.__getitem__), key  # the strongest measured
    assert set(bench.ratios(res)) == set(res.baselines)  # files: figures, no ratio
    assert re.fullmatch(r"[\d.]+", bench.cell(res, "files.store"))
    assert re.fullmatch(r"[\d.]+/[\d.]+ \([\d.]+x\)", bench.cell(res, "nvme.load"))
    assert bench.tier_figures([res], layouts=False) == [
        f"{t}.{op}" for t in ("slab", "files", "nvme") for op in ("store", "load")
    ]
    assert bench.tier_figures([res]) == [
        bench.figure(t, lay, op) for t in ("slab", "files", "nvme") for lay in bench.LAYOUTS for op in ("store", "load")
    ]
    for lay in bench.LAYOUTS:
        assert res.gbps[bench.figure("files", lay, "load")] > 0
    # only the LMDB tier's records leave the process: only it has an integrity floor
    assert bench.floored_figures([res]) == [
        bench.figure("nvme", lay, op) for lay in bench.LAYOUTS for op in ("store", "load")
    ]
    assert re.fullmatch(r"[\d.]+/[\d.]+ \([\d.]+x\)", bench.cell(res, "nvme.store", res.floors))
    assert bench.cell(res, "slab.store", res.floors) == f"{res.gbps['slab.store']:.2f}"
    (row,) = bench.ratio_rows([res], ["nvme.store", "files.load"])  # one row per size, label first
    assert row == ["64 KiB", bench.cell(res, "nvme.store"), bench.cell(res, "files.load")]
    (row,) = bench.ratio_rows([res], ["nvme.store"], floors=True)
    assert row == ["64 KiB", bench.cell(res, "nvme.store", res.floors)]
    assert [bench.size_label(s) for s in (64 * KiB, 256 * KiB, 1 << 20, 4 << 20)] == [
        "64 KiB",
        "256 KiB",
        "1 MiB",
        "4 MiB",
    ]


def test_builtin_tiers_declare_their_raw_baseline_measured_on_the_same_bytes(tmp_path: Path) -> None:
    src = torch.randint(0, 256, (8, 64 * KiB), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    cpu = CPUTier.raw_limits(CPUTierConfig(), src, dst, workdir=str(tmp_path))
    assert cpu.limit("store") == cpu.limit("load") == ("gather", "copy", "copy_2t_nt")
    assert set(cpu.gbps) == {"gather", "copy", "copy_2t_nt"} and all(v > 0 for v in cpu.gbps.values())
    assert torch.equal(dst, src)  # the copies really happened (the last one whole)
    dst.zero_()
    disk = LMDBTier.raw_limits(LMDBTierConfig(sync_mode="durable"), src, dst, workdir=str(tmp_path))
    # durable: the strongest of a file write that syncs and a py-lmdb put that syncs
    assert disk.limit("store") == ("file_durable.store", "lmdb_raw.store")
    assert disk.limit("load") == ("file.load", "lmdb_raw.load")
    assert LMDBTier.raw_limits(LMDBTierConfig(), src, dst, workdir=str(tmp_path)).limit("store") == (
        "file_pagecache.store",
        "lmdb_raw.store",
    )
    assert disk.floor == {"store": "lmdb_checked.store", "load": "lmdb_checked.load"}
    assert set(disk.gbps) == {
        "file_pagecache.store",
        "file.load",
        "file_durable.store",
        "lmdb_raw.store",
        "lmdb_raw.load",
        "lmdb_checked.store",
        "lmdb_checked.load",
    }
    assert all(v > 0 for v in disk.gbps.values())
    assert cpu.floor == {}  # the slab's records never leave the process: no checksum, no floor
    assert torch.equal(dst, src) and list(tmp_path.iterdir()) == []  # read back; scratch removed


def test_the_fs_tier_is_judged_against_one_file_per_record_and_its_own_calls_without_aiofiles(tmp_path: Path) -> None:
    """The fs tier's raw limits: ``pwrite`` / ``pread`` of one file per record (the baseline; its
    durable mode against ``pwrite`` + ``fdatasync``), the same published by ``rename``, and the
    tier's own sequence of calls on one thread without aiofiles (the floor): what aiofiles costs is
    the tier against that floor. Every figure reads back the bytes written; scratch is removed."""
    src = torch.randint(0, 256, (8, 64 * KiB), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    raw = FSTier.raw_limits(FSTierConfig(), src, dst, workdir=str(tmp_path))
    # the strongest of one file per record and of one file for every record (the disk's best)
    assert raw.limit("store") == ("pwrite.store", "file_pagecache.store")
    assert raw.limit("load") == ("pread.load", "file.load")
    assert raw.floor == {"store": "tier_calls_no_aiofiles.store", "load": "tier_calls_no_aiofiles.load"}
    assert set(raw.gbps) == {
        "file_pagecache.store",
        "file.load",
        "pwrite.store",
        "pread.load",
        "pwrite_durable.store",
        "pwrite_rename.store",
        "tier_calls_no_aiofiles.store",
        "tier_calls_no_aiofiles.load",
    }
    assert all(v > 0 for v in raw.gbps.values())
    assert torch.equal(dst, src) and list(tmp_path.iterdir()) == []
    durable = FSTier.raw_limits(FSTierConfig(sync_mode="durable"), src, dst, workdir=str(tmp_path))
    assert durable.limit("store") == ("pwrite_durable.store", "file_durable.store")
    assert "file_durable.store" in durable.gbps and "file_pagecache.store" not in durable.gbps

    (res,) = bench.run_tier_bench(
        [FSTierConfig(name="shared")], [64 * KiB], 1 << 20, 1, workdir=str(tmp_path), log=lambda m: None,
        layouts=["permuted"],
    )  # fmt: skip
    store = max(("pwrite.store", "file_pagecache.store"), key=res.gbps.__getitem__)
    load = max(("pread.load", "file.load"), key=res.gbps.__getitem__)
    assert res.baselines == {"shared.store": store, "shared.load": load}
    assert res.floors == {"shared.store": "tier_calls_no_aiofiles.store", "shared.load": "tier_calls_no_aiofiles.load"}
    assert bench.raw_figures([res]) == sorted(raw.gbps, key=list(res.gbps).index)
    rows = {name: cells for name, *cells in bench.raw_rows([res], bench.raw_figures([res]))}
    assert rows[f"{store} (baseline)"] == [f"{res.gbps[store]:.2f}"]
    assert rows["tier_calls_no_aiofiles.load (floor)"] == [f"{res.gbps['tier_calls_no_aiofiles.load']:.2f}"]
    assert rows["pwrite_rename.store"] == [f"{res.gbps['pwrite_rename.store']:.2f}"]
    assert bench.judged_lines([res]) == [
        f"baselines: shared.store vs {store}, shared.load vs {load}",
        "floors: shared.store vs tier_calls_no_aiofiles.store, shared.load vs tier_calls_no_aiofiles.load",
    ]


def test_the_integrity_floor_checks_what_it_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked raw run does the verification it stands for: bytes that differ from what was
    written fail it (here the digest of the read-back copies is made to disagree)."""
    from tieredkv.backends import _rawbench

    src = torch.randint(0, 256, (4, 64 * KiB), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    _rawbench.raw_lmdb(src, dst, str(tmp_path), checked=True)
    assert torch.equal(dst, src)
    import xxhash

    calls = []
    real = xxhash.xxh3_64_intdigest

    def digest(buf: object) -> int:
        calls.append(1)
        return real(buf) + (len(calls) > 4)  # stores (4 calls) see the truth, loads do not

    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", digest)
    with pytest.raises(ValueError, match="read back other bytes"):
        _rawbench.raw_lmdb(src, dst, str(tmp_path), checked=True)
    assert len(calls) == 5


def test_redis_raw_limits_leave_the_server_as_found(redis_server: RedisServer) -> None:
    src = torch.randint(0, 256, (8, 64 * KiB), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        client.set("raw:0", b"a user's key that looks like the old raw keys")
        before = set(client.keys("*"))
        raw = RedisTier.raw_limits(
            RedisTierConfig(url=redis_server.url, cluster=True), src, dst, workdir="/nonexistent"
        )
        assert raw.limit("store") == ("redis_py.store", "redis_benchmark.store", "redis_benchmark_pipelined.store")
        assert raw.limit("load") == ("redis_py.load", "redis_benchmark.load", "redis_benchmark_pipelined.load")
        assert raw.floor == {"store": "redis_checked.store", "load": "redis_checked.load"}
        for figure in ("redis_py.store", "redis_py.load", "redis_checked.store", "redis_checked.load"):
            assert raw.gbps[figure] > 0, figure
        assert raw.notes == ("the raw Redis figures use one node of the cluster",)
        assert torch.equal(dst, src)
        assert (
            set(client.keys("*")) == before and client.get("raw:0") == b"a user's key that looks like the old raw keys"
        )
    finally:
        client.delete("raw:0")
        client.close()


def test_bench_copy_of_a_tier_comes_from_its_config_model(tmp_path: Path) -> None:
    users = LMDBTierConfig(name="nvme", path="/srv/kv", size_cap_bytes="1GiB", map_size_bytes="2GiB")
    copy = bench.bench_config(users, 1 << 20, 100, str(tmp_path))
    assert isinstance(copy, LMDBTierConfig) and copy.name == "nvme"
    assert Path(copy.path).parent == tmp_path and users.path == "/srv/kv"
    assert int(copy.size_cap_bytes) == 100 * (1 << 20) + 8 * (1 << 20) and copy.op_timeout_s == 120.0
    slab = bench.bench_config(CPUTierConfig(segment_bytes="1MiB", op_timeout_s=300), 4 << 20, 4, str(tmp_path))
    assert isinstance(slab, CPUTierConfig) and slab.prefault and slab.op_timeout_s == 300  # never lowered
    assert int(slab.segment_bytes) >= (4 << 20) + 64 and int(slab.capacity_bytes) >= 16 << 20
    shared = bench.bench_config(RedisTierConfig(url="redis://h:1/0"), 4096, 4, str(tmp_path))
    assert isinstance(shared, RedisTierConfig) and shared.socket_timeout_s == 30.0 and shared.url == "redis://h:1/0"


# ---- no kind switch outside backends/ -----------------------------------------------------------

#: Kinds that are not tier kinds: KV group kinds, pipeline job kinds, ``kind == ""`` (missing).
NOT_TIER_KINDS = {"full", "sliding_window", "mamba", "store", "load", "put", "get", ""}
_COMPARE = re.compile(r"""\bkind\s*(?:==|!=)\s*(['"])(?P<v>\w*)\1|(['"])(?P<w>\w*)\3\s*(?:==|!=)\s*[\w.]*\bkind\b""")
_MEMBER = re.compile(r"""(?<!for )\b[\w.]*kinds?\s+(?:not\s+)?in\s*[(\[{](?P<items>[^)\]}]*)""")
_TIER_LITERAL = re.compile(
    r"""(['"])(?:cpu|lmdb|fs|redis)\1\s+(?:not\s+)?in\b|(?<!\.type\s)(?:==|!=)\s*(['"])(?:cpu|lmdb|fs|redis)\2"""
    r"""|\bisinstance\([^)]*\b(?:CPUTier|LMDBTier|FSTier|RedisTier)\b"""
)


def kind_switches(text: str) -> list[str]:
    """Lines of ``text`` that branch on a tier kind (a literal tier kind, or a kind compared with
    anything but a group or job kind; a torch ``device.type`` is no tier kind)."""
    found = []
    for line in text.splitlines():
        code = line.split("#", 1)[0]
        bad = _TIER_LITERAL.search(code) is not None
        for m in _COMPARE.finditer(code):
            bad |= (m.group("v") if m.group("v") is not None else m.group("w")) not in NOT_TIER_KINDS
        for m in _MEMBER.finditer(code):
            bad |= not set(re.findall(r"""['"](\w*)['"]""", m.group("items"))) <= NOT_TIER_KINDS
        if bad:
            found.append(line.strip())
    return found


def test_the_kind_switch_finder_finds_what_the_bench_used_to_do() -> None:
    old = """
    if kind == "cpu":
    if "lmdb" in kinds:
    redis_cfg = next((t for t in cfg.tiers if t.kind == "redis"), None)
    if t.kind in ("lmdb", "dir"):
    if isinstance(tier, LMDBTier):
    stores = [r for r in eng.results if r.kind == "store"]
    if kind == "sliding_window":
    for kind in ("capacity", "in_use"):
    if kind not in ("full", "mamba"):
    if t.device.type != "cpu":
    if tcfg.kind == "fs":
    if isinstance(tier, FSTier):
    """
    assert len(kind_switches(old)) == 7


def test_no_tier_kind_switch_outside_backends() -> None:
    """Issue 14: what differs between tiers lives with the tier (capabilities, config model,
    raw_limits); code outside tieredkv/backends/ (and the tier benchmark) never branches on a
    kind. The peer benchmarks name other products' backends and are not scanned."""
    paths = [*(ROOT / "tieredkv").rglob("*.py"), ROOT / "benchmarks" / "bench_tiers.py"]
    found = {}
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("tieredkv/backends/") and (hits := kind_switches(path.read_text())):
            found[rel] = hits
    assert found == {}


def _peers_modules() -> tuple[Any, Any]:
    """``benchmarks/bench_peers.py`` and ``benchmarks/_lmcache_child.py`` (both run as scripts
    from benchmarks/, so they import each other from there)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _lmcache_child
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_peers, _lmcache_child


def test_peers_bench_tieredkv_side_runs_every_kind(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``./scripts/bench peers`` is not in the suite (it installs LMCache); its tieredkv side is, so
    a change to the bench seam cannot break it unnoticed (issue 14's did): every kind stores and
    loads verified bytes in every layout asked for (each round's block ids drawn from the round's
    seed, as LMCache's child draws them) and reports one figure per rep, the same way the LMCache
    side does; the medium's limit is the strongest of the tier class's candidates as measured."""
    bench_peers, child = _peers_modules()
    calls: list[tuple[str, int]] = []
    real = bench.pipeline_store_load

    def spy(*a: Any, layout: str, seed: int, **kw: Any) -> tuple[float, float]:
        calls.append((layout, seed))
        return real(*a, layout=layout, seed=seed, **kw)

    monkeypatch.setattr(bench, "pipeline_store_load", spy)
    layouts = ["permuted", "consecutive"]
    # each tier class's RawLimits.limit(op), in its order
    candidates = {
        "cpu": (["gather", "copy", "copy_2t_nt"], ["gather", "copy", "copy_2t_nt"]),
        "lmdb": (["file_pagecache.store", "lmdb_raw.store"], ["file.load", "lmdb_raw.load"]),
        "fs": (["pwrite.store", "file_pagecache.store"], ["pread.load", "file.load"]),
        "redis": (
            ["redis_py.store", "redis_benchmark.store", "redis_benchmark_pipelined.store"],
            ["redis_py.load", "redis_benchmark.load", "redis_benchmark_pipelined.load"],
        ),
    }
    for kind, (store, load) in candidates.items():
        calls.clear()
        out = bench_peers.run_tieredkv(kind, [64 * KiB], 2 << 20, 2, str(tmp_path), redis_server.url, layouts=layouts)
        fig = out[64 * KiB]
        assert calls == [(lay, r) for r in range(3) for lay in layouts]  # warm-up round 0, then 2 reps
        assert list(fig["layouts"]) == layouts
        for per in fig["layouts"].values():
            assert per["verified"] and per["chunks"] == 32 and per["bytes"] == 2 << 20
            assert len(per["store_gbps"]) == len(per["load_gbps"]) == 2 and min(per["load_gbps"]) > 0
        # the ids LMCache's child draws (tieredkv/layouts.py, loaded by path) are the ids this side used
        assert fig["block_ids"] == {lay: child.ids_digest(lay, 32 * 4, 3) for lay in layouts}
        # the medium's raw limits, measured beside every kept round; its limit the strongest candidate
        assert fig["raw_gbps"] and all(len(v) == 2 and min(v) > 0 for v in fig["raw_gbps"].values())
        assert fig["raw_limit_candidates"] == {"store": store, "load": load}
        for op in ("store", "load"):
            m = bench_peers.medium_figures(fig, op)
            assert m is not None and list(m["candidates"]) == fig["raw_limit_candidates"][op]
            measured = {k: v for k, v in m["candidates"].items() if v is not None}
            assert m["limit_gbps"] == max(measured.values()) == round(statistics.median(fig["raw_gbps"][m["limit"]]), 4)


def test_peers_bench_judges_the_medium_by_its_strongest_candidate_measured() -> None:
    """The medium's limit is the candidate (``RawLimits.limit``) with the highest median of the
    run, whichever is named first; a faster figure that is no candidate (the durable write, a
    floor) is not the limit, and a candidate not measured (no ``redis-benchmark``) is left out."""
    bench_peers, _ = _peers_modules()
    t = {
        "raw_gbps": {
            "file_pagecache.store": [1.0, 3.0, 2.0],  # median 2.0
            "lmdb_raw.store": [2.6, 2.4, 2.5],  # median 2.5: the limit
            "file_durable.store": [9.0, 9.0, 9.0],  # no candidate
            "file.load": [4.0, 4.0, 4.0],
        },
        "raw_limit_candidates": {
            "store": ["file_pagecache.store", "lmdb_raw.store"],
            "load": ["file.load", "lmdb_raw.load"],
        },
    }
    assert bench_peers.medium_figures(t, "store") == {
        "limit": "lmdb_raw.store",
        "limit_gbps": 2.5,
        "candidates": {"file_pagecache.store": 2.0, "lmdb_raw.store": 2.5},
    }
    assert bench_peers.medium_figures(t, "load") == {
        "limit": "file.load",
        "limit_gbps": 4.0,
        "candidates": {"file.load": 4.0, "lmdb_raw.load": None},
    }
    assert bench_peers.medium_figures({"raw_gbps": {"x.store": [1.0]}}, "store") is None  # no candidate declared


def test_peers_bench_lists_a_cell_as_above_the_medium_only_when_no_client_reached_its_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A cell below its target is listed as above the medium only when the target throughput is
    above the medium's limit in the run; the CPU pair's target is 1x."""
    bench_peers, _ = _peers_modules()

    def row(label: str, tkv: float, lmc: float, limit: float) -> dict[str, object]:
        medium = {"limit": "lmdb_raw.store", "limit_gbps": limit, "candidates": {"lmdb_raw.store": limit}}
        return {
            "label": label,
            "median_gbps": {"tieredkv.lmdb.store": tkv, "lmcache.disk.store": lmc},
            "ratios": {"lmdb/disk.store": round(tkv / lmc, 2)},
            "medium": {"lmdb.store": medium},
        }

    rows = [row("a", 1.0, 0.9, 1.5), row("b", 1.0, 0.9, 2.0), row("c", 2.0, 0.9, 1.0)]
    below, above = bench_peers.print_table(rows, [("lmdb", "disk")])
    assert [c.split()[0] for c in below] == ["a", "b"]  # c is at 2.22x
    assert [c.split()[0] for c in above] == ["a"]  # b: the medium did 2.0, above 2x LMCache (1.8)
    out = capsys.readouterr().out
    assert "a lmdb/disk.store 1.11x: 2x LMCache is 1.80 GB/s, the medium's limit 1.50 (lmdb_raw.store)" in out
    assert "lmdb.store limit, the strongest of (lmdb_raw.store): a lmdb_raw.store" in out
    assert bench_peers.TARGETS["cpu"] == 1.0


def test_peers_bench_pairs_each_layout_of_tieredkv_with_the_same_layout_of_lmcache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Medians and ratios per layout, the run's first without ``@`` (as ``tieredkv bench`` names
    figures); a cell is tieredkv's layout over LMCache's same layout; a side that used other
    block ids than the other is reported."""
    bench_peers, _ = _peers_modules()

    def figs(store: float, load: float) -> dict[str, object]:
        return {"store_gbps": [store], "load_gbps": [load]}

    ids = {"permuted": "p", "consecutive": "c"}
    tkv = {
        "cpu": {
            1 << 20: {
                "layouts": {"permuted": figs(4.0, 6.0), "consecutive": figs(8.0, 9.0)},
                "block_ids": ids,
                "raw_gbps": {"copy": [10.0]},
                "raw_limit_candidates": {"store": ["gather", "copy"], "load": ["gather", "copy"]},
            }
        }
    }
    lmc = {
        "cpu": {
            "results": [
                {
                    "size": 1 << 20,
                    "layouts": {"permuted": figs(2.0, 8.0), "consecutive": figs(4.0, 3.0)},
                    "block_ids": ids,
                }
            ]
        }
    }
    pairs = [("cpu", "cpu")]
    (row,) = bench_peers.build_results([1 << 20], pairs, tkv, lmc, ["permuted", "consecutive"])
    assert row["ratios"] == {
        "cpu/cpu.store": 2.0,
        "cpu/cpu@consecutive.store": 2.0,
        "cpu/cpu.load": 0.75,
        "cpu/cpu@consecutive.load": 3.0,
    }
    assert row["median_gbps"]["tieredkv.cpu@consecutive.load"] == 9.0
    assert row["median_gbps"]["lmcache.cpu.load"] == 8.0
    assert row["medium"]["cpu.store"]["limit"] == "copy"
    below, _ = bench_peers.print_table([row], pairs)
    assert below == ["1 MiB cpu/cpu.load 0.75x"]
    assert "1 MiB consecutive |" in capsys.readouterr().out
    assert bench_peers.block_id_mismatches(pairs, tkv, lmc) == []
    lmc["cpu"]["results"][0]["block_ids"] = {"permuted": "p", "consecutive": "other"}
    assert bench_peers.block_id_mismatches(pairs, tkv, lmc) == ["1 MiB cpu/cpu"]


@pytest.mark.parametrize("layout", ["permuted", "fragmented", "consecutive"])
def test_peers_bench_lmcache_child_draws_the_block_ids_tieredkv_moves(tmp_path: Path, layout: str) -> None:
    """LMCache's child never imports tieredkv: it loads ``tieredkv/layouts.py`` by its path, and
    its ``round_ids`` give the blocks ``pipeline_store_load`` really stores each chunk from and
    loads it into."""
    from tieredkv import layouts

    _, child = _peers_modules()
    assert child.layouts_module.__file__ == layouts.__file__
    assert child.LAYOUTS == bench.LAYOUTS and child.BLOCKS_PER_CHUNK == bench.BLOCKS_PER_CHUNK
    src = torch.randint(0, 256, (12, 16 * KiB), dtype=torch.uint8)
    blocks = bench.bench_blocks(src)
    tier = bench.make_tier(CPUTierConfig(name="slab"), 16 * KiB, 12, str(tmp_path))
    bench.pipeline_store_load(
        tier, src, torch.zeros_like(src), bench.Namespace(model="ids"), blocks, layout=layout, seed=7
    )
    store, load = child.round_ids(layout, 12 * 4, 7)
    quarters = src.reshape(12 * 4, -1)
    assert torch.equal(blocks[store], quarters) and torch.equal(blocks[load], quarters)


def test_an_lmdb_tier_in_durable_mode_is_judged_against_a_durable_raw_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable LMDB tier beside a fast one: each is judged against py-lmdb put/get with its own
    flags (the durable raw put syncs every transaction too), under figures that name which is which;
    ``--tiers lmdb:sync_mode=durable`` builds that config."""
    from tieredkv.backends import _rawbench

    syncs: list[tuple[bool, bool]] = []
    real = _rawbench.raw_lmdb

    def spy(*args: object, sync: bool = False, checked: bool = False) -> tuple[float, float]:
        syncs.append((sync, checked))
        return real(*args, sync=sync, checked=checked)  # type: ignore[arg-type]

    monkeypatch.setattr(_rawbench, "raw_lmdb", spy)
    spec = importlib.util.spec_from_file_location("bench_tiers", ROOT / "benchmarks" / "bench_tiers.py")
    assert spec is not None and spec.loader is not None
    bench_tiers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_tiers)
    durable = bench_tiers.tier_config("lmdb:sync_mode=durable", "redis://unused")
    assert (durable.name, durable.sync_mode) == ("lmdb-durable", "durable")

    (res,) = bench.run_tier_bench(
        [LMDBTierConfig(), durable], [64 * KiB], 1 << 20, 1, workdir=str(tmp_path), log=lambda m: None
    )
    # warm-up rep and one kept rep, each raw run once plain and once checked, with its tier's flags
    assert syncs == [(False, False), (False, True), (True, False), (True, True)] * 2
    assert res.candidates["lmdb.store"] == ["file_pagecache.store", "lmdb_raw.store"]
    assert res.candidates["lmdb-durable.store"] == ["file_durable[lmdb-durable].store", "lmdb_raw[lmdb-durable].store"]
    assert res.candidates["lmdb-durable.load"] == ["file[lmdb-durable].load", "lmdb_raw[lmdb-durable].load"]
    assert res.baselines["lmdb-durable@consecutive.load"] in res.candidates["lmdb-durable.load"]
    assert res.floors["lmdb-durable.store"] == "lmdb_checked[lmdb-durable].store"
    assert res.floors["lmdb.load"] == "lmdb_checked.load"
    for figure in ("lmdb_raw.store", "lmdb_raw[lmdb-durable].store", "lmdb.store", "lmdb-durable.store"):
        assert res.gbps[figure] > 0, figure
    assert set(bench.floor_ratios(res)) == set(res.floors) == set(res.baselines)


def test_each_medium_runs_beside_its_raw_baseline_first_and_second_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier runs right before or right after the raw run it is judged against, never with
    another medium between them, and the order flips every rep (what ran just before sets the
    state of this box's page cache, so neither side always gets the better one)."""
    from tieredkv.backends import _rawbench

    events: list[str] = []
    real_raw, real_run = _rawbench.raw_lmdb, bench.pipeline_store_load

    def raw(*args: object, sync: bool = False, checked: bool = False) -> tuple[float, float]:
        if not checked:  # the checked run follows its plain one inside the same raw_limits call
            events.append("raw-durable" if sync else "raw")
        return real_raw(*args, sync=sync, checked=checked)  # type: ignore[arg-type]

    def run(tier: Tier, *args: object, **kw: object) -> tuple[float, float]:
        events.append(tier.name)
        return real_run(tier, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(_rawbench, "raw_lmdb", raw)
    monkeypatch.setattr(bench, "pipeline_store_load", run)
    durable = LMDBTierConfig(name="lmdb-durable", sync_mode="durable")
    bench.run_tier_bench([LMDBTierConfig(), durable], [64 * KiB], 1 << 20, 2, workdir=str(tmp_path), log=lambda m: None)
    lmdb, durable_ = ("lmdb",) * 3, ("lmdb-durable",) * 3  # a run per layout, back to back
    assert events == [
        *("raw", *lmdb, "raw-durable", *durable_),  # warm-up rep: raw first
        *(*lmdb, "raw", *durable_, "raw-durable"),  # rep 1: tiers first
        *("raw", *lmdb, "raw-durable", *durable_),  # rep 2: raw first again
    ]


def test_frozen_heap_freezes_for_the_runs_and_always_thaws() -> None:
    """The bench freezes its set-up heap out of the collector's view (as vLLM's engine does) only
    while it measures: a caller of run_tier_bench never gets a frozen heap back, even on error."""
    import gc

    from tieredkv.bench import frozen_heap

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a failed run")
    assert gc.get_freeze_count() == 0


def test_every_timed_write_starts_on_freshly_backed_free_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This VM hands freed memory back to its host; a write that lands on such pages runs at a
    quarter speed. Every raw baseline that writes and every tier run warm the pages first, with
    room for what they write, so both sides of a ratio start alike; where neither writes a fresh
    page (the CPU tier and host memory), neither warms."""
    from tieredkv.backends import _rawbench

    warmed: list[int] = []

    def warm(src: torch.Tensor) -> None:
        warmed.append(src.numel())

    monkeypatch.setattr(_rawbench, "warm_free_pages", warm)
    monkeypatch.setattr(bench, "warm_free_pages", warm)
    bench.run_tier_bench([LMDBTierConfig()], [64 * KiB], 1 << 20, 1, workdir=str(tmp_path), log=lambda m: None)
    # Warm-up rep and one timed rep, each: raw file (page cache), raw file (durable), raw py-lmdb,
    # raw py-lmdb checked, the tier in each of the three layouts.
    assert warmed == [1 << 20] * 14
    # A tier that stores into its own memory, touched at open (the CPU slab), and its raw
    # baseline (host memory copies) warm nothing: neither writes a fresh page.
    warmed.clear()
    bench.run_tier_bench([CPUTierConfig()], [64 * KiB], 1 << 20, 1, workdir=str(tmp_path), log=lambda m: None)
    assert warmed == []
    cpu = bench.make_tier(CPUTierConfig(), 64 * KiB, 16, str(tmp_path))
    assert not bench.writes_fresh_pages(cpu)
    unfaulted = bench.build_tier(CPUTierConfig(prefault=False))  # its first stores fault pages in
    assert bench.writes_fresh_pages(unfaulted)
    assert all(
        bench.writes_fresh_pages(bench.make_tier(c, 64 * KiB, 16, str(tmp_path)))
        for c in (LMDBTierConfig(), FSTierConfig())
    )


def test_steady_malloc_is_reported_with_the_results() -> None:
    """``tieredkv bench`` keeps freed heap (py-lmdb's dirty pages) in its process; the results say
    so, and say how the kernel reports free pages. Run in a child: the setting is for good."""
    import json
    import subprocess

    code = (
        "import json; from tieredkv import bench; before = bench.machine_info()['malloc']; "
        "ok = bench.steady_malloc(); print(json.dumps([before, ok, bench.machine_info()['malloc']]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    before, ok, after = json.loads(out.stdout)
    assert before == "glibc defaults"
    assert ok is True  # Debian: glibc
    assert after == bench.STEADY_MALLOC
    cmdline = Path("/proc/cmdline").read_text().split()
    assert bench.machine_info()["page_reporting"] == " ".join(w for w in cmdline if w.startswith("page_reporting"))


def test_the_lmdb_stages_bench_measures_every_stage_on_records_that_read_back(tmp_path: Path) -> None:
    """benchmarks/bench_lmdb_stages.py (``./scripts/bench stages``): each stage writes, and its
    records are read back and compared (a stage that lost or mangled one raises)."""
    spec = importlib.util.spec_from_file_location("bench_lmdb_stages", ROOT / "benchmarks/bench_lmdb_stages.py")
    assert spec is not None and spec.loader is not None
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    lines: list[str] = []
    got = stages.measure([64 * KiB], 1 << 20, 1, log=lines.append)
    assert list(got) == [64 * KiB]
    assert set(got[64 * KiB]) == set(stages.STAGES)
    assert all(len(v) == 1 and v[0] > 0 for v in got[64 * KiB].values())
    assert len(lines) == 1 and lines[0].split()[:2] == ["64", "KiB"] and "(1.00x)" in lines[0]


#: A stand-in for ``_lmcache_child.py`` in the peers bench's turn-taking test: LMCache is not
#: installed in the suite, so this child keeps the real one's steps and turns (``_Turns`` and
#: ``_Watchdog`` are the real child's) and logs when each step runs instead of measuring.
_STANDIN_CHILD = """
import argparse, json, os, sys, time
sys.path.insert(0, BENCHMARKS)
from _lmcache_child import _Turns, _Watchdog, _write
ap = argparse.ArgumentParser()
for opt in ("--backend", "--sizes", "--total-bytes", "--reps", "--batch-bytes", "--threads", "--workdir",
            "--redis-url", "--out", "--round-timeout", "--turns", "--layouts", "--copy"):
    ap.add_argument(opt)
a = ap.parse_args()
out = {"backend": a.backend, "results": [], "notes": []}
dog, turns = _Watchdog(float(a.round_timeout), out, a.out), _Turns(a.turns)
steps = os.path.join(a.workdir, "steps.log")
crash = os.path.join(a.workdir, "crash-once")

def step(size, k):
    with open(steps, "a") as f:
        f.write(f"{os.getpid()} {size} {k} {time.monotonic_ns()}\\n")
    if k == 1 and size == 2048 and os.path.exists(crash):
        os.remove(crash)
        os._exit(3)  # a child that dies mid-size (as a hung resp:// retrieve's watchdog ends it)
    time.sleep(0.01)
    with open(steps, "a") as f:
        f.write(f"{os.getpid()} {size} {k} {time.monotonic_ns()}\\n")

for size in map(int, a.sizes.split(",")):
    turns.take(dog)
    step(size, 0)
    for k in range(1, int(a.reps) + 1):
        turns.give()
        turns.take(dog)
        step(size, k)
    figures = {"store_gbps": [1.0] * int(a.reps), "load_gbps": [1.0] * int(a.reps)}
    out["results"].append({"size": size, "layouts": dict.fromkeys(a.layouts.split(","), figures), "copy": a.copy})
    _write(a.out, out)
    turns.give()
"""


def test_peers_bench_runs_lmcache_a_step_at_a_time_between_its_own_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``./scripts/bench peers`` interleaves the two sides: the LMCache child runs one step per
    turn (set-up with its warm-up round, then each timed round) and none while the parent runs
    its own rounds. A child that dies mid-size is an incident, and a fresh one measures that
    size and the rest with the turns it still needs. Each child gets the layouts and the copy."""
    bench_peers, _ = _peers_modules()
    child = tmp_path / "standin_child.py"
    child.write_text(f"BENCHMARKS = {str(ROOT / 'benchmarks')!r}\n" + _STANDIN_CHILD)
    monkeypatch.setattr(bench_peers, "CHILD", child)
    (tmp_path / "crash-once").write_text("")
    sizes, reps = [1024, 2048, 4096], 2
    py = Path(sys.executable)
    side = bench_peers.LMCacheSide(
        py,
        "cpu",
        sizes,
        1 << 20,
        reps,
        str(tmp_path),
        "redis://unused",
        1,
        1 << 20,
        30,
        ["permuted", "consecutive"],
        "lmcache",
    )
    steps = tmp_path / "steps.log"
    mine = []
    for size in sizes:
        for _ in range(reps + 1):
            assert side.turn()
            a = time.monotonic_ns()
            time.sleep(0.02)  # "tieredkv's round"
            mine.append((a, time.monotonic_ns()))
        side.finish(size)
    res = side.close()
    assert [r["size"] for r in res["results"]] == sizes and "error" not in res
    assert all(list(r["layouts"]) == ["permuted", "consecutive"] and r["copy"] == "lmcache" for r in res["results"])
    assert res["attempts"] == 2 and [i["sizes"] for i in res["incidents"]] == [sizes]  # the first child's
    # every finished step of the child lies outside every round of the parent
    lines = [ln.split() for ln in steps.read_text().splitlines()]
    spans, open_at = [], {}
    for pid, size, k, t in lines:
        if (pid, size, k) in open_at:
            spans.append((open_at.pop((pid, size, k)), int(t)))
        else:
            open_at[(pid, size, k)] = int(t)
    assert [key[1:] for key in open_at] == [("2048", "1")]  # the step that died
    assert len(spans) == len(sizes) * (reps + 1) + 1  # size 2048's warm-up ran twice (a fresh engine)
    assert all(e <= a or s >= b for s, e in spans for a, b in mine)


def test_block_id_layouts_are_what_an_engine_pool_hands_out() -> None:
    """``permuted``: every block once in a random order (a churned pool's free queue);
    ``fragmented``: every block once, in runs of 1-8 consecutive ids in random order;
    ``consecutive``: in order. Same seed, same ids (every tier of a rep gets the same layout)."""

    n, first = 4096, 7
    for lay in bench.LAYOUTS:
        ids = bench.block_ids(lay, n, first, np.random.default_rng(3))
        assert sorted(ids) == list(range(first, first + n)), lay
        assert ids == bench.block_ids(lay, n, first, np.random.default_rng(3)), lay
    assert bench.block_ids("consecutive", n, first, np.random.default_rng(0)) == list(range(first, first + n))
    perm = bench.block_ids("permuted", n, first, np.random.default_rng(0))
    steps = np.diff(perm)
    assert (steps == 1).mean() < 0.01  # hardly a chunk of it consecutive
    frag = bench.block_ids("fragmented", n, first, np.random.default_rng(0))
    breaks = np.flatnonzero(np.diff(frag) != 1)
    runs = np.diff(np.concatenate([[-1], breaks, [n - 1]]))
    assert runs.max() <= 8 * 2 and 2.5 < runs.mean() < 6  # short runs (two may happen to abut)
    with pytest.raises(ValueError, match="layout 'shuffled'"):
        bench.block_ids("shuffled", 4, 1, np.random.default_rng(0))


@pytest.mark.parametrize("layout", ["permuted", "fragmented", "consecutive"])
def test_the_bench_moves_chunks_from_and_into_the_layouts_blocks(tmp_path: Path, layout: str) -> None:
    """The bench's chunks live in the KV group's blocks at the layout's ids (4 blocks a chunk), go
    through a one-tier store and come back into other blocks of the same layout, byte-exact (a
    slip of one block's position would fail the comparison), for the slab's path and a staged one."""
    src = torch.randint(0, 256, (48, 16 * KiB), dtype=torch.uint8)
    blocks = bench.bench_blocks(src)
    assert tuple(blocks.shape) == (1 + 2 * 48 * 4, 4 * KiB)
    ns = bench.Namespace(model="layouts")
    for tcfg in (CPUTierConfig(name="slab"), LMDBTierConfig(name="nvme")):
        tier = bench.make_tier(tcfg, 16 * KiB, 48, str(tmp_path))
        ts, tl = bench.pipeline_store_load(tier, src, torch.zeros_like(src), ns, blocks, layout=layout, seed=5)
        assert ts > 0 and tl > 0 and tier.counters["hits"] == 48
    assert int(blocks[0].sum()) == 0  # the null block is never written


@pytest.mark.parametrize("bad", ["256KiB", "", "64,,256", "0", "-64", "64,x"])
def test_a_bench_scripts_sizes_option_names_what_it_got_and_what_it_wants(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sizes`` of the bench scripts (``add_run_args``): a bad list is argparse's usage error
    naming the option, the value and the form expected, never a traceback from ``run_plan``."""
    import argparse

    ap = argparse.ArgumentParser(prog="bench")
    bench.add_run_args(ap, total_mib=8, per="rep", reps=1, quick_sizes=[64 * 1024], quick_mib=8)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--sizes", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and repr(bad) in err and "like 64,256,1024" in err
    a = ap.parse_args(["--sizes", "64,1024"])
    assert bench.run_plan(a)[0] == [64 * 1024, 1024 * 1024]
    assert bench.run_plan(ap.parse_args([]))[0] == bench.SIZES


@pytest.mark.parametrize("script", ["bench_sealed", "bench_fs_hops", "bench_native"])
def test_bench_scripts_with_their_own_options_parse_sizes_the_same_way(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scripts that declare ``--sizes`` themselves take it through ``bench.sizes_option``:
    the same usage error for a bad list (before anything runs), and no parser of their own."""
    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as e:
        mod.main(["--sizes", "64,x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--sizes" in err and "'64,x'" in err and "like 64,256,1024" in err
    text = (ROOT / "benchmarks" / f"{script}.py").read_text()
    assert "type=sizes_option" in text and "sizes.split" not in text


def test_bench_native_runs_every_function_it_names_on_both_paths() -> None:
    """``benchmarks/bench_native.py`` (C against Python per function) runs each of its ops, the
    helper switched on and off, and each checked op's bytes come out right (``Case.check``): a
    function the helper or staging no longer has fails here, not at someone's next bench run."""
    from tieredkv import format as fmt
    from tieredkv import staging

    if fmt._fastrec is None:
        pytest.skip("needs the C helper (tieredkv._fastrec)")
    spec = importlib.util.spec_from_file_location("bench_native", ROOT / "benchmarks" / "bench_native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    helper, mover = fmt._fastrec, staging._move_pieces
    rows = mod.measure([64 * 1024], 1 << 20, 1, list(mod.OPS))
    assert [r["op"] for r in rows] == list(mod.OPS)
    assert all(len(r["reps"]["native"]) == len(r["reps"]["python"]) == 1 for r in rows)
    assert (fmt._fastrec, staging._move_pieces) == (helper, mover)  # switched back on


def test_pipeline_store_load_marks_each_timed_phase_around_its_clock(tmp_path: Path) -> None:
    """``phase`` (a profiler's marks) is called right before each phase's clock starts and right
    after it stops: store then load, each started then ended, and the time between the marks
    holds the phase's own time."""
    src = torch.randint(0, 256, (16, 64 * KiB), dtype=torch.uint8)
    dst = torch.empty_like(src)
    tier = bench.make_tier(CPUTierConfig(capacity_bytes=64 << 20), 64 * KiB, 16, str(tmp_path))
    marks: list[tuple[str, bool, float]] = []
    ts, tl = bench.pipeline_store_load(
        tier,
        src,
        dst,
        bench.Namespace(model="m"),
        phase=lambda op, started: marks.append((op, started, time.perf_counter())),
    )
    assert [(op, s) for op, s, _ in marks] == [("store", True), ("store", False), ("load", True), ("load", False)]
    assert marks[1][2] - marks[0][2] >= ts and marks[3][2] - marks[2][2] >= tl
    assert marks[2][2] >= marks[1][2]


def test_pipeline_store_load_on_a_full_tier_evicts_on_every_store_and_leaves_it_empty(tmp_path: Path) -> None:
    """``full``: the tier is filled first (untimed, no phase marks), so the timed store evicts
    the fill as it goes; the loads still verify every byte, and every key of both is deleted."""
    n, size = 256, 64 * KiB
    src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    tier = bench.make_tier(CPUTierConfig(segment_bytes=1 << 20), size, n, str(tmp_path))
    holds = tier.config.capacity_bytes // size  # room for the chunks and 8 MiB more, in whole segments
    assert n < holds < 2 * n
    marks: list[tuple[str, bool]] = []
    bench.pipeline_store_load(
        tier, src, torch.empty_like(src), bench.Namespace(model="m"), full=True, phase=lambda o, s: marks.append((o, s))
    )
    assert marks == [("store", True), ("store", False), ("load", True), ("load", False)]
    assert tier.counters["evictions"] == 2 * n - holds  # the fill's oldest, as the timed store went
    assert tier.counters["puts"] == 2 * n and tier.counters["hits"] == n
    assert tier.counters["deletes"] == holds


def _budget_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_cpu_budget", ROOT / "benchmarks/bench_cpu_budget.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cpu_budget_bench_splits_the_tiers_cpu_and_checks_the_copies_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/bench_cpu_budget.py (``./scripts/bench budget``): every figure of a small run is
    measured (the copy threads, the loop and the caller each used CPU; the budget follows from
    the limit), and copies that did not move the bytes fail the run instead of timing it."""
    mod = _budget_module()
    lines: list[str] = []
    got = mod.measure([64 * KiB], 4 << 20, 1, log=lines.append)
    assert len(lines) == 4 and sum("full tier" in x for x in lines) == 2
    for which, op in itertools.product(("tier", "full"), ("store", "load")):
        s = got[64 * KiB][f"summary_{which}"]
        assert set(s) == {"store", "load"}
        f = s[op]
        limits = got[64 * KiB]["reps"][0]["limit"]  # every candidate the CPU tier names, measured
        assert set(limits) == {"gather", "copy", "copy_2t_nt"}
        assert f["limit"] == max(limits, key=limits.__getitem__) and f["limit_gbps"] == limits[f["limit"]]
        assert f["tier_gbps"] > 0 and f["copies_gbps"] > 0 and f["copies_cpu_s"] > 0
        assert f["tier_cpu_s"]["loop"] > 0 and f["tier_cpu_s"]["caller"] > 0
        assert f["busy_vcpus"] > 0 and f["goal"] == 0.7 and f["chunks"] == 64
        budget = 2 * 64 * 64 * KiB / (0.7 * f["limit_gbps"] * 1e9)
        assert f["goal_cpu_budget_s"] == pytest.approx(budget)
        assert f["left_per_chunk_us"] == pytest.approx((budget - f["copies_cpu_s"]) / 64 * 1e6)
    assert mod.goal(64 * KiB) == 0.7 and mod.goal(256 * KiB) == 0.7 and mod.goal(4 << 20) == 0.9
    # the bench's own copies moving nothing on loads (the tier's pipeline untouched): the check
    # at the end of a size raises

    class Idle(mod.Copier):  # type: ignore[name-defined,misc]
        def scatter_blocks(self, *a: Any, **k: Any) -> None:
            return None

    monkeypatch.setattr(mod, "Copier", Idle)
    with pytest.raises(RuntimeError, match="lost bytes"):
        mod.measure([64 * KiB], 1 << 20, 1, log=lines.append)

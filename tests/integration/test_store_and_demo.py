"""TieredStore (the standalone API) and the demo engine loop, with real tiers."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

import tieredkv
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import load_config
from tieredkv.demo import DEFAULT_PREFILL_TOKENS_PER_S, SAVED_S_FORMULA, DemoOptions, _Engine, busy_seconds, run_demo
from tieredkv.keys import Namespace
from tieredkv.pipeline import JobResult, KeyState
from tieredkv.testing.servers import RedisServer


def cfg(tmp_path: Path, **extra: object) -> dict:
    return {
        "namespace": {"model": "store-test"},
        "tiers": [
            {"kind": "cpu", "capacity_bytes": "16MiB", "segment_bytes": "1MiB"},
            {"kind": "lmdb", "path": str(tmp_path / "kv"), "map_size_bytes": "64MiB", "size_cap_bytes": "32MiB"},
        ],
        **extra,
    }


def test_open_store_round_trip_of_whole_chunks(tmp_path: Path) -> None:
    k = torch.randint(0, 256, (32, 16, 64), dtype=torch.uint8)
    v = torch.randn(32, 16, 32).to(torch.float16)
    with tieredkv.open_store(cfg(tmp_path)) as store:
        store.register_group(0, [k, v], blocks_per_chunk=2)
        keys = [store.key(bytes([i]) * 32, 0) for i in range(3)]
        job = store.store(0, [(keys[i], (2 * i + 1, 2 * i + 2)) for i in range(3)])
        assert job is not None
        res = store.wait([job])[job]
        assert res.ok and res.nbytes == 3 * 2 * (16 * 64 + 16 * 32 * 2)
        assert store.lookup(keys + [store.key(b"\xff" * 32, 0)]) == [(KeyState.HIT, "cpu")] * 3 + [
            (KeyState.MISS, None)
        ]
        k0, v0 = k.clone(), v.clone()
        k[20:26].zero_()
        v[20:26].zero_()
        job = store.load(0, [(keys[1], (20, 21)), (keys[2], (22, 23))])
        assert store.wait([job])[job].ok
        assert torch.equal(k[20:24], k0[3:7]) and torch.equal(v[20:24], v0[3:7])
        assert not k[24:26].any()
        assert store.poll() == []


@pytest.mark.parametrize("tiers", [["cpu"], ["lmdb"]])
def test_block_0_is_a_block_unless_the_group_declares_it_null(tmp_path: Path, tiers: list[str]) -> None:
    """A library user's block 0 is a block like any: stored from and loaded into. Only a group
    registered with ``null_block`` (vLLM's 0) skips that id's positions in a load's chunk."""
    src = torch.randint(0, 256, (16, 4096), dtype=torch.uint8)
    c = cfg(tmp_path)
    c["tiers"] = [t for t in c["tiers"] if t["kind"] in tiers]
    with tieredkv.open_store(c) as store:
        store.register_group(0, [src], blocks_per_chunk=4)
        dst, nulled = torch.zeros_like(src), torch.zeros_like(src)
        store.register_group(1, [dst], blocks_per_chunk=4)
        store.register_group(2, [nulled], blocks_per_chunk=4, null_block=0)
        k0, k1, k2 = (store.key(bytes([i + 1]) * 32, g) for i, g in enumerate((0, 1, 2)))
        job = store.store(0, [(k0, (0, 1, 2, 3))])  # block 0 stored like any block
        assert job is not None and store.wait([job])[job].ok
        (stored,) = store.run(store.tiers[0].get_many([k0]))
        assert stored == src[0:4].numpy().tobytes()
        for g, k, t in ((1, k1, dst), (2, k2, nulled)):
            t[8:12] = src[8:12]
            job = store.store(g, [(k, (8, 9, 10, 11))])
            assert job is not None and store.wait([job])[job].ok
        job = store.load(1, [(k1, (0, 1, 2, 3))])  # into block 0: filled
        assert job is not None and store.wait([job])[job].ok
        assert torch.equal(dst[0:4], src[8:12])
        job = store.load(2, [(k2, (0, 5, 6, 7))])  # 0 is this group's null block: not copied
        assert job is not None and store.wait([job])[job].ok
        assert not nulled[0].any() and torch.equal(nulled[5:8], src[9:12])
        for bad in (-1, 16, True, "0"):
            with pytest.raises(ValueError, match="null_block"):
                store.register_group(3, [torch.zeros_like(src)], blocks_per_chunk=4, null_block=bad)


@pytest.mark.parametrize("tiers", [["lmdb"], ["cpu", "lmdb"]])
def test_a_job_larger_than_the_staging_pool_is_stored_in_parts_and_loads_back(tmp_path: Path, tiers: list[str]) -> None:
    # 2 KiB per block (two tensors), 2 blocks per chunk: 4 KiB chunks; staging holds 3 of them.
    k = torch.randint(0, 256, (65, 16, 64), dtype=torch.uint8)
    v = torch.randn(65, 16, 32).to(torch.float16)
    conf = cfg(tmp_path, pipeline={"staging_bytes": "12KiB"})
    conf["tiers"] = [t for t in conf["tiers"] if t["kind"] in tiers]
    with tieredkv.open_store(conf) as store:
        store.register_group(0, [k, v], blocks_per_chunk=2)
        keys = [store.key(bytes([i]) * 32, 0) for i in range(16)]
        job = store.store(0, [(keys[i], (1 + 2 * i, 2 + 2 * i)) for i in range(16)])  # 64 KiB
        assert job is not None, "a job larger than the staging pool must not be refused for good"
        res = store.wait([job])[job]
        assert res.ok and res.done == tuple(keys) and res.nbytes == 16 * 4096
        assert store.lookup(keys) == [(KeyState.HIT, tiers[0])] * 16
        k0, v0 = k.clone(), v.clone()
        k[33:].zero_()
        v[33:].zero_()
        job = store.load(0, [(keys[i], (33 + 2 * i, 34 + 2 * i)) for i in range(16)])
        assert job is not None
        assert store.wait([job])[job].ok
        assert torch.equal(k[33:65], k0[1:33]) and torch.equal(v[33:65], v0[1:33])  # byte-exact
        assert torch.equal(k[:33], k0[:33]) and torch.equal(v[:33], v0[:33])

        assert store.stats().counters["store_in_parts"] == 1
        assert store.stats().counters["load_in_parts"] == 1
        assert store.stats().staging.in_use == 0  # (a busy pool: test_pipeline.py)
        assert store.staging_capacity == 12 << 10

        # Only a single chunk larger than the whole pool can never be staged.
        store.register_group(1, [k, v], blocks_per_chunk=8)  # 16 KiB chunks
        assert store.store(1, [(store.key(b"x" * 32, 1), tuple(range(1, 9)))]) is None


def test_namespace_from_config_isolates_models(tmp_path: Path) -> None:
    a = tieredkv.open_store(cfg(tmp_path))
    t = torch.ones(4, 8, dtype=torch.uint8)
    a.register_group(0, [t])
    ka = a.key(b"h" * 32, 0)
    a.wait([a.store(0, [(ka, (1,))])])
    a.close()
    b = tieredkv.open_store(cfg(tmp_path, namespace={"model": "another-model"}))
    b.register_group(0, [t])
    kb = b.key(b"h" * 32, 0)
    assert kb != ka and b.lookup([kb]) == [(KeyState.MISS, None)]
    b.close()


def test_demo_with_a_mamba_group_verifies_every_block(tmp_path: Path) -> None:
    c = load_config(cfg(tmp_path), env={})
    s = run_demo(c, DemoOptions(conversations=3, turns=3, mamba=True, system_tokens=(256, 512)))
    assert s["requests"] == 9 and s["mismatches"] == 0 and s["verified_blocks"] > 0
    kinds = [g["kind"] for g in s["groups"]]
    assert kinds == ["full", "sliding_window", "mamba"]
    assert all(g["stored_chunks"] > 0 for g in s["groups"])
    assert s["store"]["failed"] == 0 and s["load"]["failed"] == 0


def test_demo_with_bounded_store_plans_drains_finished_requests(tmp_path: Path) -> None:
    # Two chunks per plan: final plans are bounded, so a finished request keeps being planned
    # (its blocks held) until every chunk was offered; the run ends only if every one drains.
    class Engine(_Engine):
        rest_plans = 0

        def store_rest(self, r: Any) -> None:
            Engine.rest_plans += r.rid in self.sched
            super().store_rest(r)

    c = load_config(cfg(tmp_path), env={})
    # seed 2: a trace whose second turns hit (with plans this small, a sliding-window chunk that
    # leaves the window before it is offered is lost, and with it the hybrid hit of some traces)
    o = DemoOptions(conversations=3, turns=2, system_tokens=(256, 512), max_chunks_per_plan=2, seed=2)
    s = run_demo(c, o, engine_cls=Engine)
    assert s["requests"] == 6 and s["mismatches"] == 0 and s["verified_blocks"] > 0
    assert s["store"]["failed"] == 0 and s["load"]["failed"] == 0
    assert s["groups"][0]["tokens_from_cache"] > 0
    assert Engine.rest_plans > 0


def test_busy_seconds_is_the_union_of_job_intervals() -> None:
    def job(start: float, end: float) -> JobResult:
        return JobResult(0, "load", True, 1, end - start, finished_at=end)

    assert busy_seconds([]) == 0.0
    # [1, 3] and [2, 4] overlap, [5, 6] stands alone, [5.2, 5.5] lies inside it; [4, 5] is idle.
    jobs = [job(5.0, 6.0), job(2.0, 4.0), job(5.2, 5.5), job(1.0, 3.0)]
    assert busy_seconds(jobs) == pytest.approx(4.0)
    assert busy_seconds([job(1.0, 2.0), job(2.0, 3.0)]) == pytest.approx(2.0)  # touching: no gap, no overlap


def _check_demo_figures(s: dict[str, Any], rate: float) -> None:
    """The invariants of the demo's user-facing figures (no timing assumptions beyond them)."""
    assert s["mismatches"] == 0 and s["verified_blocks"] > 0
    for kind in ("store", "load"):
        j = s[kind]
        assert "gbps" not in j, "the wall-time GB/s is gone: it divided bytes by mostly idle time"
        assert j["jobs"] > 0 and j["failed"] == 0 and j["bytes"] > 0
        assert 0 < j["busy_s"] <= s["wall_s"], (kind, j["busy_s"], s["wall_s"])
        # busy GB/s is at least bytes over wall time (1e-3: the JSON rounds to 3 decimals)
        assert j["busy_gbps"] >= j["bytes"] / s["wall_s"] / 1e9 - 1e-3
        assert j["busy_gbps"] == pytest.approx(j["bytes"] / j["busy_s"] / 1e9, abs=1e-3)
        assert 0 < j["p50_ms"] <= j["p99_ms"]
    # Tokens: the full-attention group loads every hit token; the sliding window only its window.
    full, swa = s["groups"]
    assert s["tokens_from_cache"] > 0 and s["tokens_from_cache"] == full["tokens_from_cache"]
    assert 0 < swa["tokens_from_cache"] < s["tokens_from_cache"]
    assert s["tokens_from_cache"] + s["tokens_recomputed"] == s["prompt_tokens"]
    assert [g["tokens_recomputed"] for g in s["groups"]] == [s["tokens_recomputed"]] * 2
    # Time saved: recomputing the tokens from cache at the stated rate, minus the time loading them.
    assert s["prefill_tokens_per_s"] == rate and s["saved_s_formula"] == SAVED_S_FORMULA
    assert s["recompute_s"] == pytest.approx(s["tokens_from_cache"] / rate, abs=1e-4)
    assert s["saved_s"] == pytest.approx(max(0.0, s["tokens_from_cache"] / rate - s["load"]["busy_s"]), abs=2e-4)


def test_demo_reports_busy_throughput_tokens_from_cache_and_time_saved(tmp_path: Path) -> None:
    o = DemoOptions(conversations=3, turns=2, system_tokens=(256, 512))
    assert o.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S == 10_000
    default = run_demo(load_config(cfg(tmp_path / "a"), env={}), o)
    _check_demo_figures(default, DEFAULT_PREFILL_TOKENS_PER_S)
    # A tenth of the rate: each token from cache is worth ten times the prefill time.
    o.prefill_tokens_per_s = 1_000
    slow = run_demo(load_config(cfg(tmp_path / "b"), env={}), o)
    _check_demo_figures(slow, 1_000)
    assert slow["saved_s"] > 0  # thousands of tokens at 1k tokens/s: seconds, against ms of loading
    per_token = [s["recompute_s"] / s["tokens_from_cache"] for s in (default, slow)]
    assert per_token == [pytest.approx(1e-4, rel=1e-3), pytest.approx(1e-3, rel=1e-3)]


def test_demo_reports_what_admission_saves_in_bytes_written(tmp_path: Path) -> None:
    """``admit_after: 2``: chunks seen once are never written. The demo replays the same trace
    (deterministic per seed) storing every chunk, in scratch tiers, and reports both; every loaded
    block is still what was stored. Without admission nothing is declined and nothing replayed."""
    o = DemoOptions(conversations=4, turns=3, system_tokens=(256, 512))
    plain = run_demo(load_config(cfg(tmp_path / "a"), env={}), o)
    adm = plain["admission"]
    assert adm["admit_after"] == {0: 1, 1: 1} and adm["baseline"] is None and adm["bytes_saved"] is None
    assert adm["bytes_not_written"] == adm["declined_bytes"] == adm["chunks_never_written"] == 0
    o.admit_after = 2
    s = run_demo(load_config(cfg(tmp_path / "b"), env={}), o)
    adm = s["admission"]
    assert s["mismatches"] == 0 and s["prompt_tokens"] == plain["prompt_tokens"]  # the same trace
    assert adm["admit_after"] == {0: 2, 1: 2}
    assert adm["chunks_never_written"] > 0 and adm["bytes_not_written"] > 0
    assert adm["declined_bytes"] >= adm["bytes_not_written"]  # a chunk declined, then written later, counts there only
    base = adm["baseline"]
    assert base["bytes_written"] == pytest.approx(plain["store"]["bytes"], rel=0.1)
    assert (
        adm["bytes_written"] < base["bytes_written"]
        and adm["bytes_saved"] == base["bytes_written"] - adm["bytes_written"]
    )
    assert s["tokens_from_cache"] < base["tokens_from_cache"]  # what it costs: chunks seen once are not there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # the replay's scratch tiers are gone


def test_demo_command_prints_the_summary_block_first_at_the_stated_rate(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    argv = [sys.executable, "-m", "tieredkv.cli", "demo", "--conversations", "3", "--turns", "2"]
    r = subprocess.run(
        [*argv, "--prefill-tokens-per-s", "2000", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("tieredkv demo — 6 requests")
    labels = [line[:14].strip() for line in lines[1:6]]
    assert labels == ["from cache", "time saved", "loads", "stores", "integrity"], lines[:7]
    cached = re.search(r"from cache +([\d,]+) of ([\d,]+) prompt tokens", lines[1])
    saved = re.search(
        r"time saved +([\d.]+) s = ([\d.]+) s to prefill them at 2,000 tokens/s - ([\d.]+) s loading", lines[2]
    )
    assert cached and saved, lines[1:3]
    tokens = int(cached.group(1).replace(",", ""))
    assert tokens > 0 and float(saved.group(2)) == pytest.approx(tokens / 2000, abs=1e-3)
    assert float(saved.group(1)) == pytest.approx(float(saved.group(2)) - float(saved.group(3)), abs=1e-9)
    assert "GB/s over busy time" in lines[3] and "GB/s over busy time" in lines[4]
    assert "loaded blocks equal what was stored" in lines[5]


def test_metrics_endpoint_reports_tiers_groups_and_breakers(tmp_path: Path) -> None:
    with tieredkv.open_store(cfg(tmp_path, metrics={"port": 0})) as store:
        assert store.metrics_server is not None
        t = torch.randint(0, 256, (8, 4096), dtype=torch.uint8)
        store.register_group(3, [t], blocks_per_chunk=2)
        key = store.key(b"m" * 32, 3)
        store.wait([store.store(3, [(key, (1, 2))])])
        store.wait([store.load(3, [(key, (5, 6))])])
        text = ""
        deadline = time.monotonic() + 10
        while "tieredkv_tier_used_bytes" not in text and time.monotonic() < deadline:
            text = urllib.request.urlopen(store.metrics_server.url, timeout=5).read().decode()
        assert 'tieredkv_tier_stored_bytes_total{tier="cpu"} 8192.0' in text
        assert 'tieredkv_tier_used_bytes{tier="lmdb"}' in text
        assert 'tieredkv_breaker_open{tier="lmdb"} 0.0' in text
        assert 'group="3"' in text
    assert store.metrics_server is None


# ---- bench: through the store, and the raw baselines leave the user's data alone -------------


def test_bench_moves_bytes_through_the_store_and_deletes_what_it_wrote(tmp_path: Path) -> None:
    from tieredkv.bench import make_tier, pipeline_store_load
    from tieredkv.config import LMDBTierConfig

    src = torch.randint(0, 256, (24, 4096), dtype=torch.uint8)
    tier = make_tier(LMDBTierConfig(path=str(tmp_path / "users")), 4096, 24, str(tmp_path))
    assert Path(tier.config.path).parent == tmp_path and tier.config.path != str(tmp_path / "users")
    ns = Namespace(model="bench-test")
    ts, tl = pipeline_store_load(tier, src, torch.zeros_like(src), ns)  # raises if bytes differ
    assert ts > 0 and tl > 0
    assert tier.counters["hits"] == 24 and tier.counters["put_bytes"] == 24 * 4096
    assert tier.counters["deletes"] == 24  # every key it wrote: the tier is empty again
    assert asyncio.run(_count_records(LMDBTier(tier.config))) == 0


async def _count_records(tier: Any) -> int:
    async with tier:
        return sum([1 async for _ in tier.scan()])


def test_redis_benchmark_baseline_deletes_every_key_it_creates(redis_server: RedisServer) -> None:
    from tieredkv.bench import REDIS_BENCHMARK_KEYS, redis_benchmark

    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        client.set("user:key", b"keep me")
        before = set(client.keys("*"))
        got = redis_benchmark(redis_server.port, 4096, 200)
        assert got is not None and got[0] > 0 and got[1] > 0
        assert set(client.keys("*")) == before  # key:__rand_int__ and the -r keys are gone
        assert client.get("user:key") == b"keep me"
        # A key of the same name that was there before is the user's: never touched, nothing run.
        client.set(REDIS_BENCHMARK_KEYS[0], b"users")
        assert redis_benchmark(redis_server.port, 4096, 200) is None
        assert client.get(REDIS_BENCHMARK_KEYS[0]) == b"users"
        client.delete(REDIS_BENCHMARK_KEYS[0])
        # So is one of the keys its -r store run would write (key:<12 digits> below n).
        client.set("key:000000000199", b"users too")
        assert redis_benchmark(redis_server.port, 4096, 200) is None
        assert client.get("key:000000000199") == b"users too"
        assert redis_benchmark(redis_server.port, 4096, 199) is not None  # 199 requests: keys 0..198
        assert set(client.keys("*")) == before | {b"key:000000000199"}
    finally:
        client.delete("user:key", "key:000000000199", *REDIS_BENCHMARK_KEYS)
        client.close()


def test_bench_command_labels_figures_by_tier_and_judges_each_against_its_medium(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``tieredkv bench`` on a config with named tiers: figures carry the tier labels, each
    ratio is against the baseline its tier class declares, and the Redis server and the
    configured LMDB directory are left as they were found."""
    import os
    import subprocess
    import sys

    conf = tmp_path / "c.yaml"
    conf.write_text(
        "namespace: {model: bench-cli}\ntiers:\n"
        "  - {kind: cpu, name: slab, capacity_bytes: 4MiB, segment_bytes: 1MiB}\n"
        f"  - {{kind: lmdb, name: nvme, path: '{tmp_path / 'kv'}'}}\n"
        f"  - {{kind: redis, name: shared, url: '{redis_server.url}'}}\n"
    )
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.set("user:key", b"keep me")
    before = set(client.keys("*"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    argv = [sys.executable, "-m", "tieredkv.cli", "bench", "--config", str(conf), "--sizes", "64", "--total-mib", "1"]
    r = subprocess.run(
        [*argv, "--reps", "1", "--out", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(r.stdout)["results"]
    # each figure (of each block-id layout) against the strongest raw figure of its medium
    assert row["layouts"] == ["permuted", "fragmented", "consecutive"]
    cands = row["limit_candidates"]
    assert {k: cands[k] for k in ("slab.store", "nvme.store", "nvme.load", "shared.store", "shared.load")} == {
        "slab.store": ["gather", "copy", "copy_2t_nt"],
        "nvme.store": ["file_pagecache.store", "lmdb_raw.store"], "nvme.load": ["file.load", "lmdb_raw.load"],
        "shared.store": ["redis_py.store", "redis_benchmark.store", "redis_benchmark_pipelined.store"],
        "shared.load": ["redis_py.load", "redis_benchmark.load", "redis_benchmark_pipelined.load"],
    }  # fmt: skip
    assert len(row["baselines"]) == 3 * 3 * 2 and "shared@consecutive.load" in row["baselines"]
    for key, limit in row["baselines"].items():
        assert limit == max(cands[key], key=row["gbps"].__getitem__), key
    assert set(row["ratios"]) == set(row["baselines"]) and all(v > 0 for v in row["ratios"].values())
    assert {k: v for k, v in row["floors"].items() if "@" not in k} == {
        "nvme.store": "lmdb_checked.store", "nvme.load": "lmdb_checked.load",
        "shared.store": "redis_checked.store", "shared.load": "redis_checked.load",
    }  # fmt: skip
    assert set(row["floor_ratios"]) == set(row["floors"]) and all(v > 0 for v in row["floor_ratios"].values())
    for key in ("file_pagecache.store", "file_durable.store", "file.load", *row["baselines"].values()):
        assert row["gbps"][key] > 0, key
    for key in row["floors"].values():
        assert row["gbps"][key] > 0, key
    assert set(client.keys("*")) == before and client.get("user:key") == b"keep me"
    client.delete("user:key")
    client.close()
    assert not (tmp_path / "kv").exists()  # bench copies ran in temporary directories beside it
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tieredkv-bench-")] == []


# ---- every documented metric has a sample after a real run -----------------------------------

ROOT = Path(__file__).resolve().parents[2]

#: What docs/operating.md's "Metrics" paragraph promises, phrase by phrase, and the metrics that keep it.
DOCUMENTED_METRICS = {
    "hits": ["tieredkv_tier_hits_total", "tieredkv_group_hits_total"],
    "misses": ["tieredkv_tier_misses_total", "tieredkv_group_misses_total"],
    "pending": ["tieredkv_pending", "tieredkv_group_pending"],
    "stored and loaded bytes": [
        "tieredkv_tier_stored_bytes_total",
        "tieredkv_tier_loaded_bytes_total",
        "tieredkv_group_stored_bytes_total",
        "tieredkv_group_loaded_bytes_total",
    ],
    "dropped stores": ["tieredkv_dropped_stores_total", "tieredkv_group_dropped_stores_total"],
    "corrupt records": ["tieredkv_tier_corrupt_records_total"],
    "evictions": ["tieredkv_tier_evictions_total"],
    "breaker state": ["tieredkv_breaker_state", "tieredkv_breaker_open"],
    "usage and capacity": ["tieredkv_tier_used_bytes", "tieredkv_tier_capacity_bytes"],
    "Per tenant": ["tieredkv_tenant_used_bytes"],
    "latency histogram": ["tieredkv_tier_op_seconds_bucket", "tieredkv_tier_op_seconds_count"],
}


def _documented_metrics_paragraph() -> str:
    text = (ROOT / "docs" / "operating.md").read_text()
    start = text.index("**Metrics.**")
    return " ".join(text[start : text.index("\n\n", start)].split())


def _dashboard_metrics() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "config" / "grafana" / "dashboards").glob("*.json")):

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    if k == "expr" and isinstance(v, str):
                        names.update(re.findall(r"\btieredkv_[a-z_]+", v))
                    else:
                        walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(json.loads(path.read_text()))
    return names


def test_demo_run_gives_every_documented_and_dashboard_metric_a_sample(tmp_path: Path) -> None:
    scraped: list[str] = []

    class Engine(_Engine):
        def extra_summary(self) -> dict[str, Any]:  # the store is still running here
            srv = self.store.metrics_server
            assert srv is not None
            deadline = time.monotonic() + 30
            text = ""
            while "tieredkv_tier_capacity_bytes{" not in text:  # the first stats refresh has run
                assert time.monotonic() < deadline, "tier stats gauges never appeared"
                text = urllib.request.urlopen(srv.url, timeout=5).read().decode()
            scraped.append(text)
            return {}

    c = load_config(cfg(tmp_path, metrics={"port": 0}), env={})
    s = run_demo(c, DemoOptions(conversations=3, turns=2, system_tokens=(256, 512)), engine_cls=Engine)
    assert s["requests"] == 6 and s["mismatches"] == 0 and s["groups"][0]["tokens_from_cache"] > 0
    samples: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(scraped[0]):
        for smp in fam.samples:
            samples.setdefault(smp.name, []).append(smp)

    paragraph = _documented_metrics_paragraph()
    for phrase, names in DOCUMENTED_METRICS.items():
        assert phrase in paragraph, (
            f"docs/operating.md's Metrics paragraph no longer says {phrase!r}: update DOCUMENTED_METRICS"
        )
        for name in names:
            assert samples.get(name), f"docs/operating.md promises {phrase!r} but {name} has no sample"
    for name in re.findall(r"\btieredkv_[a-z_]+", paragraph):
        assert samples.get(name), f"docs/operating.md names {name}, which has no sample"
    dashboard = _dashboard_metrics()
    assert "tieredkv_group_hits_total" in dashboard  # the per-group panel is checked too
    for name in sorted(dashboard):
        assert samples.get(name), f"a Grafana dashboard queries {name}, which has no sample"
    # per-group counters are really counted, not just present
    hits = {smp.labels["group"]: smp.value for smp in samples["tieredkv_group_hits_total"]}
    stored = {smp.labels["group"]: smp.value for smp in samples["tieredkv_group_stored_bytes_total"]}
    assert hits["0"] > 0 and hits["1"] > 0 and stored["0"] > 0 and stored["1"] > 0
    assert sum(smp.value for smp in samples["tieredkv_group_loaded_bytes_total"]) > 0


# ---- the facade: what the integrations, demo and bench use instead of store.pipeline ---------


def test_register_a_group_spec_then_plan_with_the_store_planner(tmp_path: Path) -> None:
    from tieredkv.errors import ConfigError
    from tieredkv.groups import GroupKind, GroupSpec
    from tieredkv.keys import GroupGeometry

    full = GroupSpec(0, GroupKind.FULL, tokens_per_block=16, blocks_per_chunk=2)
    swa = GroupSpec(1, GroupKind.SLIDING_WINDOW, tokens_per_block=16, blocks_per_chunk=2, window_tokens=64)
    with tieredkv.open_store(cfg(tmp_path)) as store:
        with pytest.raises(ValueError, match="bytes_per_block=7"):
            store.register_group(GroupSpec(0, GroupKind.FULL, 16, 2, 7), [torch.zeros(8, 512, dtype=torch.uint8)])
        store.register_group(full, [torch.zeros(8, 512, dtype=torch.uint8)])
        store.register_group(swa, [torch.zeros(8, 256, dtype=torch.uint8)])
        assert store.groups[1].bytes_per_block == 256 and store.groups[1].window_tokens == 64
        assert store.namespace.groups == (
            GroupGeometry("full", 16, 2, 512, 0),
            GroupGeometry("sliding_window", 16, 2, 256, 64),
        )
        plan = store.planner(16)
        assert [g.index for g in plan.layout.groups] == [0, 1]
        store.register_group(7, [torch.zeros(8, 64, dtype=torch.uint8)])  # by index: tokens unknown
        assert store.namespace.groups[2] == GroupGeometry("full", 0, 1, 64, 0)
        with pytest.raises(ConfigError, match=r"groups \[7\] were registered by index"):
            store.planner(16)
        with pytest.raises(ValueError, match="kind='dense' is unknown"):
            store.register_group(8, [torch.zeros(8, 64, dtype=torch.uint8)], kind="dense")


def test_store_facade_records_lookups_and_tier_calls(tmp_path: Path) -> None:
    with tieredkv.open_store(cfg(tmp_path)) as store:
        store.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        keys = [store.key(bytes([i]) * 32, 0) for i in range(3)]
        assert store.stored_key(keys[0][16:]) == keys[0]
        job = store.put_records([(k, bytes([i]) * 64) for i, k in enumerate(keys[:2])])
        assert job is not None and store.drain(10)
        assert store.wait([job])[job].ok
        assert [store.probe(k) for k in keys] == [KeyState.HIT, KeyState.HIT, KeyState.MISS]
        assert not store.is_pending(keys[0])
        fut = store.lookup_async(keys)
        assert [s for s, _ in fut.result(10)] == [KeyState.HIT, KeyState.HIT, KeyState.MISS]
        bufs = [bytearray(64) for _ in keys]
        job = store.get_records(list(zip(keys, bufs)), job_id=99)
        assert job == 99
        res = store.wait([99])[99]
        assert not res.ok and res.done == tuple(keys[:2]) and res.failed == (keys[2],)
        assert bufs[1] == bytes([1]) * 64
        st = store.tier_stats()
        assert st["cpu"] is not None and st["cpu"].records == 2
        assert store.run(store.tiers[1].contains_many(keys), timeout=10) == [True, True, False]
        g = store.stats().groups[0]
        assert (g.hits, g.misses, g.stores, g.loads, g.load_missing) == (4, 2, 2, 2, 1)
    assert store.put_records([(keys[0], b"x" * 64)]) is None  # closed: refused, never raises


def test_bad_records_raise_at_the_call_and_the_lanes_go_on(tmp_path: Path) -> None:
    """A records job with a bad item is refused at the call, naming the item, before anything is
    queued: nothing of it is written, and the tiers' writer lanes keep serving the next job."""
    with tieredkv.open_store(cfg(tmp_path)) as store:
        store.register_group(0, [torch.zeros(8, 64, dtype=torch.uint8)])
        keys = [store.key(bytes([i]) * 32, 0) for i in range(3)]
        with pytest.raises(TypeError, match="put: item 1: "):
            store.put_records([(keys[0], b"a" * 64), (keys[1], "not a buffer")])
        with pytest.raises(ValueError, match="put: item 0: a tier key must be a stored key"):
            store.put_records([(b"short", b"a" * 64)])
        with pytest.raises(ValueError, match="get: item 1: destination buffer is read-only"):
            store.get_records([(keys[0], bytearray(64)), (keys[1], b"read-only")])
        assert store.drain(10) and not any(store.is_pending(k) for k in keys)
        assert store.run(store.tiers[1].contains_many(keys), timeout=10) == [False] * 3  # nothing of it written
        job = store.put_records([(k, bytes([i]) * 64) for i, k in enumerate(keys)])
        assert job is not None and store.wait([job], timeout=10)[job].ok
        bufs = [torch.zeros(64, dtype=torch.uint8) for _ in keys]  # tensors are host buffers too
        job = store.get_records(list(zip(keys, bufs)))
        assert job is not None and store.wait([job], timeout=10)[job].ok
        assert [bytes(b.numpy()) for b in bufs] == [bytes([i]) * 64 for i in range(3)]


def test_only_the_store_and_the_pipeline_package_touch_the_pipeline() -> None:
    """The integrations, demo, bench and CLI go through TieredStore; the pipeline never branches on
    a concrete tier class (capabilities only); key bytes are built in tieredkv.keys only."""
    src = ROOT / "tieredkv"
    for path in [*src.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if rel != "tieredkv/store.py" and not rel.startswith("tieredkv/pipeline/"):
            assert not re.search(r"\bstore\.pipeline\b|\._call\(|\bPipeline\(", text), rel
        if rel.startswith("tieredkv/pipeline/"):
            assert "backends.cpu" not in text and "CPUTier" not in text, rel
        if not rel.startswith(("tieredkv/backends/", "tieredkv/keys.py", "tieredkv/admin.py")):
            assert not re.search(r'to_bytes\(4, "big"\)|\[-4:\]', text), rel

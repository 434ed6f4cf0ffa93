"""TieredStore (the standalone API) and the demo engine loop, with real tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tieredkv
from tieredkv.config import load_config
from tieredkv.demo import DemoOptions, _Engine, run_demo
from tieredkv.pipeline import KeyState


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

        # With most of the pool busy, such a job goes through the room that is free.
        held = store.pipeline.staging.try_acquire(8192)
        assert held is not None
        more = [store.key(bytes([100 + i]) * 32, 0) for i in range(5)]
        job = store.store(0, [(more[i], (1 + 2 * i, 2 + 2 * i)) for i in range(5)])
        assert job is not None and store.wait([job])[job].ok
        store.pipeline.staging.release(held)
        assert store.stats()["counters"]["store_in_parts"] == 2
        assert store.stats()["counters"]["load_in_parts"] == 1
        assert store.pipeline.staging.in_use == 0

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
    o = DemoOptions(conversations=3, turns=2, system_tokens=(256, 512), max_chunks_per_plan=2)
    s = run_demo(c, o, engine_cls=Engine)
    assert s["requests"] == 6 and s["mismatches"] == 0 and s["verified_blocks"] > 0
    assert s["store"]["failed"] == 0 and s["load"]["failed"] == 0
    assert s["groups"][0]["tokens_from_cache"] > 0
    assert Engine.rest_plans > 0


def test_metrics_endpoint_reports_tiers_groups_and_breakers(tmp_path: Path) -> None:
    import urllib.request

    with tieredkv.open_store(cfg(tmp_path, metrics={"port": 0})) as store:
        assert store.metrics_server is not None
        t = torch.randint(0, 256, (8, 4096), dtype=torch.uint8)
        store.register_group(3, [t], blocks_per_chunk=2)
        key = store.key(b"m" * 32, 3)
        store.wait([store.store(3, [(key, (1, 2))])])
        store.wait([store.load(3, [(key, (5, 6))])])
        text = ""
        deadline = __import__("time").monotonic() + 10
        while "tieredkv_tier_used_bytes" not in text and __import__("time").monotonic() < deadline:
            text = urllib.request.urlopen(store.metrics_server.url, timeout=5).read().decode()
        assert 'tieredkv_tier_stored_bytes_total{tier="cpu"} 8192.0' in text
        assert 'tieredkv_tier_used_bytes{tier="lmdb"}' in text
        assert 'tieredkv_breaker_open{tier="lmdb"} 0.0' in text
        assert 'group="3"' in text
    assert store.metrics_server is None

"""Tier events (``Pipeline.record_tier_events`` / ``TieredStore.take_tier_events``): replayed in
order, they are exactly what each tier holds — through the slot path, the writer lanes,
write-back demotions, promotions, host-buffer puts and every tier's evictions — and nothing is
recorded until asked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, PipelineConfig, PolicyRule
from tieredkv.keys import Namespace
from tieredkv.pipeline import ChunkRef, LoadJob, Pipeline, StoreJob, TierEvent
from tieredkv.policy import TierPolicy
from tieredkv.staging import StagingPool
from tieredkv.store import open_store

NS = Namespace(model="tier-events")
BLOCKS, BPC = 96, 2
LAYER_SHAPE = (BLOCKS, 2, 16, 4, 32)  # 4 KiB per block per layer
CHUNK = BPC * 2 * 4096  # two layers


def kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, LAYER_SHAPE, dtype=torch.uint8, generator=g) for _ in range(2)]


def chunk(i: int) -> ChunkRef:
    return ChunkRef(NS.key(i.to_bytes(32, "big"), 0), tuple(range(BPC * (i % 40), BPC * (i % 40) + BPC)))


def pipeline(tmp_path: Path, write: str) -> Pipeline:
    tiers = [
        CPUTier(CPUTierConfig(capacity_bytes=6 * CHUNK, segment_bytes=CHUNK + 4096)),
        LMDBTier(LMDBTierConfig(path=str(tmp_path / "lmdb"), map_size_bytes=32 << 20, size_cap_bytes=12 * CHUNK)),
    ]
    pol = TierPolicy([PolicyRule(tiers=["cpu", "lmdb"], write=write)], ["cpu", "lmdb"])
    return Pipeline(tiers, pol, PipelineConfig(), staging=StagingPool(8 << 20))


def finish(p: Pipeline, n: int) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + 60
    while len(got) < n:
        got += p.poll_finished()
        assert time.monotonic() < deadline, f"{len(got)} of {n} jobs finished"
        time.sleep(0.002)
    return got


def replay(events: list[TierEvent]) -> dict[str, set[bytes]]:
    held: dict[str, set[bytes]] = {}
    for tier, removed, keys in events:
        s = held.setdefault(tier, set())
        if removed:
            s.difference_update(keys)
        else:
            s.update(keys)
    return held


async def _keys(tier: Any) -> set[bytes]:
    return {info.key async for info in tier.scan(NS)}


def test_replayed_events_are_what_each_tier_holds(tmp_path: Path) -> None:
    for write in ("back", "through"):
        with pipeline(tmp_path / write, write) as p:
            events = p.record_tier_events()
            p.register_group(0, kv(1), blocks_per_chunk=BPC)
            for i in range(30):  # one job each: the CPU tier and LMDB both evict
                p.submit_store(StoreJob(i, 0, (chunk(i),)))
                finish(p, 1)
            # loads of early chunks: hits below the CPU tier are promoted into it
            p.submit_load(LoadJob(100, 0, tuple(chunk(i) for i in range(20, 26))))
            assert all(r.ok for r in finish(p, 1))
            assert p.drain(60)
            log = events.take()
            held = replay(log)
            for name, tier in p.tiers.items():
                assert held.get(name, set()) == p.run(_keys(tier), 30), f"{write}: {name}"
            kinds = {(t, removed) for t, removed, _ in log}
            assert kinds == {("cpu", False), ("cpu", True), ("lmdb", False), ("lmdb", True)}, kinds
            assert p.stats().counters["promotions"] > 0
            if write == "back":
                assert p.stats().counters["write_backs"] > 0
            assert events.take() == []  # taken once


def test_nothing_is_recorded_until_asked(tmp_path: Path) -> None:
    with pipeline(tmp_path, "back") as p:
        p.register_group(0, kv(2), blocks_per_chunk=BPC)
        for i in range(10):
            p.submit_store(StoreJob(i, 0, (chunk(i),)))
            finish(p, 1)
        assert p.events is None and p.tiers["cpu"].counters["evictions"] > 0
        assert all(t._removal_listener is None for t in p.tiers.values())


def test_store_records_host_buffer_puts_and_evictions(tmp_path: Path) -> None:
    cfg = {
        "namespace": {"model": "tier-events-store"},
        "tiers": [{"kind": "cpu", "name": "cpu", "capacity_bytes": "4MiB", "segment_bytes": "1MiB"}],
    }
    with open_store(cfg) as store:
        assert store.take_tier_events() == []
        store.record_tier_events()
        keys = [store.key(i.to_bytes(32, "big"), 0) for i in range(12)]
        for i, k in enumerate(keys):
            store.wait([store.put_records([(k, bytearray([i]) * (512 << 10))])])
        held = replay(store.take_tier_events())["cpu"]
        (tier,) = store.tiers
        assert held == store.run(_keys_of(tier, store.namespace), 30) and 0 < len(held) < 12


async def _keys_of(tier: Any, ns: Namespace) -> set[bytes]:
    return {info.key async for info in tier.scan(ns)}

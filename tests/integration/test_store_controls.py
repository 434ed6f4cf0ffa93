"""A TieredStore's request controls on real tiers (CPU slab + LMDB): calls restricted to some tiers
of a route, admission counted per group, retention holding chunks through evictions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tieredkv
from tieredkv.pipeline import KeyState

BLOCK = 16 * 64  # bytes per block of the test group (uint8, 16 x 64)


def cfg(tmp_path: Path, cpu: str = "16MiB", **extra: object) -> dict:
    return {
        "namespace": {"model": "controls-test"},
        "tiers": [
            {"kind": "cpu", "capacity_bytes": cpu, "segment_bytes": "64KiB"},
            {
                "kind": "lmdb",
                "name": "nvme",
                "path": str(tmp_path / "kv"),
                "map_size_bytes": "64MiB",
                "size_cap_bytes": "32MiB",
            },
        ],
        "pipeline": {"staging_bytes": "1MiB"},
        **extra,
    }


def held(store: tieredkv.TieredStore, keys: list[bytes]) -> dict[str, list[bool]]:
    return {t.name: list(store.run(t.contains_many(keys))) for t in store.tiers}


def test_store_load_and_lookup_restricted_to_some_tiers(tmp_path: Path) -> None:
    kv = torch.randint(0, 256, (64, 16, 64), dtype=torch.uint8)
    with tieredkv.open_store(cfg(tmp_path)) as store:
        store.register_group(0, [kv], blocks_per_chunk=2)
        keys = [store.key(bytes([i]) * 32, 0) for i in range(4)]
        only_cpu = store.store(0, [(keys[0], (1, 2)), (keys[1], (3, 4))], tiers={"cpu"})
        only_lmdb = store.store(0, [(keys[2], (5, 6))], tiers=["nvme", "not-a-tier"])
        both = store.store(0, [(keys[3], (7, 8))])
        assert all(r.ok for r in store.wait([only_cpu, only_lmdb, both]).values())  # type: ignore[list-item]
        assert held(store, keys) == {"cpu": [True, True, False, True], "nvme": [False, False, True, True]}
        with pytest.raises(ValueError, match="no tier of group 0's route"):
            store.store(0, [(keys[0], (1, 2))], tiers={"redis"})
        # probes and lookups over the allowed tiers only
        assert [store.probe_among(k, {"nvme"}) for k in keys] == [KeyState.MISS] * 2 + [KeyState.HIT] * 2
        assert store.probe_among(keys[0], set()) is KeyState.MISS
        got = store.lookup_async(keys, tiers={"nvme"}).result(10)
        assert got == [(KeyState.MISS, None)] * 2 + [(KeyState.HIT, "nvme")] * 2
        # a load that may read only LMDB reads key 3 there (the CPU slab holds it too) ...
        before = {t.name: t.counters.get("get_bytes", 0) for t in store.tiers}
        kv[40:42].zero_()
        job = store.load(0, [(keys[3], (40, 41))], tiers={"nvme"})
        res = store.wait([job])[job]  # type: ignore[list-item]
        assert res.ok and res.tiers == {"nvme": 1}
        assert torch.equal(kv[40:42], kv[7:9])
        after = {t.name: t.counters.get("get_bytes", 0) for t in store.tiers}
        assert after["cpu"] == before["cpu"] and after["nvme"] == before["nvme"] + 2 * BLOCK
        # ... and one that may not read the tier holding the chunk misses it
        job = store.load(0, [(keys[0], (42, 43))], tiers={"nvme"})
        res = store.wait([job])[job]  # type: ignore[list-item]
        assert not res.ok and res.failed == (keys[0],)


def test_admission_counts_declined_chunks_and_bytes_per_group(tmp_path: Path) -> None:
    kv = torch.zeros(8, 16, 64, dtype=torch.uint8)
    with tieredkv.open_store(cfg(tmp_path, policy=[{"admit_after": 2}])) as store:
        store.register_group(0, [kv], blocks_per_chunk=2)
        keys = [store.key(bytes([i]) * 32, 0) for i in range(3)]
        assert store.admit(keys, set()) == [False] * 3
        assert store.admit(keys[:1], set()) == [True]
        gs = store.stats().groups[0]
        assert (gs.admission_declined, gs.admission_declined_bytes) == (3, 3 * 2 * BLOCK)
        families = {f.name for f in store.metrics.collector.collect()}
        assert {"tieredkv_group_admission_declined", "tieredkv_group_admission_declined_bytes"} <= families
    with tieredkv.open_store(cfg(tmp_path / "b")) as store:  # the default: admit always, count nothing
        assert not store.admission_active and store.admit([b"x" * 40], set()) == [True]


def test_retained_chunks_survive_the_cpu_slab_filling_up(tmp_path: Path) -> None:
    """A CPU tier of 16 chunks: 4 retained chunks stay through 40 more stores; without retention
    they are evicted. The retention's bound is a quarter of the smallest tier (4 chunks here)."""
    kv = torch.randint(0, 256, (128, 16, 64), dtype=torch.uint8)
    chunk = 2 * BLOCK
    c = cfg(tmp_path, cpu=str(16 * chunk), policy=[{"tiers": ["cpu"]}])
    c["tiers"][0].update(segment_bytes=str(chunk), min_slot_bytes=str(chunk))
    with tieredkv.open_store(c) as store:
        store.register_group(0, [kv], blocks_per_chunk=2)
        assert store.retention.max_bytes == 4 * chunk
        first = [store.key(bytes([i]) * 32, 0) for i in range(8)]
        store.wait([store.store(0, [(k, (2 * i, 2 * i + 1)) for i, k in enumerate(first)])])  # type: ignore[list-item]
        assert store.retain(first[:6], seconds=None, priority=1) == 4  # bounded: 2 refused
        store.count_control("hint:tieredkv.retain", "accepted")
        fams = {
            f.name: {tuple(smp.labels.values()): smp.value for smp in f.samples}
            for f in store.metrics.collector.collect()
        }
        assert fams["tieredkv_retained_chunks"] == {(): 4.0}
        assert (
            fams["tieredkv_retention_chunks"][("retained",)] == 4
            and fams["tieredkv_retention_chunks"][("refused",)] == 2
        )
        assert fams["tieredkv_control_events"] == {("hint:tieredkv.retain", "accepted"): 1.0}
        for n in range(40):
            k = store.key(b"f" + n.to_bytes(31, "big"), 0)
            store.wait([store.store(0, [(k, (20 + n % 50, 21 + n % 50))])])  # type: ignore[list-item]
        assert held(store, first)["cpu"] == [True] * 4 + [False] * 4
        assert store.retention.release_all() == 4
        for n in range(40, 80):
            k = store.key(b"f" + n.to_bytes(31, "big"), 0)
            store.wait([store.store(0, [(k, (20 + n % 50, 21 + n % 50))])])  # type: ignore[list-item]
        assert held(store, first)["cpu"] == [False] * 8

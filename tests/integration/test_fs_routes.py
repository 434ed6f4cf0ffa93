"""Policy routes with the fs tier, through the public engine API: full attention to the CPU tier
then the shared directory, Mamba states straight to the shared directory (as
config/tieredkv-shared.yaml routes them); a second engine on the same directory loads what the
first stored, byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tieredkv

BLOCK = 4096
BPC = 2


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "cpu", "capacity_bytes": "8MiB", "segment_bytes": "1MiB"},
            {"kind": "fs", "name": "shared", "path": str(tmp_path / "shared"), "size_cap_bytes": "64MiB"},
        ],
        "policy": [{"kinds": ["full"], "tiers": ["cpu", "shared"]}, {"kinds": ["mamba"], "tiers": ["shared"]}],
    }


def engine(tmp_path: Path) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    store = tieredkv.open_store(config(tmp_path))
    full = [torch.zeros((16, BLOCK), dtype=torch.uint8) for _ in range(2)]
    mamba = [torch.zeros((16, BLOCK), dtype=torch.uint8)]
    assert list(store.register_group(0, full, blocks_per_chunk=BPC, kind="full").tiers) == ["cpu", "shared"]
    assert list(store.register_group(1, mamba, blocks_per_chunk=BPC, kind="mamba").tiers) == ["shared"]
    return store, full, mamba


def test_full_attention_goes_cpu_then_fs_mamba_straight_to_fs(tmp_path: Path) -> None:
    store, full, mamba = engine(tmp_path)
    with store:
        for t in (*full, *mamba):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        fkeys = [store.key(bytes([i]) * 32, 0) for i in range(4)]
        mkeys = [store.key(bytes([i]) * 32, 1) for i in range(4)]
        jobs = [
            store.store(0, [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(fkeys)]),
            store.store(1, [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(mkeys)]),
        ]
        assert all(r.ok for r in store.wait([j for j in jobs if j is not None], timeout=60).values())
        cpu, shared = store.tiers
        assert store.run(cpu.contains_many(fkeys + mkeys), timeout=30) == [True] * 4 + [False] * 4
        assert store.run(shared.contains_many(fkeys + mkeys), timeout=30) == [True] * 8
        want_full = [t[:8].clone() for t in full]
        want_mamba = [t[:8].clone() for t in mamba]
    other, full2, mamba2 = engine(tmp_path)  # another engine, the same shared directory
    with other:
        jobs = [
            other.load(0, [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(fkeys)]),
            other.load(1, [(k, [2 * i, 2 * i + 1]) for i, k in enumerate(mkeys)]),
        ]
        assert all(r.ok for r in other.wait([j for j in jobs if j is not None], timeout=60).values())
        for got, want in zip(full2 + mamba2, want_full + want_mamba, strict=True):
            assert torch.equal(got[:8], want)
        assert other.locate(fkeys[0]) == "cpu"  # promoted into this engine's CPU tier

"""The namespace of a store opened from a config follows what the engine says (issue: an fp16 and
a bf16 engine with one YAML hit each other's records; TP rank 1 loaded rank 0's shard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tieredkv
from tieredkv.keys import ParallelLayout
from tieredkv.pipeline import KeyState

ROOT = Path(__file__).resolve().parents[2]


def cfg(tmp_path: Path) -> dict:
    return {
        "namespace": {"model": "ns-test"},
        "tiers": [{"kind": "lmdb", "path": str(tmp_path / "kv"), "map_size_bytes": "64MiB", "size_cap_bytes": "32MiB"}],
    }


def _store_one(tmp_path: Path, dtype: torch.dtype, **kw: object) -> bytes:
    """Open a store on the shared LMDB directory, register one group of ``dtype``, store a chunk."""
    with tieredkv.open_store(cfg(tmp_path), **kw) as s:
        s.register_group(0, [torch.ones(8, 4, 16, dtype=dtype)], blocks_per_chunk=2)
        key = s.key(b"h" * 32, 0)
        s.wait([s.store(0, [(key, (1, 2))])])
        assert s.lookup([key]) == [(KeyState.HIT, "lmdb")]
        return key


def _lookup(tmp_path: Path, dtype: torch.dtype, **kw: object) -> tuple[bytes, KeyState]:
    with tieredkv.open_store(cfg(tmp_path), **kw) as s:
        s.register_group(0, [torch.ones(8, 4, 16, dtype=dtype)], blocks_per_chunk=2)
        key = s.key(b"h" * 32, 0)
        return key, s.lookup([key])[0][0]


def test_tensor_dtype_joins_the_namespace(tmp_path: Path) -> None:
    k16 = _store_one(tmp_path, torch.float16)
    kbf, state = _lookup(tmp_path, torch.bfloat16)
    assert kbf != k16 and state is KeyState.MISS  # same YAML, same block size, other dtype
    k16b, state = _lookup(tmp_path, torch.float16)
    assert k16b == k16 and state is KeyState.HIT  # the same engine again finds its records


def test_group_geometry_joins_the_namespace(tmp_path: Path) -> None:
    k = _store_one(tmp_path, torch.float16)
    with tieredkv.open_store(cfg(tmp_path)) as s:
        s.register_group(0, [torch.ones(8, 2, 16, dtype=torch.float16)], blocks_per_chunk=2)  # half the heads
        k2 = s.key(b"h" * 32, 0)
        assert k2 != k and s.lookup([k2])[0][0] is KeyState.MISS


def test_explicit_parallel_rank_is_its_own_namespace(tmp_path: Path) -> None:
    k0 = _store_one(tmp_path, torch.float16, parallel=ParallelLayout(tp_size=2, rank=0))
    k1, state = _lookup(tmp_path, torch.float16, parallel=ParallelLayout(tp_size=2, rank=1))
    assert k1 != k0 and state is KeyState.MISS


def test_register_group_again_with_another_shape_is_refused(tmp_path: Path) -> None:
    with tieredkv.open_store(cfg(tmp_path)) as s:
        t = torch.ones(8, 4, 16, dtype=torch.float16)
        s.register_group(0, [t], blocks_per_chunk=2)
        s.register_group(0, [t], blocks_per_chunk=2)  # the same again is fine
        with pytest.raises(ValueError, match=r"register_group\(0\): group 0 is registered already"):
            s.register_group(0, [t], blocks_per_chunk=4)
        with pytest.raises(ValueError, match="registered already"):
            s.register_group(0, [t.to(torch.bfloat16)], blocks_per_chunk=2)


_WORKER = r"""
import json, sys, torch, torch.distributed as dist, tieredkv
from tieredkv.keys import ParallelLayout
rank, init, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
cfg = {"namespace": {"model": "ns-test"}, "tiers": [{"kind": "cpu", "capacity_bytes": "1MiB", "segment_bytes": "256KiB"}]}
out = {}
with tieredkv.open_store(cfg) as s:
    s.register_group(0, [torch.ones(8, 4, 16, dtype=torch.float16)], blocks_per_chunk=2)
    out["dist"] = s.namespace.fingerprint.hex()
with tieredkv.open_store(cfg, parallel=ParallelLayout(tp_size=2, rank=rank)) as s:
    s.register_group(0, [torch.ones(8, 4, 16, dtype=torch.float16)], blocks_per_chunk=2)
    out["explicit"] = s.namespace.fingerprint.hex()
with tieredkv.open_store(cfg, parallel=ParallelLayout(tp_size=4, rank=3)) as s:
    s.register_group(0, [torch.ones(8, 4, 16, dtype=torch.float16)], blocks_per_chunk=2)
    out["override"] = s.namespace.fingerprint.hex()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_torch_distributed_rank_joins_the_namespace(tmp_path: Path) -> None:
    """Two real gloo ranks: each store's namespace carries its rank, equal to the explicit layout;
    an explicit ``parallel`` wins over torch.distributed."""
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(r), init, str(ROOT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["dist"] != outs[1]["dist"]
    for o in outs:
        assert o["dist"] == o["explicit"]
    assert outs[0]["override"] == outs[1]["override"] != outs[0]["dist"]


# ---- every public entry checks its input at the call ------------------------------------------


def test_bad_calls_raise_at_the_call_and_the_store_keeps_working(tmp_path: Path) -> None:
    """A short key, a key of another group or namespace, a short chunk, out-of-range block ids,
    a strided tensor, blocks_per_chunk <= 0, an unregistered group, a call after close(): each
    raises a clear error at the call; the store then still stores and loads."""
    from tieredkv.errors import TierClosedError

    s = tieredkv.open_store(cfg(tmp_path))
    t = torch.arange(8 * 64, dtype=torch.float16).view(8, 64)
    with pytest.raises(ValueError, match="blocks_per_chunk=0 is invalid"):
        s.register_group(0, [t], blocks_per_chunk=0)
    with pytest.raises(ValueError, match="does not hold each block contiguously"):
        s.register_group(0, [t.view(8, 8, 8).transpose(1, 2)], blocks_per_chunk=2)
    s.register_group(0, [t], blocks_per_chunk=2)
    s.register_group(1, [t.clone()], blocks_per_chunk=2)
    key = s.key(b"h" * 32, 0)
    cases = [
        ((0, [(key[:10], (1, 2))]), ValueError, "key is 10 bytes"),
        ((0, [(b"x" * 600, (1, 2))]), ValueError, "key is 600 bytes"),
        ((0, [(s.key(b"h" * 32, 1), (1, 2))]), ValueError, "key is of group 1, not of group 0"),
        ((0, [(b"\0" * 16 + b"h" * 32 + b"\0" * 4, (1, 2))]), ValueError, "another namespace"),
        ((0, [(key, (1,))]), ValueError, "has 1 block ids; group 0 chunks are 2 blocks"),
        ((0, [(key, (-1, 2))]), ValueError, r"block ids \[-1\] are out of range"),
        ((0, [(key, (7, 8))]), ValueError, r"block ids \[8\] are out of range 0..7"),
        ((0, [(key, ("a", 2))]), TypeError, "are not integers"),
        ((0, ["nope"]), TypeError, "expected \\(key: bytes, block_ids\\)"),
        ((5, [(key, (1, 2))]), ValueError, "group=5 is not registered"),
    ]
    for (group, chunks), exc, msg in cases:
        for op in (s.store, s.load):
            with pytest.raises(exc, match=msg):
                op(group, chunks)
    with pytest.raises(ValueError, match="skip_blocks=2 is invalid"):
        s.load(0, [(key, (1, 2))], skip_blocks=2)
    # nothing above reached a writer lane: the store still works
    s.wait([s.store(0, [(key, (1, 2))])])
    t[1:3] = 0
    r = s.wait([s.load(0, [(key, (1, 2))])])
    assert all(res.ok for res in r.values())
    assert torch.equal(t[1:3], torch.arange(8 * 64, dtype=torch.float16).view(8, 64)[1:3])
    s.close()
    for call in (
        lambda: s.store(0, [(key, (1, 2))]),
        lambda: s.load(0, [(key, (1, 2))]),
        lambda: s.register_group(2, [t], blocks_per_chunk=2),
    ):
        with pytest.raises(TierClosedError, match="the store is closed"):
            call()

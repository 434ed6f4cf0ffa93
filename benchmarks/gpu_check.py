"""Short device check (< 5 minutes) for a CUDA machine; runs on CPU tensors as a dry run.

1. tieredkv's staging path: ``Copier.gather`` (device blocks → staging, "D2H") and
   ``Copier.scatter`` (staging → device blocks, "H2D") on random block ids, GB/s, against a raw
   ``torch`` copy of the same bytes into / out of one pinned host buffer (per-block loop, and one
   contiguous copy as the ceiling).
2. The vLLM path, if vLLM 0.33 imports: ``TieredKVOffloadingSpec``'s worker storing and loading
   real blocks (``GPULoadStoreSpec``) through tieredkv's CPU tier, bytes verified.

    python benchmarks/gpu_check.py                  # CUDA if available, else CPU dry run
    python benchmarks/gpu_check.py --device cpu --block-kib 64 --blocks 256 --json out.json

Every timing is the median of ``--repeats`` runs after one warm-up; GB/s = 1e9 payload bytes/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tieredkv.staging import Copier, KVGroupTensors, StagingPool


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_time(fn: Any, dev: torch.device, repeats: int) -> float:
    fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def staging_vs_raw(dev: torch.device, block_bytes: int, num_blocks: int, n: int, repeats: int) -> dict[str, Any]:
    kv = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=dev)
    ids = torch.randperm(num_blocks - 1)[:n].add_(1).tolist()
    nbytes = n * block_bytes
    group = KVGroupTensors([kv])
    pool = StagingPool(nbytes + (1 << 20))
    buf = pool.try_acquire(nbytes)
    assert buf is not None
    copier = Copier()
    pinned = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    nb = dev.type == "cuda"

    def wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def tkv_d2h() -> None:
        wait(copier.gather(group, ids, buf.tensor, after=copier.record_ready(group)))

    placements = list(enumerate(ids))

    def tkv_h2d() -> None:
        wait(copier.scatter(group, placements, buf.tensor, n))

    def raw_d2h_blocks() -> None:
        for i, b in enumerate(ids):
            host[i * block_bytes : (i + 1) * block_bytes].copy_(kv[b], non_blocking=nb)

    def raw_h2d_blocks() -> None:
        for i, b in enumerate(ids):
            kv[b].copy_(host[i * block_bytes : (i + 1) * block_bytes], non_blocking=nb)

    flat = kv[1 : n + 1].reshape(-1)

    def raw_d2h_contig() -> None:
        host.copy_(flat, non_blocking=nb)

    def raw_h2d_contig() -> None:
        flat.copy_(host, non_blocking=nb)

    out: dict[str, Any] = {
        "block_bytes": block_bytes,
        "blocks_per_transfer": n,
        "bytes": nbytes,
        "staging_pinned": pool.pinned,
        "host_pinned": pinned,
    }
    for name, fn in [
        ("tieredkv_d2h", tkv_d2h),
        ("raw_d2h_per_block", raw_d2h_blocks),
        ("raw_d2h_contiguous", raw_d2h_contig),
        ("tieredkv_h2d", tkv_h2d),
        ("raw_h2d_per_block", raw_h2d_blocks),
        ("raw_h2d_contiguous", raw_h2d_contig),
    ]:
        t = _median_time(fn, dev, repeats)
        out[name + "_gbps"] = round(nbytes / t / 1e9, 3)
    # correctness of the staging round trip
    tkv_d2h()
    before = kv[ids].clone()
    kv[ids] = 0
    tkv_h2d()
    _sync(dev)
    out["staging_roundtrip_ok"] = bool(torch.equal(kv[ids], before))
    out["tieredkv_vs_raw_per_block_d2h"] = round(out["tieredkv_d2h_gbps"] / out["raw_d2h_per_block_gbps"], 3)
    out["tieredkv_vs_raw_per_block_h2d"] = round(out["tieredkv_h2d_gbps"] / out["raw_h2d_per_block_gbps"], 3)
    pool.release(buf)
    return out


def vllm_path(dev: torch.device, block_bytes: int, num_blocks: int, n: int, bpc: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda" if dev.type == "cuda" else "cpu")
    try:
        import vllm
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
            make_offload_key,
        )
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"vLLM not importable: {type(e).__name__}: {e}"}
    from tieredkv.integrations.vllm.spec import TieredKVLoadStoreSpec, TieredKVOffloadingSpec

    n = (n // bpc) * bpc
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "tiers.yaml"
        cap = max(64 << 20, 4 * n * block_bytes)
        cfg_path.write_text(
            json.dumps(
                {
                    "version": 1,
                    "tiers": [
                        {"kind": "cpu", "capacity_bytes": cap, "segment_bytes": max(8 << 20, 2 * block_bytes * bpc)}
                    ],
                    "pipeline": {"staging_bytes": 2 * n * block_bytes + (8 << 20)},
                }
            )
        )
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer",), 0),),
            worker_kv_bytes_per_block=block_bytes,
            enable_kv_cache_events=False,
            extra_config={"tieredkv_config": str(cfg_path)},
            engine_id=f"gpu-check-{os.getpid()}",
            model=OffloadingModelConfig("gpu-check", "uint8"),
            cache=OffloadingCacheConfig(16, bpc),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
        )
        spec = TieredKVOffloadingSpec(config)
        kv = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=dev).view(torch.int8)
        worker = spec.get_worker(
            CanonicalKVCaches([CanonicalKVCacheTensor(kv, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]])
        )
        manager = spec.get_manager()
        try:
            src = list(range(1, n + 1))
            dst = list(range(n + 1, 2 * n + 1))
            keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n // bpc)]
            _sync(dev)
            t0 = time.perf_counter()
            worker.submit_store(1, GPULoadStoreSpec(src, [n], [0]), TieredKVLoadStoreSpec(keys))
            worker.wait({1})
            t_store = time.perf_counter() - t0
            t0 = time.perf_counter()
            worker.submit_load(2, TieredKVLoadStoreSpec(keys), GPULoadStoreSpec(dst, [n], [0]))
            worker.wait({2})
            _sync(dev)
            t_load = time.perf_counter() - t0
            results = {r.job_id: r.success for r in worker.get_finished()}
            ok = bool(torch.equal(kv[src], kv[dst]))
        finally:
            worker.shutdown()
            manager.shutdown()
    nbytes = n * block_bytes
    return {
        "vllm": vllm.__version__,
        "jobs_ok": results == {1: True, 2: True},
        "bytes_verified": ok,
        "store_gbps": round(nbytes / t_store / 1e9, 3),
        "load_gbps": round(nbytes / t_load / 1e9, 3),
        "bytes": nbytes,
        "blocks_per_chunk": bpc,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block-kib", type=int, default=None, help="bytes per KV block (default 256 KiB CUDA, 64 KiB CPU)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per transfer (default 1024 CUDA, 256 CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    block_bytes = (a.block_kib or (256 if cuda else 64)) << 10
    n = a.blocks or (1024 if cuda else 256)
    num_blocks = 2 * n + 2
    t0 = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "staging": staging_vs_raw(dev, block_bytes, num_blocks, n, a.repeats),
        "vllm_path": vllm_path(dev, block_bytes, num_blocks, n, a.blocks_per_chunk),
    }
    result["seconds"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    ok = result["staging"]["staging_roundtrip_ok"] and result["vllm_path"].get("bytes_verified", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

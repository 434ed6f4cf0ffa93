"""Short device check (< 3 minutes on an H100) for a CUDA machine; runs on CPU tensors as a dry
run.

1. tieredkv's staging path, one chunk per call: ``Copier.gather`` (device blocks → staging, "D2H")
   and ``Copier.scatter`` (staging → device blocks, "H2D") on random block ids, GB/s, against a
   raw ``torch`` copy of the same bytes into / out of one pinned host buffer (per-block loop, and
   one contiguous copy as the ceiling).
2. The engine's layout: a group's KV blocks at scattered block ids of its pool, moved a whole job
   (several chunks, ``--job-mib``) per ``Copier`` call with ``chunk_blocks``, as the pipeline moves
   them: ``gather`` into pinned staging (D2H) and ``scatter_blocks`` back (H2D), ``--figure-mib``
   per figure. Block ids: a random permutation of the pool, a fragmented free list (the pool cut
   into runs of 1..8 ids, shuffled), and consecutive ids (the named best case). Two groups: one
   tensor (``--block-kib`` per block) and several tensors of different block sizes
   (``--multi-kib``, like the K/V layers of a hybrid model). Each figure's GB/s is printed with
   its ratio to the limit: one raw pinned ``copy_`` of the same number of bytes (a contiguous
   device tensor ↔ a pinned host buffer). Every figure's bytes are verified (the staging bytes
   against a torch reference of the payload layout; after the scatter, the pool's blocks against
   the staging bytes, and blocks outside the job untouched).
3. The vLLM path, if vLLM 0.33 imports: ``TieredKVOffloadingSpec``'s worker storing and loading
   real blocks (``GPULoadStoreSpec``) through tieredkv's CPU tier, bytes verified.

    python benchmarks/gpu_check.py                  # CUDA if available, else CPU dry run
    python benchmarks/gpu_check.py --device cpu --block-kib 64 --blocks 256 --json out.json
    python benchmarks/gpu_check.py --device cpu --figure-mib 8 --job-mib 1 --multi-kib 16,16,8

Options (defaults: CUDA / CPU dry run):

  --device DEV            cuda or cpu (cuda when available)
  --block-kib N           KV block bytes of the one-tensor groups, KiB (256 / 64)
  --blocks N              blocks per transfer of part 1 (1024 / 256)
  --blocks-per-chunk N    blocks per chunk of parts 2 and 3 (4)
  --figure-mib N          bytes moved per figure of part 2, MiB (256 / 8)
  --job-mib N             bytes per Copier call of part 2 (a job of whole chunks), MiB (16 / 1)
  --multi-kib A,B,...     block KiB of each tensor of part 2's multi-tensor group, ``KxN`` for N
                          tensors of K KiB (32x12,16x4: 16 per-layer tensors / 16,16,8); each
                          tensor costs its own gather/scatter kernels per job on CUDA
  --copy-threads N        Copier(threads=N): host copies split over N threads (CPU dry run only) (1)
  --repeats N             timed runs per figure (5)
  --json PATH             also write the result here

Every timing is the median of ``--repeats`` runs after one warm-up; GB/s = 1e9 payload bytes/s.
A CPU dry run sets torch to one thread (its raw ``copy_`` is then one memcpy, like the limit's DMA).
The summary lines come first, then the whole result as JSON. Exit status 1 when any bytes
verified differ.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
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


_MIB = 1 << 20


def _ids(kind: str, rng: np.random.Generator, num_blocks: int, n: int) -> list[int]:
    """``n`` distinct block ids of ``1..num_blocks-1`` (0 is the engine's null block)."""
    if kind == "consecutive":
        return list(range(1, n + 1))
    if kind == "permutation":
        return (rng.permutation(num_blocks - 1)[:n] + 1).tolist()
    if kind == "fragmented":  # a churned free list: the pool in runs of 1..8 ids, shuffled
        cuts = np.cumsum(rng.integers(1, 9, num_blocks)) + 1
        starts = np.concatenate([[1], cuts[cuts < num_blocks]])
        ends = np.append(starts[1:], num_blocks)
        order = rng.permutation(len(starts))
        ids = np.concatenate([np.arange(starts[i], ends[i]) for i in order])
        return ids[:n].tolist()
    raise ValueError(kind)


#: Block id layouts of part 2, in print order, with their names.
_LAYOUTS = {
    "consecutive": "consecutive ids (best case)",
    "permutation": "permutation of the pool",
    "fragmented": "fragmented free list",
}


def _ref_payload(tensors: list[torch.Tensor], ids: list[int], bpc: int) -> torch.Tensor:
    """Chunks of ``bpc`` blocks back to back, each tensor by tensor its blocks' bytes (torch only)."""
    idx = torch.tensor(ids, device=tensors[0].device)
    rows = [t.index_select(0, idx).view(len(ids) // bpc, -1) for t in tensors]
    return torch.cat(rows, dim=1).reshape(-1)


def raw_pinned(dev: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """The limit: one ``copy_`` of ``nbytes`` between a contiguous device tensor and pinned host."""
    pinned = dev.type == "cuda"
    d = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    out = {
        "d2h_gbps": nbytes / _median_time(lambda: h.copy_(d, non_blocking=pinned), dev, repeats) / 1e9,
        "h2d_gbps": nbytes / _median_time(lambda: d.copy_(h, non_blocking=pinned), dev, repeats) / 1e9,
    }
    return {k: round(v, 3) for k, v in out.items()}


_Spans = list[tuple[list[int], torch.Tensor]]  # (a job's block ids, its staging bytes), job by job


def _gather_jobs(copier: Copier, group: KVGroupTensors, spans: _Spans, bpc: int) -> None:
    """A figure's D2H: each job's whole chunks in one ``gather``, after the KV bytes are ready."""
    ready = copier.record_ready(group)
    ev = None
    for job_ids, span in spans:
        ev = copier.gather(group, job_ids, span, after=ready, chunk_blocks=bpc)
    if ev is not None:  # one stream: the last job's event is every job's
        ev.synchronize()


def _scatter_jobs(copier: Copier, group: KVGroupTensors, spans: _Spans, bpc: int) -> None:
    """A figure's H2D: each job's whole chunks in one ``scatter_blocks``."""
    ev = None
    for job_ids, span in spans:
        ev = copier.scatter_blocks(group, job_ids, span, bpc)
    if ev is not None:
        ev.synchronize()


def engine_layout(
    dev: torch.device,
    name: str,
    block_bytes: list[int],
    figure_bytes: int,
    job_bytes: int,
    bpc: int,
    repeats: int,
    threads: int,
    lines: list[str],
) -> dict[str, Any]:
    """Part 2 for one group: every layout's D2H and H2D figures, and the raw pinned limit."""
    bpb = sum(block_bytes)
    cb = bpc * bpb
    chunks = max(1, figure_bytes // cb)
    n = chunks * bpc
    nbytes = chunks * cb
    job_chunks = max(1, min(chunks, job_bytes // cb))
    num_blocks = n + n // 4 + 1  # a pool a quarter larger than the figure, block 0 left alone
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = [torch.empty((num_blocks, bb), dtype=torch.uint8, device=dev) for bb in block_bytes]
    group = KVGroupTensors(tensors)
    pool = StagingPool(nbytes + 4096)  # the pool's capacity is whole pages
    buf = pool.try_acquire(nbytes)
    assert buf is not None
    copier = Copier(threads=threads)
    jobs = [(a, min(a + job_chunks, chunks)) for a in range(0, chunks, job_chunks)]
    limit = raw_pinned(dev, nbytes, repeats)
    lim = "raw pinned copy_" if pool.pinned else "raw copy_"  # no pinned memory in a dry run
    out: dict[str, Any] = {
        "tensors": len(block_bytes),
        "block_bytes": block_bytes,
        "blocks_per_chunk": bpc,
        "chunks_per_job": job_chunks,
        "jobs_per_figure": len(jobs),
        "bytes": nbytes,
        "staging_pinned": pool.pinned,
        "limit": f"{lim} (contiguous device tensor <-> {'pinned' if pool.pinned else 'pageable'} host, same bytes)",
        "raw_pinned_d2h_gbps": limit["d2h_gbps"],
        "raw_pinned_h2d_gbps": limit["h2d_gbps"],
        "layouts": {},
    }
    counts = [(bb, len(list(same))) for bb, same in itertools.groupby(block_bytes)]
    sizes = ",".join(f"{bb / 1024:g}" + (f"x{k}" if k > 1 else "") for bb, k in counts)  # 32x12,16x4
    lines.append(
        f"engine layout, {name}: {len(block_bytes)} tensor(s) of {sizes} KiB per block, {bpc} blocks/chunk,"
        f" {len(jobs)} jobs of {job_chunks * cb / _MIB:.2f} MiB, {nbytes / _MIB:.1f} MiB per figure"
        f" ({'pinned' if pool.pinned else 'pageable'} staging)"
    )
    lines.append(f"  limit = {out['limit']}: D2H {limit['d2h_gbps']:.2f} GB/s, H2D {limit['h2d_gbps']:.2f} GB/s")
    rng = np.random.default_rng(1)
    all_ok = True
    for kind, label in _LAYOUTS.items():
        ids = _ids(kind, rng, num_blocks, n)
        spans = [(ids[a * bpc : b * bpc], buf.tensor[a * cb : b * cb]) for a, b in jobs]
        for t in tensors:
            t.random_(0, 256, generator=gen)

        d2h = functools.partial(_gather_jobs, copier, group, spans, bpc)
        h2d = functools.partial(_scatter_jobs, copier, group, spans, bpc)
        row: dict[str, Any] = {}
        row["d2h_gbps"] = round(nbytes / _median_time(d2h, dev, repeats) / 1e9, 3)
        want = _ref_payload(tensors, ids, bpc).cpu()
        row["d2h_bytes_ok"] = bool(torch.equal(buf.tensor, want))
        for t in tensors:
            t.zero_()
        row["h2d_gbps"] = round(nbytes / _median_time(h2d, dev, repeats) / 1e9, 3)
        _sync(dev)
        rest = torch.tensor(sorted(set(range(num_blocks)) - set(ids)), dtype=torch.long, device=dev)
        row["h2d_bytes_ok"] = bool(
            torch.equal(_ref_payload(tensors, ids, bpc).cpu(), want)
            and not any(bool(t.index_select(0, rest).any()) for t in tensors)
        )
        row["d2h_vs_raw_pinned"] = round(row["d2h_gbps"] / limit["d2h_gbps"], 3)
        row["h2d_vs_raw_pinned"] = round(row["h2d_gbps"] / limit["h2d_gbps"], 3)
        out["layouts"][kind] = row
        all_ok = all_ok and row["d2h_bytes_ok"] and row["h2d_bytes_ok"]
        for way in ("d2h", "h2d"):
            ok = "bytes ok" if row[f"{way}_bytes_ok"] else "BYTES DIFFER"
            lines.append(
                f"  {way.upper()} {label:<28} {row[f'{way}_gbps']:7.2f} GB/s ="
                f" {row[f'{way}_vs_raw_pinned']:.3f} x {lim} {way.upper()}  ({ok})"
            )
    out["bytes_ok"] = all_ok
    pool.release(buf)
    pool.free()
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


def _kib_list(spec: str) -> list[int]:
    """Block bytes of ``"32x12,16x4,8"``: 12 tensors of 32 KiB, 4 of 16 KiB, one of 8 KiB."""
    out: list[int] = []
    for item in spec.split(","):
        kib, _, count = item.partition("x")
        out += [int(kib) << 10] * int(count or 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block-kib", type=int, default=None, help="bytes per KV block (default 256 KiB CUDA, 64 KiB CPU)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per transfer (default 1024 CUDA, 256 CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks-per-chunk", type=int, default=4)
    ap.add_argument("--figure-mib", type=int, default=None, help="MiB per engine-layout figure (256 CUDA, 8 CPU)")
    ap.add_argument("--job-mib", type=int, default=None, help="MiB per Copier call (16 CUDA, 1 CPU)")
    ap.add_argument(
        "--multi-kib",
        default=None,
        help="block KiB per tensor of the multi-tensor group, KxN: N of them (32x12,16x4 / 16,16,8)",
    )
    ap.add_argument("--copy-threads", type=int, default=1, help="Copier(threads=...) (host copies only)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if not cuda:  # torch's CPU copy_ split over its threads ran 8 MiB at ~1 GB/s on a loaded 2-core VM
        torch.set_num_threads(1)
    block_bytes = (a.block_kib or (256 if cuda else 64)) << 10
    n = a.blocks or (1024 if cuda else 256)
    num_blocks = 2 * n + 2
    figure = (a.figure_mib or (256 if cuda else 8)) * _MIB
    job = (a.job_mib or (16 if cuda else 1)) * _MIB
    multi = _kib_list(a.multi_kib or ("32x12,16x4" if cuda else "16,16,8"))
    bpc = a.blocks_per_chunk
    t0 = time.perf_counter()
    lines: list[str] = []
    result = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "staging": staging_vs_raw(dev, block_bytes, num_blocks, n, a.repeats),
        "engine_layout": {
            "one_tensor": engine_layout(
                dev, "one tensor", [block_bytes], figure, job, bpc, a.repeats, a.copy_threads, lines
            ),
            "multi_tensor": engine_layout(
                dev, "multi-tensor group", multi, figure, job, bpc, a.repeats, a.copy_threads, lines
            ),
        },
        "vllm_path": vllm_path(dev, block_bytes, num_blocks, n, bpc),
    }
    result["seconds"] = round(time.perf_counter() - t0, 2)
    st = result["staging"]
    print(
        f"one chunk per call, {st['blocks_per_transfer']} random blocks of {block_bytes >> 10} KiB:"
        f" D2H {st['tieredkv_d2h_gbps']:.2f} GB/s ({st['raw_d2h_contiguous_gbps']:.2f} raw contiguous),"
        f" H2D {st['tieredkv_h2d_gbps']:.2f} GB/s ({st['raw_h2d_contiguous_gbps']:.2f} raw contiguous),"
        f" round trip {'ok' if st['staging_roundtrip_ok'] else 'BYTES DIFFER'}"
    )
    print("\n".join(lines))
    vp = result["vllm_path"]
    print(f"vLLM path: {vp.get('skipped') or ('bytes ok' if vp.get('bytes_verified') else 'BYTES DIFFER')}")
    dry = "" if cuda else " (CPU tensors: the code paths and bytes are checked; the GB/s are no device's)"
    print(f"{result['device']}, {result['seconds']} s{dry}")
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    ok = (
        result["staging"]["staging_roundtrip_ok"]
        and all(g["bytes_ok"] for g in result["engine_layout"].values())
        and result["vllm_path"].get("bytes_verified", True)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

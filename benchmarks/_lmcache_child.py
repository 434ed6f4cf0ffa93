"""LMCache 0.5.6 side of ``benchmarks/bench_peers.py``; runs in ``.venv-lmcache`` (never imports tieredkv).

    .venv-lmcache/bin/python benchmarks/_lmcache_child.py --backend cpu|disk|redis|resp \
        --sizes 65536,262144 --total-bytes 134217728 --reps 3 --out result.json \
        [--layouts permuted,consecutive] [--copy blocks|lmcache] \
        [--redis-url redis://127.0.0.1:PORT/0] [--workdir DIR] [--batch-bytes 16777216] [--turns R,W]

(``redis``/``resp`` empty the Redis database after each round: give it a private server only, as
``bench_peers.py`` does.)

API used (the highest level that runs without vLLM and without a GPU): ``LMCacheEngineBuilder``
builds an ``LMCacheEngine`` (``post_init()`` creates its ``StorageManager`` and backends from an
``LMCacheEngineConfig``); each batch is ``engine.store(tokens, kvcaches=kv, slot_mapping=slots)``
and ``engine.retrieve(tokens, kvcaches=kv, slot_mapping=slots)``, the arguments vLLM's adapter
passes (``lmcache.integration.vllm.vllm_v1_adapter``): token chunking and prefix hashing,
allocation from LMCache's CPU pool, the connector's ``batched_from_gpu`` / ``batched_to_gpu``,
``StorageManager.batched_put`` / ``batched_get`` into the backend, back.

The KV cache is paged, in the same layout as tieredkv's side (``--layouts``; round ``k``, the
warm-up being 0, draws its block ids from seed ``k`` on both sides): vLLM's per-layer
``[2, num_blocks, block_size, num_heads, head_size]`` (K and V planes; one layer, one head),
block 0 the null block, blocks of 64 tokens, ``chunk_bytes / 4`` with K and V, four to an
LMCache chunk of 256 tokens, as tieredkv's ``bench_blocks`` has four blocks of
``chunk_bytes / 4`` to a chunk. Chunk ``i`` is stored from the blocks
``tieredkv.layouts.round_ids`` draws among ``1 .. N`` and retrieved into those it draws next
among ``N+1 .. 2N`` (this process runs where tieredkv is not installed: it loads
``tieredkv/layouts.py``, NumPy only, by its path; each result carries ``block_ids``, a digest of
the ids it used, which ``bench_peers.py`` checks against tieredkv's, as the two virtualenvs'
NumPy versions differ).
``slot_mapping`` is per token (``block * block_size + offset``), as vLLM's adapter builds it.

What LMCache 0.5.6 offers for a paged KV cache on CPU, and why the connector is a stand-in:

* ``CreateGPUConnector(config, metadata, EngineType.VLLM)`` raises ``No supported cpu connector
  found.`` on a CPU-only build; ``EngineType.MOCK`` (``MockGPUConnector``, its standalone mode)
  copies nothing, so no bytes could be verified.
* Its vLLM connector, ``VLLMPagedMemGPUConnectorV2`` (``from_gpu`` / ``to_gpu`` by
  ``slot_mapping``; V3 and the layerwise ones alike), needs CUDA: ``torch.cuda.Stream()`` in
  ``__init__``, ``_initialize_pointers`` asserts ``device.type == "cuda"``.
* Its per-chunk transfer, ``lmcache.device_ops.multi_layer_kv_transfer(memory_obj.tensor,
  kv_cache_pointers, slot_mapping[start:end], ...)``, does run on CPU: a CPU-only build resolves
  ``device_ops`` to ``CpuDeviceOps``, whose ``multi_layer_kv_transfer`` is the torch fallback
  ``lmcache.v1.platform.torch_ops.mem_kernels.multi_layer_kv_transfer`` (a per-token
  ``index_select`` / ``index_copy_`` and a masked assignment). It needs the format named:
  ``normalize_kv_and_discover_format`` reads a one-head ``[2, nb, bs, 1, hd]`` as the HND
  ``NL_X_TWO_NB_NH_BS_HS``, which the fallback rejects, so it gets
  ``layout_hints={"kv_layout": "NHD"}`` (``NL_X_TWO_NB_BS_NH_HS``). In one micro-run here (one
  thread, 64 KiB / 1 MiB chunks, permuted blocks, the copy alone): 0.59 / 1.02 GB/s from the
  pages, 0.43 / 0.64 into them, against 5-15 GB/s for the block copies below.
* ``device_ops.multi_layer_block_kv_transfer`` (block ids instead of slots) serves LMCache's
  multiprocess mode (``torch_ops.mp_mem_kernels``), not ``LMCacheEngine.store`` / ``retrieve``.

So the connector (:class:`PagedCPUConnector`, the stand-in for vLLM's GPU connector, whose real
copy is a CUDA kernel) takes LMCache's own arguments and, by default (``--copy blocks``), moves
whole blocks: the chunk's block ids are ``slot_mapping[start:end:block_size] // block_size``, read
with one ``torch.index_select`` per K/V plane and written with one numpy fancy assignment per plane
(the fastest CPU copies of scattered blocks found: in LMCache's favour). ``--copy lmcache`` calls
LMCache's own fallback, ``device_ops.multi_layer_kv_transfer``, per chunk instead, as
``VLLMPagedMemGPUConnectorV2`` does on CUDA.

Backends (one engine per chunk size, ``chunk_size`` = 256 tokens, KV dtype uint8, ``kv_shape``
``(1 layer, 2, 256, 1, chunk_bytes // 512)`` so one LMCache chunk is exactly ``chunk_bytes``):

* ``cpu``: ``local_cpu: true`` (LocalCPUBackend hot cache), nothing else.
* ``disk``: ``local_cpu: false`` (the CPU pool is then only LMCache's staging allocator, so a
  retrieve really reads the files), ``local_disk: <dir>``, ``max_local_disk_size`` of every byte
  the engine stores in its life (``(reps + 1) * layouts * total`` + 64 MiB), though one layout's
  chunks at most are on disk at once: LocalDiskBackend (0.5.6) adds each put to
  ``current_cache_size`` in ``submit_put_task`` and lowers it only when it evicts there, while
  ``remove()`` (what ``engine.clear()`` calls) lowers ``usage`` alone. With a cap of one round
  (as before the two layouts), every put past it silently evicted the oldest chunk on disk, one of
  the layout being stored, and the retrieve found a fraction of the tokens. After each store the
  child checks that all ``n`` chunks are on disk (``len(LocalDiskBackend.dict)``, untimed).
* ``redis``: ``local_cpu: false``, ``remote_url: redis://127.0.0.1:PORT`` (RemoteBackend with
  LMCache's ``RedisConnector``, redis-py asyncio), ``remote_serde: naive``.
* ``resp``: the same with ``remote_url: resp://127.0.0.1:PORT`` (RemoteBackend with LMCache's
  ``RESPConnector``: its native multi-threaded RESP client, ``lmcache_redis``; batched SET/GET of
  raw chunk bytes, no metadata key). Same Redis server, LMCache's other way to use it.

Timing: a store is done when the backend holds every chunk: for ``disk`` when LocalDiskBackend's
in-flight put list is empty (a key is published after its file is written), for ``redis``/``resp`` when
the connector's put coroutines of every batch have returned (counted by wrapping them; LMCache's
batched put path does not track them itself), for ``cpu`` when ``store()`` returns (synchronous).
Each engine first does one untimed round (warms LMCache's CPU pool and code paths: in LMCache's
favour), then ``reps`` timed rounds; a round is one store + retrieve of ``total`` bytes per layout,
each on new tokens (new keys). Every retrieved block is compared with the block it was stored
from, and every token must be reported retrieved. After each layout's store + retrieve (untimed)
its chunks are dropped (``engine.clear(tokens, locations=[backend])``;
for Redis a FLUSHDB of the private server the parent started), as tieredkv starts every round on
an empty tier.
Prints nothing on stdout but LMCache's own logging; the results go to ``--out`` as JSON, rewritten
after every size so a later failure keeps what was measured: per size ``{"size", "layouts":
{layout: figures (:func:`side_figures`)}, "block_ids": {layout: sha1 (:func:`ids_digest`)}, "copy"}``.

With ``--turns`` (as ``bench_peers.py`` runs it) every step waits for the parent's go and
reports back when it is over: an engine's set-up with its warm-up round, then each timed round.
The parent runs tieredkv's round of the same size and rep in between, so the two sides'
rounds are interleaved and never overlap (this machine's state drifts over minutes).

A watchdog ends the process (exit 3, every thread's stack on stderr) when one round (store +
retrieve of ``total`` bytes, or the engine's set-up or close) runs past ``--round-timeout``. Seen with ``resp``: ``RESPConnector.batched_contains`` (called by
``retrieve``) uses ``ConnectorClientBase.batch_exists_sync``, which submits to the native client
*before* registering the future that the event-loop thread completes; a completion drained in
between is dropped (``_pending.pop`` finds nothing) and ``fut.result()`` waits forever. The parent
runs the unfinished sizes again in a fresh process.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("PYTHONHASHSEED", "0")

import numpy as np
import torch


def _load_layouts() -> Any:
    """``tieredkv/layouts.py`` loaded by its path (NumPy only): this process runs in LMCache's
    virtualenv, where tieredkv is not installed, and draws its block ids from the same code."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tieredkv" / "layouts.py"
    spec = importlib.util.spec_from_file_location("tieredkv_layouts", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layouts_module = _load_layouts()
LAYOUTS, BLOCKS_PER_CHUNK = layouts_module.LAYOUTS, layouts_module.BLOCKS_PER_CHUNK
round_ids, ids_digest = layouts_module.round_ids, layouts_module.ids_digest
TOKENS_PER_CHUNK = 256
BLOCK_TOKENS = TOKENS_PER_CHUNK // BLOCKS_PER_CHUNK
#: How the connector moves a chunk between the paged KV cache and a MemoryObj (``--copy``).
COPIES = ("blocks", "lmcache")
BACKEND_CLASS = {
    "cpu": "LocalCPUBackend",
    "disk": "LocalDiskBackend",
    "redis": "RemoteBackend",
    "resp": "RemoteBackend",
}
GiB = 1 << 30
MiB = 1 << 20


def side_figures(n: int, nbytes: int, samples: list[tuple[float, float]]) -> dict[str, Any]:
    """One side's figures for one chunk size from ``(store s, load s)`` per rep (both sides of
    ``bench_peers.py`` report them the same way; it imports this)."""
    return {
        "chunks": n,
        "bytes": nbytes,
        "verified": True,
        "store_s": [round(s, 6) for s, _ in samples],
        "load_s": [round(lo, 6) for _, lo in samples],
        "store_gbps": [round(nbytes / s / 1e9, 4) for s, _ in samples],
        "load_gbps": [round(nbytes / lo / 1e9, 4) for _, lo in samples],
    }


def _connector_class() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class PagedCPUConnector(GPUConnectorInterface):  # type: ignore[misc, valid-type]
        """vLLM's paged KV cache on CPU (``kvcaches``: one ``[2, num_blocks, block_size, heads,
        head]`` tensor per layer) <-> LMCache MemoryObjs (KV_2LTD), by ``slot_mapping``: whole
        blocks (``copy="blocks"``) or LMCache's own ``device_ops.multi_layer_kv_transfer``."""

        def __init__(self, kv_shape: tuple[int, int, int, int, int], copy: str = "blocks") -> None:
            self.kv_shape, self.copy = kv_shape, copy
            self._lmc: tuple[int, Any, Any] | None = None  # (pages' address, format, pointers)

        def _blocks(self, memory_obj: Any, start: int, end: int, kw: Any) -> tuple[Any, Any, Any]:
            """(K/V planes of the pages as [2, num_blocks, block bytes], the MemoryObj as
            [2, blocks, block bytes], the chunk's block ids) for whole blocks."""
            kv = kw["kvcaches"][0]
            bs = kv.shape[2]
            ids = kw["slot_mapping"][start:end:bs] // bs  # each block's first slot
            return kv.view(2, kv.shape[1], -1), memory_obj.tensor.view(2, len(ids), -1), ids

        def _lmcache(self, memory_obj: Any, start: int, end: int, kw: Any, to_pages: bool) -> None:
            """What ``VLLMPagedMemGPUConnectorV2.from_gpu`` / ``to_gpu`` do per chunk, on CPU."""
            import lmcache.lmcache_native as native
            from lmcache import device_ops
            from lmcache.utils import EngineType
            from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format

            kv = kw["kvcaches"][0]
            if self._lmc is None or self._lmc[0] != kv.data_ptr():
                fmt, layers = normalize_kv_and_discover_format(
                    kw["kvcaches"], EngineType.VLLM, layout_hints={"kv_layout": "NHD"}
                )
                self._lmc = (kv.data_ptr(), fmt, torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64))
            _, fmt, ptrs = self._lmc
            way = native.TransferDirection.H2D if to_pages else native.TransferDirection.D2H
            device_ops.multi_layer_kv_transfer(
                memory_obj.tensor,
                ptrs,
                kw["slot_mapping"][start:end],
                kv.device,
                kv.shape[1] * kv.shape[2],
                way,
                fmt,
                block_size=kv.shape[2],
                head_size=kv.shape[4],
            )

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            if self.copy == "lmcache":
                return self._lmcache(memory_obj, start, end, kw, to_pages=False)
            pages, obj, ids = self._blocks(memory_obj, start, end, kw)
            torch.index_select(pages[0], 0, ids, out=obj[0])
            torch.index_select(pages[1], 0, ids, out=obj[1])
            return None

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            if self.copy == "lmcache":
                return self._lmcache(memory_obj, start, end, kw, to_pages=True)
            pages, obj, ids = self._blocks(memory_obj, start, end, kw)
            p, o, i = pages.numpy(), obj.numpy(), ids.numpy()
            p[0, i] = o[0]  # numpy's fancy assignment: a memcpy per block (torch's index_copy_ is slower)
            p[1, i] = o[1]
            return None

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            layers, kv, _, heads, head = self.kv_shape
            return torch.Size([kv, layers, num_tokens, heads * head])

    return PagedCPUConnector


class _PutCounter:
    """Counts chunks whose remote put coroutine has returned (wraps the connector's put methods)."""

    def __init__(self, conn: Any) -> None:
        self.done = 0
        self.failed = 0
        self._lock = threading.Lock()
        for name, count in (
            ("batched_put", lambda a, kw: len(kw.get("keys", a[0] if a else []))),
            ("put", lambda a, kw: 1),
        ):
            orig = getattr(conn, name, None)
            if orig is not None:
                setattr(conn, name, self._wrap(orig, count))

    def _wrap(self, orig: Any, count: Any) -> Any:
        async def wrapped(*a: Any, **kw: Any) -> Any:
            ok = False
            try:
                r = await orig(*a, **kw)
                ok = True
                return r
            finally:
                with self._lock:
                    if ok:
                        self.done += count(a, kw)
                    else:
                        self.failed += count(a, kw)

        return wrapped


def _engine(
    backend: str,
    size: int,
    n: int,
    reps: int,
    workdir: str,
    redis_url: str | None,
    tag: str,
    copy: str,
    layouts: int = 1,
) -> Any:
    """One engine for chunks of ``size`` bytes that will store ``n`` chunks per layout, ``layouts``
    layouts per round, ``reps + 1`` rounds (warm-up included)."""
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    hidden = size // (2 * TOKENS_PER_CHUNK)
    kv_shape = (1, 2, TOKENS_PER_CHUNK, 1, hidden)
    total = n * size
    # The CPU pool holds every round (warm-up + reps) for the cpu backend; for disk/redis it is
    # only staging (chunks in flight), the same size keeps allocation out of the picture.
    pool = ((reps + 1) * total + 64 * MiB) / GiB
    cfg: dict[str, Any] = {
        "chunk_size": TOKENS_PER_CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": pool,
        "lmcache_instance_id": tag,
    }
    if backend == "disk":
        d = os.path.join(workdir, tag)
        os.makedirs(d, exist_ok=True)
        # Every byte the engine will ever store, not just what is on disk at once (one layout:
        # each is cleared after its retrieve): LMCache 0.5.6's LocalDiskBackend counts a put into
        # ``current_cache_size`` (submit_put_task) but ``remove()`` (what ``clear()`` calls) never
        # takes it back; only its own eviction does. With a cap of one round, the puts after the
        # first round silently evicted the chunks just written (see the module docstring).
        lifetime = (reps + 1) * layouts * total
        cfg.update(local_cpu=False, local_disk=d, max_local_disk_size=(lifetime + 64 * MiB) / GiB)
    elif backend in ("redis", "resp"):
        if not redis_url:
            raise SystemExit(f"--redis-url is required for --backend {backend}")
        url = redis_url if backend == "redis" else "resp://" + redis_url.split("://", 1)[1].split("/", 1)[0]
        cfg.update(local_cpu=False, remote_url=url, remote_serde="naive")
    config = LMCacheEngineConfig.from_defaults(**cfg)
    md = LMCacheMetadata(
        model_name="tieredkv-peers",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.uint8,
        kv_shape=kv_shape,
        role="worker",
    )
    eng = LMCacheEngineBuilder.get_or_create(
        tag, config, md, _connector_class()(kv_shape, copy), mock_up_broadcast_fn, mock_up_broadcast_object_fn
    )
    eng.post_init()
    return eng, hidden


def _backend_obj(eng: Any, backend: str) -> Any:
    sb = eng.storage_manager.storage_backends
    want = BACKEND_CLASS[backend]
    if want not in sb:
        raise RuntimeError(f"LMCache created backends {list(sb)}, not {want}")
    return sb[want]


def _wait(pred: Any, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _destroy(builder: Any, tag: str, notes: list[str], timeout: float = 2.0) -> None:
    """``LMCacheEngineBuilder.destroy`` with a deadline.

    In LMCache 0.5.6 closing a ``redis://`` or ``resp://`` RemoteBackend never returns: the async
    ``RedisConnector.close`` / ``RESPConnector.close`` runs on the storage manager's event loop and
    calls the synchronous ``AsyncPQExecutor.shutdown(wait=True)``, which blocks that same loop on a
    future only the loop could complete. The engine is left behind (its threads idle) and the process ends with
    ``os._exit``; the measurement (already finished) is not affected."""
    t = threading.Thread(target=builder.destroy, args=(tag,), name=f"destroy-{tag}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        msg = (
            f"LMCacheEngineBuilder.destroy() of the {tag.split('-')[1]} engines did not return within"
            f" {timeout:.0f} s (LMCache 0.5.6 RemoteBackend close deadlock); left running, after measuring"
        )
        if msg not in notes:
            notes.append(msg)


def run_size(
    backend: str,
    size: int,
    n: int,
    reps: int,
    batch_bytes: int,
    workdir: str,
    redis_url: str | None,
    seed: int,
    notes: list[str],
    dog: _Watchdog,
    turns: _Turns,
    layouts: list[str],
    copy: str = "blocks",
) -> dict[str, Any]:
    """One chunk size: the engine's set-up and warm-up round in one turn, then each timed round in
    a turn of its own; the last turn is given back by the caller (after the close and the
    result's file). Each round stores and retrieves every chunk once per layout."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    tag = f"peers-{backend}-{size}-{os.getpid()}"
    turns.take(dog)
    dog.arm(f"LMCache {backend} {size} B set-up")
    eng, hidden = _engine(backend, size, n, reps, workdir, redis_url, tag, copy, layouts=len(layouts))
    try:
        be = _backend_obj(eng, backend)
        name = BACKEND_CLASS[backend]
        if backend in ("redis", "resp") and be.connection is None:
            raise RuntimeError(
                f"LMCache {backend}: RemoteBackend has no connection (connector creation failed; see log)"
            )
        counter = _PutCounter(be.connection) if backend in ("redis", "resp") else None
        per = max(1, batch_bytes // size)
        batches = [(b, min(n, b + per)) for b in range(0, n, per)]
        nb = n * BLOCKS_PER_CHUNK
        # vLLM's paged KV cache of one layer: [2 (K, V), blocks, block_size, heads, head]; block 0
        # is the null block, 1..nb hold the chunks to store, nb+1..2nb take the retrieved ones.
        kv = torch.zeros(2, 1 + 2 * nb, BLOCK_TOKENS, 1, hidden, dtype=torch.uint8)
        g = torch.Generator().manual_seed(seed)
        kv[:, 1 : 1 + nb] = torch.randint(0, 256, (2, nb, BLOCK_TOKENS, 1, hidden), dtype=torch.uint8, generator=g)
        kvcaches = [kv]
        pages = kv.view(2, 1 + 2 * nb, -1).numpy()
        offsets = np.arange(BLOCK_TOKENS)
        used: dict[str, Any] = {lay: hashlib.sha1(usedforsecurity=False) for lay in layouts}
        tok_lo = 0

        def one_layout(k: int, layout: str) -> tuple[float, float]:
            nonlocal tok_lo
            store_ids, load_ids = round_ids(layout, nb, k)
            for ids in (store_ids, load_ids):
                used[layout].update(np.asarray(ids, dtype=np.int64).tobytes())
            # vLLM's slot mapping: one slot per token, block * block_size + offset
            slots = [
                torch.from_numpy((np.asarray(ids)[:, None] * BLOCK_TOKENS + offsets).reshape(-1))
                for ids in (store_ids, load_ids)
            ]
            # New tokens (so new keys) every round and layout; one store()/retrieve() per batch of chunks.
            toks = [torch.arange(tok_lo + b * TOKENS_PER_CHUNK, tok_lo + e * TOKENS_PER_CHUNK) for b, e in batches]
            tok_lo += n * TOKENS_PER_CHUNK
            kv[:, 1 + nb :].zero_()
            # As tieredkv's side does before its stores (tieredkv.backends._rawbench.warm_free_pages;
            # this process never imports tieredkv): fault in and free the memory the writes will
            # take, so neither side draws pages this VM has handed back to its host.
            warm = np.empty(n * size * 5 // 4 + (16 << 20), np.uint8)
            warm.fill(1)
            del warm
            before = counter.done if counter else 0
            t0 = time.perf_counter()
            for (b, e), t in zip(batches, toks):
                sl = slots[0][b * TOKENS_PER_CHUNK : e * TOKENS_PER_CHUNK]
                eng.store(t, kvcaches=kvcaches, slot_mapping=sl)
            if backend == "disk":
                _wait(lambda: not be.disk_worker.put_tasks, "LMCache disk writes")
            elif counter is not None:
                _wait(lambda: counter.done - before >= n or counter.failed, "LMCache redis puts")
                if counter.failed:
                    raise RuntimeError(f"{counter.failed} LMCache redis puts failed")
            ts = time.perf_counter() - t0
            if backend == "disk" and len(be.dict) != n:  # untimed; its in-flight list is empty
                raise RuntimeError(
                    f"LMCache disk: {len(be.dict)} of {n} chunks on disk after the store (puts skipped or"
                    f" evicted: current_cache_size {be.current_cache_size / MiB:.0f} MiB of"
                    f" max_local_disk_size {be.max_cache_size / MiB:.0f} MiB)"
                )
            got = 0
            t0 = time.perf_counter()
            for (b, e), t in zip(batches, toks):
                sl = slots[1][b * TOKENS_PER_CHUNK : e * TOKENS_PER_CHUNK]
                got += int(eng.retrieve(t, kvcaches=kvcaches, slot_mapping=sl).sum())
            tl = time.perf_counter() - t0
            if got != n * TOKENS_PER_CHUNK:
                raise RuntimeError(f"LMCache {backend}: retrieved {got} of {n * TOKENS_PER_CHUNK} tokens")
            step = max(1, (64 << 20) // (size // BLOCKS_PER_CHUNK))  # compare 64 MiB at a time
            for i in range(0, nb, step):
                if not np.array_equal(pages[:, load_ids[i : i + step]], pages[:, store_ids[i : i + step]]):
                    raise RuntimeError(f"LMCache {backend}: retrieved bytes differ from stored bytes ({layout})")
            # Untimed: drop these chunks, as tieredkv starts every run on an empty tier (frees
            # LMCache's CPU pool, deletes the disk files, empties the private Redis).
            if backend in ("redis", "resp"):
                _flush_private_redis(redis_url or "")
            else:
                cleared = sum(eng.clear(tokens=t, locations=[name]) for t in toks)
                if cleared != n:
                    raise RuntimeError(f"LMCache {backend}: clear removed {cleared} of {n} chunks")
            return ts, tl

        def one_round(k: int) -> dict[str, tuple[float, float]]:
            dog.arm(f"LMCache {backend} {size} B round {k} ({'warm-up' if k == 0 else 'timed'})")
            return {lay: one_layout(k, lay) for lay in layouts}

        # As vLLM's engine does after start-up, and as tieredkv's side of this bench does: the
        # set-up heap leaves the collector's view, so a full collection costs what it does there.
        gc.collect()
        gc.freeze()
        try:
            one_round(0)  # warm-up, untimed
            samples: dict[str, list[tuple[float, float]]] = {lay: [] for lay in layouts}
            for k in range(1, reps + 1):
                turns.give()
                turns.take(dog)
                for lay, sample in one_round(k).items():
                    samples[lay].append(sample)
        finally:
            gc.unfreeze()
        dog.arm(f"LMCache {backend} {size} B close")
        return {
            "size": size,
            "layouts": {lay: side_figures(n, n * size, samples[lay]) for lay in layouts},
            "block_ids": {lay: h.hexdigest() for lay, h in used.items()},
            "copy": copy,
        }
    finally:
        _destroy(LMCacheEngineBuilder, tag, notes)
        if backend == "disk":
            shutil.rmtree(os.path.join(workdir, tag), ignore_errors=True)
        if backend in ("redis", "resp") and redis_url:
            _flush_private_redis(redis_url)


def _flush_private_redis(url: str) -> None:
    """The parent starts a private throwaway redis-server for this run; empty it between sizes."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        r.flushdb()
    finally:
        r.close()


class _Turns:
    """Rounds taken in turn with the parent (``--turns R,W``: two pipe descriptors it passed):
    :meth:`take` waits for its ``g`` on R before a step, :meth:`give` writes ``d`` on W after it,
    so no step of this process runs while the parent measures tieredkv. Without ``--turns``
    every step runs at once."""

    def __init__(self, fds: str | None) -> None:
        self._fds = tuple(int(x) for x in fds.split(",")) if fds else None

    def take(self, dog: _Watchdog) -> None:
        if self._fds is None:
            return
        dog.disarm()  # waiting for a turn is no step of ours
        if os.read(self._fds[0], 1) != b"g":
            raise SystemExit("the parent closed its turns pipe")

    def give(self) -> None:
        if self._fds is not None:
            os.write(self._fds[1], b"d")


class _Watchdog:
    """Ends the process if one armed step runs past ``seconds``: dumps every thread's stack to stderr
    (the parent's log), writes what was measured so far with the error, then ``os._exit(3)``."""

    def __init__(self, seconds: float, out: dict[str, Any], path: str) -> None:
        self.seconds, self.out, self.path = seconds, out, path
        self.what = ""
        self._deadline = float("inf")
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, what: str) -> None:
        with self._lock:
            self.what, self._deadline = what, time.monotonic() + self.seconds

    def disarm(self) -> None:
        with self._lock:
            self.what, self._deadline = "", float("inf")

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                late = time.monotonic() > self._deadline
            if late:
                print(f"watchdog: {self.what} did not finish in {self.seconds:.0f} s; stacks:", file=sys.stderr)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self.out["error"] = (
                    f"TimeoutError: {self.what} did not finish in {self.seconds:.0f} s (stacks in the log)"
                )
                _write(self.path, self.out)
                sys.stderr.flush()
                os._exit(3)


def _write(path: str, out: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True, choices=sorted(BACKEND_CLASS))
    ap.add_argument("--sizes", required=True, help="chunk sizes in bytes, comma-separated")
    ap.add_argument("--total-bytes", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-bytes", type=int, default=16 * MiB, help="bytes per store()/retrieve() call")
    ap.add_argument("--redis-url")
    ap.add_argument("--workdir")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (same as the tieredkv side)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--turns",
        help="R,W: pipe descriptors to take turns with the parent on (one byte per step each way)",
    )
    ap.add_argument(
        "--layouts",
        default=LAYOUTS[0],
        help=f"block-id layouts of the paged KV cache, comma-separated ({', '.join(LAYOUTS)})",
    )
    ap.add_argument(
        "--copy",
        default=COPIES[0],
        choices=COPIES,
        help="blocks: whole blocks (index_select / numpy); lmcache: LMCache's device_ops.multi_layer_kv_transfer",
    )
    ap.add_argument(
        "--round-timeout",
        type=float,
        default=120.0,
        help="deadline (seconds) for one round, or one engine's set-up or close",
    )
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    torch.set_num_threads(a.threads)
    import lmcache

    out: dict[str, Any] = {
        "backend": a.backend,
        "lmcache": getattr(lmcache, "__version__", "?"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "results": [],
        "notes": [],
    }
    try:
        from importlib.metadata import version

        out["lmcache"] = version("lmcache")
    except Exception:  # noqa: BLE001, S110 - the version is a label; a missing one is no error
        pass
    work = a.workdir or tempfile.mkdtemp(prefix="lmcache-peers-")
    dog = _Watchdog(a.round_timeout, out, a.out)
    turns = _Turns(a.turns)
    try:
        for i, size in enumerate(int(s) for s in a.sizes.split(",")):
            if size % (2 * TOKENS_PER_CHUNK):
                raise SystemExit(f"chunk size {size} is not a multiple of {2 * TOKENS_PER_CHUNK} bytes")
            n = max(4, a.total_bytes // size)
            out["results"].append(
                run_size(
                    a.backend,
                    size,
                    n,
                    a.reps,
                    a.batch_bytes,
                    work,
                    a.redis_url,
                    seed=i,
                    notes=out["notes"],
                    dog=dog,
                    turns=turns,
                    layouts=layouts,
                    copy=a.copy,
                )
            )
            for lay, fig in out["results"][-1]["layouts"].items():
                print(
                    f"lmcache {a.backend} {size} B {lay}: store {fig['store_gbps']} GB/s, load {fig['load_gbps']} GB/s",
                    file=sys.stderr,
                    flush=True,
                )
            _write(a.out, out)  # what is measured survives a later failure
            turns.give()
    except BaseException as e:  # noqa: BLE001 - report what failed; the parent prints it and marks the backend
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        dog.arm("cleanup")
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        _write(a.out, out)
    return 1 if "error" in out else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # an engine whose close hung keeps non-daemon threads alive; do not wait for them

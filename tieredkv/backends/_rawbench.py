"""Raw limits of the built-in tiers' media, measured without tieredkv on the bench's payloads.

Each tier's :meth:`~tieredkv.backends.base.Tier.raw_limits` picks the figures of its medium from
here and names the one it is judged against; ``tieredkv bench`` (:mod:`tieredkv.bench`) runs
them interleaved with the tiers. Payloads are ``src``, a ``(chunks, size)`` uint8 tensor, read
back into ``dst`` of the same shape; this module never imports torch itself (the tensors come
from the caller), lmdb and redis only inside the functions that use them.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BATCH_BYTES",
    "REDIS_BENCHMARK_KEYS",
    "gbps",
    "raw_file",
    "raw_host_memory",
    "raw_lmdb",
    "raw_redis",
    "redis_benchmark",
    "redis_benchmark_keys",
    "run_loop",
    "warm_free_pages",
]

MiB = 1 << 20
#: Bytes per write transaction / pipeline job, the same batch the bench gives the pipeline.
BATCH_BYTES = 16 * MiB


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor row, without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs lack __buffer__


class _Digests:
    """The integrity work alone, for a ``checked`` raw run (or nothing, unchecked): an xxh3-64 of
    every payload as it is written (kept, as a header would carry it), and of every delivered
    copy, compared with it (a mismatch raises)."""

    def __init__(self, checked: bool, what: str) -> None:
        import xxhash

        self.checked = checked
        self.what = what
        self.sums: list[int] = []
        self._digest = xxhash.xxh3_64_intdigest

    def seal(self, payload: memoryview) -> None:
        if self.checked:
            self.sums.append(self._digest(payload))

    def check(self, i: int, delivered: memoryview) -> None:
        if self.checked and self._digest(delivered) != self.sums[i]:
            raise ValueError(f"{self.what}: key {i} read back other bytes than were written")


def warm_free_pages(src: torch.Tensor) -> None:
    """Fault in fresh anonymous memory for writing ``src`` (its bytes, a quarter more for B-tree
    pages and allocator slack, and one batch) and free it again, just before a timed write.

    This machine kind is a Firecracker guest booted with free page reporting
    (``page_reporting.page_reporting_order=11`` on the kernel command line): a couple of seconds
    after memory is freed, the guest hands it back to the host, and the next touch of such a page
    costs a host fault. A page-cache or heap write that lands on those pages runs at 0.4-0.6 GB/s
    instead of 1.8-2.2 GB/s (raw py-lmdb put, 64 KiB values, measured after 3 s idle with and
    without this). Which run draws them is chance (what ran before, and how long ago), so both the
    raw baselines and the tier runs call this before they write: a figure measures the code and
    the medium, not the draw. A NumPy array this large is backed by transparent huge pages
    (NumPy asks for them), which is what takes whole reported blocks back from the host; a
    ``bytearray`` of 4 KiB pages did not (0.4-1.6 GB/s after it)."""
    import numpy as np

    buf = np.empty(src.numel() * 5 // 4 + BATCH_BYTES, np.uint8)
    buf.fill(1)  # every page written, so backed
    del buf  # freed at once (munmap): the pages go back to the guest's free lists, backed


def run_loop(coro: Any) -> Any:
    """Run ``coro`` on uvloop when installed (as the pipeline does), else asyncio."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---- host memory ---------------------------------------------------------------------------------


def raw_host_memory(src: torch.Tensor, dst: torch.Tensor, blocks_per_chunk: int = 4) -> dict[str, float]:
    """GB/s of what host memory itself moves on the bytes of ``src`` into ``dst`` (both
    ``(chunks, size)``), the strongest a CPU tier could be held to:

    * ``gather``: one ``index_select`` of ``src``'s blocks (``size / blocks_per_chunk`` bytes each,
      the bench's KV blocks) in a random order into ``dst``, contiguous: an engine's scattered
      block ids gathered by one vectorized call (torch's intra-op threads as set, the bench: one);
    * ``copy``: one ``copy_`` of the whole of ``src`` into ``dst`` (one thread);
    * ``copy_2t_nt``: the same bytes copied by two threads with non-temporal stores (the C
      helper's ``stream_into``, the GIL released; NumPy's copy without the helper): the best copy
      this kind of machine gives (both cores; writing the destination without reading it first).
    """
    import threading

    import numpy as np
    import torch

    n, size = src.shape
    nbytes = src.numel()
    bs = size // blocks_per_chunk
    rows = src.view(-1, bs)
    order = torch.from_numpy(np.random.default_rng(n).permutation(rows.shape[0]))
    out = dst.view(-1, bs)
    figures = {"gather": gbps(nbytes, _timed(lambda: torch.index_select(rows, 0, order, out=out)))}
    figures["copy"] = gbps(nbytes, _timed(lambda: dst.copy_(src)))
    try:
        from tieredkv._fastrec import stream_into as copy_fn
    except ImportError:  # without the helper: NumPy's copy
        copy_fn = np.copyto
    s, d = src.numpy().reshape(-1), dst.numpy().reshape(-1)
    half = nbytes // 2 // 64 * 64

    def two() -> None:
        other = threading.Thread(target=copy_fn, args=(d[half:], s[half:]))
        other.start()
        copy_fn(d[:half], s[:half])
        other.join()

    figures["copy_2t_nt"] = gbps(nbytes, _timed(two))
    return figures


# ---- local disk ----------------------------------------------------------------------------------


def raw_file(src: torch.Tensor, dst: torch.Tensor, workdir: str, durable: bool) -> tuple[float, float]:
    """(write seconds, warm read seconds) of the chunks as one file."""
    path = os.path.join(workdir, "raw.bin")
    size = src.shape[1]
    warm_free_pages(src)
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(src.shape[0]):
            os.pwrite(fd, _view(src[i]), i * size)
        if durable:
            os.fdatasync(fd)
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(src.shape[0]):
            os.preadv(fd, [_view(dst[i])], i * size)
        tr = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return tw, tr


def raw_record_files(
    src: torch.Tensor,
    dst: torch.Tensor,
    workdir: str,
    *,
    durable: bool = False,
    rename: bool = False,
    checked: bool = False,
) -> tuple[float, float]:
    """(write seconds, read seconds) of one file per chunk in fanned-out directories, as the fs
    tier keeps records: ``open``/``pwrite``/``close`` of each chunk's bytes (``fdatasync``'d when
    ``durable``), then ``open``/``preadv``/``close`` of each, all on this thread.

    ``rename``: each file written under a temporary name and renamed into place. ``checked``: the
    fs tier's own sequence of calls without aiofiles: a 64-byte header with the record checksum
    written before each payload, and each payload checked against it on the read."""
    from tieredkv.format import HEADER_SIZE, encode_heads_into, verify_parts

    root = tempfile.mkdtemp(dir=workdir)
    n = src.shape[0]
    fan = [os.path.join(root, f"{i % 256:02x}", f"{(i // 256) % 256:02x}") for i in range(n)]
    for d in set(fan):
        os.makedirs(d, exist_ok=True)
    tmp = os.path.join(root, "tmp")
    os.makedirs(tmp)
    keys = [bytes(16) + i.to_bytes(8, "big") + bytes(4) for i in range(n)]
    paths = [os.path.join(d, keys[i][16:].hex() + ".kv") for i, d in enumerate(fan)]
    heads = memoryview(bytearray(HEADER_SIZE * n))
    warm_free_pages(src)
    try:
        t0 = time.perf_counter()
        if checked:
            encode_heads_into(heads, [(keys[i], _view(src[i])) for i in range(n)])
        for i in range(n):
            target = os.path.join(tmp, f"{i}.tmp") if rename else paths[i]
            fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            try:
                parts = [heads[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], _view(src[i])] if checked else [_view(src[i])]
                os.pwritev(fd, parts, 0)
                if durable:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if rename:
                os.rename(target, paths[i])
        tw = time.perf_counter() - t0
        head = memoryview(bytearray(HEADER_SIZE))
        t0 = time.perf_counter()
        for i in range(n):
            fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                if checked:
                    os.preadv(fd, [head, _view(dst[i])], 0)
                    verify_parts(head, _view(dst[i]), keys[i])
                else:
                    os.preadv(fd, [_view(dst[i])], 0)
            finally:
                os.close(fd)
        tr = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return tw, tr


def raw_lmdb(
    src: torch.Tensor, dst: torch.Tensor, workdir: str, *, sync: bool = False, checked: bool = False
) -> tuple[float, float]:
    """(write seconds, read seconds) of py-lmdb put/get in transactions of about BATCH_BYTES,
    with the LMDB tier's map flags (``sync``/``metasync`` as its ``sync_mode`` sets them).

    ``checked``: the same, plus the integrity work alone (:class:`_Digests`): no header, no key in
    the hash, no second write: the floor a verified record format cannot go below on this medium."""
    import lmdb

    path = tempfile.mkdtemp(dir=workdir)
    n, size = src.shape
    env = lmdb.open(
        path,
        map_size=max(4 * n * size, 64 * MiB),
        writemap=False,
        sync=sync,
        metasync=sync,
        readahead=False,
        meminit=False,
        max_dbs=2,
    )
    db = env.open_db(b"records")
    per = max(1, BATCH_BYTES // size)
    keys = [i.to_bytes(8, "big") for i in range(n)]
    warm_free_pages(src)
    sums = _Digests(checked, "raw lmdb bench")
    try:
        t0 = time.perf_counter()
        for b in range(0, n, per):
            with env.begin(write=True, db=db) as txn:
                for i in range(b, min(n, b + per)):
                    payload = _view(src[i])
                    sums.seal(payload)
                    txn.put(keys[i], payload)
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        with env.begin(db=db, buffers=True) as txn:
            for i in range(n):
                got = txn.get(keys[i])
                if got is None:
                    raise KeyError(f"raw lmdb bench: key {i} vanished")
                out = _view(dst[i])
                out[:] = got
                sums.check(i, out)
        tr = time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return tw, tr


# ---- Redis ---------------------------------------------------------------------------------------


def raw_redis(
    src: torch.Tensor, dst: torch.Tensor, url: str, *, checked: bool = False, **client_kwargs: Any
) -> tuple[float, float]:
    """(SET seconds, GET seconds) of redis-py (uvloop when installed) pipelines of at most 64
    values and about 8 MiB (``client_kwargs``: e.g. the tier's ``username``/``password``). Its
    keys carry a fresh random token (a user's key is never overwritten) and are deleted again;
    nothing else is touched. ``checked``: plus the integrity work alone (:class:`_Digests`), as
    :func:`raw_lmdb` does."""
    import redis.asyncio as aioredis

    n, size = src.shape
    per = max(1, min(64, (8 * MiB) // size))
    names = [f"tieredkv-raw:{uuid.uuid4().hex}:{i}" for i in range(n)]
    sums = _Digests(checked, "raw redis bench")

    async def run() -> tuple[float, float]:
        r = aioredis.Redis.from_url(url, **client_kwargs)
        try:
            warm_free_pages(src)
            t0 = time.perf_counter()
            for b in range(0, n, per):
                p = r.pipeline(transaction=False)
                for i in range(b, min(n, b + per)):
                    payload = _view(src[i])
                    sums.seal(payload)
                    p.set(names[i], payload)
                await p.execute()
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            for b in range(0, n, per):
                p = r.pipeline(transaction=False)
                for i in range(b, min(n, b + per)):
                    p.get(names[i])
                for i, v in zip(range(b, min(n, b + per)), await p.execute()):
                    out = _view(dst[i])
                    out[:] = v
                    sums.check(i, out)
            tr = time.perf_counter() - t0
            for b in range(0, n, 1000):  # only the keys this run wrote, never the whole database
                await r.delete(*names[b : b + 1000])
            return tw, tr
        finally:
            await r.aclose()

    result: tuple[float, float] = run_loop(run())
    return result


#: The key ``redis-benchmark -t set,get`` writes without ``-r`` (the placeholder stays literal).
REDIS_BENCHMARK_KEYS = ("key:__rand_int__",)


def redis_benchmark_keys(n: int) -> list[str]:
    """Every key :func:`redis_benchmark` may write for ``n`` requests: the literal one, and the
    ``-r n`` keys (``key:`` and a 12-digit number below ``n``)."""
    return [*REDIS_BENCHMARK_KEYS, *(f"key:{i:012d}" for i in range(n))]


def redis_benchmark(
    port: int, size: int, n: int, host: str = "127.0.0.1", pipeline: int = 1
) -> tuple[float, float] | None:
    """GB/s of SET and GET from ``redis-benchmark`` over one connection (``-c 1``), ``pipeline``
    requests in flight (``-P``; 1 was the best setting for big values here, the tier's own
    pipelining is measured beside it).

    SET is timed with ``-r n``: random keys among ``n``, so the server allocates new values as
    the tiers' stores make it do (without ``-r`` every SET overwrites one key and the server
    reuses its memory: 1.5-2x the figure at 1-4 MiB here). GET reads the one literal key, so every
    reply carries a full value (with ``-r`` a third of the GETs would miss and look fast).

    It writes :func:`redis_benchmark_keys` into database 0 of the user's server: when one of them
    already exists there (someone's data) nothing is run (None); otherwise they are deleted after
    the run, whatever happens, so the server is left as it was found. None too when the
    ``redis-benchmark`` executable is not installed."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    import redis

    keys = redis_benchmark_keys(n)
    client = redis.Redis(host=host, port=port, db=0, socket_timeout=30)
    try:
        if any(client.exists(*keys[b : b + 1000]) for b in range(0, len(keys), 1000)):
            return None  # never overwrite (and then delete) a key that is not ours
        try:
            return _run_redis_benchmark(exe, host, port, size, n, pipeline)
        finally:
            for b in range(0, len(keys), 1000):
                client.delete(*keys[b : b + 1000])
    finally:
        client.close()


def _run_redis_benchmark(
    exe: str, host: str, port: int, size: int, n: int, pipeline: int = 1
) -> tuple[float, float] | None:
    argv = [exe, "-h", host, "-p", str(port), "-d", str(size), "-P", str(pipeline), "-c", "1", "-q"]
    store = _rps(argv + ["-t", "set", "-r", str(n)], "SET", n)  # new keys
    load = _rps(argv + ["-t", "set,get"], "GET", n)  # the literal key, read back at full size
    if store is None or load is None:
        return None
    return store * size / 1e9, load * size / 1e9


def _rps(argv: list[str], test: str, n: int) -> float | None:
    """Requests per second of ``test`` over ``n`` requests. A run shorter than redis-benchmark's
    clock can tell (it prints ``inf``: seen in 1 of 6 runs of 32 requests of 64 KiB here) is run
    again with ten times the requests (the same keys: ``-r`` stays), up to twice."""
    for _ in range(3):
        out = subprocess.run(argv + ["-n", str(n)], capture_output=True, text=True, timeout=300, check=False).stdout
        m = re.search(rf"{test}: ([\d.]+|inf) requests per second", out)
        if m is None:
            return None
        if m.group(1) != "inf":
            return float(m.group(1))
        n *= 10
    return None

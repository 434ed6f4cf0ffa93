"""LMDBTier: one LMDB environment on local disk, LRU-evicted below a size cap.

Layout: named DB ``records`` (stored key → record) and named DB ``access`` (stored key →
``<d Q`` last-access Unix time, record bytes). The access DB survives restarts; at open it
is read once to rebuild the in-memory LRU order and the byte count.

* Every blocking LMDB call runs on one dedicated thread (a single-worker executor), never
  on the event loop; all LRU state is touched only from that thread.
* ``put_many`` is one write transaction: it evicts the least-recently-used unpinned records
  until the batch fits under ``size_cap_bytes`` (or raises TierFullError having stored
  nothing), then writes every record.
* ``get_many`` is one read transaction with ``buffers=True``: each record is verified and its
  payload copied straight from the memory map into the caller's buffer (one copy).
  Access stamps are bumped in memory and written with the next write transaction.
* ``MapFullError`` grows the map (doubling, up to ``max_map_size_bytes``) and retries; at the
  limit it evicts further; it never crashes. ``MapResizedError`` (another process grew it)
  adopts the new size and retries.
* ``sync_mode='durable'`` fsyncs every commit. ``'fast'`` skips the per-commit fsync and syncs
  on close: a process crash loses nothing committed; a power loss may lose recent puts (never
  corrupts older ones). ``writemap`` is never used: with it, a full disk kills the process with
  SIGBUS while writing through the map; without it the commit fails with ENOSPC, which this tier
  reports as :class:`~tieredkv.errors.TierFullError`.

The in-memory LRU assumes this process is the environment's only writer; other processes
(the admin CLI) may read, and records they delete simply turn into misses here.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import lmdb

from tieredkv.backends.base import RecordInfo, Tier, TierStats
from tieredkv.config import LMDBTierConfig
from tieredkv.errors import ConfigError, CorruptRecordError, TieredKVError, TierFullError, TierUnavailableError
from tieredkv.format import HEADER_SIZE, encode_record_into, verify_record

__all__ = ["LMDBTier"]

_ACCESS = struct.Struct("<dQ")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return True
    return isinstance(exc, lmdb.Error) and any(os.strerror(e) in str(exc) for e in _DISK_FULL)
_T = TypeVar("_T")
_SCAN_PAGE = 1024


class LMDBTier(Tier):
    """``LMDBTier(LMDBTierConfig(path="/nvme/tieredkv", size_cap_bytes="100GiB"))``."""

    kind = "lmdb"

    def __init__(self, config: LMDBTierConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or LMDBTierConfig(), **kwargs)
        cfg: LMDBTierConfig = self.config
        self.path = os.path.abspath(os.path.expanduser(cfg.path))
        self._cap = int(cfg.size_cap_bytes)
        self._max_map = int(cfg.max_map_size_bytes)
        self._pool: ThreadPoolExecutor | None = None
        # Held by a probe's read transaction (scheduler thread) and by whatever may not run beside
        # one: set_mapsize (LMDB requires no transaction open in the process) and close.
        self._probe_lock = threading.Lock()
        self._env: Any = None
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> record bytes, oldest first
        self._dirty: dict[bytes, float] = {}
        self._used = 0
        self._scratch = memoryview(bytearray(0))

    # ---- thread plumbing ---------------------------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        if _disk_full(exc):
            return TierFullError(f"tier {self.name!r}: the disk under {self.path} is full ({exc}); free space or"
                                 " lower size_cap_bytes")
        if isinstance(exc, lmdb.MapFullError):
            return TierFullError(f"tier {self.name!r}: LMDB map is full at {self._max_map} bytes; raise max_map_size_bytes")
        if isinstance(exc, (lmdb.Error, OSError)):
            return TierUnavailableError(f"tier {self.name!r} (lmdb at {self.path}): {op} failed: {exc}")
        return super()._translate(exc, op)

    # ---- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tieredkv-lmdb-{self.name}")
        try:
            await self._run(self._open_sync)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._pool = None
            raise

    def _open_sync(self) -> None:
        cfg: LMDBTierConfig = self.config
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, ".tieredkv-write-test")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:  # not a directory, no permission, read-only: a setup error, not an outage
            raise ConfigError(
                f"tiers.{self.name}.path: {self.path!r} cannot hold an LMDB environment ({e.strerror});"
                " point it at a writable directory"
            ) from e
        fast = cfg.sync_mode == "fast"
        self._env = lmdb.open(
            self.path,
            map_size=int(cfg.map_size_bytes),
            max_dbs=2,
            max_readers=cfg.max_readers,
            writemap=False,  # writes go through pwrite: a full disk is an error, never a SIGBUS
            sync=not fast,
            metasync=not fast,
            readahead=False,
            meminit=False,
            lock=True,
        )
        self._rec = self._env.open_db(b"records")
        self._acc = self._env.open_db(b"access")
        entries: list[tuple[float, bytes, int]] = []
        with self._env.begin(db=self._acc) as txn:
            for k, v in txn.cursor():
                stamp, size = _ACCESS.unpack(v)
                entries.append((stamp, bytes(k), size))
        entries.sort()
        self._lru = OrderedDict((k, size) for _, k, size in entries)
        self._used = sum(self._lru.values())

    async def _close(self) -> None:
        if self._pool is None:
            return
        try:
            await self._run(self._close_sync)
        finally:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _close_sync(self) -> None:
        if self._env is None:
            return
        try:
            if self._dirty:
                self._write(lambda txn: None)
            self._env.sync(True)
        finally:
            with self._probe_lock:  # no probe's read transaction may outlive the environment
                self._env.close()
                self._env = None

    # ---- writes ------------------------------------------------------------------------

    async def _put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._run(self._put_sync, items, False)

    def _put_sync(self, items: list[tuple[bytes, memoryview]], raw: bool) -> None:
        """One write transaction: evict to fit under the cap (all or nothing), then write every
        item — encoded as a record, or (``raw``) already a record."""
        sizes = {k: len(p) if raw else HEADER_SIZE + len(p) for k, p in items}
        need = sum(sizes.values()) - sum(self._lru.get(k, 0) for k in sizes)
        if sum(sizes.values()) > self._cap:
            raise TierFullError(
                f"tier {self.name!r}: a batch of {sum(sizes.values())} bytes exceeds size_cap_bytes ({self._cap})"
            )
        victims = self._pick_victims(self._used + need - self._cap, sizes)
        now = time.time()
        scratch = self._scratch_for(0 if raw else max(sizes.values()))

        def body(txn: Any) -> None:
            for k in victims:
                txn.delete(k, db=self._rec)
                txn.delete(k, db=self._acc)
            for k, payload in items:
                if raw:
                    txn.put(k, payload, db=self._rec)
                else:
                    n = encode_record_into(scratch, k, payload)
                    txn.put(k, scratch[:n], db=self._rec)
                txn.put(k, _ACCESS.pack(now, sizes[k]), db=self._acc)

        victims = self._write(body, victims, sizes)
        for k in victims:
            self._used -= self._lru.pop(k, 0)
        self._count("evictions", len(victims))
        for k, size in sizes.items():
            self._used += size - self._lru.pop(k, 0)
            self._lru[k] = size
            self._dirty.pop(k, None)

    def _scratch_for(self, n: int) -> memoryview:
        """A reusable encode buffer of at least ``n`` bytes (fresh large buffers cost page faults)."""
        if len(self._scratch) < n:
            self._scratch = memoryview(bytearray(max(n, 2 * len(self._scratch))))
        return self._scratch

    def _pick_victims(self, excess: int, protect: dict[bytes, int] | set[bytes]) -> list[bytes]:
        """Oldest unpinned keys (not in ``protect``) whose bytes cover ``excess``."""
        victims: list[bytes] = []
        for k, size in self._lru.items():
            if excess <= 0:
                break
            if k in protect or self.is_pinned(k):
                continue
            victims.append(k)
            excess -= size
        if excess > 0:
            raise TierFullError(
                f"tier {self.name!r}: size cap of {self._cap} bytes reached and every record that"
                " could be evicted is pinned (in use)"
            )
        return victims

    def _write(
        self, body: Callable[[Any], None], victims: list[bytes] | None = None, protect: dict[bytes, int] | None = None
    ) -> list[bytes]:
        """Run ``body`` in one write transaction (plus dirty stamps), handling a full map.

        On MapFullError the map doubles, up to ``max_map_size_bytes``; at the limit, more
        least-recently-used records are evicted in a transaction of their own (LMDB reuses
        freed pages only after a commit) and ``body`` is retried. Returns ``victims``.
        """
        victims = list(victims or [])
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    self._flush_stamps(txn)
                    body(txn)
                return victims
            except lmdb.MapResizedError:
                with self._probe_lock:  # set_mapsize needs no transaction open in this process
                    self._env.set_mapsize(0)
            except lmdb.MapFullError:
                size = self._env.info()["map_size"]
                if size < self._max_map:
                    with self._probe_lock:
                        self._env.set_mapsize(min(size * 2, self._max_map))
                    self._count("map_growths")
                    continue
                more = self._pick_victims(max(self._used // 8, 1), {*(protect or {}), *victims})
                with self._env.begin(write=True) as txn:
                    for k in more:
                        txn.delete(k, db=self._rec)
                        txn.delete(k, db=self._acc)
                for k in more:
                    self._used -= self._lru.pop(k, 0)
                    self._dirty.pop(k, None)
                self._count("evictions", len(more))

    def _flush_stamps(self, txn: Any) -> None:
        for k, stamp in self._dirty.items():
            size = self._lru.get(k)
            if size is not None:
                txn.put(k, _ACCESS.pack(stamp, size), db=self._acc, overwrite=True)
        self._dirty.clear()

    # ---- reads -------------------------------------------------------------------------

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        out, bad = await self._run(self._get_sync, keys, into)
        for key, err in bad:
            self._on_corrupt(key, err)
        return out

    def _get_sync(
        self, keys: list[bytes], into: list[memoryview | None]
    ) -> tuple[list[int | bytes | None], list[tuple[bytes, Exception]]]:
        out: list[int | bytes | None] = []
        bad: list[tuple[bytes, Exception]] = []
        gone: list[bytes] = []
        now = time.time()
        with self._env.begin(db=self._rec, buffers=True) as txn:
            for key, dst in zip(keys, into):
                rec = txn.get(key)
                if rec is None:
                    if key in self._lru:
                        gone.append(key)
                    out.append(None)
                    continue
                try:
                    payload = verify_record(rec, key)
                except CorruptRecordError as e:
                    bad.append((key, e))
                    out.append(None)
                    continue
                out.append(self._deliver(key, payload, dst))
                if key in self._lru:
                    self._lru.move_to_end(key)
                else:  # written by another process
                    self._lru[key] = len(rec)
                    self._used += len(rec)
                self._dirty[key] = now
        for key in gone:  # deleted by another process
            self._used -= self._lru.pop(key, 0)
        if bad:
            self._delete_sync([k for k, _ in bad])
        return out, bad

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return await self._run(self._contains_sync, keys)

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """One read transaction on the memory-mapped B-tree (LMDB readers never wait on writers);
        None while the environment is not open or when LMDB refuses (e.g. a map another process
        grew: the asynchronous path handles that)."""
        if self._env is None or self._closed or not self._probe_lock.acquire(blocking=False):
            return None  # closing or resizing the map right now: the asynchronous lookup answers
        try:
            if self._env is None:
                return None
            return self._contains_sync(list(keys))
        except Exception:  # noqa: BLE001 - advisory: the asynchronous lookup will answer
            return None
        finally:
            self._probe_lock.release()

    def _contains_sync(self, keys: list[bytes]) -> list[bool]:
        with self._env.begin(db=self._rec, buffers=True) as txn:
            return [txn.get(k) is not None for k in keys]

    async def _delete_many(self, keys: list[bytes]) -> int:
        return await self._run(self._delete_sync, keys)

    def _delete_sync(self, keys: list[bytes]) -> int:
        deleted: list[bytes] = []

        def body(txn: Any) -> None:
            deleted.clear()
            for k in keys:
                if txn.delete(k, db=self._rec):
                    deleted.append(k)
                txn.delete(k, db=self._acc)

        self._write(body)
        for k in keys:
            self._used -= self._lru.pop(k, 0)
            self._dirty.pop(k, None)
        return len(deleted)

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        after: bytes | None = None
        while True:
            page = await self._run(self._scan_page, fingerprint, after)
            for info in page:
                yield info
            if len(page) < _SCAN_PAGE:
                return
            after = page[-1].key

    def _scan_page(self, fingerprint: bytes | None, after: bytes | None) -> list[RecordInfo]:
        page: list[RecordInfo] = []
        with self._env.begin(db=self._acc) as txn:
            cur = txn.cursor()
            start = after if after is not None else (fingerprint or b"")
            if not cur.set_range(start):
                return page
            if after is not None and cur.key() == after and not cur.next():
                return page
            for k, v in cur:
                if fingerprint is not None and not k.startswith(fingerprint):
                    break
                stamp, size = _ACCESS.unpack(v)
                page.append(RecordInfo(bytes(k), size - HEADER_SIZE, stamp))
                if len(page) >= _SCAN_PAGE:
                    break
        return page

    async def _stats(self) -> TierStats:
        return await self._run(self._stats_sync)

    def _stats_sync(self) -> TierStats:
        info = self._env.info()
        with self._env.begin(db=self._rec) as txn:
            records = txn.stat(self._rec)["entries"]
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=self._cap,
            used_bytes=self._used,
            records=records,
            extra={"path": self.path, "map_size": info["map_size"], "sync_mode": self.config.sync_mode},
        )

    # ---- raw records (admin, migration, fault injection) -------------------------------

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        def read() -> list[bytes | None]:
            with self._env.begin(db=self._rec) as txn:
                return [txn.get(k) for k in keys]

        return await self._run(read)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._run(self._put_sync, items, True)  # same cap and eviction as put_many

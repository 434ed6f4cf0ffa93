"""FSTier: a directory that every node mounts, one checksummed record per file, capped for the
directory whoever writes.

Built in layers, each using only those before it:

* :mod:`~tieredkv.backends.fs.layout` — where records, temporary files, the marker and the
  ledger live; fan-out; who owns a temporary file.
* :mod:`~tieredkv.backends.fs.ledger` — the shared usage ledger and its lock.
* :mod:`~tieredkv.backends.fs.records` — record files written (temporary name, rename) and read
  and checked, a slice of a batch at a time on an I/O thread (handed there through aiofiles).
* :mod:`~tieredkv.backends.fs.space` — reservations, eviction, recounts, the sweep.
* this module — :class:`FSTier`: capabilities, lifecycle, the contract's operations, admin reads
  and repairs, stats, and the bench's raw limits.

Failures of the medium: a full filesystem (``ENOSPC``/``EDQUOT``) refuses the store with
:class:`~tieredkv.errors.TierFullError` (counted ``disk_full``), a read-only mount or missing
permission refuses every store (counted ``refused_stores``; found at open, or when a write
meets it), a stale NFS handle on a read is a miss (counted ``stale_handles``); in every case
reads keep working and no partial record is ever visible.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiofiles.os

from tieredkv.backends.base import RawLimits, RecordInfo, TierCapabilities, TierStats, cancel_background
from tieredkv.backends.fs.config import FSTierConfig
from tieredkv.backends.fs.layout import Layout
from tieredkv.backends.fs.ledger import LedgerBusyError, acquire, release
from tieredkv.backends.fs.records import GONE, read_raw_slice, read_slice, unlink_all, write_slice
from tieredkv.backends.fs.space import FSSpace
from tieredkv.catalog import catalog_key
from tieredkv.errors import (
    ConfigError,
    CorruptRecordError,
    TieredKVError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from tieredkv.format import HEADER_SIZE, decode_header, encode_heads_into

__all__ = ["FSTier"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")
_FULL = (errno.ENOSPC, errno.EDQUOT)
#: The fewest records a slice of a batch holds (one hand-off to an I/O thread). Measured on this
#: 2-core box (bench_tiers, 64 KiB loads): a record a slice 1.0 GB/s, 8 about 2.0, one slice for
#: the batch 1.7 (the threads' Python then contends for the GIL, or the batch waits on one thread).
_SLICE_RECORDS = 8
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)


class FSTier(FSSpace):
    """``FSTier(FSTierConfig(path="/mnt/shared/tieredkv", size_cap_bytes="500GiB"))``."""

    kind = "fs"
    capabilities = TierCapabilities(
        access_stamps=True,
        local_eviction=True,
        shared=True,
        medium="disk",
    )
    config_model = FSTierConfig

    def __init__(self, config: Any, *, name: str | None = None) -> None:
        super().__init__(config, name=name)
        self._pool: ThreadPoolExecutor | None = None
        self._upkeep: asyncio.Task[None] | None = None
        self._probe_budget = config.probe_budget_ms / 1000
        self._probe_cost = 0.0
        self._probe_paused_until = 0.0

    @property
    def path(self) -> str:
        return self.layout.root

    # ---- what the registry, admin tools and the bench ask of the class ------------------

    @classmethod
    def missing(cls, config: Any) -> str | None:
        layout = Layout(config.path)
        return None if os.path.exists(layout.marker) else f"no fs tier at {layout.root}"

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits:
        """The filesystem under ``workdir``, one file per record as this tier keeps them: ``pwrite``
        of each record's bytes into a new file (page cache; then ``fdatasync``'d) and ``pread``
        back, the baseline; the same with a temporary name and ``rename``; and this tier's own
        sequence of calls (header, checksum, temporary file, rename, the check on load) made
        directly on one thread, without aiofiles: what aiofiles costs is the tier against it."""
        from tieredkv.backends._rawbench import gbps, raw_file, raw_record_files

        nbytes = src.numel()
        durable = config.sync_mode == "durable"
        w, r = raw_file(src, dst, workdir, durable=durable)  # the medium's strongest: one file
        figures: dict[str, float] = {
            ("file_durable.store" if durable else "file_pagecache.store"): gbps(nbytes, w),
            "file.load": gbps(nbytes, r),
        }
        for label, how in (
            ("pwrite", {}),
            ("pwrite_durable", {"durable": True}),
            ("pwrite_rename", {"rename": True}),
            ("tier_calls_no_aiofiles", {"rename": True, "checked": True}),
        ):
            w, r = raw_record_files(src, dst, workdir, **how)
            figures[f"{label}.store"] = gbps(nbytes, w)
            if label in ("pwrite", "tier_calls_no_aiofiles"):
                figures[f"{label.replace('pwrite', 'pread')}.load"] = gbps(nbytes, r)
        store = "pwrite_durable.store" if durable else "pwrite.store"
        one_file = "file_durable.store" if durable else "file_pagecache.store"
        return RawLimits(
            figures,  # the strongest of one file per record and one file for all
            baseline={"store": (store, one_file), "load": ("pread.load", "file.load")},
            floor={"store": "tier_calls_no_aiofiles.store", "load": "tier_calls_no_aiofiles.load"},
            notes=("fs: one file per record in fanned-out directories, as the tier writes them",),
        )

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        where = f"tier {self.name!r} (fs at {self.layout.root})"
        if isinstance(exc, LedgerBusyError):
            self._count("ledger_busy")
            return TierTimeoutError(f"{where}: {op}: {exc}; another node holds the usage ledger")
        if isinstance(exc, OSError):
            if exc.errno in _FULL:
                self._count("disk_full")
                return TierFullError(
                    f"{where}: {op}: the filesystem is full ({exc.strerror}); stores refused, reads go on"
                )
            if exc.errno in _REFUSED:
                self._count("refused_stores")
                return TierUnavailableError(
                    f"{where}: {op}: {exc.strerror} ({exc.filename}); stores refused, reads go on"
                )
            if exc.errno == errno.ESTALE:
                self._count("stale_handles")
            return TierUnavailableError(f"{where}: {op} failed: {exc}")
        return super()._translate(exc, op)

    # ---- threads -----------------------------------------------------------------------

    async def _run(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` on one of the tier's I/O threads (aiofiles' ``wrap``)."""
        result: _R = await aiofiles.os.wrap(fn)(*args, executor=self._pool)
        return result

    async def _sliced(self, fn: Callable[..., list[_R]], items: Sequence[Any], *args: Any) -> list[_R]:
        """``fn(slice, *args)`` over ``items`` cut into at most ``io_threads`` slices of at least
        ``_SLICE_RECORDS`` records, in order, the slices on the tier's I/O threads at once (a
        network filesystem's round trips overlap; a local one pays one hand-off per slice, not
        per file call); the results in ``items``' order."""
        n = len(items)
        if not n:
            return []
        k = min(-(-n // _SLICE_RECORDS), self.config.io_threads)
        bounds = [n * i // k for i in range(k + 1)]
        parts = await asyncio.gather(*(self._run(fn, items[a:b], *args) for a, b in itertools.pairwise(bounds)))
        return [r for part in parts for r in part]

    # ---- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        n = self.config.io_threads
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"tieredkv-fs-{self.name}")
        try:
            await self._run(self._open_sync)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._pool = None
            raise
        self._upkeep = asyncio.get_running_loop().create_task(self._upkeep_loop())

    def _open_sync(self) -> None:
        lay = self.layout
        wrong = lay.check_marker()
        if wrong is not None:
            raise ConfigError(f"tiers.{self.name}.path: {wrong}; point it at an fs tier's directory or an empty one")
        try:
            lay.ensure()
            self._probe_write()
        except OSError as e:
            if e.errno not in _REFUSED or not os.path.isdir(lay.ns):
                raise ConfigError(
                    f"tiers.{self.name}.path: {lay.root!r} cannot hold an fs tier ({e.strerror});"
                    " point it at a directory every node can write"
                ) from e
            self._read_only = f"{e.strerror} ({e.filename})"
        self._ledger = acquire(lay.ledger)
        if self._ledger.read_only is not None:
            self._read_only = self._read_only or self._ledger.read_only
        if self._read_only is not None:
            log.warning(
                "tier %s: %s is read-only here (%s): stores refused, reads go on", self.name, lay.root, self._read_only
            )
        else:
            self._sweep_sync()

    def _load_index(self) -> None:
        """This process's eviction index from a listing of the directory (after open, on an I/O
        thread: a large directory on a network filesystem takes a while), with a recount of the
        ledger when it is missing, damaged or due (and no other node holds it past the timeout)."""
        if self._read_only is None:
            try:
                if self._due():
                    self._recount()
                    return
            except LedgerBusyError as e:
                log.info("tier %s: %s; listing without a recount", self.name, e)
        since = time.time()
        _, _, index = self._walked()
        self._install(index, since)

    def _probe_write(self) -> None:
        """Create and remove a temporary file: a read-only mount or a missing permission shows here."""
        probe = self._next_temp(0)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        os.close(fd)
        os.unlink(probe)

    async def _upkeep_loop(self) -> None:
        """Every so often: give the ledger this process's pending changes, sweep temporary files,
        recount when due."""
        period = min(60.0, self.config.temp_max_age_s / 2, self.config.reconcile_interval_s / 2)
        try:
            await self._run(self._load_index)
        except Exception as e:  # noqa: BLE001 - a store that needs room recounts anyway
            log.warning("tier %s: listing the directory failed: %s", self.name, e)
        while True:
            await asyncio.sleep(period)
            try:
                await self._run(self._upkeep_sync)
            except Exception as e:  # noqa: BLE001 - upkeep must outlive a bad moment of the medium
                log.warning("tier %s: upkeep failed: %s", self.name, e)

    def _upkeep_sync(self) -> None:
        if self._read_only is not None:
            return
        if self._due():
            self._recount()
        else:
            self._flush_pending()
        if time.time() - self._last_sweep > self.config.temp_max_age_s / 4:
            self._sweep_sync()

    async def _close(self) -> None:
        upkeep, self._upkeep = self._upkeep, None
        await cancel_background(upkeep)
        if self._pool is None:
            return
        try:
            if self._ledger is not None:
                try:
                    await self._run(self._flush_pending)
                except (OSError, LedgerBusyError) as e:
                    log.warning("tier %s: usage ledger not updated at close: %s", self.name, e)
        finally:
            self._pool.shutdown(wait=True)
            self._pool = None
            if self._ledger is not None:
                release(self._ledger)
                self._ledger = None

    # ---- lookups without waiting ----------------------------------------------------------

    def probe_key(self, key: bytes) -> bool | None:
        """Whether ``key`` holds a record, at once, from any thread: True for a record this
        process knows the directory holds (it wrote, read or listed it: its index); for any
        other key one ``lstat`` on the calling thread while the filesystem answers them within
        ``probe_budget_ms`` on average (a local disk, a near NFS server with its attribute
        cache), else None (the asynchronous lookup asks on an I/O thread). A known record that
        another node evicted since is a miss at its load, as any record gone between lookup and
        load is; a record another node wrote a moment ago may be missed (a lost hit, never a
        wrong one)."""
        if key in self._stamps:
            return True
        if self._probe_paused_until > time.monotonic() or not self._probe_budget:
            return None
        t0 = time.perf_counter()
        try:
            found = stat.S_ISREG(os.lstat(self.layout.record_path(key)).st_mode)
        except FileNotFoundError:
            found = False
        except OSError:
            return None
        dt = time.perf_counter() - t0
        self._probe_cost = cost = 0.9 * self._probe_cost + 0.1 * dt
        if cost > self._probe_budget:  # slow medium: ask asynchronously for a while
            self._probe_paused_until = time.monotonic() + 1.0
            self._probe_cost = 0.0
        return found

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        out = []
        for k in keys:
            got = self.probe_key(k)
            if got is None:
                return None
            out.append(got)
        return out

    # ---- stores ------------------------------------------------------------------------

    def _writable(self, op: str) -> None:
        if self._read_only is not None:
            self._count("refused_stores")
            raise TierUnavailableError(
                f"tier {self.name!r} (fs at {self.layout.root}): {op} refused: the directory is read-only"
                f" here ({self._read_only}); reads go on"
            )

    async def _put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        heads = memoryview(bytearray(HEADER_SIZE * len(items)))
        encode_heads_into(heads, items)
        await self._store([(k, (heads[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], p)) for i, (k, p) in enumerate(items)])

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._store([(k, (raw,)) for k, raw in items])

    async def _store(self, records: list[tuple[bytes, tuple[memoryview, ...]]]) -> None:
        """Reserve room for ``records`` (key, parts), then publish each; all-or-nothing on room."""
        self._writable("put")
        for k, _ in records:
            if not Layout.fits(k):
                raise ValueError(f"tier {self.name!r}: a key of {len(k)} bytes is too long for a file name")
        sizes = [sum(map(len, parts)) for _, parts in records]
        total = sum(sizes)
        if total > self._cap:
            raise TierFullError(f"tier {self.name!r}: a batch of {total} bytes is larger than its {self._cap}-byte cap")
        todo = [
            (self._next_temp(size, k), self.layout.record_path(k), parts)
            for (k, parts), size in zip(records, sizes, strict=True)
        ]
        await self._run(self._reserve, total, len(records), [tmp for tmp, _, _ in todo])
        try:
            outcomes = await self._sliced(write_slice, todo, self._durable)
        except BaseException:
            self._unreserve(total, len(records))
            raise
        failed = next((got for got in outcomes if isinstance(got, BaseException)), None)
        if failed is not None:  # all or nothing: what this batch published goes too
            done = [
                final for (_, final, _), got in zip(todo, outcomes, strict=True) if not isinstance(got, BaseException)
            ]
            await self._run(unlink_all, done)
            self._unreserve(total, len(records))
            raise failed
        now = time.time()
        for (k, _), size, got in zip(records, sizes, outcomes, strict=True):
            if isinstance(got, int):
                self._replaced(got)
            self._known(k, size, now)
        if self._durable:
            dirs = sorted({os.path.dirname(final) for _, final, _ in todo})
            await self._run(_sync_dirs, dirs)

    # ---- loads -------------------------------------------------------------------------

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        todo = [(self.layout.record_path(k), k, d) for k, d in zip(keys, into, strict=True)]
        got = await self._sliced(read_slice, todo, self._cap)
        out: list[int | bytes | None] = []
        bad: list[bytes] = []
        touch: list[str] = []
        now = time.time()
        for (path, key, dst), res in zip(todo, got, strict=True):
            if res is None:
                out.append(None)
            elif isinstance(res, CorruptRecordError):
                self._on_corrupt(key, res)
                bad.append(key)
                out.append(None)
            elif isinstance(res, BaseException):
                if not self._unreadable(res):
                    raise res
                out.append(None)
            elif not res.fits:
                assert dst is not None
                self._oversize(key, res.n, dst)
                out.append(None)
            else:
                out.append(res.n if dst is not None else res.data)
                if now - res.atime > self.config.touch_interval_s:
                    touch.append(path)
                self._seen(key, now)
        if bad:
            await self._drop_corrupt(bad)
        if touch and self._read_only is None:
            await self._run(_touch, touch, now)
        return out

    def _unreadable(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised reading one record file, makes that record a miss (counted)
        rather than a failure of the tier: a stale NFS handle (the file was removed on another
        node while this one held it), or something other than a regular file at the record's
        name (a symlink: never followed)."""
        if not isinstance(exc, OSError):
            return False
        if exc.errno == errno.ESTALE:
            self._count("stale_handles")
            return True
        if exc.errno == errno.ELOOP:
            self._count("not_a_record")
            log.warning("tier %s: %s is a symlink, not a record: a miss", self.name, exc.filename)
            return True
        return False

    async def _drop_corrupt(self, keys: list[bytes]) -> None:
        """Delete the corrupt records of ``keys``, each only while it still is the one read."""
        raws = await self._raw_get_many(keys)
        bad = [(k, r) for k, r in zip(keys, raws, strict=True) if r is not None and self.check_record(r, k)]
        if bad and self._read_only is None:
            try:
                await self._delete_if_same(bad)
            except (OSError, LedgerBusyError) as e:
                log.warning("tier %s: corrupt records not deleted: %s", self.name, e)

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return await self._run(_exist, [self.layout.record_path(k) for k in keys])

    # ---- deletions ---------------------------------------------------------------------

    async def _delete_many(self, keys: list[bytes]) -> int:
        self._writable("delete")
        return await self._run(self._delete_sync, keys)

    def _delete_sync(self, keys: list[bytes]) -> int:
        with self._led.locked(self.config.lock_timeout_s):
            st = self._held()
            used, records, n = st.used, st.records, 0
            for k in keys:
                size = self._remove(k)
                if size is not None:
                    used, records, n = used - size, records - 1, n + 1
            self._led.write(type(st)(max(used, 0), max(records, 0), st.reconciled_at))
        return n

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        self._writable("delete")
        return await self._run(self._delete_if_same_sync, items)

    def _delete_if_same_sync(self, items: list[tuple[bytes, bytes]]) -> int:
        """Move each record aside (``rename``: atomic), compare what was moved, and delete it when
        it is the same; else put it back unless a newer record took its place meanwhile (``link``
        fails on an existing name: it never replaces one). A deleted file whose size is not what
        its header says (cut short, grown, its header gone) was changed outside the tier, so the
        ledger never counted its size: the directory is recounted instead."""
        n = freed = 0
        resized = False
        for key, raw in items:
            path = self.layout.record_path(key)
            aside = self._next_temp(0)
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            try:
                with open(aside, "rb") as f:  # (the size first: a huge file is never read whole)
                    held = f.read() if os.fstat(f.fileno()).st_size == len(raw) else None
                if held == raw:
                    self._forget(key)
                    n += 1
                    freed += len(raw)
                    try:
                        decode_header(raw)
                    except CorruptRecordError:
                        resized = True
                else:
                    try:
                        os.link(aside, path)
                    except FileExistsError:
                        pass
            finally:
                os.unlink(aside)
        if n:
            with self._led.locked(self.config.lock_timeout_s):
                st = self._held()
                self._led.write(type(st)(max(st.used - freed, 0), max(st.records - n, 0), st.reconciled_at))
        if resized:
            self._recount()
        return n

    # ---- admin reads -------------------------------------------------------------------

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        paths = [self.layout.record_path(k) for k in keys]
        got = await self._sliced(read_raw_slice, paths, self._cap + HEADER_SIZE)
        out: list[bytes | None] = []
        for r in got:
            if isinstance(r, BaseException):
                if not self._unreadable(r):
                    raise r
                out.append(None)
            else:
                out.append(r)
        return out

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        found = await self._run(self.layout.walk, fingerprint)
        for key, _, st in found:
            yield RecordInfo(key, max(st.st_size - HEADER_SIZE, 0), st.st_atime)

    async def _stats(self) -> TierStats:
        return await self._run(self._stats_sync)

    def _stats_sync(self) -> TierStats:
        st = self._led.read()
        temps = self.layout.temps()
        with self._index_lock:
            dbytes, drecs = self._pending
            known = len(self._policy)
        used = max(0, (st.used if st else 0) + dbytes)
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=self._cap,
            used_bytes=used,
            records=max(0, (st.records if st else 0) + drecs),
            extra={
                "path": self.layout.root,
                "sync_mode": self.config.sync_mode,
                "read_only": self._read_only,
                "temp_files": len(temps),
                "ledger_recounted_at": st.reconciled_at if st else None,
                "records_known_here": known,
                # namespace catalog records among the records (tieredkv.catalog): one per namespace
                "catalog_records": sum(
                    os.path.exists(self.layout.record_path(catalog_key(bytes.fromhex(ns))))
                    for ns in self.layout.namespaces()
                ),
            },
        )

    async def reconcile(self) -> int:
        """Recount the directory now (``tieredkv status --recount``): set the shared ledger to what
        it holds. Returns the bytes counted."""
        await self._ensure_open()
        self._writable("recount")

        return int((await self._guard("reconcile", 0, self._run(self._recount))).used)


def _exist(paths: list[str]) -> list[bool]:
    out = []
    for p in paths:
        try:
            out.append(stat.S_ISREG(os.lstat(p).st_mode))  # a symlink at a record's name is none
        except OSError as e:
            if e.errno not in GONE:
                raise
            out.append(False)
    return out


def _touch(paths: list[str], now: float) -> None:
    """Set each file's access time to ``now`` (its change time kept); a file gone is skipped."""
    for p in paths:
        try:
            os.utime(p, (now, os.lstat(p).st_mtime), follow_symlinks=False)
        except OSError:
            pass


def _sync_dirs(dirs: list[str]) -> None:
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

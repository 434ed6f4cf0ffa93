"""LMDBTier: one LMDB environment on local disk, evicted below a size cap (LRU by default).

The tier is built in layers, one module per job, each using only those before it:

* :mod:`~tieredkv.backends.lmdb.layout` — what the named DBs hold; records stored apart, whole,
  or in record files.
* :mod:`~tieredkv.backends.lmdb.env` — the environment shared by this process's tiers on one
  directory, beside other processes (map growth and adoption, stale readers, the disk reserve).
* :mod:`~tieredkv.backends.lmdb.core` — the tier's state, its threads, the transaction bracket.
* :mod:`~tieredkv.backends.lmdb.records` — record files: written, freed, kept as spares, swept
  (ownership and the sweep itself: :mod:`~tieredkv.backends.lmdb.files`).
* :mod:`~tieredkv.backends.lmdb.eviction` — what goes to fit the cap and the tenants' quotas,
  across processes.
* :mod:`~tieredkv.backends.lmdb.writes` — puts and deletions, a full map, a full disk
  (:mod:`~tieredkv.backends.lmdb.space`).
* :mod:`~tieredkv.backends.lmdb.reads` — loads, lookups, records that moved during a read.
* :mod:`~tieredkv.backends.lmdb.raw` — whole records for admin tools and repairs.
* this module — :class:`LMDBTier`: capabilities, lifecycle, listings (``scan``), tenant usage,
  stats, and the bench's raw limits.

Tenants (:mod:`~tieredkv.backends.lmdb.tenants`): each tenant's bytes are counted in the
``tenants`` DB inside the same write transaction as its records; a writer that does not keep
them (an earlier version) is noticed by the next one, which counts them again by a scan.

Several processes may open one directory (engines, ``tieredkv verify/migrate/evict``): the size
cap holds for the environment (:mod:`~tieredkv.backends.lmdb.eviction`), a map another process
grew is adopted on every path (:mod:`~tieredkv.backends.lmdb.env`), and pins protect keys only
from the process that pinned them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb

from tieredkv.backends.base import RawLimits, RecordInfo, TierCapabilities, TierStats, cancel_background
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.lmdb.env import acquire_env, release_env
from tieredkv.backends.lmdb.layout import ACCESS
from tieredkv.backends.lmdb.raw import LMDBRaw
from tieredkv.backends.lmdb.space import disk_full
from tieredkv.backends.lmdb.tenants import Ledger, count_tenants, entry_tenant, read_counters
from tieredkv.catalog import catalog_key
from tieredkv.errors import ConfigError, TieredKVError, TierFullError, TierUnavailableError
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import FINGERPRINT_BYTES

__all__ = ["LMDBTier"]

log = logging.getLogger(__name__)

_SCAN_PAGE = 1024


def _catalogued(txn: Any, acc: Any) -> int:
    """How many namespaces have a catalog record (:mod:`tieredkv.catalog`): one look-up per
    namespace, stepping from one fingerprint to the next in key order."""
    cur = txn.cursor(db=acc)
    n, start = 0, b""
    while cur.set_range(start):
        fp = bytes(cur.key()[:FINGERPRINT_BYTES])
        if len(fp) < FINGERPRINT_BYTES:
            break
        if txn.get(catalog_key(fp), db=acc) is not None:
            n += 1
        value = int.from_bytes(fp, "big") + 1
        if value >> (8 * FINGERPRINT_BYTES):
            break
        start = value.to_bytes(FINGERPRINT_BYTES, "big")
    return n


class LMDBTier(LMDBRaw):
    """``LMDBTier(LMDBTierConfig(path="/nvme/tieredkv", size_cap_bytes="100GiB"))``."""

    kind = "lmdb"
    capabilities = TierCapabilities(
        access_stamps=True,
        local_eviction=True,
        shared=True,
        sync_probe=True,
        writes_in_flight=2,
        medium="disk",
        tenants=True,
    )
    config_model = LMDBTierConfig

    # ---- what the registry, admin tools and the bench ask of the class ------------------

    @classmethod
    def missing(cls, config: Any) -> str | None:
        """The directory, when it holds no LMDB environment (``data.mdb``)."""
        path = os.path.abspath(os.path.expanduser(config.path))
        return None if os.path.exists(os.path.join(path, "data.mdb")) else f"no LMDB environment at {path}"

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits:
        """The disk under ``workdir``: one file written with ``pwrite`` (page cache, then with
        ``fdatasync``) and read warm with ``preadv``; py-lmdb put/get with this tier's map flags
        (``sync_mode``), the baseline: what LMDB itself does with these records; and the same with
        an xxh3 of every payload on both paths, the floor: what LMDB does with records whose
        integrity is checked, as this tier's are."""
        from tieredkv.backends._rawbench import gbps, raw_file, raw_lmdb

        nbytes = src.numel()
        sync = config.sync_mode == "durable"
        w, r = raw_file(src, dst, workdir, durable=False)
        figures = {"file_pagecache.store": gbps(nbytes, w), "file.load": gbps(nbytes, r)}
        figures["file_durable.store"] = gbps(nbytes, raw_file(src, dst, workdir, durable=True)[0])
        w, r = raw_lmdb(src, dst, workdir, sync=sync)
        figures |= {"lmdb_raw.store": gbps(nbytes, w), "lmdb_raw.load": gbps(nbytes, r)}
        w, r = raw_lmdb(src, dst, workdir, sync=sync, checked=True)
        figures |= {"lmdb_checked.store": gbps(nbytes, w), "lmdb_checked.load": gbps(nbytes, r)}
        write = "file_durable.store" if sync else "file_pagecache.store"
        return RawLimits(
            figures,  # judged against the strongest of the file and LMDB itself on this disk
            baseline={"store": (write, "lmdb_raw.store"), "load": ("file.load", "lmdb_raw.load")},
            floor={"store": "lmdb_checked.store", "load": "lmdb_checked.load"},
        )

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        if disk_full(exc, self.path):
            self._count("disk_full")
            return self._full_disk_error(exc)
        if isinstance(exc, lmdb.MapFullError):
            return TierFullError(
                f"tier {self.name!r}: LMDB map is full at {self._max_map} bytes; raise max_map_size_bytes"
            )
        if isinstance(exc, (lmdb.Error, OSError)):
            return TierUnavailableError(f"tier {self.name!r} (lmdb at {self.path}): {op} failed: {exc}")
        return super()._translate(exc, op)

    # ---- lifecycle ---------------------------------------------------------------------

    async def _open(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tieredkv-lmdb-{self.name}")
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tieredkv-lmdb-{self.name}-helper")
        try:
            await self._run(self._open_sync)
        except BaseException:
            self._pool.shutdown(wait=False)
            self._pool = None
            self._shut_helper()
            raise
        self._upkeep = asyncio.get_running_loop().create_task(self._upkeep_loop())

    def _open_sync(self) -> None:
        try:
            os.makedirs(self._spares, exist_ok=True)
            # A name of its own per open: several processes open one directory at once.
            fd, probe = tempfile.mkstemp(prefix=".tieredkv-write-test-", dir=self.path)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:  # not a directory, no permission, read-only: a setup error, not an outage
            raise ConfigError(
                f"tiers.{self.name}.path: {self.path!r} cannot hold an LMDB environment ({e.strerror});"
                " point it at a writable directory"
            ) from e
        shared = acquire_env(self.path, self.config)
        self._shared = shared
        self._ledger = Ledger(shared.tenants, shared.acc, shared.rec)
        try:
            self._count("stale_readers_cleared", shared.reader_check())
            shared.keep_reserve()
            ranked = self._txn(self._ranked)
            self._upkeep_sync(at_open=True)
        except BaseException:
            self._shared = None
            release_env(shared)
            raise
        self._adopt(ranked, skip=())

    async def _close(self) -> None:
        if self._pool is None:
            return
        upkeep, self._upkeep = self._upkeep, None
        await cancel_background(upkeep)
        try:
            await self._run(self._close_sync)
        finally:
            self._pool.shutdown(wait=True)
            self._pool = None
            self._shut_helper()

    def _shut_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def _close_sync(self) -> None:
        shared = self._shared
        if shared is None:
            return
        try:
            if self._dirty:
                try:
                    self._write(lambda txn: None)
                except TierFullError as e:  # access stamps only: the records are all committed
                    log.warning("tier %s: access stamps not written at close: %s", self.name, e)
            self._give_back_kept()
            try:
                shared.env.sync(True)
            except lmdb.Error as e:
                if not disk_full(e, self.path):
                    raise
                log.warning("tier %s: sync at close failed, the disk is full: %s", self.name, e)
        finally:
            self._shared = None
            release_env(shared)  # the last tier on this directory closes the environment

    # ---- listings, tenant usage, stats ---------------------------------------------------

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
        """A page of records in key order, each with its tenant (from the index: the header kept
        beside its stamp, or its ``records`` value; never a payload or a record file)."""
        rec = self._sh.rec

        def read(txn: Any) -> list[RecordInfo]:
            page: list[RecordInfo] = []
            get = txn.get
            cur = txn.cursor()
            start = after if after is not None else (fingerprint or b"")
            if not cur.set_range(start):
                return page
            if after is not None and cur.key() == after and not cur.next():
                return page
            for k, v in cur:
                if fingerprint is not None and not k.startswith(fingerprint):
                    break
                stamp, size = ACCESS.unpack_from(v)
                tenant = entry_tenant(v, lambda k=k: get(k, db=rec))
                page.append(RecordInfo(bytes(k), size - HEADER_SIZE, stamp, tenant))
                if len(page) >= _SCAN_PAGE:
                    break
            return page

        return self._txn(read, db=self._sh.acc)

    async def _tenant_usage(self) -> dict[int, int]:
        return await self._run(self._tenant_usage_sync)

    def _tenant_usage_sync(self) -> dict[int, int]:
        """Bytes per tenant: the counters, or (left behind by a writer that does not keep them)
        a scan of the index; the default tenant (0) holds the rest of the used bytes."""
        sh = self._sh

        def read(txn: Any) -> dict[int, int]:
            counts = read_counters(txn, sh.tenants)
            held = (
                {t: c[0] for t, c in counts.items()}
                if counts is not None
                else {t: c[0] for t, c in count_tenants(txn, sh.acc, sh.rec).items()}
            )
            rest = self._used_in(txn) - sum(held.values())
            return {**({0: rest} if rest > 0 else {}), **{t: n for t, n in held.items() if n > 0}}

        return self._txn(read)

    async def _stats(self) -> TierStats:
        return await self._run(self._stats_sync)

    def _stats_sync(self) -> TierStats:
        sh = self._shared
        assert sh is not None

        def read(txn: Any) -> tuple[int, int, int, int, int, int]:
            pages = 0
            for db in (sh.rec, sh.acc):
                st = txn.stat(db)
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            counts = (
                txn.stat(sh.rec)["entries"],
                self._used_in(txn),
                pages,
                txn.stat(sh.files)["entries"],
                txn.stat(sh.tenants)["entries"],
                _catalogued(txn, sh.acc),
            )
            return counts

        records, used, pages, files, tenants, catalogued = self._txn(read)
        info = sh.env.info()
        psize = sh.env.stat()["psize"]
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=self._cap,
            used_bytes=used,
            records=records,
            extra={
                "path": self.path,
                "map_size": info["map_size"],
                "sync_mode": self.config.sync_mode,
                "data_pages_bytes": pages * psize,  # B-tree pages of records and access stamps
                "file_high_water_bytes": (info["last_pgno"] + 1) * psize,
                "readers": info["num_readers"],
                "record_files": files,  # files under files/ that hold records (large write batches)
                "tenants": tenants,  # tenants other than the default one that hold records
                "catalog_records": catalogued,  # namespace catalog records among the records (tieredkv.catalog)
            },
        )

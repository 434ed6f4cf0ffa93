"""LMDBTier: one LMDB environment on local disk, evicted below a size cap (LRU by default).

Layout: named DB ``records`` (stored key → payload, a whole record, or a record's place in a
record file), named DB ``access`` (stored key → ``<d Q`` last-access Unix time, record bytes,
then the record's 64-byte header when the record is stored apart, or its place when it is in a
record file), named DB ``files`` (record file token → ``<Q`` records it still holds), named DB
``tenants`` (per-tenant bytes and records: :mod:`~tieredkv.backends.lmdb.tenants`) and, in the
main DB, ``tieredkv:used-bytes`` (``<Q``: the sum of every record's bytes, kept in the same
write transaction as the records it counts) and ``tieredkv:tenants-at`` (the transaction that
last left the tenant counters exact).

* **A record stored apart** (``put_many``): its payload alone in ``records``, its header
  (:mod:`tieredkv.format`, checksum over key, header and payload) after its access stamp. The
  two are written in one transaction, and a read checks the payload against that header. Stored
  so, py-lmdb copies each payload once, straight from the caller's buffer: a whole record would
  first have to be copied beside its header, because py-lmdb takes a value as one buffer and
  cannot reserve one to fill (measured, raw py-lmdb puts in 16 MiB transactions, 12 reps
  alternating: whole records 0.83-0.91x the bare payloads' put, apart 0.91-0.93x).
* **A record in a record file** (``put_many`` of a batch whose payloads add up to
  ``file_batch_bytes`` or more): the batch is written as one file under ``files/`` (its name a
  random 16-byte token in hex: never used twice), each record's header then its payload, one
  after another, before the transaction that enters them. A record's ``records`` value and the
  tail of its access entry name its place (``_PLACE``: token, offset); the ``files`` DB counts
  the records each file still holds. LMDB copies a value into a dirty page and again into the
  page cache at commit; a file is written once (measured in ``tieredkv bench``: 64 KiB-4 MiB
  stores 1.13-1.33x py-lmdb's put, against 0.68-0.79x stored apart). A deleted, replaced or
  evicted record's blocks are given back (punched) after the commit, and a file goes with its
  last record (kept as a spare for a later batch to write over: :meth:`LMDBTier._retire`, only
  while the disk has room to spare; spares no writer took for :data:`_SPARE_IDLE_S` are given
  back, all of them on a disk short of free space or full, and a tier that closes far below its
  cap gives back those it kept). A
  read copies the records of a batch out of their files in one C call, inside the read
  transaction that found their places (:func:`~tieredkv.format.read_placed_into`: the access
  entries are parsed there, no Python per record). A file changes only after its records left
  it, so a reader looks again once its copies are done if anything committed meanwhile
  (:meth:`LMDBTier._still_placed`): a record no longer where it was read is a miss
  (``record_files_moved_on``) whatever its copy got, and a record is deleted as corrupt only
  while it still names the place that failed. An admin read (``raw_get_many``: ``tieredkv
  verify``) looks again the same way, and reads a record that moved again where it is now (a
  record that keeps moving, or went, is None): never the bytes its old place holds now. A repair
  deletes by ``delete_if_same``: the whole record compared, then deleted, in one write
  transaction.
* **Who owns a record file** (:mod:`~tieredkv.backends.lmdb.files`): its writer, by an
  exclusive ``flock`` held from before the file has its name under ``files/`` (it comes in by
  a rename from ``files/spare/``, a spare or a new empty file made there) until the transaction
  that names it has committed, or the file is removed. Files no record names and no one holds
  (a crash between the write and the commit, or between a commit and the removal, in any
  process: the kernel lets go of a dead process's locks) are swept at open, and by an open
  tier every :data:`_SWEEP_EVERY_S` (at most :data:`_SWEEP_MAX_FILES` a pass, on the tier's
  thread between calls); a sweeper locks a file (skipping a held one) and looks for its name
  again in a transaction begun after, so a file a live writer owns is never swept, however
  long its write takes.
* **A record stored whole** (``raw_put_many``: migrations and tools write records as they are
  given, damaged ones included): the whole record in ``records``, the access entry its stamp
  alone. A read of any kind delivers only a payload that its header vouches for.
* **Tenants** (:mod:`~tieredkv.backends.lmdb.tenants`): a record's tenant is in its header (a
  record of the default tenant is version 1, as before) and, for a record in a record file,
  after its place in its ``records`` value, so evictions, scans and the counters find it in the
  index. Each tenant's bytes are counted in the ``tenants`` DB inside the same write transaction
  as its records; a writer that does not keep them (an earlier version) is noticed by the next
  one, which counts them again by a scan.

The access DB survives restarts; at open it is read once to rebuild the in-memory eviction
order: an :class:`~tieredkv.eviction.EvictionPolicy` named by ``eviction_policy`` (``lru``), fed
in the order its :meth:`~tieredkv.eviction.EvictionPolicy.rank` gives the stamps. Below, "LRU"
stands for that policy's order. (Versions before records were stored apart cannot open an
environment that holds one: they read every access entry as 16 bytes.)

* Every blocking LMDB call runs on one dedicated thread (a single-worker executor), never
  on the event loop; all LRU state is touched only from that thread.
* ``put_many`` is one write transaction: it evicts the least-recently-used unpinned records
  until the batch fits under ``size_cap_bytes`` (or raises TierFullError having stored
  nothing), then writes every record. With tenant quotas (:attr:`Tier.quotas`): a tenant whose
  batch would take it over its quota first loses its own least-recently-used records (this
  process's order of them; the shared stamps when it has not seen enough of them, as below),
  and when the cap is reached the records of tenants over their quota go before anyone's; a
  tenant's batch larger than its quota is refused (TierFullError, nothing stored). The headers of a batch of 1 MiB or more are computed by
  a helper thread: a pipeline lane keeps two batches in flight here (``writes_in_flight``), and
  one batch's checksums run while the tier's thread writes the one before. A smaller batch's
  are computed on the tier's thread, right before its transaction, unless a batch before it is
  still with the helper (``_put_many``).
* ``get_many`` reads in a read transaction with ``buffers=True``: each record's payload is copied
  straight from the memory map into the caller's buffer (one copy) and verified — a small one
  first, a large one (128 KiB and more) right after the copy, in the buffer, while the bytes are
  still in cache (a record that fails is a miss either way). A batch of large records (512 KiB
  and more each, 2 MiB in all) is read in two halves on two threads, each in its own read
  transaction; the tier's own thread updates the LRU and stamps once both are back.
  Access stamps are bumped in memory and written with the next write transaction.
* ``MapFullError`` first clears stale reader slots (a killed reader pins old pages), then grows
  the map (doubling, up to ``max_map_size_bytes``) and retries; at the limit it evicts further;
  it never crashes. (When the map is so full that even the eviction cannot commit, the map takes
  a one-time reserve of max(max_map/64, 256 KiB) past the limit.)
* ``sync_mode='durable'`` fsyncs every commit. ``'fast'`` skips the per-commit fsync and syncs
  on close: a process crash loses nothing committed; a power loss may lose recent puts (never
  corrupts older ones). ``writemap`` is never used: with it, a full disk kills the process with
  SIGBUS while writing through the map; without it the commit fails.
* **A full disk is a full tier, never an outage** (:mod:`~tieredkv.backends.lmdb.space`):
  ENOSPC or EDQUOT from a record file's write or sync, LMDB's commit (the eviction's own
  included) or the map's growth, and EIO while the filesystem has less free space than the
  write needed (LMDB reports a short write at commit as EIO), raise
  :class:`~tieredkv.errors.TierFullError` (counted ``disk_full``) and give back every spare.
  Nothing is stored then; reads and lookups go on (a read that finds a damaged record still
  answers a miss when the disk cannot take its deletion), and a pipeline's breaker stays
  closed. A real I/O error, with room on the disk, stays
  :class:`~tieredkv.errors.TierUnavailableError`. Disk blocks are kept allocated past LMDB's
  committed pages (up to 4 MiB, at most 1/32 of the filesystem: :meth:`_SharedEnv.keep_reserve`),
  so that on a full disk a deletion or an eviction still commits and frees room (``tieredkv
  evict`` empties a full disk); a deletion too large for them is done in smaller transactions.

Several processes on one directory (engines, ``tieredkv verify/migrate/evict``):

* The size cap holds for the environment, not per process: the used-bytes counter lives in the
  environment and is read and updated inside each write transaction (LMDB serializes writers
  across processes), so whichever process writes evicts until the whole environment fits. A
  process evicts the oldest records of its own LRU first; when those do not cover the excess,
  or over an eighth of the cap is records it has never seen (then at most every
  max(1 s, 20x the read)), it reads the shared access stamps, evicts the oldest records of any
  process and adopts that order.
* ``MapResizedError`` (another process grew the map past this one's) is handled on every path —
  reads, writes, probes, open: the map is adopted (``set_mapsize(0)``, with no transaction of
  this process open) and the operation retried.
* Stale reader slots (a SIGKILLed reader) are cleared (``reader_check``) at open, before the map
  grows, and at most once a second before a write.
* Inside one process all tiers on one directory share one environment (LMDB forbids opening
  it twice: fcntl locks belong to the process, so closing a second handle would drop the
  first's locks). A registry keyed by the directory's identity refcounts it; the last close
  closes it. A read/write lock lets any number of transactions run together and gives
  ``set_mapsize``/``close`` the environment to themselves.
* Pins protect keys only from the process that pinned them: a record another process evicts
  turns into a miss here, like one it deletes.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Container, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import lmdb

from tieredkv.backends.base import RawLimits, RecordInfo, Tier, TierCapabilities, TierStats
from tieredkv.backends.lmdb import files as record_files
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.lmdb.space import (
    disk_full,
    free_bytes,
    index_reserve,
    libc_fallocate,
    preallocate,
    spares_fit,
)
from tieredkv.backends.lmdb.tenants import (
    TENANTS_DB,
    Ledger,
    TenantOrders,
    count_tenants,
    counters_exact,
    entry_tenant,
    header_tenant,
    place_value,
    read_counters,
)
from tieredkv.catalog import catalog_key
from tieredkv.errors import ConfigError, CorruptRecordError, TieredKVError, TierFullError, TierUnavailableError
from tieredkv.eviction import EvictionPolicy, make_policy
from tieredkv.format import (
    HEADER_SIZE,
    encode_heads_into,
    read_placed_into,
    read_records_into,
    verify_many_into,
    verify_many_parts_into,
    verify_parts,
    verify_record,
    write_records,
)
from tieredkv.keys import FINGERPRINT_BYTES

__all__ = ["LMDBTier"]

log = logging.getLogger(__name__)

_ACCESS = struct.Struct("<dQ")
_USED = struct.Struct("<Q")
_USED_KEY = b"tieredkv:used-bytes"  # main DB: sum of record bytes in the environment
_TOKEN = 16  # bytes of a record file's name token (random: a name is never used twice)
_PLACE = struct.Struct("<16sQ")  # where a record in a file is: the file's token, the record's offset
_FILED = struct.Struct(_ACCESS.format + _PLACE.format[1:])  # a filed record's access entry: _ACCESS, then _PLACE
# For format.read_placed_into: a filed access entry's size, and where its record's size, file token
# and offset are in it.
_FILED_LAYOUT = (_FILED.size, struct.calcsize("<d"), _ACCESS.size, _ACCESS.size + struct.calcsize("<16s"))
_LIVE = struct.Struct("<Q")  # files DB: a record file's token -> how many records it still holds
_FILES = "files"  # record files, under the environment's directory
_SPARE = "spare"  # record files that lost their last record, kept (in files/spare/) to be written again
_SPARES_KEPT = 8  # at most this many spare files in an environment
_SPARE_IDLE_S = 60.0  # a spare no writer took for this long is given back (no one is churning here)
_SWEEP_EVERY_S = 30.0  # an open tier sweeps its directory's record files this often, on its own thread
_SWEEP_MAX_FILES = 64  # unnamed record files a periodic sweep locks and looks at, at most
_DELETE_SPLIT_MIN = 16  # a deletion the full disk refuses is split in two down to this many keys
_RAW_READ_TRIES = 3  # an admin read of a record that keeps moving (rewritten during each read) is a miss after this
_RESIZE_RETRIES = 3  # adopt a map another process grew, then retry (a few times: it may grow again)
_READER_CHECK_EVERY_S = 1.0


_T = TypeVar("_T")
#: A record that failed a read: its key, what was wrong, and its place in a record file (if in one).
_Bad = tuple[bytes, Exception, tuple[bytes, int] | None]
_SCAN_PAGE = 1024
_HEADS_ON_HELPER_FROM = 1 << 20  # payload bytes of a batch from which the helper thread checksums it


class _SharedEnv:
    """One open LMDB environment of this process, shared by every tier on its directory.

    ``txn()`` brackets every transaction (shared; re-entrant per thread); ``exclusive()`` is for
    what LMDB forbids beside an open transaction of the process: ``set_mapsize`` and ``close``.
    A waiting exclusive holder stops new shared ones, so a resize is never starved.
    """

    def __init__(self, key: tuple[int, int], path: str, env: Any, sync_mode: str) -> None:
        self.key = key
        self.path = path
        self.env = env
        self.sync_mode = sync_mode
        self.refs = 0
        self.closed = False
        self.rec: Any = None
        self.acc: Any = None
        self.files: Any = None
        self.tenants: Any = None
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._exclusive = False
        self._waiting = 0
        self._held = threading.local()
        self._last_reader_check = 0.0
        self.data_path = os.path.join(path, "data.mdb")
        self.psize = int(env.stat()["psize"])
        self.reserve = index_reserve(path)  # disk blocks kept allocated past data.mdb's committed pages
        self.reserved_to = 0  # data.mdb's blocks are allocated up to here
        self.can_reserve = True

    # ---- the read/write lock -------------------------------------------------------------

    def acquire_shared(self, blocking: bool = True) -> bool:
        n = getattr(self._held, "n", 0)
        if n:
            self._held.n = n + 1
            return True
        with self._cond:
            while self._exclusive or self._waiting:
                if not blocking:
                    return False
                self._cond.wait()
            self._readers += 1
        self._held.n = 1
        return True

    def release_shared(self) -> None:
        self._held.n -= 1
        if self._held.n == 0:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    def acquire_exclusive(self, blocking: bool = True) -> bool:
        if getattr(self._held, "n", 0):
            raise RuntimeError("lmdb: set_mapsize/close from inside a transaction of this thread")
        with self._cond:
            if not blocking and (self._exclusive or self._readers):
                return False
            self._waiting += 1
            try:
                while self._exclusive or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        return True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()

    # ---- map and reader table --------------------------------------------------------------

    def adopt_map(self, blocking: bool = True) -> bool:
        """Take the map size another process grew the environment to (no transaction open)."""
        if not self.acquire_exclusive(blocking):
            return False
        try:
            if not self.closed:
                self.env.set_mapsize(0)
        finally:
            self.release_exclusive()
        return True

    def grow_map(self, target: int) -> None:
        with self.exclusive():
            if not self.closed and self.env.info()["map_size"] < target:
                self.env.set_mapsize(target)

    def reader_check(self) -> int:
        """Clear reader slots of dead processes (they pin old pages: the file would only grow)."""
        self._last_reader_check = time.monotonic()
        return int(self.env.reader_check())

    def reader_check_due(self) -> bool:
        return time.monotonic() - self._last_reader_check >= _READER_CHECK_EVERY_S

    def keep_reserve(self) -> None:
        """Keep disk blocks allocated past the pages LMDB has committed
        (:func:`~tieredkv.backends.lmdb.space.index_reserve`), topped up when half of them went:
        on a full disk a deletion or an eviction still commits. (A failed commit of a full disk
        does not use them up: an aborted commit's pages are where the next one writes.)"""
        if not self.can_reserve:
            return
        end = (self.env.info()["last_pgno"] + 1) * self.psize
        if end + self.reserve // 2 <= self.reserved_to:
            return
        err = preallocate(self.data_path, end, self.reserve)
        if err == 0:
            self.reserved_to = end + self.reserve
        elif err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            self.can_reserve = False  # (the filesystem cannot: nothing to keep)


_REGISTRY: dict[tuple[int, int], _SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()


def _env_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _acquire_env(path: str, cfg: LMDBTierConfig) -> _SharedEnv:
    """This process's environment on ``path``: opened now, or the one already open (refcounted)."""
    with _REGISTRY_LOCK:
        key = _env_identity(path)
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = _open_env(key, path, cfg)
            _REGISTRY[key] = shared
        elif shared.sync_mode != cfg.sync_mode:
            raise ConfigError(
                f"{path!r} is already open in this process with sync_mode={shared.sync_mode!r}; tiers on one"
                f" directory share one LMDB environment, so sync_mode={cfg.sync_mode!r} cannot apply — use one mode"
            )
        shared.refs += 1
    try:
        if shared.env.info()["map_size"] < int(cfg.map_size_bytes):
            shared.grow_map(int(cfg.map_size_bytes))
    except BaseException:
        _release_env(shared)
        raise
    return shared


def _open_env(key: tuple[int, int], path: str, cfg: LMDBTierConfig) -> _SharedEnv:
    """Open, clear stale readers, open the named DBs and make sure the used-bytes counter exists,
    adopting a map another process grows meanwhile; on any failure the environment is closed
    (never left half open: a later open starts clean)."""
    fast = cfg.sync_mode == "fast"
    for attempt in range(_RESIZE_RETRIES + 1):
        try:
            env = lmdb.open(
                path,
                map_size=int(cfg.map_size_bytes),
                max_dbs=4,
                max_readers=cfg.max_readers,
                writemap=False,  # writes go through pwrite: a full disk is an error, never a SIGBUS
                sync=not fast,
                metasync=not fast,
                readahead=False,
                meminit=False,
                lock=True,
            )
            break
        except lmdb.MapResizedError:
            if attempt == _RESIZE_RETRIES:
                raise
    shared = _SharedEnv(key, path, env, cfg.sync_mode)
    try:
        env.reader_check()
        for attempt in range(_RESIZE_RETRIES + 1):
            try:
                shared.rec = env.open_db(b"records")
                shared.acc = env.open_db(b"access")
                shared.files = env.open_db(b"files")
                shared.tenants = env.open_db(TENANTS_DB)
                with env.begin(write=True) as txn:
                    if txn.get(_USED_KEY) is None:  # created by an older version: count once
                        total = sum(_ACCESS.unpack_from(v)[1] for v in txn.cursor(db=shared.acc).iternext(keys=False))
                        txn.put(_USED_KEY, _USED.pack(total))
                    if not counters_exact(txn, write=True):
                        # tenant counters missing or left behind by a writer that does not keep
                        # them (an older version): counted once, here
                        Ledger(shared.tenants, shared.acc, shared.rec).rebuild(txn)
                break
            except lmdb.MapResizedError:
                if attempt == _RESIZE_RETRIES:
                    raise
                env.set_mapsize(0)  # nothing of this environment is open yet
    except BaseException:
        shared.closed = True
        env.close()
        raise
    return shared


#: A read batch of records this large each, and this large in all, is read by two threads.
#: (With the C helper's checked copy, 256 KiB records read 4.40 -> 5.74 GB/s split, 64 KiB the same
#: either way: 3.18 -> 3.23; interleaved A/B through the pipeline, median of 8.)
_SPLIT_RECORD_BYTES = 128 << 10
_SPLIT_BATCH_BYTES = 2 << 20


def _head(meta: Any) -> memoryview | None:
    """The record header kept in an access entry ``meta`` (None: the record is stored whole)."""
    if meta is None or len(meta) != _ACCESS.size + HEADER_SIZE:
        return None
    return memoryview(meta)[_ACCESS.size :]


def _place(meta: Any) -> tuple[bytes, int] | None:
    """Where the record of access entry ``meta`` is in a record file: (the file's token, the
    record's offset); None: the record is in LMDB."""
    if meta is None or len(meta) != _FILED.size:
        return None
    token, at = _PLACE.unpack_from(meta, _ACCESS.size)
    return token, at


def _read_at(path: str, at: int, size: int) -> bytes | None:
    """``size`` bytes at ``at`` of the record file ``path`` (fewer where it ends first); None
    when the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, size, at)
    finally:
        os.close(fd)


def _merged(holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges with those that touch joined: records evicted together, in the
    order they were written, are one range (one call)."""
    out: list[tuple[int, int]] = []
    for at, n in sorted(holes):
        if out and out[-1][0] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((at, n))
    return out


def _punch(path: str, holes: list[tuple[int, int]]) -> None:
    """Give back the disk blocks of the (offset, length) ranges of a record file (their bytes
    read as zeros afterwards); where the file system cannot, they stay until the file goes.

    Only while the file is still the one at ``path``, and holding a shared ``flock`` on it: the
    commit that freed these ranges is over, so another writer may meanwhile have taken the
    file's last record, retired it as a spare and taken it again for a batch of its own, which
    it writes holding the exclusive lock. A punch by path without those checks gave back blocks
    of that new batch's live records (read afterwards as corrupt, and deleted: about one run in
    twelve of two threads and a process overwriting each other's records)."""
    fallocate = libc_fallocate()
    if fallocate is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a writer holds it: retired and taken since
            here = os.stat(path)
        except OSError:
            return
        mine = os.fstat(fd)
        if (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
            return  # renamed away since it was opened (a spare now, or taken again): written over whole
        for at, n in holes:
            if fallocate(fd, 3, at, n) != 0:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
                return
    finally:
        os.close(fd)  # (lets go of the lock)


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


def _release_env(shared: _SharedEnv) -> None:
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        if _REGISTRY.get(shared.key) is shared:
            del _REGISTRY[shared.key]
        # Closed before the registry lock goes: a new open of this directory must not race it.
        with shared.exclusive():  # no probe's read transaction may outlive the environment
            shared.closed = True
            shared.env.close()


class LMDBTier(Tier):
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

    def __init__(self, config: LMDBTierConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or LMDBTierConfig(), **kwargs)
        cfg: LMDBTierConfig = self.config
        self.path = os.path.abspath(os.path.expanduser(cfg.path))
        self._cap = int(cfg.size_cap_bytes)
        self._max_map = int(cfg.max_map_size_bytes)
        self._pool: ThreadPoolExecutor | None = None
        # the tier's second thread: reads the second half of a large batch, encodes a write's records
        self._helper: ThreadPoolExecutor | None = None
        self._shared: _SharedEnv | None = None
        self._policy: EvictionPolicy = make_policy(cfg.eviction_policy)  # key -> record bytes
        self._torders = TenantOrders(cfg.eviction_policy)  # the same, per tenant (not the default one)
        self._ledger: Ledger | None = None  # the tenant counters, within a write transaction
        self._dirty: dict[bytes, float] = {}
        self._on_helper = 0  # batches on the helper thread now (loop thread only)
        self._rescan: list[RecordInfo] | None = None  # shared order read by the last eviction
        self._next_scan = 0.0  # monotonic time before which only a shortfall triggers a shared scan
        self._files = os.path.join(self.path, _FILES)
        self._spares = os.path.join(self._files, _SPARE)
        self._file_min = None if cfg.file_batch_bytes is None else int(cfg.file_batch_bytes)
        # what the open write transaction frees in record files: whole files, and records in files
        self._doomed: list[bytes] = []
        self._holes: dict[bytes, list[tuple[int, int]]] = {}
        self._kept: set[str] = set()  # names of the spares this tier kept (given back at close when idle here)
        self._upkeep: asyncio.Task[None] | None = None  # the periodic sweep (:meth:`_upkeep_loop`)

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
        return RawLimits(
            figures,
            baseline={"store": "lmdb_raw.store", "load": "lmdb_raw.load"},
            floor={"store": "lmdb_checked.store", "load": "lmdb_checked.load"},
        )

    @property
    def _sh(self) -> _SharedEnv:
        """The shared environment (only used while open)."""
        assert self._shared is not None, "LMDB tier used while not open"
        return self._shared

    @property
    def _env(self) -> Any:
        return None if self._shared is None else self._shared.env

    # ---- thread plumbing ---------------------------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

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

    def _txn(self, fn: Callable[[Any], _T], write: bool = False, db: Any = None, buffers: bool = False) -> _T:
        """``fn(txn)`` in one transaction (committed when ``write``), bracketed by the shared lock;
        a map another process grew is adopted and ``fn`` retried."""
        sh = self._shared
        assert sh is not None
        for attempt in range(_RESIZE_RETRIES + 1):
            try:
                with sh.shared(), sh.env.begin(write=write, db=db, buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                if attempt == _RESIZE_RETRIES:
                    raise
                sh.adopt_map()
                self._count("map_adoptions")
        raise AssertionError("unreachable")

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
        shared = _acquire_env(self.path, self.config)
        self._shared = shared
        self._ledger = Ledger(shared.tenants, shared.acc, shared.rec)
        try:
            self._count("stale_readers_cleared", shared.reader_check())
            shared.keep_reserve()
            ranked = self._txn(self._ranked)
            self._upkeep_sync(at_open=True)
        except BaseException:
            self._shared = None
            _release_env(shared)
            raise
        self._adopt(ranked, skip=())

    async def _close(self) -> None:
        if self._pool is None:
            return
        upkeep, self._upkeep = self._upkeep, None
        if upkeep is not None and not upkeep.done():
            loop = upkeep.get_loop()
            if loop is asyncio.get_running_loop():
                upkeep.cancel()
                await asyncio.gather(upkeep, return_exceptions=True)
            elif not loop.is_closed():  # (closed from another loop than it was opened in)
                loop.call_soon_threadsafe(upkeep.cancel)
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
            _release_env(shared)  # the last tier on this directory closes the environment

    # ---- upkeep: sweeping record files no one owns, giving back spares ---------------------

    async def _upkeep_loop(self) -> None:
        """Every :data:`_SWEEP_EVERY_S`, one bounded sweep (:meth:`_upkeep_sync`) on the tier's
        thread, queued behind the calls already there (never inside one). A failed sweep is
        logged; the next one tries again."""
        while True:
            await asyncio.sleep(_SWEEP_EVERY_S)
            try:
                await self._run(self._upkeep_sync)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - housekeeping: never the tier's outcome
                log.warning("tier %s: record file sweep failed: %s", self.name, e)

    def _upkeep_sync(self, at_open: bool = False) -> None:
        """Remove record files no committed record names and no writer holds (at most
        :data:`_SWEEP_MAX_FILES` a pass; at open, all: a crash between a file's write and its
        commit, or between a commit and the removal, in any process), and give back the spares
        no one took for :data:`_SPARE_IDLE_S`, or all of them while the disk is short of free
        space."""
        if self._shared is None:
            return
        limit = None if at_open else _SWEEP_MAX_FILES
        if os.path.isdir(self._files):

            def named() -> set[str]:
                return self._txn(
                    lambda txn: {bytes(t).hex() for t in txn.cursor(db=self._sh.files).iternext(values=False)}
                )

            self._count("orphan_files_removed", record_files.sweep(self._files, named, limit))
        entries = record_files.spares(self._spares)
        self._kept.intersection_update(name for name, _, _ in entries)  # (others take spares too)
        if entries:
            held = sum(n for _, n, _ in entries)
            drop = (
                [name for name, _, _ in entries]
                if not spares_fit(free_bytes(self._files), held)
                else record_files.idle(entries, _SPARE_IDLE_S)
            )
            self._give_back(drop)
        self._count("sweeps")

    def _give_back(self, names: list[str]) -> int:
        """Remove the spares ``names`` (those no one is taking); the disk bytes freed."""
        if not names:
            return 0
        n, freed = record_files.give_back(self._spares, names)
        self._kept.difference_update(names)
        self._count("spares_given_back", n)
        return freed

    def _give_back_kept(self) -> None:
        """At close: the spares this tier kept that no one took are given back, unless the
        environment is at least half full (a writer still evicting here will want them)."""
        if not self._kept:
            return
        try:
            used = self._txn(self._used_in)
            if used < self._cap // 2:
                self._give_back(sorted(self._kept))
        except (OSError, lmdb.Error) as e:
            log.warning("tier %s: spares not given back at close: %s", self.name, e)
        self._kept.clear()

    # ---- record files ------------------------------------------------------------------

    def _file_path(self, token: bytes) -> str:
        return os.path.join(self._files, token.hex())

    def _doom(self, txn: Any, meta: Any) -> None:
        """The open write transaction deletes (or replaces) the record of access entry ``meta``:
        if it is in a record file, count it out of the file, and once the transaction has
        committed (:meth:`_free`) remove the file when it was its last record, else give back
        the record's blocks."""
        place = _place(meta)
        if place is None:
            return
        token, at = place
        files = self._sh.files
        raw = txn.get(token, db=files)
        live = 0 if raw is None else _LIVE.unpack(raw)[0] - 1
        if live > 0:
            txn.put(token, _LIVE.pack(live), db=files)
            self._holes.setdefault(token, []).append((at, _ACCESS.unpack_from(meta)[1]))
        else:
            txn.delete(token, db=files)
            self._doomed.append(token)

    def _drop(self, txn: Any, key: bytes, meta: Any) -> None:
        """The open write transaction deletes (or replaces) ``key``'s record, of access entry
        ``meta`` (None: not there): its record file keeps count (:meth:`_doom`), and its tenant's
        counter (:mod:`~tieredkv.backends.lmdb.tenants`) drops it. Called before its ``records``
        value goes (a record's tenant may be there)."""
        if meta is None:
            return
        self._doom(txn, meta)
        ledger = self._ledger
        if ledger is not None and ledger.active:
            tenant = entry_tenant(meta, lambda: txn.get(key, db=self._sh.rec))
            if tenant:
                ledger.add(tenant, -_ACCESS.unpack_from(meta)[1], -1)

    def _forget_freed(self) -> None:
        """A write transaction starts (again): nothing is freed yet."""
        self._doomed.clear()
        self._holes.clear()

    def _free(self) -> None:
        """After the commit: remove the record files that lost their last record, give back the
        blocks of the records deleted from the others (a reader that opened a file first still
        reads a removed one whole; one reading a record whose blocks went reads zeros: a miss)."""
        for token in self._doomed:
            self._holes.pop(token, None)
            self._retire(token)
        for token, holes in self._holes.items():
            _punch(self._file_path(token), _merged(holes))
        self._forget_freed()

    def _retire(self, token: bytes) -> None:
        """A file that lost its last record: kept as a spare (renamed into ``files/spare/``: its
        name is gone, so no reader finds it by its token again) while fewer than
        :data:`_SPARES_KEPT` are there and the disk has room to spare
        (:func:`~tieredkv.backends.lmdb.space.spares_fit`), else removed. The next batch's file
        is a spare written over when there is one: creating a file costs 0.5-0.9 ms of kernel
        CPU on ext4 while files are being deleted (it skips inodes freed in the last seconds), a
        rename 15 µs, and pages already in the page cache are written over at about twice the
        speed of new ones."""
        path = self._file_path(token)
        try:
            entries = record_files.spares(self._spares)
            if len(entries) < _SPARES_KEPT:
                held = sum(n for _, n, _ in entries) + os.stat(path).st_blocks * 512
                if spares_fit(free_bytes(self._files), held):
                    os.rename(path, os.path.join(self._spares, token.hex()))
                    self._kept.add(token.hex())
                    return
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("tier %s: record file %s not kept as a spare: %s", self.name, token.hex(), e)
        self._unlink(token)

    def _unlink(self, token: bytes) -> None:
        try:
            os.unlink(self._file_path(token))
        except FileNotFoundError:
            pass
        except OSError as e:  # left behind: a sweep removes it
            log.warning("tier %s: record file %s not removed: %s", self.name, token.hex(), e)

    def _write_file(self, heads: memoryview, payloads: list[memoryview]) -> tuple[bytes, int]:
        """Write the records (header ``heads[i]``, then ``payloads[i]``) one after another into a
        record file of a new token: a spare written over, or a new file. Returns the token and a
        descriptor holding the file's lock (:mod:`~tieredkv.backends.lmdb.files`: no sweep
        removes the file while it is held), to be closed once the transaction that names the file
        has committed, or the file is removed. Durable: the file synced, then its directory,
        before that commit. On a failure nothing is left (and nothing held)."""
        token = os.urandom(_TOKEN)
        path = self._file_path(token)
        durable = self.config.sync_mode == "durable"
        spare = record_files.take(self._spares, path)
        if spare is None:
            held = record_files.create(self._spares, path)
        else:
            held = spare[0]
            self._kept.discard(spare[1])
        try:
            write_records(path, heads, payloads, sync=durable, reuse=True)
            if durable:
                fd = os.open(self._files, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            self._unlink(token)  # (write_records removes a file it fails to write, not one it fails to open)
            os.close(held)
            raise
        return token, held

    def _full_disk(self, exc: BaseException) -> TierFullError:
        """A write found the disk full (:func:`~tieredkv.backends.lmdb.space.disk_full`): the
        spares go (their blocks are the room a next write needs), and the tier answers full —
        alive: reads and lookups go on, and a caller's breaker stays closed."""
        self._count("disk_full")
        try:
            self._give_back([name for name, _, _ in record_files.spares(self._spares)])
        except OSError as e:
            log.warning("tier %s: spares not given back: %s", self.name, e)
        return self._full_disk_error(exc)

    def _full_disk_error(self, exc: BaseException) -> TierFullError:
        free = free_bytes(self._files)
        return TierFullError(
            f"tier {self.name!r}: the disk under {self.path} is full ({exc}; {free} bytes free);"
            " free space or lower size_cap_bytes"
        )

    # ---- shared accounting (inside a write transaction) ---------------------------------

    def _used_in(self, txn: Any) -> int:
        raw = txn.get(_USED_KEY)
        return 0 if raw is None else _USED.unpack(raw)[0]

    def _evict_in(
        self,
        txn: Any,
        excess: int,
        protect: set[bytes],
        evicted: dict[bytes, int],
        tenant: int | None = None,
        must: bool = True,
    ) -> int:
        """Delete the least-recently-used unpinned records (not in ``protect``) covering ``excess``
        bytes of the environment, adding them to ``evicted`` (keys already gone map to 0). This
        process's LRU goes first; the shared access stamps (every process's records) decide
        instead when it falls short, or when over an eighth of the cap is records this process
        has never seen (rate-limited: a full read of the access DB), and the LRU adopts that order
        after the commit (:meth:`_after_evictions`). With quotas, the records of tenants over
        their quota go first (:meth:`_evict_over_quota`).

        ``tenant``: only that tenant's records (it is over its quota), by this process's order of
        them, then by the shared stamps the same way (over an eighth of its quota unseen here).

        Returns what is left of ``excess`` (0 or less: covered). Raises TierFullError (the
        caller's transaction is then aborted) when it is not covered (everything is pinned),
        unless ``must`` is false."""
        sh = self._shared
        assert sh is not None

        def take(k: bytes, size: int, meta: Any = None) -> None:
            self._drop(txn, k, txn.get(k, db=sh.acc) if meta is None else meta)
            txn.delete(k, db=sh.rec)
            txn.delete(k, db=sh.acc)
            evicted[k] = size

        if tenant is None:
            if self.quotas.enabled:
                excess = self._evict_over_quota(txn, excess, protect, evicted)
                if excess <= 0:
                    return excess
            foreign = self._used_in(txn) - self._policy.total_bytes  # bytes this process has never seen
            bound = self._cap
            order = self._policy.victims()
        else:
            assert self._ledger is not None
            foreign = self._ledger.usage(txn, tenant) - self._torders.known_bytes(tenant)
            bound = self.quotas.limit(tenant, self._cap) or self._cap
            order = self._torders.victims(tenant)
        if foreign > bound // 8 and time.monotonic() >= self._next_scan:
            # their records may be the oldest
            return self._scan_in(txn, excess, protect, evicted, take, tenant, must)
        for k in order:  # not changed here: _after_evictions forgets them
            if excess <= 0:
                return excess
            if k in protect or k in evicted or self.is_pinned(k):
                continue
            meta = txn.get(k, db=sh.acc)  # (read once: its size, and its place in a record file)
            size = 0 if meta is None else _ACCESS.unpack_from(meta)[1]
            if size and tenant is not None and entry_tenant(meta, lambda k=k: txn.get(k, db=sh.rec)) != tenant:
                continue  # written again since by another tenant (in another process): not this tenant's
            if size:
                take(k, size, meta)
                excess -= size
            else:  # already gone: another process deleted or evicted it
                evicted[k] = 0
        if excess > 0:
            return self._scan_in(txn, excess, protect, evicted, take, tenant, must)
        return excess

    def _evict_over_quota(self, txn: Any, excess: int, protect: set[bytes], evicted: dict[bytes, int]) -> int:
        """The environment is over its cap by ``excess``: the tenants over their quota lose their
        own oldest records first (the furthest over first), down to their quota at most. Returns
        what is left of ``excess``."""
        assert self._ledger is not None
        over = []
        for t, held in self._ledger.all(txn).items():
            quota = self.quotas.limit(t, self._cap)
            if quota is not None and held > quota:
                over.append((held - quota, t))
        for gap, t in sorted(over, reverse=True):
            if excess <= 0:
                break
            want = min(gap, excess)
            excess -= want - self._evict_in(txn, want, protect, evicted, tenant=t, must=False)
        return excess

    def _scan_in(
        self,
        txn: Any,
        excess: int,
        protect: set[bytes],
        evicted: dict[bytes, int],
        take: Callable[[bytes, int], None],
        tenant: int | None = None,
        must: bool = True,
    ) -> int:
        """Evict by the shared access stamps (every process's records, oldest first; ``tenant``:
        only that tenant's). A full read of the access DB: when not forced by a shortfall, run at
        most every 20x its own duration. Returns what is left of ``excess``."""
        started = time.monotonic()
        self._count("shared_lru_scans")
        self._rescan = self._ranked(txn)
        for info in self._rescan:
            if excess <= 0:
                break
            k = info.key
            if tenant is not None and info.tenant != tenant:
                continue
            if k in protect or evicted.get(k) or self.is_pinned(k):
                continue
            size = info.size + HEADER_SIZE
            take(k, size)
            excess -= size
        now = time.monotonic()
        self._next_scan = now + max(1.0, 20 * (now - started))
        if excess > 0 and must:
            whose = "" if tenant is None else f" of tenant {self.quotas.label(tenant)} (over its quota)"
            raise TierFullError(
                f"tier {self.name!r}: size cap of {self._cap} bytes reached and every record{whose} that"
                " could be evicted is pinned (in use)"
            )
        return excess

    def _after_evictions(self, evicted: dict[bytes, int]) -> None:
        """After the commit: drop what went from the LRU, and adopt a shared LRU order just read."""
        if self._rescan is not None:
            self._adopt(self._rescan, skip=evicted)
            self._rescan = None
        self._forget(evicted)
        self._count("evictions", sum(1 for size in evicted.values() if size))

    def _forget(self, keys: Any) -> None:
        torders = self._torders if self._torders else None
        for k in keys:
            self._policy.remove(k)
            self._dirty.pop(k, None)
            if torders is not None:
                torders.remove(k)

    def _ranked(self, txn: Any) -> list[RecordInfo]:
        """Every record of the environment (every process's) by its shared access stamp, in the
        policy's eviction order (:meth:`~tieredkv.eviction.EvictionPolicy.rank`), with its tenant
        (looked up only while some tenant other than the default one holds records)."""
        infos = []
        sh = self._sh
        get, rec = txn.get, sh.rec
        tenanted = txn.stat(sh.tenants)["entries"] > 0
        for k, v in txn.cursor(db=sh.acc):
            stamp, size = _ACCESS.unpack_from(v)
            tenant = entry_tenant(v, lambda k=k: get(k, db=rec)) if tenanted else 0
            infos.append(RecordInfo(bytes(k), size - HEADER_SIZE, stamp, tenant))
        return self._policy.rank(infos)

    def _adopt(self, ranked: list[RecordInfo], skip: Container[bytes]) -> None:
        """Replace the in-memory orders by ``ranked`` (first = evict first), less ``skip``."""
        policy = make_policy(self.config.eviction_policy)
        orders = TenantOrders(self.config.eviction_policy)
        for info in ranked:
            if info.key not in skip:
                policy.insert(info.key, info.size + HEADER_SIZE)
                if info.tenant:
                    orders.insert(info.key, info.size + HEADER_SIZE, info.tenant)
        self._policy = policy
        self._torders = orders

    # ---- writes ------------------------------------------------------------------------

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        """Compute the batch's record headers on the helper thread, then write the batch on the
        tier's thread. A record is stored apart (see the module docstring): its payload as it is
        in ``records``, its header beside its access stamp, so py-lmdb copies each payload
        once, from the caller's buffer, and nothing copies it before. A lane keeps two batches in
        flight here (``writes_in_flight``): the headers of one are computed (the checksums let go
        of the GIL) while the one before is in its transaction.

        A small batch (an engine step's few chunks) has its headers computed on the tier's thread
        right before its transaction when no batch is in the helper's hands: the two thread
        hand-offs it saves cost more than its checksums (seven 64 KiB chunks: 0.54 ms a call the
        long way, of which 0.24 in the transaction). Only then: an earlier batch still with the
        helper would otherwise be written after it, and writes land in call order.

        The payloads must stay as they are until the call returns (the pipeline holds its
        buffers until then). Cancelled while its batch is with the helper, a call writes
        nothing; once its work has begun on the tier's thread it may still land, and a payload
        changed under it then fails its checksum when read (a miss, never other bytes).

        ``tenants`` (per item; None: all the default tenant): each record's tenant, in its header,
        counted against its quota (:meth:`_put_records`)."""
        extra = () if tenants is None else (tenants,)  # (the default tenant's calls are as they were)
        if self._on_helper == 0 and sum(len(p) for _, p in items) < _HEADS_ON_HELPER_FROM:
            await self._run(self._heads_put, items, *extra)
            return
        assert self._helper is not None
        self._on_helper += 1  # loop thread only
        try:
            heads = await asyncio.get_running_loop().run_in_executor(self._helper, self._heads, items, *extra)
        finally:
            self._on_helper -= 1
        await self._run(self._put_records, items, heads, *extra)  # queued before this coroutine yields again

    def _heads_put(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        if tenants is None:
            self._put_records(items, self._heads(items))
        else:
            self._put_records(items, self._heads(items, tenants), tenants)

    def _heads(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> bytearray:
        """The 64-byte header of every item (with its tenant), one after another."""
        heads = bytearray(HEADER_SIZE * len(items))
        if tenants is None:
            encode_heads_into(memoryview(heads), items)
        else:
            encode_heads_into(memoryview(heads), [(k, p, t) for (k, p), t in zip(items, tenants, strict=True)])
        return heads

    def _put_records(
        self, items: list[tuple[bytes, memoryview]], heads: bytearray | None = None, tenants: list[int] | None = None
    ) -> None:
        """One write transaction: evict to fit under the cap (all or nothing), then write every
        item (keys unique: ``put_checked``). With ``heads`` (the items' headers, in order), each
        item is a payload, stored apart from its header; without, a whole record (header, then
        payload: ``raw_put_many``, from a migration or a tool), stored as it is.

        Tenants (``tenants``, per item; a whole record's own header names its): a tenant whose
        records would go over its quota loses its own oldest records first, in the same
        transaction, before anyone's go for the cap; a tenant's batch larger than its quota is
        refused (TierFullError, nothing stored)."""
        apart = heads is not None
        sizes = {k: (HEADER_SIZE if apart else 0) + len(p) for k, p in items}
        total = sum(sizes.values())
        if total > self._cap:
            raise TierFullError(f"tier {self.name!r}: a batch of {total} bytes exceeds size_cap_bytes ({self._cap})")
        if tenants is not None:
            tids = {k: t for (k, _), t in zip(items, tenants, strict=True) if t}
        elif heads is None:
            tids = {k: t for k, p in items if (t := header_tenant(p[:HEADER_SIZE]))}
        else:
            tids = {}
        by_tenant: dict[int, int] = {}
        for k, t in tids.items():
            by_tenant[t] = by_tenant.get(t, 0) + sizes[k]
        quotas: dict[int, int] = {}
        for t, nbytes in by_tenant.items():
            quota = self.quotas.limit(t, self._cap)
            if quota is None:
                continue
            if nbytes > quota:
                raise TierFullError(
                    f"tier {self.name!r}: a batch of {nbytes} bytes of tenant {self.quotas.label(t)} exceeds"
                    f" its quota ({quota} bytes); nothing of it was stored"
                )
            quotas[t] = quota
        now = time.time()
        token: bytes | None = None
        held: int | None = None  # the lock on the batch's record file, until its commit
        in_lmdb = total  # value bytes the transaction writes (for telling a full disk: _write)
        if heads is None:
            stamps = [(k, _ACCESS.pack(now, n)) for k, n in sizes.items()]
        else:
            hv = memoryview(heads)
            stamps = [
                (k, _ACCESS.pack(now, sizes[k]) + hv[i * HEADER_SIZE : (i + 1) * HEADER_SIZE])
                for i, (k, _) in enumerate(items)  # heads[i] is items[i]'s
            ]
            if self._file_min is not None and total - HEADER_SIZE * len(items) >= self._file_min:
                # one record file for the batch: each record names its place there
                try:
                    token, held = self._write_file(hv, [p for _, p in items])
                except OSError as e:
                    if disk_full(e, self._files, total):
                        raise self._full_disk(e) from e
                    raise
                in_lmdb = len(items) * _FILED.size
                places = []
                at = 0
                for k, _ in items:
                    places.append((k, _PLACE.pack(token, at)))
                    at += sizes[k]
                stamps = [(k, _ACCESS.pack(now, sizes[k]) + place) for k, place in places]
                if tids:  # the records value: the place, then the tenant when not the default one
                    places = [(k, place_value(place, tids.get(k, 0))) for k, place in places]
                items = places  # type: ignore[assignment]
        evicted: dict[bytes, int] = {}
        sh = self._shared
        assert sh is not None

        ledger = self._ledger
        assert ledger is not None

        def body(txn: Any) -> None:
            evicted.clear()
            used = self._used_in(txn)
            old = txn.cursor(db=sh.acc).getmulti(list(sizes))  # records about to be overwritten
            for k, v in old:
                used -= _ACCESS.unpack_from(v)[1]
                self._drop(txn, k, v)
            protect = set(sizes)
            for t, quota in quotas.items():  # a tenant over its quota loses its own records first
                over = ledger.usage(txn, t) + by_tenant[t] - quota
                if over > 0:
                    self._evict_in(txn, over, protect, evicted, tenant=t)
            used -= sum(evicted.values())
            if used + total > self._cap:
                before = sum(evicted.values())
                self._evict_in(txn, used + total - self._cap, protect, evicted)
                used -= sum(evicted.values()) - before
            txn.cursor(db=sh.rec).putmulti(items)
            txn.cursor(db=sh.acc).putmulti(stamps)
            if token is not None:
                txn.put(token, _LIVE.pack(len(items)), db=sh.files)
            for k, t in tids.items():
                ledger.add(t, sizes[k], 1)
            txn.put(_USED_KEY, _USED.pack(used + total))

        try:
            self._write(body, protect=set(sizes), need=total, writes=in_lmdb)
        except BaseException:
            if token is not None:
                self._unlink(token)  # written, never named by a committed record
            raise
        finally:
            if held is not None:
                os.close(held)  # committed (a sweep finds it named) or removed: let go of it
        self._after_evictions(evicted)
        for k, size in sizes.items():
            self._policy.insert(k, size)
            self._dirty.pop(k, None)
        if tids or self._torders:
            for k, size in sizes.items():
                self._torders.insert(k, size, tids.get(k, 0))

    def _write(
        self, body: Callable[[Any], None], protect: set[bytes] | None = None, need: int = 0, writes: int = 0
    ) -> None:
        """Run ``body`` in one write transaction (plus dirty stamps), handling a full map and a
        full disk.

        On MapFullError stale reader slots are cleared first (their pages become reusable) and
        ``body`` retried; else the map doubles, up to ``max_map_size_bytes``; at the limit, more
        least-recently-used records (an eighth of the used bytes, and at least the ``need`` bytes
        ``body`` stores) are evicted in a transaction of their own (LMDB reuses freed pages only
        after a commit) and ``body`` is retried.

        A full disk met anywhere here (a commit, the eviction's own commit, the map's growth) is
        :class:`~tieredkv.errors.TierFullError` (:meth:`_full_disk`): ENOSPC or EDQUOT, or EIO
        while the filesystem has less free than the ``writes`` value bytes ``body`` puts in LMDB
        need (LMDB reports a short write at commit as EIO). The access stamps it carries stay
        to be written by the next one.
        """
        try:
            self._write_txns(body, protect, need)
        except (lmdb.Error, OSError) as e:
            if disk_full(e, self.path, writes):
                raise self._full_disk(e) from e
            raise

    def _write_txns(self, body: Callable[[Any], None], protect: set[bytes] | None, need: int) -> None:
        sh = self._shared
        assert sh is not None
        if sh.reader_check_due():
            self._count("stale_readers_cleared", sh.reader_check())

        ledger = self._ledger
        assert ledger is not None

        def full(txn: Any) -> None:
            self._rescan = None
            self._forget_freed()
            ledger.begin(txn)
            self._flush_stamps(txn)
            body(txn)
            ledger.settle(txn)

        while True:
            try:
                self._txn(full, write=True)
                self._dirty.clear()
                self._free()
                sh.keep_reserve()
                return
            except lmdb.MapFullError:
                cleared = sh.reader_check()
                if cleared:
                    self._count("stale_readers_cleared", cleared)
                    continue
                size = sh.env.info()["map_size"]
                if size < self._max_map:
                    sh.grow_map(min(size * 2, self._max_map))
                    self._count("map_growths")
                    continue
                more: dict[bytes, int] = {}

                def evict(txn: Any, more: dict[bytes, int] = more) -> None:
                    more.clear()
                    self._rescan = None
                    self._forget_freed()
                    ledger.begin(txn)
                    used = self._used_in(txn)
                    self._evict_in(txn, max(used // 8, need, 1), protect or set(), more)
                    txn.put(_USED_KEY, _USED.pack(used - sum(more.values())))
                    ledger.settle(txn)

                try:
                    self._txn(evict, write=True)
                except lmdb.MapFullError:
                    # Even a deletion needs a few copy-on-write pages, and pages freed by the last
                    # commit are not reusable yet: take a small reserve past max_map, once.
                    reserve = max(self._max_map // 64, 64 * 4096)
                    if sh.env.info()["map_size"] >= self._max_map + reserve:
                        raise
                    sh.grow_map(self._max_map + reserve)
                    self._count("map_reserve_used")
                    self._txn(evict, write=True)
                self._free()
                self._after_evictions(more)

    def _flush_stamps(self, txn: Any) -> None:
        acc = self._sh.acc
        for k, stamp in self._dirty.items():
            raw = txn.get(k, db=acc)
            if raw is not None and k in self._policy:  # not deleted meanwhile
                # the record's header, when it is kept here, stays as it is
                txn.put(k, _ACCESS.pack(stamp, _ACCESS.unpack_from(raw)[1]) + raw[_ACCESS.size :], db=acc)

    # ---- reads -------------------------------------------------------------------------

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        out, bad = await self._run(self._get_sync, keys, into)
        for key, err, _ in bad:
            self._on_corrupt(key, err)
        return out

    def _get_sync(
        self, keys: list[bytes], into: list[memoryview | None]
    ) -> tuple[list[int | bytes | None], list[_Bad]]:
        """Read ``keys`` into ``into``; a record that fails verification is a miss and is deleted.

        A batch of large records (:data:`_SPLIT_RECORD_BYTES` each, :data:`_SPLIT_BATCH_BYTES` in
        all) is read by two threads at once, each in a read transaction of its own: the copy and
        the checksum release the GIL, so the halves run on two cores (measured +40% at 1 and
        4 MiB and +30% at 256 KiB on a 2-vCPU box; no gain at 64 KiB, where the GIL-held work
        per record is a larger share). The
        second half is read by the helper thread while this (the tier's) thread reads the first;
        this thread alone updates the LRU and stamps, after both halves are back."""
        helper = self._helper
        h = None if helper is None else self._split_at(into)
        later = None if helper is None or h is None else helper.submit(self._read_part, keys[h:], into[h:])
        try:
            out, bad, seen = self._read_part(keys[:h], into[:h])
        finally:
            rest = None if later is None else later.result()  # never leave the helper reading alone
        if rest is not None:
            out += rest[0]
            bad += rest[1]
            seen += rest[2]
        now = time.time()
        gone = []
        policy, dirty = self._policy, self._dirty
        torders = self._torders if self._torders else None
        for key, size in zip(keys, seen):
            if size is None:
                if key in policy:
                    gone.append(key)  # deleted (or evicted) by another process
                continue
            if size < 0:  # found but failed verification
                continue
            if key in policy:
                policy.touch(key)
                if torders is not None:
                    torders.touch(key)
            else:  # written by another process
                policy.insert(key, size)
            dirty[key] = now
        self._forget(gone)
        if bad:
            # A record in a file that failed is deleted only while it is still there: a record
            # replaced or deleted meanwhile (its file removed, its blocks given back) is a read
            # that lost a race, not damage.
            moved: set[bytes] = set()
            try:
                self._delete_sync([k for k, _, _ in bad], only={k: p for k, _, p in bad if p is not None}, kept=moved)
            except TierFullError as e:  # a full disk: the read still answers (a miss); a later read deletes them
                log.warning("tier %s: %d corrupt records not deleted: %s", self.name, len(bad), e)
            if moved:
                self._count("record_files_moved_on", len(moved))
                bad = [b for b in bad if b[0] not in moved]
        return out, bad

    def _split_at(self, into: list[memoryview | None]) -> int | None:
        """Where a batch is cut in two for :meth:`_get_sync` (None: read by one thread)."""
        if len(into) < 2:
            return None
        total = 0
        for dst in into:
            if dst is None or len(dst) < _SPLIT_RECORD_BYTES:
                return None
            total += len(dst)
        return (len(into) + 1) // 2 if total >= _SPLIT_BATCH_BYTES else None

    def _read_part(
        self, keys: list[bytes], into: list[memoryview | None]
    ) -> tuple[list[int | bytes | None], list[_Bad], list[int | None]]:
        """One read transaction over ``keys`` (safe on any thread: it touches no LRU state).

        Returns what each key delivered, the records that failed, and per key the stored
        record's size (None: not there; -1: failed). The records are checked and copied by
        :func:`~tieredkv.format.verify_many_into` (one C call for all of them where the helper is
        built, the GIL let go once; one that fails is zeroed where it landed: no damaged byte
        stays in a destination). Records in record files are read inside the transaction, all
        of them in one C call that takes their places from the access entries
        (:func:`~tieredkv.format.read_placed_into`), and looked for again after it if anything
        committed during the copies (:meth:`_placed_outcomes`); those without a destination are
        read after it (:meth:`_read_files`)."""

        acc = self._sh.acc
        files: list[tuple[int, bytes, int]] = []
        snapshot = [0]  # the read transaction's id
        odd: list[tuple[int, Any, tuple[bytes, int], int]] = []  # filed records not delivered
        placed: list[tuple[int, bytes, int]] = []  # filed records to look for again (a commit came)
        files_dir, env = self._files, self._sh.env

        def read(txn: Any) -> tuple[list[int | bytes | None], list[_Bad], list[int | None]]:
            snapshot[0] = txn.id()
            get = txn.get
            meta_of = txn.cursor(db=acc).get  # (a cursor's get: no keyword to parse per key)
            metas = [meta_of(key) for key in keys]  # stamp, size, and a header kept apart or a place
            # Records in record files, in one C call that parses their places (no Python per record)
            filed = read_placed_into(files_dir, metas, keys, into, _FILED_LAYOUT)
            recs: list[Any] = [None] * len(keys)
            out: list[int | bytes | None] = [None] * len(keys)
            seen: list[int | None] = [None] * len(keys)
            bad: list[_Bad] = []
            whole: list[int] = []
            apart: list[int] = []
            any_filed = False
            files.clear()
            odd.clear()
            placed.clear()
            for i, r in enumerate(filed):
                if r is not None:  # in a record file, read above
                    any_filed = True
                    if type(r) is int and r >= 0:
                        out[i] = r
                        seen[i] = r + HEADER_SIZE
                    else:
                        meta = metas[i]
                        odd.append((i, r, _PLACE.unpack_from(meta, _ACCESS.size), _ACCESS.unpack_from(meta)[1]))
                    continue
                meta = metas[i]
                if meta is not None and len(meta) == _FILED.size:  # in a file, no destination: read after
                    _, seen[i], token, at = _FILED.unpack(meta)
                    files.append((i, token, at))
                    continue
                rec = recs[i] = get(keys[i])
                if rec is None:
                    continue
                if meta is not None and len(meta) > _ACCESS.size:
                    seen[i] = len(rec) + HEADER_SIZE
                    if into[i] is not None:
                        apart.append(i)
                elif into[i] is not None:
                    seen[i] = len(rec)
                    whole.append(i)
                else:
                    seen[i] = len(rec)
            if any_filed and env.info()["last_txnid"] != snapshot[0]:
                # A transaction committed since this one began: a record read from a file may
                # have left it during its copy. Look again, after this transaction (below).
                placed.extend(
                    (i, *_PLACE.unpack_from(metas[i], _ACCESS.size)) for i, g in enumerate(filed) if g is not None
                )
            dsts: list[Any] = into
            got = verify_many_into([recs[i] for i in whole], [keys[i] for i in whole], [dsts[i] for i in whole])
            got += verify_many_parts_into(
                [metas[i] for i in apart],
                [recs[i] for i in apart],
                [keys[i] for i in apart],
                [dsts[i] for i in apart],
                head_at=_ACCESS.size,
            )
            for i, n in zip(whole + apart, got):
                if isinstance(n, CorruptRecordError):
                    bad.append((keys[i], n, None))
                    seen[i] = -1
                elif n < 0:
                    self._oversize(keys[i], len(recs[i]) - (0 if _head(metas[i]) is not None else HEADER_SIZE), dsts[i])
                else:
                    out[i] = n
            for i, rec in enumerate(recs):
                if rec is not None and into[i] is None:  # (records in files: below)
                    head = _head(metas[i])
                    try:
                        out[i] = bytes(
                            verify_record(rec, keys[i]) if head is None else verify_parts(head, rec, keys[i])
                        )
                    except CorruptRecordError as e:
                        bad.append((keys[i], e, None))
                        seen[i] = -1
            return out, bad, seen

        if not keys:
            return [], [], []
        out, bad, seen = self._txn(read, db=self._sh.rec, buffers=True)
        if placed or odd:
            self._placed_outcomes(keys, into, out, bad, seen, placed, odd)
        if files:
            self._read_files(keys, into, files, out, bad, seen, snapshot[0])
        return out, bad, seen

    def _placed_outcomes(
        self,
        keys: list[bytes],
        into: list[memoryview | None],
        out: list[int | bytes | None],
        bad: list[_Bad],
        seen: list[int | None],
        placed: list[tuple[int, bytes, int]],
        odd: list[tuple[int, Any, tuple[bytes, int], int]],
    ) -> None:
        """After :meth:`_read_part`'s transaction: each record read from a file (``placed``, when a
        commit came during the copies) that is no longer where it was read is a miss, its
        destination zeroed (:meth:`_still_placed`), and each one that was not delivered (``odd``:
        index, what the read answered, its place, its stored size) is sorted as
        :meth:`_read_files` sorts them."""
        moved: set[int] = set()
        if placed:
            for (i, _, _), here in zip(placed, self._still_placed(keys, placed, None)):
                if not here:
                    moved.add(i)
                    dst = into[i]
                    assert dst is not None
                    dst[:] = bytes(len(dst))  # nothing unchecked stays where it landed
                    out[i] = None
                    seen[i] = -1
            if moved:
                self._count("record_files_moved_on", len(moved))
        for i, n, place, size in odd:
            if i in moved:
                continue
            seen[i] = -1
            if isinstance(n, (CorruptRecordError, FileNotFoundError)):
                bad.append((keys[i], n, place))
            elif isinstance(n, OSError):  # the file could not be read now: a miss, the record kept
                log.warning("tier %s: record file %s not read: %s", self.name, place[0].hex(), n)
                self._count("record_file_errors")
            else:  # a good header, a payload longer than its destination
                seen[i] = size
                dst = into[i]
                assert dst is not None  # (only records with a destination are read in the transaction)
                self._oversize(keys[i], size - HEADER_SIZE, dst)

    def _read_files(
        self,
        keys: list[bytes],
        into: list[memoryview | None],
        files: list[tuple[int, bytes, int]],
        out: list[int | bytes | None],
        bad: list[_Bad],
        seen: list[int | None],
        snapshot: int,
    ) -> None:
        """Read the records in record files ``files`` ((index, file token, offset), found by
        :meth:`_read_part`'s transaction, of id ``snapshot``) into their destinations, checked:
        fills in ``out``, ``bad`` and ``seen`` as :meth:`_read_part` does. A file removed since
        the transaction is a miss (its records were replaced or deleted meanwhile, or the file
        lost: then the record goes too, unless it was written again since). So is a record that
        is no longer where it was read once the copies are done (:meth:`_still_placed`): its
        file may have changed under the copy."""
        dsts: list[Any] = [
            into[i] if into[i] is not None else bytearray((seen[i] or 0) - HEADER_SIZE) for i, _, _ in files
        ]
        paths = {t: self._file_path(t) for t in {t for _, t, _ in files}}  # a batch's records share a file
        got = read_records_into(
            [paths[t] for _, t, _ in files],
            [at for _, _, at in files],
            [seen[i] or 0 for i, _, _ in files],
            [keys[i] for i, _, _ in files],
            dsts,
        )
        kept = self._still_placed(keys, files, snapshot)
        for (i, token, at), n, dst, here in zip(files, got, dsts, kept):
            if here and type(n) is int and n >= 0:
                out[i] = n if into[i] is not None else bytes(dst)
            elif not here:  # replaced or deleted since the transaction: its file may have changed under the copy
                dst[:] = bytes(len(dst))  # nothing unchecked stays where it landed
                self._count("record_files_moved_on")
                seen[i] = -1
            elif isinstance(n, (CorruptRecordError, FileNotFoundError)):
                bad.append((keys[i], n, (token, at)))
                seen[i] = -1
            elif isinstance(n, OSError):  # the file could not be read now: a miss, the record kept
                log.warning("tier %s: record file %s not read: %s", self.name, token.hex(), n)
                self._count("record_file_errors")
                seen[i] = -1
            else:  # a good header, a payload longer than its destination
                self._oversize(keys[i], (seen[i] or 0) - HEADER_SIZE, dst)

    def _still_placed(self, keys: list[bytes], files: list[tuple[int, bytes, int]], snapshot: int | None) -> list[bool]:
        """Whether each record read from a file (``files``: (index, file token, offset)) is still
        there, in a transaction begun after the copies. A writer changes a file only after the
        records there have left it (their blocks punched, or the file written over as a spare,
        once the transaction that replaced or deleted them committed); a record still there was
        not changed under its copy, and one that left is a miss, whatever its copy delivered.
        When no transaction has committed since the read transaction ``snapshot`` (the
        environment's last one is still it), none left: nothing to look up (None: one did)."""
        if snapshot is not None and self._sh.env.info()["last_txnid"] == snapshot:
            return [True] * len(files)
        acc = self._sh.acc

        def read(txn: Any) -> list[bool]:
            meta_of = txn.cursor(db=acc).get
            return [_place(meta_of(keys[i])) == (token, at) for i, token, at in files]

        return self._txn(read, db=acc)

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return await self._run(self._contains_sync, keys)

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """One read transaction on the memory-mapped B-tree (LMDB readers never wait on writers);
        None while the environment is not open or is being resized or closed (the asynchronous
        lookup answers then). A map another process grew is adopted here when nothing else of
        this process holds a transaction, else left to the asynchronous path."""
        sh = self._shared
        if sh is None or self._closed:
            return None
        wanted = list(keys)
        for _ in range(2):
            if not sh.acquire_shared(blocking=False):
                return None  # resizing the map or closing right now
            try:
                if sh.closed or self._shared is not sh:
                    return None
                with sh.env.begin(db=sh.rec, buffers=True) as txn:
                    return [txn.get(k) is not None for k in wanted]
            except lmdb.MapResizedError:
                pass
            except Exception:  # noqa: BLE001 - advisory: the asynchronous lookup will answer
                return None
            finally:
                sh.release_shared()
            try:
                if not sh.adopt_map(blocking=False):
                    return None
            except Exception:  # noqa: BLE001
                return None
            self._count("map_adoptions")
        return None

    def _contains_sync(self, keys: list[bytes]) -> list[bool]:
        return self._txn(lambda txn: [txn.get(k) is not None for k in keys], db=self._sh.rec, buffers=True)

    async def _delete_many(self, keys: list[bytes]) -> int:
        return await self._run(self._delete_sync, keys)

    def _delete_sync(
        self, keys: list[bytes], only: dict[bytes, tuple[bytes, int]] | None = None, kept: set[bytes] | None = None
    ) -> int:
        """Delete ``keys``; a key in ``only`` just while its record is still at that place in a
        record file (not a record written since by anyone, nor deleted): else it is added to
        ``kept``. On a disk too full for one transaction (the pages it copies), the keys are
        deleted in smaller ones: each commit gives the next the pages it freed."""
        kept = set() if kept is None else kept
        try:
            return self._delete_txn(keys, only, kept)
        except TierFullError:
            if len(keys) < 2 * _DELETE_SPLIT_MIN:
                raise
        n, half = 0, len(keys) // 2
        for part in (keys[:half], keys[half:]):
            also: set[bytes] = set()
            n += self._delete_sync(part, only, also)
            kept |= also
        return n

    def _delete_txn(self, keys: list[bytes], only: dict[bytes, tuple[bytes, int]] | None, kept: set[bytes]) -> int:
        deleted: list[bytes] = []
        sh = self._shared
        assert sh is not None

        def body(txn: Any) -> None:
            deleted.clear()
            kept.clear()
            used = self._used_in(txn)
            for k in keys:
                meta = txn.get(k, db=sh.acc)
                if only and k in only and _place(meta) != only[k]:
                    kept.add(k)
                    continue
                if meta is not None:
                    used -= _ACCESS.unpack_from(meta)[1]
                    self._drop(txn, k, meta)
                if txn.delete(k, db=sh.rec):
                    deleted.append(k)
                txn.delete(k, db=sh.acc)
            txn.put(_USED_KEY, _USED.pack(max(used, 0)))

        self._write(body)
        self._forget(k for k in keys if k not in kept)
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
                stamp, size = _ACCESS.unpack_from(v)
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

    # ---- raw records (admin, migration, fault injection) -------------------------------

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self._run(self._raw_get_sync, keys)

    def _raw_get_sync(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's whole record as stored (header then payload; None: not there), for admin
        tools. A record in a record file is read in the transaction that found its place, and
        looked for again once the read is done, as loads do (:meth:`_still_placed`): one that
        left its place meanwhile (replaced, deleted, evicted: its file may have been written
        over or punched under the read) is read again, at most :data:`_RAW_READ_TRIES` times,
        then reported gone. Never another record's bytes, nor zeros, for a good record."""
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(_RAW_READ_TRIES):
            snapshot, placed = self._txn(functools.partial(self._raw_read, keys, todo, out))
            if not placed:
                return out
            todo = [i for (i, _, _), here in zip(placed, self._still_placed(keys, placed, snapshot)) if not here]
            if not todo:
                return out
            self._count("record_files_moved_on", len(todo))
        for i in todo:  # moved under every read: gone, as far as this read can tell
            out[i] = None
        return out

    def _raw_read(
        self, keys: list[bytes], todo: list[int], out: list[bytes | None], txn: Any
    ) -> tuple[int, list[tuple[int, bytes, int]]]:
        """:meth:`_raw_get_sync`'s read of ``keys[i]`` for ``i`` in ``todo`` into ``out``: the
        transaction's id, and the records read from record files (index, file token, offset)."""
        placed: list[tuple[int, bytes, int]] = []
        for i in todo:
            out[i], place = self._stored(txn, keys[i])
            if place is not None:
                placed.append((i, *place))
        return txn.id(), placed

    def _stored(self, txn: Any, key: bytes) -> tuple[bytes | None, tuple[bytes, int] | None]:
        """``key``'s whole record in ``txn`` (stored whole, apart: its header then its payload,
        or read from its record file) and its place in a record file (None: in LMDB). The
        record is None when the key is not there, or its file is gone."""
        sh = self._sh
        rec = txn.get(key, db=sh.rec)
        if rec is None:
            return None, None
        meta = txn.get(key, db=sh.acc)
        place = _place(meta)
        if place is not None:
            return _read_at(self._file_path(place[0]), place[1], _ACCESS.unpack_from(meta)[1]), place
        if meta is None or len(meta) <= _ACCESS.size:
            return bytes(rec), None  # a record stored whole
        return bytes(meta[_ACCESS.size :]) + bytes(rec), None  # header and payload, stored apart

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        return await self._run(self._delete_same_sync, items)

    def _delete_same_sync(self, items: list[tuple[bytes, bytes]]) -> int:
        """Delete each key whose whole record (as :meth:`_raw_get_sync` gives it) is exactly the
        bytes given, in one write transaction: the comparison and the deletion see the same
        records (LMDB lets one writer at a time in, across processes). A record in a record file
        is read there inside it: a file changes only after the records there have left it in a
        committed transaction, and none can commit before this one ends. Accounting as in
        :meth:`_delete_sync`: used bytes, the record's file (:meth:`_doom`), the LRU."""
        sh = self._sh
        deleted: list[bytes] = []

        def body(txn: Any) -> None:
            deleted.clear()
            used = self._used_in(txn)
            for k, raw in items:
                meta = txn.get(k, db=sh.acc)
                if meta is not None and _ACCESS.unpack_from(meta)[1] != len(raw):
                    continue  # not the record that was read (sizes differ): nothing to read
                whole, _ = self._stored(txn, k)
                if whole is None or whole != raw:
                    continue
                if meta is not None:
                    used -= _ACCESS.unpack_from(meta)[1]
                    self._drop(txn, k, meta)
                txn.delete(k, db=sh.rec)
                txn.delete(k, db=sh.acc)
                deleted.append(k)
            txn.put(_USED_KEY, _USED.pack(max(used, 0)))

        self._write(body)
        self._forget(deleted)
        return len(deleted)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._run(self._put_records, items)  # same cap and eviction as put_many

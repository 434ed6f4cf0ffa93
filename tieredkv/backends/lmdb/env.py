"""The LMDB environments of this process: one per directory, shared, refcounted, safe beside others.

* Inside one process all tiers on one directory share one environment (LMDB forbids opening
  it twice: fcntl locks belong to the process, so closing a second handle would drop the
  first's locks). A registry (:data:`REGISTRY`) keyed by the directory's identity refcounts it;
  the last close closes it. A read/write lock (:class:`SharedEnv`) lets any number of
  transactions run together and gives ``set_mapsize``/``close`` the environment to themselves.
* ``MapResizedError`` (another process grew the map past this one's) is handled on every path —
  reads, writes, probes, open: the map is adopted (``set_mapsize(0)``, with no transaction of
  this process open: :meth:`SharedEnv.adopt_map`) and the operation retried.
* Stale reader slots (a SIGKILLed reader) are cleared (``reader_check``) at open, before the map
  grows, and at most once a second before a write.
* Disk blocks are kept allocated past LMDB's committed pages (up to 4 MiB, at most 1/32 of the
  filesystem: :meth:`SharedEnv.keep_reserve`), so that on a full disk a deletion or an eviction
  still commits and frees room (:mod:`~tieredkv.backends.lmdb.space`).
* ``writemap`` is never used: with it, a full disk kills the process with SIGBUS while writing
  through the map; without it the commit fails.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lmdb

from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.lmdb.layout import ACCESS, USED, USED_KEY
from tieredkv.backends.lmdb.space import index_reserve, preallocate
from tieredkv.backends.lmdb.tenants import TENANTS_DB, Ledger, counters_exact
from tieredkv.errors import ConfigError

__all__ = ["REGISTRY", "RESIZE_RETRIES", "SharedEnv", "acquire_env", "release_env"]

RESIZE_RETRIES = 3  # adopt a map another process grew, then retry (a few times: it may grow again)
_READER_CHECK_EVERY_S = 1.0


class SharedEnv:
    """One open LMDB environment of this process, shared by every tier on its directory.

    ``shared()`` brackets every transaction (shared; re-entrant per thread); ``exclusive()`` is for
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


REGISTRY: dict[tuple[int, int], SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()


def _env_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def acquire_env(path: str, cfg: LMDBTierConfig) -> SharedEnv:
    """This process's environment on ``path``: opened now, or the one already open (refcounted)."""
    with _REGISTRY_LOCK:
        key = _env_identity(path)
        shared = REGISTRY.get(key)
        if shared is None:
            shared = _open_env(key, path, cfg)
            REGISTRY[key] = shared
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
        release_env(shared)
        raise
    return shared


def _open_env(key: tuple[int, int], path: str, cfg: LMDBTierConfig) -> SharedEnv:
    """Open, clear stale readers, open the named DBs and make sure the used-bytes counter exists,
    adopting a map another process grows meanwhile; on any failure the environment is closed
    (never left half open: a later open starts clean)."""
    fast = cfg.sync_mode == "fast"
    for attempt in range(RESIZE_RETRIES + 1):
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
            if attempt == RESIZE_RETRIES:
                raise
    shared = SharedEnv(key, path, env, cfg.sync_mode)
    try:
        env.reader_check()
        for attempt in range(RESIZE_RETRIES + 1):
            try:
                shared.rec = env.open_db(b"records")
                shared.acc = env.open_db(b"access")
                shared.files = env.open_db(b"files")
                shared.tenants = env.open_db(TENANTS_DB)
                with env.begin(write=True) as txn:
                    if txn.get(USED_KEY) is None:  # created by an older version: count once
                        total = sum(ACCESS.unpack_from(v)[1] for v in txn.cursor(db=shared.acc).iternext(keys=False))
                        txn.put(USED_KEY, USED.pack(total))
                    if not counters_exact(txn, write=True):
                        # tenant counters missing or left behind by a writer that does not keep
                        # them (an older version): counted once, here
                        Ledger(shared.tenants, shared.acc, shared.rec).rebuild(txn)
                break
            except lmdb.MapResizedError:
                if attempt == RESIZE_RETRIES:
                    raise
                env.set_mapsize(0)  # nothing of this environment is open yet
    except BaseException:
        shared.closed = True
        env.close()
        raise
    return shared


def release_env(shared: SharedEnv) -> None:
    """Let go of ``shared``; the last tier of this process on its directory closes it."""
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        if REGISTRY.get(shared.key) is shared:
            del REGISTRY[shared.key]
        # Closed before the registry lock goes: a new open of this directory must not race it.
        with shared.exclusive():  # no probe's read transaction may outlive the environment
            shared.closed = True
            shared.env.close()

"""Room in the ``fs`` tier's directory: reservations against the shared usage ledger, eviction,
recounts, and the sweep of crashed writers' temporary files.

:class:`FSSpace` holds the tier's state (layout, ledger, this process's eviction index) and runs
everything here synchronously on one of the tier's I/O threads, under the ledger's lock where
the ledger is read or written.

**Which records go** (any node can evict, and does, when its own store needs room): the oldest by
access time. Each process keeps an index of the records it knows (what its open or last recount
listed, what it wrote and read since) in its :mod:`~tieredkv.eviction` policy (``lru``: last
access). The access time itself lives in the file system, where every node sees it: a read sets
it (explicitly, at most every ``touch_interval_s``; so ``noatime`` mounts work). Before a
process deletes its index's oldest record it looks at that atime: a record another node read
since is moved to the back instead. So the order is the directory's LRU, at the touch interval's
resolution, without a shared access log: a log every node appends to on every read is a write
per hit and a second thing that can tear, where the atime is one ``utime`` per record per
interval and cannot disagree with the file it describes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from tieredkv.backends.base import Tier
from tieredkv.backends.fs.layout import Layout, key_tag, owner_alive, owner_token
from tieredkv.backends.fs.ledger import LedgerState, SharedLedger
from tieredkv.backends.fs.records import create_temps, unlink_all
from tieredkv.errors import TierFullError
from tieredkv.eviction import EvictionPolicy, make_policy

__all__ = ["FSSpace"]

log = logging.getLogger(__name__)


class FSSpace(Tier):
    """The ``fs`` tier's state and its room-making (see the module doc)."""

    def __init__(self, config: Any, *, name: str | None = None) -> None:
        super().__init__(config, name=name)
        self.layout = Layout(config.path)
        self._cap = int(config.size_cap_bytes)
        self._durable = config.sync_mode == "durable"
        self._owner = owner_token()
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._ledger: SharedLedger | None = None
        #: Why stores are refused here (a read-only mount, no permission), else None.
        self._read_only: str | None = None
        self._index_lock = threading.Lock()
        self._policy: EvictionPolicy = make_policy(config.eviction_policy)
        self._stamps: dict[bytes, float] = {}
        #: Bytes and records this process changed outside the ledger's lock (overwrites), added
        #: to it the next time it holds the lock.
        self._pending = [0, 0]
        #: Temporary files of this process's batches not yet reserved: its own recounts leave them
        #: out (the reservation that follows counts them).
        self._unreserved: set[str] = set()
        self._last_sweep = 0.0

    # ---- the index ---------------------------------------------------------------------

    def _known(self, key: bytes, size: int, stamp: float) -> None:
        with self._index_lock:
            self._policy.insert(key, size)
            self._stamps[key] = stamp

    def _seen(self, key: bytes, stamp: float) -> None:
        with self._index_lock:
            self._policy.touch(key)
            self._stamps[key] = stamp

    def _forget(self, key: bytes) -> None:
        with self._index_lock:
            self._policy.remove(key)
            self._stamps.pop(key, None)

    def _next_temp(self, size: int, key: bytes | None = None) -> str:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        return self.layout.temp_path(self._owner, seq, size, key)

    @property
    def _led(self) -> SharedLedger:
        assert self._ledger is not None, "tier is not open"
        return self._ledger

    def _held(self) -> LedgerState:
        """The ledger (lock held) with this process's pending changes applied; a missing or
        damaged one recounted (the lock held through the walk: there is nothing to correct)."""
        st = self._led.read()
        if st is None:
            log.info("tier %s: usage ledger %s missing or damaged: recounting", self.name, self._led.path)
            return self._recount_locked()
        with self._index_lock:
            dbytes, drecs = self._pending
            self._pending = [0, 0]
        return LedgerState(max(0, st.used + dbytes), max(0, st.records + drecs), st.reconciled_at)

    def _due(self) -> bool:
        """Whether the ledger is missing, damaged, or was last recounted over ``reconcile_interval_s`` ago."""
        st = self._led.read()
        return st is None or time.time() - st.reconciled_at > self.config.reconcile_interval_s

    # ---- reservations ------------------------------------------------------------------

    def _reserve(self, nbytes: int, nrecords: int, temps: list[str]) -> None:
        """Create the batch's temporary files (``temps``), make room for ``nbytes`` more (evicting)
        and count them in the ledger; or raise :class:`TierFullError` having reserved nothing (and
        the files removed). The files exist before the reservation does: a recount that sees the
        reservation in the ledger also sees them (by the size in their names). When this process's index has nothing
        left to evict, the directory is recounted (the ledger may be wrong, the index stale:
        records other nodes wrote) and the room looked for once more."""
        with self._index_lock:
            self._unreserved.update(temps)
        try:
            create_temps(temps)
            try:
                self._make_room(nbytes, nrecords)
            except BaseException:
                unlink_all(temps)
                raise
        finally:
            with self._index_lock:
                self._unreserved.difference_update(temps)

    def _make_room(self, nbytes: int, nrecords: int) -> None:
        timeout = self.config.lock_timeout_s
        used = 0
        for attempt in (0, 1):
            with self._led.locked(timeout):
                st = self._held()
                used, records = st.used, st.records
                if used + nbytes > self._cap:
                    freed, gone = self._evict_locked(used + nbytes - self._cap)
                    used, records = used - freed, records - gone
                if used + nbytes <= self._cap:
                    self._led.write(LedgerState(used + nbytes, records + nrecords, st.reconciled_at))
                    return
                self._led.write(LedgerState(used, records, st.reconciled_at))
            if attempt == 0:
                self._recount()
        raise TierFullError(
            f"tier {self.name!r} (fs at {self.layout.root}): {nbytes} bytes do not fit its"
            f" {self._cap}-byte cap ({used} used, the rest pinned or being written)"
        )

    def _unreserve(self, nbytes: int, nrecords: int) -> None:
        """Give back a reservation whose records were not written (next time the lock is held)."""
        with self._index_lock:
            self._pending[0] -= nbytes
            self._pending[1] -= nrecords

    def _replaced(self, old_size: int) -> None:
        """A record overwrote one of ``old_size`` bytes: counted twice until the next lock."""
        with self._index_lock:
            self._pending[0] -= old_size
            self._pending[1] -= 1

    def _flush_pending(self) -> None:
        if self._read_only is not None or self._pending == [0, 0]:
            return
        with self._led.locked(self.config.lock_timeout_s):
            st = self._held()
            self._led.write(st)

    # ---- eviction ----------------------------------------------------------------------

    def _evict_locked(self, need: int) -> tuple[int, int]:
        """Delete records, the index's oldest first, until ``need`` bytes are free; (bytes, records)
        freed. Pinned keys stay; a record read on another node since this index saw it goes to
        the back (its atime says so)."""
        freed = gone = 0
        slack = max(self.config.touch_interval_s, 1.0)
        with self._index_lock:
            order = list(self._policy.victims())
        requeued: list[tuple[bytes, float]] = []
        removed: list[bytes] = []
        for key in order:
            if freed >= need:
                break
            if self.is_pinned(key):
                continue
            path = self.layout.record_path(key)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._forget(key)
                removed.append(key)
                continue
            if st.st_atime > self._stamps.get(key, 0.0) + slack:
                requeued.append((key, st.st_atime))
                continue
            size = self._remove(key)
            removed.append(key)
            if size is not None:
                freed, gone = freed + self._evicted(size), gone + 1
        for key, at in requeued:
            self._seen(key, at)
        self._removed(removed)
        if freed < need and requeued:  # what other nodes read is still older than nothing
            f2, g2 = self._evict_requeued(need - freed, [k for k, _ in requeued])
            freed, gone = freed + f2, gone + g2
        return freed, gone

    def _evict_requeued(self, need: int, keys: list[bytes]) -> tuple[int, int]:
        freed = gone = 0
        removed: list[bytes] = []
        for key in keys:
            if freed >= need:
                break
            if not self.is_pinned(key):
                size = self._remove(key)
                removed.append(key)
                if size is not None:
                    freed, gone = freed + self._evicted(size), gone + 1
        self._removed(removed)
        return freed, gone

    def _remove(self, key: bytes) -> int | None:
        """Delete ``key``'s record file and forget it; its size, or None when it was not there
        (another node deleted it first, and counted it)."""
        path = self.layout.record_path(key)
        try:
            size: int | None = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            size = None
        self._forget(key)
        return size

    def _evicted(self, size: int) -> int:
        self._count("evictions")
        self._count("evicted_bytes", size)
        return size

    # ---- recounts and the sweep ----------------------------------------------------------

    def _recount(self) -> LedgerState:
        """Set the ledger to what the directory holds (:meth:`_recount_locked`, the lock taken).
        The lock is held through the walk, which keeps the count exact: a walk without it would
        miss what other nodes delete meanwhile and count twice what they write. The cost is the
        walk's time (about 0.4 s for 20,000 records on local disk here; far more on a large NFS
        directory), during which other nodes' stores wait up to ``lock_timeout_s`` and are then
        refused (counted ``ledger_busy``): recounts are rare (a missing or damaged ledger, a full
        one with nothing left to evict, every ``reconcile_interval_s``)."""
        with self._led.locked(self.config.lock_timeout_s):
            return self._recount_locked()

    def _recount_locked(self) -> LedgerState:
        """Set the ledger (its lock held) to what the directory holds: every record, and every
        record being written by a live writer (by the size in its temporary file's name; this
        process's batches not yet reserved left out); merge the listing into this process's
        eviction index (:meth:`_install`)."""
        since = time.time()
        used, records, index = self._walked()
        self._install(index, since)
        state = LedgerState(used, records, time.time())
        if self._read_only is None:
            self._led.write(state)
        self._count("recounts")
        return state

    def _walked(self) -> tuple[int, int, list[tuple[bytes, int, float]]]:
        """What the directory holds: bytes (every record, and every live writer's record in the
        making, by the size in its name), records, and ``(key, size, atime)`` of each record in
        place, oldest access first. Sweeps crashed writers' temporary files."""
        # temporary files first: one renamed into place while the walk goes on is counted as the
        # file it was (its record, found by its key's tag, is not counted again), never missed
        making, n_making, tags = self._sweep_sync()
        listed = self.layout.walk()
        found = [r for r in listed if key_tag(r[0]) not in tags]  # (counted as in the making)
        used = sum(st.st_size for _, _, st in found) + making
        index = sorted(((k, st.st_size, st.st_atime) for k, _, st in listed), key=lambda r: r[2])
        return used, len(found) + n_making, index

    def _install(self, index: list[tuple[bytes, int, float]], since: float) -> None:
        """Merge a listing (oldest access first) taken from ``since`` on into this process's
        eviction index. Each record's place is its last access that anyone knows of: the later
        of its atime and this process's own last store or read of it (a read within
        ``touch_interval_s`` of the last touch does not move the atime; this process's index
        saw it). A record this process stored or read since the listing began stays even where
        the listing missed it (renamed into place after its directory was listed); one the
        index knew from before that the listing did not find is gone (another node evicted it)."""
        with self._index_lock:
            old, stamps = self._policy, self._stamps
            sizes = {key: size for key, size, _ in index}
            order = [(max(atime, stamps.get(key, atime)), key) for key, _, atime in index]
            for key in list(old.victims()):
                size = old.remove(key)
                if key not in sizes and stamps.get(key, 0.0) >= since:
                    sizes[key] = size
                    order.append((stamps[key], key))
            order.sort(key=lambda r: r[0])  # (stable: the listing's order, then the index's, at a tie)
            policy = make_policy(self.config.eviction_policy)
            for _, key in order:
                policy.insert(key, sizes[key])
            self._policy, self._stamps = policy, {key: at for at, key in order}

    def _sweep_sync(self) -> tuple[int, int, set[str]]:
        """Remove temporary files of writers that are gone: of a dead process of this host at once,
        any other older than ``temp_max_age_s``. Returns the bytes and the records the live ones
        will hold (a record being written; a file of size 0 in its name is none: a record moved
        aside by a repair, a write probe), and their records' key tags."""
        now = time.time()
        live = n_live = 0
        tags: set[str] = set()
        for path, name, st in self.layout.temps():
            if name is not None:
                alive = owner_alive(name.host, name.pid, name.start)
                if alive or (alive is None and now - st.st_mtime <= self.config.temp_max_age_s):
                    if path not in self._unreserved:
                        live += name.size
                        n_live += name.size > 0
                        if name.tag is not None:
                            tags.add(name.tag)
                    continue
            elif now - st.st_mtime <= self.config.temp_max_age_s:
                continue
            if self._read_only is not None:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("tier %s: cannot sweep temporary file %s: %s", self.name, path, e)
                continue
            self._count("temps_swept")
        self._last_sweep = now
        return live, n_live, tags

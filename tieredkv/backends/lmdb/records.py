"""Record files of an LMDB tier: writing a batch's file, freeing records and files after the
commit, spares, the periodic sweep, and a full disk met on the way.

A record file (layout: :mod:`~tieredkv.backends.lmdb.layout`) is written whole before the
transaction that enters its records (:meth:`LMDBRecordFiles._write_file`: a spare written over
when there is one, else a new file). A deleted, replaced or evicted record's blocks are given
back (punched) after the commit, and a file goes with its last record (kept as a spare for a
later batch to write over: :meth:`LMDBRecordFiles._retire`, only while the disk has room to
spare; spares no writer took for :data:`_SPARE_IDLE_S` are given back, all of them on a disk
short of free space or full, and a tier that closes far below its cap gives back those it kept).
A file changes only after its records left it, which is what lets a reader copy records out of
it outside any lock (:mod:`~tieredkv.backends.lmdb.reads`).

**Who owns a record file** (:mod:`~tieredkv.backends.lmdb.files`): its writer, by an exclusive
``flock`` held from before the file has its name under ``files/`` (it comes in by a rename from
``files/spare/``, a spare or a new empty file made there) until the transaction that names it
has committed, or the file is removed. Files no record names and no one holds (a crash between
the write and the commit, or between a commit and the removal, in any process: the kernel lets
go of a dead process's locks) are swept at open, and by an open tier every
:data:`_SWEEP_EVERY_S` (at most :data:`_SWEEP_MAX_FILES` a pass, on the tier's thread between
calls); a sweeper locks a file (skipping a held one) and looks for its name again in a
transaction begun after, so a file a live writer owns is never swept, however long its write
takes.

**A full disk** met by a record file's write or sync (ENOSPC, EDQUOT, or EIO with too little
free: :func:`~tieredkv.backends.lmdb.space.disk_full`) is a full tier
(:meth:`LMDBRecordFiles._full_disk`): every spare is given back and the write raises
:class:`~tieredkv.errors.TierFullError`, counted ``disk_full``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from typing import Any

import lmdb

from tieredkv.backends.lmdb import files as record_files
from tieredkv.backends.lmdb.core import LMDBCore
from tieredkv.backends.lmdb.layout import ACCESS, LIVE, TOKEN, place_of
from tieredkv.backends.lmdb.space import free_bytes, libc_fallocate, spares_fit
from tieredkv.backends.lmdb.tenants import entry_tenant
from tieredkv.errors import TierFullError
from tieredkv.format import write_records

__all__ = ["LMDBRecordFiles"]

log = logging.getLogger(__name__)

_SPARES_KEPT = 8  # at most this many spare files in an environment
_SPARE_IDLE_S = 60.0  # a spare no writer took for this long is given back (no one is churning here)
_SWEEP_EVERY_S = 30.0  # an open tier sweeps its directory's record files this often, on its own thread
_SWEEP_MAX_FILES = 64  # unnamed record files a periodic sweep locks and looks at, at most


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


class LMDBRecordFiles(LMDBCore):
    """The tier's record files: written, counted, freed, kept as spares, swept."""

    # ---- record files ------------------------------------------------------------------

    def _file_path(self, token: bytes) -> str:
        return os.path.join(self._files, token.hex())

    def _doom(self, txn: Any, meta: Any) -> None:
        """The open write transaction deletes (or replaces) the record of access entry ``meta``:
        if it is in a record file, count it out of the file, and once the transaction has
        committed (:meth:`_free`) remove the file when it was its last record, else give back
        the record's blocks."""
        place = place_of(meta)
        if place is None:
            return
        token, at = place
        files = self._sh.files
        raw = txn.get(token, db=files)
        live = 0 if raw is None else LIVE.unpack(raw)[0] - 1
        if live > 0:
            txn.put(token, LIVE.pack(live), db=files)
            self._holes.setdefault(token, []).append((at, ACCESS.unpack_from(meta)[1]))
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
                ledger.add(tenant, -ACCESS.unpack_from(meta)[1], -1)

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
        token = os.urandom(TOKEN)
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

"""Reads of an LMDB tier: loads into the caller's buffers, lookups, and records that moved meanwhile.

* ``get_many`` reads in a read transaction with ``buffers=True``: each record's payload is copied
  straight from the memory map into the caller's buffer (one copy) and verified — a small one
  first, a large one (128 KiB and more) right after the copy, in the buffer, while the bytes are
  still in cache (a record that fails is a miss either way, and is deleted). A batch of large
  records (512 KiB and more each, 2 MiB in all) is read in two halves on two threads, each in
  its own read transaction; the tier's own thread updates the LRU and stamps once both are back.
  Access stamps are bumped in memory and written with the next write transaction.
* Records in record files are copied out of their files in one C call, inside the read
  transaction that found their places (:func:`~tieredkv.format.read_placed_into`: the access
  entries are parsed there, no Python per record). A file changes only after its records left
  it (:mod:`~tieredkv.backends.lmdb.records`), so a reader looks again once its copies are done
  if anything committed meanwhile (:meth:`LMDBReads._still_placed`): a record no longer where it
  was read is a miss (``record_files_moved_on``) whatever its copy got, and a record is deleted
  as corrupt only while it still names the place that failed.
* ``probe`` answers lookups synchronously, from one read transaction on the memory-mapped B-tree
  (LMDB readers never wait on writers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import lmdb

from tieredkv.backends.lmdb.layout import ACCESS, FILED, FILED_LAYOUT, PLACE, head_of, place_of
from tieredkv.backends.lmdb.writes import LMDBWrites
from tieredkv.errors import CorruptRecordError, TierFullError
from tieredkv.format import (
    HEADER_SIZE,
    read_placed_into,
    read_records_into,
    verify_many_into,
    verify_many_parts_into,
    verify_parts,
    verify_record,
)

__all__ = ["LMDBReads"]

log = logging.getLogger(__name__)

#: A record that failed a read: its key, what was wrong, and its place in a record file (if in one).
_Bad = tuple[bytes, Exception, tuple[bytes, int] | None]

#: A read batch of records this large each, and this large in all, is read by two threads.
#: (With the C helper's checked copy, 256 KiB records read 4.40 -> 5.74 GB/s split, 64 KiB the same
#: either way: 3.18 -> 3.23; interleaved A/B through the pipeline, median of 8.)
_SPLIT_RECORD_BYTES = 128 << 10
_SPLIT_BATCH_BYTES = 2 << 20


class LMDBReads(LMDBWrites):
    """Loads, lookups (``contains_many`` and the synchronous ``probe``)."""

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
            filed = read_placed_into(files_dir, metas, keys, into, FILED_LAYOUT)
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
                        odd.append((i, r, PLACE.unpack_from(meta, ACCESS.size), ACCESS.unpack_from(meta)[1]))
                    continue
                meta = metas[i]
                if meta is not None and len(meta) == FILED.size:  # in a file, no destination: read after
                    _, seen[i], token, at = FILED.unpack(meta)
                    files.append((i, token, at))
                    continue
                rec = recs[i] = get(keys[i])
                if rec is None:
                    continue
                if meta is not None and len(meta) > ACCESS.size:
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
                    (i, *PLACE.unpack_from(metas[i], ACCESS.size)) for i, g in enumerate(filed) if g is not None
                )
            dsts: list[Any] = into
            got = verify_many_into([recs[i] for i in whole], [keys[i] for i in whole], [dsts[i] for i in whole])
            got += verify_many_parts_into(
                [metas[i] for i in apart],
                [recs[i] for i in apart],
                [keys[i] for i in apart],
                [dsts[i] for i in apart],
                head_at=ACCESS.size,
            )
            for i, n in zip(whole + apart, got):
                if isinstance(n, CorruptRecordError):
                    bad.append((keys[i], n, None))
                    seen[i] = -1
                elif n < 0:
                    self._oversize(
                        keys[i], len(recs[i]) - (0 if head_of(metas[i]) is not None else HEADER_SIZE), dsts[i]
                    )
                else:
                    out[i] = n
            for i, rec in enumerate(recs):
                if rec is not None and into[i] is None:  # (records in files: below)
                    head = head_of(metas[i])
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
            return [place_of(meta_of(keys[i])) == (token, at) for i, token, at in files]

        return self._txn(read, db=acc)

    # ---- lookups -----------------------------------------------------------------------

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

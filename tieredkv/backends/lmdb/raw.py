"""Raw records of an LMDB tier: whole records for admin tools, migrations and repairs.

An admin read (``raw_get_many``: ``tieredkv verify``) gives each record whole, as stored (header
then payload), however it is stored (:mod:`~tieredkv.backends.lmdb.layout`). A record in a
record file is read in the transaction that found its place and looked for again once the read
is done, as loads do: a record that moved meanwhile is read again where it is now (a record that
keeps moving, or went, is None), never the bytes its old place holds now. A repair deletes by
``delete_if_same``: the whole record compared, then deleted, in one write transaction.
``raw_put_many`` stores records as they are given (damaged ones included), under the same cap
and eviction as ``put_many``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from tieredkv.backends.lmdb.layout import ACCESS, USED, USED_KEY, place_of
from tieredkv.backends.lmdb.reads import LMDBReads

__all__ = ["LMDBRaw"]

_RAW_READ_TRIES = 3  # an admin read of a record that keeps moving (rewritten during each read) is a miss after this


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


class LMDBRaw(LMDBReads):
    """Whole records in and out, and compare-and-delete (admin, migration, fault injection)."""

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
        place = place_of(meta)
        if place is not None:
            return _read_at(self._file_path(place[0]), place[1], ACCESS.unpack_from(meta)[1]), place
        if meta is None or len(meta) <= ACCESS.size:
            return bytes(rec), None  # a record stored whole
        return bytes(meta[ACCESS.size :]) + bytes(rec), None  # header and payload, stored apart

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
                if meta is not None and ACCESS.unpack_from(meta)[1] != len(raw):
                    continue  # not the record that was read (sizes differ): nothing to read
                whole, _ = self._stored(txn, k)
                if whole is None or whole != raw:
                    continue
                if meta is not None:
                    used -= ACCESS.unpack_from(meta)[1]
                    self._drop(txn, k, meta)
                txn.delete(k, db=sh.rec)
                txn.delete(k, db=sh.acc)
                deleted.append(k)
            txn.put(USED_KEY, USED.pack(max(used, 0)))

        self._write(body)
        self._forget(deleted)
        return len(deleted)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._run(self._put_records, items)  # same cap and eviction as put_many

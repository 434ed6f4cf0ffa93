"""Writes of an LMDB tier: a batch in one write transaction, deletions, a full map, a full disk.

* ``put_many`` is one write transaction: it evicts
  (:mod:`~tieredkv.backends.lmdb.eviction`) until the batch fits under ``size_cap_bytes`` (or
  raises TierFullError having stored nothing), then writes every record (stored apart, or in a
  record file: :mod:`~tieredkv.backends.lmdb.layout`). A tenant's batch larger than its quota is
  refused (TierFullError, nothing stored). The headers of a batch of 1 MiB or more are computed
  by a helper thread: a pipeline lane keeps two batches in flight here (``writes_in_flight``),
  and one batch's checksums run while the tier's thread writes the one before. A smaller
  batch's are computed on the tier's thread, right before its transaction, unless a batch
  before it is still with the helper (:meth:`LMDBWrites._put_many`).
* ``MapFullError`` first clears stale reader slots (a killed reader pins old pages), then grows
  the map (doubling, up to ``max_map_size_bytes``) and retries; at the limit it evicts further;
  it never crashes. (When the map is so full that even the eviction cannot commit, the map takes
  a one-time reserve of max(max_map/64, 256 KiB) past the limit.)
* ``sync_mode='durable'`` fsyncs every commit. ``'fast'`` skips the per-commit fsync and syncs
  on close: a process crash loses nothing committed; a power loss may lose recent puts (never
  corrupts older ones).
* **A full disk is a full tier, never an outage** (:mod:`~tieredkv.backends.lmdb.space`):
  ENOSPC or EDQUOT from a record file's write or sync, LMDB's commit (the eviction's own
  included) or the map's growth, and EIO while the filesystem has less free space than the
  write needed (LMDB reports a short write at commit as EIO), raise
  :class:`~tieredkv.errors.TierFullError` (counted ``disk_full``) and give back every spare.
  Nothing is stored then; reads and lookups go on (a read that finds a damaged record still
  answers a miss when the disk cannot take its deletion), and a pipeline's breaker stays
  closed. A real I/O error, with room on the disk, stays
  :class:`~tieredkv.errors.TierUnavailableError`. The blocks kept past LMDB's committed pages
  (:meth:`~tieredkv.backends.lmdb.env.SharedEnv.keep_reserve`) let a deletion or an eviction
  still commit on a full disk (``tieredkv evict`` empties a full disk); a deletion too large for
  them is done in smaller transactions.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import lmdb

from tieredkv.backends.lmdb.eviction import LMDBEviction
from tieredkv.backends.lmdb.layout import ACCESS, FILED, LIVE, PLACE, USED, USED_KEY, place_of
from tieredkv.backends.lmdb.space import disk_full
from tieredkv.backends.lmdb.tenants import header_tenant, place_value
from tieredkv.errors import TierFullError
from tieredkv.format import HEADER_SIZE, encode_heads_into

__all__ = ["LMDBWrites"]

_DELETE_SPLIT_MIN = 16  # a deletion the full disk refuses is split in two down to this many keys

_HEADS_ON_HELPER_FROM = 1 << 20  # payload bytes of a batch from which the helper thread checksums it


class LMDBWrites(LMDBEviction):
    """Puts (records and whole records), deletions, and the write transaction they share."""

    # ---- writes ------------------------------------------------------------------------

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        """Compute the batch's record headers on the helper thread, then write the batch on the
        tier's thread. A record is stored apart (:mod:`~tieredkv.backends.lmdb.layout`): its payload as it is
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
            stamps = [(k, ACCESS.pack(now, n)) for k, n in sizes.items()]
        else:
            hv = memoryview(heads)
            stamps = [
                (k, ACCESS.pack(now, sizes[k]) + hv[i * HEADER_SIZE : (i + 1) * HEADER_SIZE])
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
                in_lmdb = len(items) * FILED.size
                places = []
                at = 0
                for k, _ in items:
                    places.append((k, PLACE.pack(token, at)))
                    at += sizes[k]
                stamps = [(k, ACCESS.pack(now, sizes[k]) + place) for k, place in places]
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
                used -= ACCESS.unpack_from(v)[1]
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
                txn.put(token, LIVE.pack(len(items)), db=sh.files)
            for k, t in tids.items():
                ledger.add(t, sizes[k], 1)
            txn.put(USED_KEY, USED.pack(used + total))

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
                    txn.put(USED_KEY, USED.pack(used - sum(more.values())))
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
                txn.put(k, ACCESS.pack(stamp, ACCESS.unpack_from(raw)[1]) + raw[ACCESS.size :], db=acc)

    # ---- deletions ---------------------------------------------------------------------

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
                if only and k in only and place_of(meta) != only[k]:
                    kept.add(k)
                    continue
                if meta is not None:
                    used -= ACCESS.unpack_from(meta)[1]
                    self._drop(txn, k, meta)
                if txn.delete(k, db=sh.rec):
                    deleted.append(k)
                txn.delete(k, db=sh.acc)
            txn.put(USED_KEY, USED.pack(max(used, 0)))

        self._write(body)
        self._forget(k for k in keys if k not in kept)
        return len(deleted)

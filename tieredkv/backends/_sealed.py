"""SealedTier: a tier whose every record is sealed (AES-256-GCM, :mod:`tieredkv.sealing`).

The registry builds it around the tier a config names when that config has ``encryption``
(:class:`~tieredkv.config.EncryptionConfig`; Redis, Redis Cluster and LMDB): the inner tier keeps
doing everything about its medium (connections, routing, capacity, eviction, quotas, scans), and
only sees whole records, the sealed ones, through its raw-record hooks:

* ``put_many`` seals each payload (its tenant from ``tenants`` when the inner tier keeps tenants,
  else the default tenant) and stores the sealed records as they are (the inner tier's
  ``raw_put_many`` hook: the same capacity and eviction as its own puts; a tier that keeps tenants
  reads each record's tenant from its header, which a seal leaves in clear). Calls may overlap
  (``writes_in_flight`` is the inner tier's): a call that shares a key with an earlier one still
  in flight waits for it, so writes to a key land in call order, whatever the inner raw path does.
* ``get_many`` reads the records as stored and opens each into its destination: one that does not
  open (not sealed — forged by anyone who knows the format —, changed by a bit, sealed under a key
  not in the ring, or for another key, namespace or tenant) is a miss, counted ``corrupt``, none of
  its bytes left where it landed, and deleted by compare-and-delete (only while the key still holds
  those very bytes). A Redis tier reads through :class:`_RedisReads` (bounded, in place); any
  other through its ``raw_get_many`` hook (LMDB: which leaves access stamps as they are, so a
  sealed LMDB tier evicts by write order, not by use).
* A batch of 1 MiB or more is sealed, or opened, on a worker thread (AES-GCM lets go of the GIL:
  the loop moves the other batches in flight meanwhile).
* everything else — contains, delete, scan (sizes less the tag), stats, probes, pins, counters,
  quotas, stamps, raw records, compare-and-delete — is the inner tier's. Pins and counters are the
  inner tier's own objects: a pin taken here protects a record from the inner tier's eviction, and
  its evictions count here.

Its ``kind``, ``name`` and ``capabilities`` are the inner tier's, less the slot API (``slots``):
payloads never sit in the wrapper's memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Container, Sequence
from typing import Any, TypeVar

import numpy as np

from tieredkv.backends.base import RecordInfo, RemovalListener, Tier, TierStats, runs
from tieredkv.errors import CorruptRecordError, TieredKVError
from tieredkv.format import HEADER_SIZE, SEAL_TAG
from tieredkv.sealing import Keyring, claimed_size, sealed_size
from tieredkv.tenants import TenantQuotas

__all__ = ["SealedTier"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")
#: Batches of at least this many payload bytes are sealed and opened off the loop (SealedTier._work).
_OFF_LOOP_BYTES = 1 << 20


class SealedTier(Tier):
    """``SealedTier(inner, keyring)``: ``inner``'s records sealed with ``keyring``'s newest key,
    opened with any of its keys."""

    def __init__(self, inner: Tier, keyring: Keyring) -> None:
        super().__init__(inner.config, name=inner.name)
        self.kind = inner.kind  # type: ignore[misc]
        self.capabilities = dataclasses.replace(inner.capabilities, slots=False)  # type: ignore[misc]
        self.evicts_locally = inner.evicts_locally  # type: ignore[misc]
        self.op_timeout = inner.op_timeout
        self.inner = inner
        self.keyring = keyring
        # one set of counters and pins for both: the inner tier's evictions and node errors count
        # here, and a pin taken here (a load in flight) keeps the inner tier from evicting the key
        self.counters = inner.counters
        self._counter_lock = inner._counter_lock
        self._pins = inner._pins
        self._pin_lock = inner._pin_lock
        self.quotas = inner.quotas
        self._writing: dict[bytes, asyncio.Future[None]] = {}  # key -> the put_many writing it now
        #: A batch of this many payload bytes or more is sealed / opened on a worker thread
        #: (:meth:`_work`); None: always on the loop.
        self.off_loop_bytes: int | None = _OFF_LOOP_BYTES
        self._reads: _RedisReads | None = None
        if inner.kind == "redis":
            from tieredkv.backends.redis.tier import RedisTier

            if isinstance(inner, RedisTier):
                self._reads = _RedisReads(self, inner)

    def __repr__(self) -> str:
        return f"SealedTier({self.inner.name!r}, {self.keyring!r})"

    @property  # type: ignore[override]
    def passive_scans(self) -> bool:  # the inner tier scans: it must know
        return self.inner.passive_scans

    @passive_scans.setter
    def passive_scans(self, value: bool) -> None:
        self.inner.passive_scans = value

    # ---- lifecycle -------------------------------------------------------------------

    async def _open(self) -> None:
        await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    # ---- writes ----------------------------------------------------------------------

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        earlier = {f for f in (self._writing.get(k) for k, _ in items) if f is not None}
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for k, _ in items:
            self._writing[k] = mine
        try:
            records = await self._work(sum(len(p) for _, p in items), self._seal, items, tenants)
            for f in earlier:
                await asyncio.shield(f)  # a later call's cancel must not cancel the earlier call's future
            await self.inner._raw_put_many(records)
        finally:
            mine.set_result(None)
            for k, _ in items:
                if self._writing.get(k) is mine:
                    del self._writing[k]

    def _seal(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None) -> list[tuple[bytes, memoryview]]:
        """Every item's sealed record, one after another in one new buffer (not zeroed first: each
        byte of it is written by its seal)."""
        arena = np.empty(sum(sealed_size(len(p)) for _, p in items), np.uint8).data
        out: list[tuple[bytes, memoryview]] = []
        at = 0
        seal = self.keyring.seal_into
        for i, (key, payload) in enumerate(items):
            n = seal(arena[at:], key, payload, tenants[i] if tenants is not None else 0)
            out.append((key, arena[at : at + n]))
            at += n
        return out

    async def _work(self, nbytes: int, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` — the AES-GCM of a batch — on a worker thread when the batch holds
        :attr:`off_loop_bytes` or more (AES-GCM lets go of the GIL: the loop meanwhile moves the
        other batches in flight), else here. Cancelled, it still waits for the thread to finish:
        nothing is written into a caller's buffer after the call has ended."""
        if self.off_loop_bytes is None or nbytes < self.off_loop_bytes:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    # ---- reads -----------------------------------------------------------------------

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        out: list[int | bytes | None] = [None] * len(keys)
        try:
            if self._reads is not None and None not in into:
                await self._reads.read_into(keys, into, out)  # type: ignore[arg-type]  # no None in into
                return out
            raws = await self.inner._raw_get_many(keys)
            bad: list[tuple[bytes, bytes]] = []
            await self._work(sum(len(r) for r in raws if r is not None), self._open_all, keys, raws, into, out, bad)
            if bad:
                await self._drop_corrupt(bad)
        except BaseException:
            for dst, n in zip(into, out, strict=True):  # a failed load leaves nothing in its buffers
                if dst is not None and type(n) is int:
                    dst[:n] = bytes(n)
            raise
        return out

    def _open_all(
        self,
        keys: list[bytes],
        raws: list[Any],
        into: list[memoryview | None],
        out: list[int | bytes | None],
        bad: list[tuple[bytes, bytes]],
    ) -> None:
        for i, (key, raw) in enumerate(zip(keys, raws, strict=True)):
            if raw is not None:
                out[i] = self._open_one(key, raw, into[i], bad)

    def _open_one(
        self, key: bytes, raw: Any, dst: memoryview | None, bad: list[tuple[bytes, bytes]]
    ) -> int | bytes | None:
        """Open record ``raw`` of ``key`` into ``dst`` (None: as new bytes): the payload's length
        (or bytes), or None — a miss: too large for ``dst`` (counted ``oversize``), or it does not
        open (counted ``corrupt``, added to ``bad`` to be deleted)."""
        try:
            if dst is None:
                return self.keyring.open(raw, key)
            n = self.keyring.open_into(raw, key, dst)
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            bad.append((key, bytes(raw)))
            return None
        if n < 0:
            self._oversize(key, len(raw) - HEADER_SIZE - SEAL_TAG, dst)
            return None
        return n

    async def _drop_corrupt(self, bad: list[tuple[bytes, bytes]]) -> None:
        """Delete records that did not open, each only while its key still holds those very bytes
        (a record sealed meanwhile by a writer with the keys stays). Best effort: the read's
        answers stand, and the next read of such a key judges it again."""
        try:
            await self.inner._delete_if_same(bad)
        except NotImplementedError:
            pass
        except (TieredKVError, OSError, ConnectionError) as e:
            log.warning("tier %s: could not delete %d records that do not open: %s", self.name, len(bad), e)
        except Exception as e:  # noqa: BLE001 - the inner tier's native error; the read stands
            log.warning("tier %s: could not delete %d records that do not open: %s", self.name, len(bad), e)

    def check_record(self, raw: bytes | memoryview, key: bytes) -> str | None:
        return self.keyring.check(raw, key)

    # ---- forwarded -------------------------------------------------------------------

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return await self.inner._contains_many(keys)

    async def _delete_many(self, keys: list[bytes]) -> int:
        return await self.inner._delete_many(keys)

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        async for info in self.inner._scan(fingerprint):  # sizes are of what is stored: less the tag
            yield RecordInfo(info.key, max(info.size - SEAL_TAG, 0), info.stamp)

    async def fill_stamps(self, infos: list[RecordInfo]) -> list[RecordInfo]:
        return await self.inner.fill_stamps(infos)

    async def _stats(self) -> TierStats:
        st = await self.inner._stats()
        st.name = self.name
        st.extra["encryption"] = {
            "cipher": "AES-256-GCM",
            "sealing_key_id": f"{self.keyring.newest_id:08x}",
            "key_ids": [f"{k:08x}" for k in self.keyring.ids],
        }
        return st

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self.inner._raw_get_many(keys)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self.inner._raw_put_many(items)

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        return await self.inner._delete_if_same(items)

    async def _tenant_usage(self) -> dict[int, int]:
        return await self.inner._tenant_usage()

    def set_quotas(self, quotas: TenantQuotas) -> None:
        super().set_quotas(quotas)
        self.inner.set_quotas(quotas)

    def set_removal_listener(self, fn: RemovalListener | None) -> None:
        # the inner tier evicts (and watches its server); a record found corrupt here is reported here
        super().set_removal_listener(fn)
        self.inner.set_removal_listener(fn)

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        return self.inner.probe(keys)

    def probe_key(self, key: bytes) -> bool | None:
        return self.inner.probe_key(key)

    def probe_members(self) -> Container[bytes] | None:
        return self.inner.probe_members()

    def probe_batch(self, keys: Sequence[bytes]) -> list[bool] | None:
        return self.inner.probe_batch(keys)

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        return self.inner._translate(exc, op)


class _RedisReads:
    """Reads of a sealed Redis tier into destinations, as the Redis tier reads its own records:
    bounded, and received in place.

    Per key ``EXISTS`` and ``GETRANGE key 0 cap``, ``cap`` the sealed record of the destination's
    size, so a value longer than that (a foreign one, however large) costs at most ``cap + 1``
    bytes; sent through the tier's batches (``RedisTier._per_key(data=True)``: with ``native_io``
    split over its own connections, each reply's header received into a 64-byte buffer and its
    sealed body into scratch memory; on a cluster routed per node, following redirections, a dead
    node costing its own keys). Each body is then opened from there into its destination (AES-GCM
    does not decrypt in place). A value longer than ``cap`` whose header is a sealed header for
    its key is a record too large for the destination (``oversize``, kept); any other is corrupt,
    deleted by the tier's compare-and-delete (``RedisTier._drop_corrupt``: only while the key
    still holds, or starts with, the bytes read).

    The generic path (the tier's ``raw_get_many``: a whole ``GET`` through redis-py) is unbounded,
    and through a store loaded 0.32-0.39 GB/s against 0.72-1.18 here (64 KiB-1 MiB chunks, one
    node, 2 vCPUs, interleaved runs). This relies on these
    RedisTier internals: ``_per_key``, ``_run_bytes``, ``_drop_corrupt``, ``_NativePipe``,
    ``_wrongtype`` (``tests/integration/test_sealed_tiers.py`` runs it on a node, with and without
    ``native_io``, and on a cluster).
    """

    def __init__(self, tier: SealedTier, inner: Any) -> None:
        from tieredkv.backends.redis.native import _NativePipe
        from tieredkv.backends.redis.reads import _wrongtype
        from tieredkv.backends.redis.resp import Into, Placed

        self.tier = tier
        self.inner = inner
        self._into = Into
        self._placed = Placed
        self._native_pipe = _NativePipe
        self._wrongtype = _wrongtype

    async def read_into(self, keys: list[bytes], into: list[memoryview], out: list[int | bytes | None]) -> None:
        """Deliver each key's payload into ``into[i]``, its length (or None: a miss) in ``out[i]``."""
        inner, tier = self.inner, self.tier
        corrupt: list[tuple[bytes, bytes, bool]] = []  # (redis key, bytes seen, whole value?)

        def cap(i: int) -> int:
            return sealed_size(len(into[i]))

        for run in runs(range(len(keys)), cap, inner._run_bytes()):
            rkeys = [inner.redis_key(keys[i]) for i in run]
            caps = [cap(i) for i in run]
            scratch = np.empty(sum(caps) - HEADER_SIZE * len(run), np.uint8).data
            heads = [bytearray(HEADER_SIZE) for _ in run]
            bodies: list[memoryview] = []
            at = 0
            for c in caps:
                bodies.append(scratch[at : at + c - HEADER_SIZE])
                at += c - HEADER_SIZE

            def add(
                pipe: Any,
                j: int,
                rkeys: list[bytes] = rkeys,
                caps: list[int] = caps,
                heads: list[bytearray] = heads,
                bodies: list[memoryview] = bodies,
            ) -> None:
                pipe.exists(rkeys[j])  # tells an empty value (corrupt) from no key (a plain miss)
                if isinstance(pipe, self._native_pipe):  # the header and the sealed body land in place
                    pipe.getrange(rkeys[j], 0, caps[j], into=self._into(memoryview(heads[j]), bodies[j]))
                else:
                    pipe.getrange(rkeys[j], 0, caps[j])  # at most caps[j] + 1 bytes: longer means too long

            replies = await inner._per_key(rkeys, add, ncmd=2, data=True)
            todo: list[tuple[int, bytes, bytes, memoryview]] = []  # (index, redis key, header, sealed body)
            for j, (i, rk, limit, reply) in enumerate(zip(run, rkeys, caps, replies, strict=True)):
                if isinstance(reply, BaseException):  # its node is down: a miss (counted node_errors)
                    continue
                exists, value = reply
                key = keys[i]
                if isinstance(value, self._placed):
                    todo.append((i, rk, bytes(heads[j]), bodies[j][: int(value) - HEADER_SIZE]))
                    continue
                if isinstance(value, BaseException):
                    if self._wrongtype(value):  # a foreign non-string value under our key: a miss
                        tier._on_corrupt(key, value)
                    continue
                if not value and not (isinstance(exists, int) and exists > 0):
                    continue  # no such key
                if len(value) > limit:
                    claimed = claimed_size(value, key)
                    if claimed is not None and claimed > limit:  # a sealed record for this key, larger
                        tier._oversize(key, claimed - HEADER_SIZE - SEAL_TAG, into[i])
                    else:
                        says = "no sealed header for this key" if claimed is None else f"a header for {claimed} bytes"
                        tier._on_corrupt(
                            key, CorruptRecordError(f"a value longer than {limit} bytes with {says} (not read further)")
                        )
                        corrupt.append((rk, value, False))
                    continue
                mv = memoryview(value)
                todo.append((i, rk, bytes(mv[:HEADER_SIZE]), mv[HEADER_SIZE:]))
            await tier._work(sum(len(b) for *_, b in todo), self._open_all, todo, keys, into, out, corrupt)
        if corrupt:
            await inner._drop_corrupt(corrupt)

    def _open_all(
        self,
        todo: list[tuple[int, bytes, bytes, memoryview]],
        keys: list[bytes],
        into: list[memoryview],
        out: list[int | bytes | None],
        corrupt: list[tuple[bytes, bytes, bool]],
    ) -> None:
        for i, rk, head, body in todo:
            out[i] = self._open(keys[i], rk, head, body, into[i], corrupt)

    def _open(
        self,
        key: bytes,
        rk: bytes,
        head: bytes,
        body: memoryview,
        dst: memoryview,
        corrupt: list[tuple[bytes, bytes, bool]],
    ) -> int | None:
        try:
            n = self.tier.keyring.open_parts_into(head, body, key, dst)
        except CorruptRecordError as e:
            self.tier._on_corrupt(key, e)
            corrupt.append((rk, head + bytes(body), True))
            return None
        if n < 0:  # fits the bound, not the destination (a record of at most 15 bytes more)
            self.tier._oversize(key, len(body) - SEAL_TAG, dst)
            return None
        return n

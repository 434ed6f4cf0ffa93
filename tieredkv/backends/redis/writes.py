"""The Redis tier's writes: :class:`RedisWrites` (``put_many``, ``raw_put_many``, ``delete_many``).

Values are whole records (:func:`tieredkv.format.encode_record`; on the native connections the
header and the payload are sent as two parts of one bulk string), written with one ``SET``
each (atomic per record; ``EX`` when ``ttl_s`` is set).

Capacity is the server's (``maxmemory``): the tier does not evict (``evicts_locally`` is
false). A put that Redis refuses (``OOM``) raises :class:`~tieredkv.errors.TierFullError`
after deleting the records of that call that were already written (best effort).

Tenants: a record's header names its tenant (version 2; the default tenant's records are
version 1, as before). With tenant quotas configured, each tenant's usage is kept in Redis
itself, shared by every engine and node, and a tenant over its quota loses its own oldest
records (:mod:`~tieredkv.backends.redis.tenants`, which says what that costs); a quota given as
a share is a share of the primaries' summed ``maxmemory`` (unbounded where one has none).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError, ResponseError

from tieredkv.backends.base import runs
from tieredkv.backends.redis.client import _SMALL_BATCH, RedisTierBase, _each, _raise_first
from tieredkv.backends.redis.keys import parse_redis_key
from tieredkv.backends.redis.native import _NativePipe
from tieredkv.backends.redis.resp import Record
from tieredkv.errors import TierFullError
from tieredkv.format import HEADER_SIZE, TENANT_AT, encode_record, make_header

__all__ = ["RedisWrites"]

log = logging.getLogger(__name__)


class RedisWrites(RedisTierBase):
    """Stores and deletions, tenants' books kept (see the module docstring)."""

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        """SET every record (header and payload). Calls may overlap (``writes_in_flight``), and
        their batches go out on different connections, which the server serves in no set order:
        so a call that shares a key with an earlier call still in flight waits for that call
        first, and writes to one key land in call order (a rollback of the earlier call's keys,
        too, happens before the later call writes them).

        ``tenants`` (per item): each record's tenant, in its header; with quotas configured,
        counted in its tenant's books, and a tenant over its quota loses its own oldest records
        (:meth:`_set_records`)."""
        earlier = {f for f in (self._writing.get(k) for k, _ in items) if f is not None}
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for k, _ in items:
            self._writing[k] = mine
        try:
            for f in earlier:
                await asyncio.shield(f)  # a later call's cancel must not cancel the earlier call's future
            if tenants is None:
                await self._set_records(items)
            else:
                await self._set_records(items, tenants)
            if self._removal_watch is not None:
                self._removal_watch.track([k for k, _ in items])
        finally:
            mine.set_result(None)
            for k, _ in items:
                if self._writing.get(k) is mine:
                    del self._writing[k]

    async def _set_records(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        """SET the records, all or nothing (a refusal undoes this call's writes). With
        ``tenants`` and quotas configured: a tenant's batch larger than its quota is refused
        first, and once written the records are counted in their tenants' books, whose
        victims (each over-quota tenant's oldest records) are then deleted
        (:mod:`~tieredkv.backends.redis.tenants`)."""
        ttl = self.config.ttl_s
        written: list[bytes] = []
        books = tenants is not None and self.quotas.enabled and not self._books.refused
        quotas: dict[int, int | None] = {}
        if books:
            assert tenants is not None
            quotas = self._batch_quotas([HEADER_SIZE + len(p) for _, p in items], tenants)
        tenant_of_key = dict(zip((k for k, _ in items), tenants, strict=True)) if tenants is not None else {}
        booked: dict[int, list[tuple[bytes, int]]] = {}  # per tenant: (Redis key, record bytes) written
        try:
            for run in runs(items, lambda it: HEADER_SIZE + len(it[1]), self._run_bytes()):
                rkeys = [self.redis_key(k) for k, _ in run]

                def add(pipe: Any, i: int, rkeys: list[bytes] = rkeys, run: list[Any] = run) -> None:
                    key, payload = run[i]
                    if isinstance(pipe, _NativePipe):  # header and payload sent as they are
                        pipe.set(rkeys[i], Record(make_header(key, payload), payload), ex=ttl)
                    else:
                        pipe.set(rkeys[i], encode_record(key, payload), ex=ttl)

                def add_tenant(pipe: Any, i: int, rkeys: list[bytes] = rkeys, run: list[Any] = run) -> None:
                    key, payload = run[i]
                    tenant = tenant_of_key[key]
                    if isinstance(pipe, _NativePipe):  # header and payload sent as they are
                        pipe.set(rkeys[i], Record(make_header(key, payload, tenant=tenant), payload), ex=ttl)
                    else:
                        pipe.set(rkeys[i], encode_record(key, payload, tenant=tenant), ex=ttl)

                results = await self._per_key(rkeys, add if tenants is None else add_tenant, data=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                written.extend(rk for rk, r in zip(rkeys, results, strict=True) if not isinstance(r, BaseException))
                if books:
                    for (k, p), rk in zip(run, rkeys, strict=True):
                        if tenant := tenant_of_key[k]:
                            booked.setdefault(tenant, []).append((rk, HEADER_SIZE + len(p)))
                if failed:
                    raise failed[0]
        except ResponseError:
            # The server answered but refused (OOM, READONLY...): undo this call's writes.
            await self._rollback(written)
            raise
        if items:
            self._note_size(HEADER_SIZE + len(items[-1][1]))
        if booked:
            await self._keep_books(booked, quotas, len(items))

    def _batch_quotas(self, sizes: list[int], tenants: list[int]) -> dict[int, int | None]:
        """The quota of each tenant of a batch (records of ``sizes`` bytes); raises TierFullError,
        before anything is written, when one tenant's records alone exceed its quota."""
        by_tenant: dict[int, int] = {}
        for n, t in zip(sizes, tenants, strict=True):
            if t:
                by_tenant[t] = by_tenant.get(t, 0) + n
        quotas: dict[int, int | None] = {}
        for t, nbytes in by_tenant.items():
            quota = quotas[t] = self.quotas.limit(t, self._capacity)
            if quota is not None and nbytes > quota:
                raise TierFullError(
                    f"tier {self.name!r}: a batch of {nbytes} bytes of tenant {self.quotas.label(t)} exceeds"
                    f" its quota ({quota} bytes); nothing of it was stored"
                )
        return quotas

    async def _keep_books(
        self, written: dict[int, list[tuple[bytes, int]]], quotas: dict[int, int | None], n: int
    ) -> None:
        """Count written records (per tenant: Redis key, bytes) in their tenants' books and
        delete the victims over quota (keys this process has pinned are put back instead).
        Failures of the books are logged and counted, never the put's: its records are stored."""
        ttl = self.config.ttl_s
        try:
            victims = await self._books.account(written, quotas, None if ttl is None else ttl * 1000)
            pinned: dict[int, list[tuple[bytes, int]]] = {}
            for t, gone in victims.items() if self._pins else ():
                keep = [v for v in gone if self.is_pinned(parse_redis_key(self._prefix, v[0]) or b"")]
                if keep:
                    victims[t] = [v for v in gone if v not in keep]
                    pinned[t] = keep
            if pinned:  # in use here (being loaded): back in the books, as the newest
                await self._books.account(pinned, {}, None)
            self._count("tenant_evictions", await self._books.delete_victims(victims))
            if self._removal_watch is not None and victims:
                taken = [parse_redis_key(self._prefix, rk) for vs in victims.values() for rk, _ in vs]
                await self._removal_watch.confirm([k for k in taken if k is not None])
        except RedisError as e:
            self._count("tenant_books_errors")
            log.warning("tier %s: tenant books not kept for a batch of %d records: %s", self.name, n, e)

    async def _rollback(self, rkeys: list[bytes]) -> None:
        if not rkeys:
            return
        try:
            for run in runs(rkeys, lambda _: 1, _SMALL_BATCH):
                await self._per_key(run, _each("delete", run))
        except RedisError as e:  # best effort: the put's own error is what the caller sees
            log.warning("tier %s: could not roll back %d records of a failed put: %s", self.name, len(rkeys), e)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        """SET whole records as given. With quotas configured (a store's tier: the records of a
        sealed tier come this way), each record counts in the books of the tenant its header
        names, as :meth:`_set_records` counts them; an admin tool's tier has no quotas. While
        the server's removals are watched, its keys are registered as being written, as
        :meth:`_put_many`'s are (the watch reports a key gone only after its write returned)."""
        if self._removal_watch is None:
            await self._raw_set(items)
            return
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for k, _ in items:
            self._writing[k] = mine
        try:
            await self._raw_set(items)
        finally:
            mine.set_result(None)
            for k, _ in items:
                if self._writing.get(k) is mine:
                    del self._writing[k]

    async def _raw_set(self, items: list[tuple[bytes, memoryview]]) -> None:
        ttl = self.config.ttl_s
        tenants = [_header_tenant(rec) for _, rec in items] if self.quotas.enabled and not self._books.refused else []
        quotas = self._batch_quotas([len(rec) for _, rec in items], tenants) if any(tenants) else None
        booked: dict[int, list[tuple[bytes, int]]] = {}
        for run in runs(list(range(len(items))), lambda i: len(items[i][1]), self._max_batch):
            rkeys = [self.redis_key(items[i][0]) for i in run]

            def add(pipe: Any, j: int, rkeys: list[bytes] = rkeys, run: list[int] = run) -> None:
                pipe.set(rkeys[j], items[run[j]][1], ex=ttl)

            _raise_first(await self._per_key(rkeys, add))
            if quotas is not None:
                for i, rk in zip(run, rkeys, strict=True):
                    if tenants[i]:
                        booked.setdefault(tenants[i], []).append((rk, len(items[i][1])))
        if self._removal_watch is not None:
            self._removal_watch.track([k for k, _ in items])
        if booked:
            assert quotas is not None
            await self._keep_books(booked, quotas, len(items))

    async def _delete_many(self, keys: list[bytes]) -> int:
        """``DEL`` the keys; while tenant books exist, by a script that takes each record out of
        its tenant's books too (plain ``DEL`` where scripts are refused)."""
        removed = 0
        for run in runs(keys, lambda _: 1, _SMALL_BATCH):
            rkeys = [self.redis_key(k) for k in run]
            replies = None
            if self._books.active and not self._books.refused:
                replies = await self._books.delete(rkeys)
                if replies and replies[0] is None:
                    replies = None
            if replies is None:
                replies = await self._per_key(rkeys, _each("delete", rkeys))
            failed = [r for r in replies if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            removed += sum(int(r) for r in replies)
        return removed


def _header_tenant(record: memoryview | bytes) -> int:
    """The tenant a whole record's header names (0: version 1, the default tenant, or no header)."""
    if len(record) < HEADER_SIZE or bytes(record[4:6]) != b"\x02\x00":
        return 0
    return int.from_bytes(record[TENANT_AT : TENANT_AT + 8], "little")

"""The Redis tier's admin paths: :class:`RedisAdmin` (``scan``, ``fill_stamps``, ``stats``,
``tenant_usage``).

Ages and admin scans: Redis keeps each key's idle time (``OBJECT IDLETIME``, read by
:meth:`RedisTier.fill_stamps`; it does not touch the key). ``STRLEN`` / ``GET`` / ``GETRANGE``
count as accesses and reset it, so the admin CLI sets :attr:`RedisTier.passive_scans`: ``scan``
then asks for strings only (``SCAN ... TYPE string``) and sizes them with ``MEMORY USAGE`` (no
touch; an upper bound of the payload, as it counts the allocation), so ``ls`` never changes what
``evict --older-than`` / ``--to-size`` see. ``stats().records`` is ``None``: ``DBSIZE`` counts other
applications' keys too (it is ``extra["db_keys"]``); ``tieredkv status`` counts ours by scan.

``scan`` gives each record's tenant: an active scan reads header bytes 48..55 (``GETRANGE``, an
access like ``STRLEN``); a passive one cannot read a header without touching the key (Redis
before 7.2 has no ``CLIENT NO-TOUCH``), so it finds tenants in the tenants' books (``ZMSCORE``:
exact for records stored while quotas were configured; a record in no book is taken for the
default tenant's; every tenant is unknown, None, where there are no books).

On a cluster ``scan`` sends ``SCAN`` to every master, so a key that moves between two masters
while they are scanned may be listed twice (dropped) or missed; its sizing goes through the
tier's batches (:mod:`~tieredkv.backends.redis.client`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from tieredkv.backends.base import RecordInfo, TierStats, runs
from tieredkv.backends.redis.client import _SMALL_BATCH, RedisTierBase, _each
from tieredkv.backends.redis.keys import parse_redis_key, scan_match
from tieredkv.backends.redis.tenants import SCAN_TENANTS_MAX, tenant_of
from tieredkv.format import HEADER_SIZE, TENANT_AT
from tieredkv.keys import key_fingerprint

__all__ = ["RedisAdmin"]

#: SCAN ``COUNT`` hint.
_SCAN_COUNT = 1000


class RedisAdmin(RedisTierBase):
    """Listing and sizing records, their ages, the server's figures (see the module docstring)."""

    # passive_scans (see Tier): ``scan`` then never touches a key (it sizes values with ``MEMORY
    # USAGE``, an upper bound, instead of ``STRLEN``), so listing records does not reset the idle
    # time that ``evict --older-than`` / ``--to-size`` read. Off, sizes are exact.

    # ---- scan -------------------------------------------------------------------------

    def _match(self, fingerprint: bytes | None) -> bytes:
        return scan_match(self._prefix, fingerprint)

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        match = self._match(fingerprint)
        seen: set[bytes] = set()  # SCAN may return a key twice
        # A passive scan finds tenants in the tenants' books (reading a header would touch it)
        books = await self._books.tenants(self._client) if self.passive_scans else []
        async for batch in self._scan_batches(match):
            fresh = [rk for rk in batch if rk not in seen]
            seen.update(fresh)
            keyed = [(rk, sk) for rk in fresh if (sk := parse_redis_key(self._prefix, rk)) is not None]
            if fingerprint is not None:
                keyed = [(rk, sk) for rk, sk in keyed if key_fingerprint(sk) == fingerprint]
            if not keyed:
                continue
            rks = [rk for rk, _ in keyed]
            for info in await self._describe(rks, [sk for _, sk in keyed], books):
                if info is not None:
                    yield info

    async def _describe(self, rks: list[bytes], keys: list[bytes], books: list[int]) -> list[RecordInfo | None]:
        """Each key's size and tenant (``stamp`` is left to :meth:`fill_stamps`); ``None`` for a key
        gone since SCAN saw it or a foreign value. A passive scan sizes values with ``MEMORY
        USAGE``, which does not touch the key (an upper bound: it counts the allocation), and
        finds tenants in the tenants' books (``books``: the tenants that have some; at most
        :data:`~tieredkv.backends.redis.tenants.SCAN_TENANTS_MAX` of them, else the tenant is
        unknown, as it is with no books: a header read would touch the key on Redis before 7.2);
        an active one with ``STRLEN`` and ``GETRANGE`` of the header's tenant: exact, but both
        count as accesses and reset the key's idle time."""
        passive = self.passive_scans

        def add(pipe: Any, i: int) -> None:
            if passive:
                pipe.memory_usage(rks[i], samples=0)
            else:
                pipe.strlen(rks[i])
                pipe.getrange(rks[i], TENANT_AT, TENANT_AT + 7)

        replies = await self._per_key(rks, add, ncmd=1 if passive else 2)
        if not passive:
            tenants: list[int | None] = [tenant_of(r[1]) for r in replies]
            replies = [r[0] for r in replies]
        elif books and len(books) <= SCAN_TENANTS_MAX:
            tenants = list(await self._books.tenants_of(rks, books))
        else:
            tenants = [None] * len(rks)
        out: list[RecordInfo | None] = []
        for n, rk, key, tenant in zip(replies, rks, keys, tenants, strict=True):
            # n: 0 / None when deleted since SCAN saw it; an error for a foreign non-string value
            if not isinstance(n, int) or n < HEADER_SIZE:
                out.append(None)
                continue
            size = _payload_upper_bound(n, len(rk)) if passive else n - HEADER_SIZE
            out.append(RecordInfo(key=key, size=size, tenant=tenant))
        return out

    async def fill_stamps(self, infos: list[RecordInfo]) -> list[RecordInfo]:
        """Last access from ``OBJECT IDLETIME`` (which does not touch the key) where ``stamp`` is
        missing; stays ``None`` when the server cannot tell (an LFU ``maxmemory-policy``)."""
        todo = [i for i, info in enumerate(infos) if info.stamp is None]
        if not todo:
            return infos
        await self._ensure_open()
        return await self._guard("fill_stamps", len(todo), self._fill_stamps(infos, todo))

    async def _fill_stamps(self, infos: list[RecordInfo], todo: list[int]) -> list[RecordInfo]:
        out = list(infos)
        now = time.time()
        for run in runs(todo, lambda _: 1, _SMALL_BATCH):
            rks = [self.redis_key(infos[i].key) for i in run]
            idles = await self._per_key(rks, _each("object", rks, "idletime"))
            for i, idle in zip(run, idles, strict=True):
                out[i] = dataclasses.replace(infos[i], stamp=_stamp(idle, now))
        return out

    async def _scan_batches(self, match: bytes) -> AsyncIterator[list[bytes]]:
        """SCAN every primary (one on a single node), yielding each reply's keys. A passive scan
        asks for strings only (``TYPE string``): ``MEMORY USAGE`` would size any type."""
        kind = "string" if self.passive_scans else None
        type_args = ("TYPE", "string") if kind else ()
        if not self.config.cluster:
            cursor = 0
            while True:
                cursor, keys = await self._client.scan(cursor, match=match, count=_SCAN_COUNT, _type=kind)
                if keys:
                    yield list(keys)
                if cursor == 0:
                    return
        for node in self._client.get_primaries():
            cursor = 0
            while True:
                reply = await self._client.execute_command(
                    "SCAN", cursor, "MATCH", match, "COUNT", _SCAN_COUNT, *type_args, target_nodes=node
                )
                cursor, keys = _scan_reply(reply)
                if keys:
                    yield keys
                if cursor == 0:
                    break

    # ---- stats ------------------------------------------------------------------------

    async def _stats(self) -> TierStats:
        """Server memory and key counts. ``records`` is ``None``: ``DBSIZE`` counts every
        application's keys, and counting only ours takes a scan (``tieredkv status`` does one)."""
        capacity, infos, sizes = await self._memory()
        self._capacity = capacity
        policies = sorted({str(i.get("maxmemory_policy", "")) for i in infos})
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=capacity,
            used_bytes=sum(int(i.get("used_memory", 0)) for i in infos),
            records=None,
            extra={
                "nodes": len(infos),
                "maxmemory_policy": policies[0] if len(policies) == 1 else policies,
                "db_keys": sum(sizes),
                "db_keys_scope": "DBSIZE: every key in the database(s), other applications' too",
                "key_prefix": self.config.key_prefix,
                "url": self._where,
                "tenants_note": (
                    "per-tenant usage is kept in Redis while tenant quotas are configured, for tenants'"
                    " records only (the default tenant's are part of the server's own usage)"
                ),
            },
        )

    async def _tenant_usage(self) -> dict[int, int]:
        """Bytes per tenant from the tenants' books (kept while quotas are configured; records of
        the default tenant are not counted: Redis's own figures cover the server)."""
        return await self._books.usage(self._client)


def _stamp(idle: Any, now: float) -> float | None:
    """Unix time of the last access from an ``OBJECT IDLETIME`` reply (``None``: an error, e.g. LFU)."""
    return now - float(idle) if isinstance(idle, int) and not isinstance(idle, bool) else None


#: What ``MEMORY USAGE`` counts besides the value and the key at least (object header, dict entry).
_MEMORY_OVERHEAD = 16 + 24


def _payload_upper_bound(memory_usage: int, key_len: int) -> int:
    """A payload size no smaller than the real one, from ``MEMORY USAGE`` less what it surely
    counts besides the value (allocation rounding still makes it larger)."""
    return max(memory_usage - _MEMORY_OVERHEAD - (key_len + 4) - HEADER_SIZE, 0)


def _scan_reply(reply: Any) -> tuple[int, list[bytes]]:
    """Normalise a SCAN reply sent to one cluster node (``[cursor, keys]`` or ``{node: ...}``)."""
    if isinstance(reply, dict):  # {node_name: [cursor, keys]}
        (reply,) = reply.values()
    cursor, keys = reply
    if isinstance(cursor, dict):  # redis-py's cluster callback: ({node_name: cursor}, keys)
        (cursor,) = cursor.values()
    return int(cursor), list(keys)

"""Tenant quotas in the Redis tier (:class:`~tieredkv.backends.redis.RedisTier`): per-tenant usage
kept in Redis itself, so every engine and every node shares it.

Redis's capacity is the server's (``maxmemory``), and Redis evicts by its own policy, blind to
tenants; a quota bounds each tenant inside it. Per tenant ``t`` (not the default one, 0), three
keys under one hash tag (one cluster slot, so one script updates them atomically)::

    {key_prefix}:tenant:{<t as 16 hex digits>}:order   ZSET  Redis key of a record -> last write (server ms)
    {key_prefix}:tenant:{<t as 16 hex digits>}:size    HASH  Redis key of a record -> record bytes
    {key_prefix}:tenant:{<t as 16 hex digits>}:bytes   STRING the sum of those sizes

and ``{key_prefix}:tenants`` (SET of the tenants' hex ids) to list them. None of them matches
the record keys' ``{key_prefix}:{`` pattern, so scans, ``flush`` and ``evict`` never see them.

The store path of a batch with tenants, while quotas are configured (:attr:`TenantQuotas.enabled
<tieredkv.tenants.TenantQuotas.enabled>`; without quotas nothing here runs, and records of the
default tenant never cost anything here):

1. a tenant's batch larger than its quota is refused before anything is written;
2. the records are written as always (``SET`` pipelines; header version 2 names the tenant);
3. :data:`ACCOUNT`, one script per tenant of the batch (pipelined: one round trip on a single
   node; on a cluster one per node holding those tenants' slots, concurrently): counts the
   written records in (a record written again replaces its old size), then, while the tenant is
   over its quota, takes its oldest records out of the books (never one of this batch), returning
   them; the time is the server's (``TIME``), the same for every engine;
4. those victims are deleted by :data:`DEL_IF_TENANT` (a script on each victim's own slot: only
   while its header still names that tenant; a key another tenant wrote since is kept), except
   keys this process has pinned (put back in the books).

What it costs: one more round trip per batch with tenants (two when a tenant is over its quota),
about 100 bytes of Redis memory per record of a tenant, and the script's work (a ZADD, HSET and
HMGET of the batch's keys: O(log n) each). On a cluster a tenant's books are one slot, on one
node: every batch of that tenant runs a script there, wherever its records live. Measured in
``benchmarks/results/tenant-quota-redis-*.md``.

What the books do not see: records that leave without this tier deleting them (Redis's own
``maxmemory`` eviction, ``ttl_s`` expiry, another client's ``DEL``) stay counted until they
come up as their tenant's oldest (an over-count: the tenant then loses its own oldest records a
little early, never anyone else's); entries older than ``ttl_s`` are pruned by each
:data:`ACCOUNT`. Deletions by the tier (``delete_many``: ``tieredkv evict`` / ``flush``) take
their records out of the books (:data:`DEL_TENANT`, then :data:`UNACCOUNT`). With an
``allkeys-*`` ``maxmemory-policy``, Redis may evict the books themselves: that tenant's usage
then counts again from zero. The order is by last write, not last read (a read does not touch
the books: loads cost nothing more).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from tieredkv.format import TENANT_AT

__all__ = ["ACCOUNT", "DEL_IF_TENANT", "DEL_TENANT", "UNACCOUNT", "TenantBooks", "book_keys", "registry_key"]

log = logging.getLogger(__name__)

_ID = struct.Struct("<Q")
#: Records per :data:`ACCOUNT` call (Lua's unpack takes some 8000 values at most).
MEMBERS_PER_CALL = 1000
#: A passive scan finds records' tenants in the books of at most this many tenants.
SCAN_TENANTS_MAX = 64

_FORGET = """
local function forget(ms, total)
  if #ms == 0 then return total end
  local sizes = redis.call('HMGET', KEYS[2], unpack(ms))
  for i = 1, #ms do total = total - (tonumber(sizes[i]) or 0) end
  redis.call('HDEL', KEYS[2], unpack(ms))
  redis.call('ZREM', KEYS[1], unpack(ms))
  return total
end
local function store(total)
  if total <= 0 then redis.call('DEL', KEYS[3]) else redis.call('SET', KEYS[3], total) end
end
"""

#: KEYS: order, size, bytes. ARGV: quota (-1: none), ttl ms (-1: none), then (Redis key, bytes)
#: pairs of the records written. Returns {bytes held, victims (Redis keys, oldest first), their
#: sizes}.
ACCOUNT = (
    _FORGET
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local quota, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
if ttl >= 0 then
  total = forget(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ttl), 'LIMIT', 0, 1000), total)
end
local members, zargs, hargs = {}, {}, {}
for i = 3, #ARGV, 2 do
  members[#members + 1] = ARGV[i]
  zargs[#zargs + 1] = now
  zargs[#zargs + 1] = ARGV[i]
  hargs[#hargs + 1] = ARGV[i]
  hargs[#hargs + 1] = ARGV[i + 1]
  total = total + tonumber(ARGV[i + 1])
end
if #members > 0 then
  local old = redis.call('HMGET', KEYS[2], unpack(members))
  for i = 1, #members do total = total - (tonumber(old[i]) or 0) end
  redis.call('HSET', KEYS[2], unpack(hargs))
  redis.call('ZADD', KEYS[1], unpack(zargs))
end
local victims, vsizes = {}, {}
if quota >= 0 and total > quota then
  local fresh = {}
  for i = 1, #members do fresh[members[i]] = true end
  local skip = 0
  while total > quota do
    local batch = redis.call('ZRANGE', KEYS[1], skip, skip + 127)
    if #batch == 0 then break end
    local sizes = redis.call('HMGET', KEYS[2], unpack(batch))
    local gone = {}
    for i = 1, #batch do
      if total <= quota then break end
      local m = batch[i]
      if fresh[m] then
        skip = skip + 1
      else
        gone[#gone + 1] = m
        victims[#victims + 1] = m
        vsizes[#vsizes + 1] = sizes[i] or '0'
        total = total - (tonumber(sizes[i]) or 0)
      end
    end
    if #gone == 0 then break end
    redis.call('HDEL', KEYS[2], unpack(gone))
    redis.call('ZREM', KEYS[1], unpack(gone))
  end
end
store(total)
return {total, victims, vsizes}
"""
)

#: KEYS: order, size, bytes. ARGV: Redis keys of records deleted. Returns the bytes held.
UNACCOUNT = (
    _FORGET
    + """
local total = forget(ARGV, tonumber(redis.call('GET', KEYS[3]) or '0'))
store(total)
return total
"""
)

#: KEYS: records (of one cluster slot). ARGV: per key its tenant id (8 bytes, little-endian).
#: Deletes each record only while its header names that tenant; returns how many it deleted.
DEL_IF_TENANT = f"""
local n = 0
for i = 1, #KEYS do
  if redis.call('GETRANGE', KEYS[i], {TENANT_AT}, {TENANT_AT + 7}) == ARGV[i] then
    n = n + redis.call('DEL', KEYS[i])
  end
end
return n
"""

#: KEYS: a record. Deletes it; returns {deleted, the tenant bytes of its header ('' if none)}.
DEL_TENANT = f"""
local h = redis.pcall('GETRANGE', KEYS[1], {TENANT_AT}, {TENANT_AT + 7})
if type(h) ~= 'string' then h = '' end
return {{redis.call('DEL', KEYS[1]), h}}
"""


def book_keys(prefix: bytes, tenant: int) -> tuple[bytes, bytes, bytes]:
    """The keys of ``tenant``'s books: its order, sizes and byte count (one hash tag)."""
    head = b"%s:tenant:{%016x}" % (prefix, tenant)
    return head + b":order", head + b":size", head + b":bytes"


def registry_key(prefix: bytes) -> bytes:
    """The SET of the tenants that have books."""
    return prefix + b":tenants"


def _hash_tag(rk: bytes) -> bytes:
    """The part of Redis key ``rk`` a cluster hashes: between its first ``{`` and the next ``}``."""
    a = rk.find(b"{")
    b = rk.find(b"}", a + 1) if a >= 0 else -1
    return rk[a + 1 : b] if a >= 0 and b > a + 1 else rk


def tenant_bytes(tenant: int) -> bytes:
    """A tenant id as a record header holds it (bytes 48..55)."""
    return _ID.pack(tenant)


def tenant_of(head: Any) -> int | None:
    """The tenant id in header bytes 48..55 as read alone (None: not 8 bytes)."""
    if not isinstance(head, (bytes, bytearray)) or len(head) != 8:
        return None
    return int(_ID.unpack(head)[0])


PerKey = Callable[..., Awaitable[list[Any]]]


def _scripting_refused(e: BaseException) -> bool:
    return isinstance(e, NoPermissionError) or (
        isinstance(e, ResponseError) and ("NOSCRIPT" in str(e) or "unknown command" in str(e).lower())
    )


class TenantBooks:
    """One tier's view of the books. ``per_key(rkeys, add, ncmd=1)`` is the tier's batch runner
    (a pipeline on one node; per node, with redirections followed, on a cluster)."""

    def __init__(self, prefix: bytes, per_key: PerKey, count: Callable[[str, int], None], name: str) -> None:
        self.prefix = prefix
        self.registry = registry_key(prefix)
        self._per_key = per_key
        self._count = count
        self._name = name
        self._registered: set[int] = set()
        #: Books exist on the server (or this process keeps them): deletions take records out.
        self.active = False
        self.refused = False  # the server refuses scripts (an ACL without +eval): no books

    def _refused(self, e: BaseException) -> None:
        if not self.refused:
            log.warning(
                "tier %s: the server refuses scripts (%s): tenant quotas cannot be kept here; grant +eval",
                self._name,
                e,
            )
        self.refused = True

    async def account(
        self, written: dict[int, list[tuple[bytes, int]]], quotas: dict[int, int | None], ttl_ms: int | None
    ) -> dict[int, list[tuple[bytes, int]]]:
        """Count ``written`` (per tenant: (Redis key, record bytes)) in; each tenant over its quota
        (``quotas``) gives its oldest records up. Returns the victims per tenant (Redis key,
        record bytes), out of the books already. A tenant whose books could not be reached is logged and
        counted (``tenant_books_errors``): its records stay stored, uncounted."""
        if self.refused or not written:
            return {}
        calls: list[tuple[int, tuple[bytes, bytes, bytes], list[Any]]] = []
        for t, members in written.items():
            quota = quotas.get(t)
            head: list[Any] = [-1 if quota is None else quota, -1 if ttl_ms is None else ttl_ms]
            keys = book_keys(self.prefix, t)
            for a in range(0, len(members), MEMBERS_PER_CALL):
                argv = list(head)
                for rk, n in members[a : a + MEMBERS_PER_CALL]:
                    argv += (rk, n)
                calls.append((t, keys, argv))
        new = [t for t in written if t not in self._registered]
        rks = [keys[0] for _, keys, _ in calls] + [self.registry] * (1 if new else 0)

        def add(pipe: Any, i: int) -> None:
            if i < len(calls):
                _, keys, argv = calls[i]
                pipe.execute_command("EVAL", ACCOUNT, 3, *keys, *argv)
            else:
                pipe.sadd(self.registry, *(b"%016x" % t for t in new))

        self.active = True
        replies = await self._per_key(rks, add)
        victims: dict[int, list[tuple[bytes, int]]] = {}
        for (t, _, _), reply in zip(calls, replies, strict=False):
            if isinstance(reply, BaseException):
                if _scripting_refused(reply):
                    self._refused(reply)
                    return {}
                self._count("tenant_books_errors", 1)
                log.warning("tier %s: tenant %016x's books not updated: %s", self._name, t, reply)
                continue
            _, gone, sizes = reply
            if gone:
                victims.setdefault(t, []).extend((bytes(v), int(n)) for v, n in zip(gone, sizes, strict=True))
        if new and not isinstance(replies[-1], BaseException):
            self._registered.update(new)
        return victims

    async def delete_victims(self, victims: dict[int, list[tuple[bytes, int]]]) -> int:
        """Delete the victims of :meth:`account` (each only while its header still names its
        tenant), one script per hash tag (the keys of one tag share a cluster slot). Returns
        how many were deleted."""
        by_tag: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for t, gone in victims.items():
            tid = tenant_bytes(t)
            for rk, _ in gone:
                by_tag.setdefault(_hash_tag(rk), []).append((rk, tid))
        if not by_tag:
            return 0
        groups = list(by_tag.values())
        firsts = [g[0][0] for g in groups]

        def add(pipe: Any, i: int) -> None:
            group = groups[i]
            pipe.execute_command("EVAL", DEL_IF_TENANT, len(group), *(rk for rk, _ in group), *(t for _, t in group))

        n = 0
        for reply in await self._per_key(firsts, add):
            if isinstance(reply, BaseException):
                self._count("tenant_books_errors", 1)
                log.warning("tier %s: a record over its tenant's quota was not deleted: %s", self._name, reply)
            else:
                n += int(reply)
        return n

    async def delete(self, rks: list[bytes]) -> list[Any]:
        """``DEL`` each key, taking the records out of their tenants' books. Per key the number
        deleted (0 or 1) or an error; None for every key when the server refuses scripts (the
        caller deletes them plainly)."""
        replies = await self._per_key(rks, lambda pipe, i: pipe.execute_command("EVAL", DEL_TENANT, 1, rks[i]))
        out: list[Any] = []
        gone: dict[int, list[bytes]] = {}
        for rk, reply in zip(rks, replies, strict=True):
            if isinstance(reply, BaseException):
                if _scripting_refused(reply):
                    self._refused(reply)
                    return [None] * len(rks)
                out.append(reply)
                continue
            deleted, head = reply
            out.append(int(deleted))
            t = tenant_of(head)
            if deleted and t:
                gone.setdefault(t, []).append(rk)
        if gone:
            await self.forget(gone)
        return out

    async def forget(self, gone: dict[int, list[bytes]]) -> None:
        """Take records (Redis keys, per tenant) out of their tenants' books."""
        calls = [
            (book_keys(self.prefix, t), rks[a : a + MEMBERS_PER_CALL])
            for t, rks in gone.items()
            for a in range(0, len(rks), MEMBERS_PER_CALL)
        ]

        def add(pipe: Any, i: int) -> None:
            keys, members = calls[i]
            pipe.execute_command("EVAL", UNACCOUNT, 3, *keys, *members)

        for reply in await self._per_key([keys[0] for keys, _ in calls], add):
            if isinstance(reply, BaseException):
                self._count("tenant_books_errors", 1)
                log.warning("tier %s: deleted records not taken out of their tenant's books: %s", self._name, reply)

    async def tenants(self, client: Any) -> list[int]:
        """The tenants that have books (the registry; none where it cannot be read: an ACL
        without ``+smembers``, a foreign key of that name)."""
        try:
            members = await client.smembers(self.registry)
        except ResponseError as e:
            log.debug("tier %s: tenant registry not read: %s", self._name, e)
            return []
        out = []
        for m in members:
            try:
                out.append(int(m, 16))
            except ValueError:
                continue
        if out:
            self.active = True
        return sorted(out)

    async def usage(self, client: Any) -> dict[int, int]:
        """Bytes per tenant, as the books hold them."""
        tenants = await self.tenants(client)
        if not tenants:
            return {}
        keys = [book_keys(self.prefix, t)[2] for t in tenants]
        replies = await self._per_key(keys, lambda pipe, i: pipe.get(keys[i]))
        out = {}
        for t, reply in zip(tenants, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            if reply:
                out[t] = int(reply)
        return out

    async def tenants_of(self, rks: list[bytes], tenants: list[int]) -> list[int]:
        """Each record's tenant as the books of ``tenants`` say (0: in none of them), without
        touching a record (``ZMSCORE`` on the books)."""
        found = [0] * len(rks)
        if not tenants or not rks:
            return found
        orders = [book_keys(self.prefix, t)[0] for t in tenants]
        replies = await self._per_key(orders, lambda pipe, i: pipe.execute_command("ZMSCORE", orders[i], *rks))
        for t, reply in zip(tenants, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            for j, score in enumerate(reply):
                if score is not None:
                    found[j] = t
        return found

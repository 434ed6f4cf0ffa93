"""Redis tier: one Redis key per record, batched through pipelines (single node or Cluster).

Primitives:

* :class:`RedisTier` — the tier (``kind = "redis"``); redis-py asyncio, hiredis when installed.
* :func:`redis_key` / :func:`parse_redis_key` — the key layout and its inverse.

Key layout (ASCII bytes)::

    {key_prefix}:{<fingerprint hex>.<bucket hex>}:<block hash + group, hex>

The part in braces is the Redis Cluster *hash tag*: ``bucket`` is the first 4 bytes of the
block hash (big-endian) modulo ``hash_tag_buckets``, so one namespace's batch touches at most
``hash_tag_buckets`` slots, while different blocks still spread over the cluster. Every
group of a block lands in the same slot. Hex keeps keys printable and unambiguous, and
``parse_redis_key`` recovers the stored key for ``scan``.

Values are whole records (:func:`tieredkv.format.encode_record`), written with one ``SET``
each (atomic per record; ``EX`` when ``ttl_s`` is set) and verified on every read. Reads are
bounded: ``GETRANGE key 0 cap`` (with ``EXISTS`` in the same pipeline, to tell an empty value
from no key) where ``cap`` is the destination's record size (or ``max_batch_bytes`` when the
caller wants bytes), so a huge foreign value under one of our keys costs at most ``cap + 1``
bytes on the wire and in memory; it is a miss, counted ``corrupt`` and deleted. A longer value
whose header is ours for that key is a record too big for the destination (an ``oversize``
miss, kept), or, when bytes are wanted, read in full by a second ``GETRANGE`` up to the size
its header states.

On a Redis Cluster every batch is split per node (a pipeline each, run concurrently) and the
cluster's redirections are followed by the tier itself
(:class:`~tieredkv.backends.redis.cluster.ClusterBatches`): ``MOVED`` patches the slot map and resends
the key to the new owner; ``ASK`` (a slot in migration, the key already moved) resends it to the
importing master with ``ASKING`` before it on the same connection; ``TRYAGAIN`` (a multi-key
command split by a migration) resends it after a backoff. A node that fails costs its own keys
only: they are retried after a topology refresh (at most twice on the same node, so a dead
master fails fast), then are misses (loads) or an error (puts, which are all-or-nothing).
Bounded: at most 24 sends of a key, and no retry round starts later than half ``op_timeout_s``
into the batch; each send is bounded by the socket timeouts, the whole call by ``op_timeout_s``.
Admin paths (``scan`` sizing, ``fill_stamps``, ``raw_get_many`` / ``raw_put_many``,
``delete_if_same``'s script; not its ``WATCH`` fallback where scripting is refused, a redis-py
cluster transaction) go the same way; ``scan`` itself sends ``SCAN`` to every master, so a key
that moves between two masters while they are scanned may be listed twice (dropped) or missed.

redis-py's own cluster handling is not used for this (measured,
``benchmarks/results/cluster-retry-20261206T0351Z.md``): pipelines run with
``allow_redirections=False`` because its ``ASK`` handling sends ``ASKING`` on one pooled
connection and the command on another, so a migrated key fails with ``ClusterError: TTL
exhausted`` (redis-py 8.2.0; about 200 failed operations per reshard window, against none here).
Its retry is off (``retries=0``): it holds every operation that touches a dead master through its
backoff (3.5-4.5 s each, 0.5 operations/s while the master is down, against 175 here with only
that master's keys lost). During a failover to a replica it does ride it out (1 failed operation
against 283 here, whose operations touching that master fail for the ~2 s until the promotion),
at 32 operations/s with stalls up to 3.2 s, against 58 successful operations/s here.

Ages and admin scans: Redis keeps each key's idle time (``OBJECT IDLETIME``, read by
:meth:`RedisTier.fill_stamps`; it does not touch the key). ``STRLEN`` / ``GET`` / ``GETRANGE``
count as accesses and reset it, so the admin CLI sets :attr:`RedisTier.passive_scans`: ``scan``
then asks for strings only (``SCAN ... TYPE string``) and sizes them with ``MEMORY USAGE`` (no
touch; an upper bound of the payload, as it counts the allocation), so ``ls`` never changes what
``evict --older-than`` / ``--to-size`` see. ``stats().records`` is ``None``: ``DBSIZE`` counts other
applications' keys too (it is ``extra["db_keys"]``); ``tieredkv status`` counts ours by scan.

Capacity is the server's (``maxmemory``): the tier does not evict (``evicts_locally`` is
false). A put that Redis refuses (``OOM``) raises :class:`~tieredkv.errors.TierFullError`
after deleting the records of that call that were already written (best effort).

Tenants: a record's header names its tenant (version 2; the default tenant's records are
version 1, as before). With tenant quotas configured, each tenant's usage is kept in Redis
itself, shared by every engine and node, and a tenant over its quota loses its own oldest
records (:mod:`~tieredkv.backends.redis.tenants`, which says what that costs); a quota given as
a share is a share of the primaries' summed ``maxmemory`` (unbounded where one has none).
``scan`` gives each record's tenant: an active scan reads header bytes 48..55 (``GETRANGE``, an
access like ``STRLEN``); a passive one cannot read a header without touching the key (Redis
before 7.2 has no ``CLIENT NO-TOUCH``), so it finds tenants in the tenants' books (``ZMSCORE``:
exact for records stored while quotas were configured; a record in no book is taken for the
default tenant's; every tenant is unknown, None, where there are no books).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tieredkv.backends.base import RawLimits, RecordInfo, Tier, TierCapabilities, TierStats, runs
from tieredkv.backends.redis.cluster import ClusterBatches
from tieredkv.backends.redis.config import RedisTierConfig
from tieredkv.backends.redis.pool import RespPool, native_target
from tieredkv.backends.redis.resp import Into, Placed, Record
from tieredkv.backends.redis.tenants import SCAN_TENANTS_MAX, TenantBooks, tenant_of
from tieredkv.errors import (
    ConfigError,
    CorruptRecordError,
    TieredKVError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from tieredkv.format import (
    HEADER_SIZE,
    TENANT_AT,
    decode_header,
    encode_record,
    make_header,
    verify_into,
    verify_parts,
    verify_record,
)
from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, chunk_key_of, key_fingerprint, key_group, key_hash, stored_key

__all__ = ["RedisTier", "parse_redis_key", "redis_key"]

log = logging.getLogger(__name__)


#: Keys per pipeline for commands whose replies are small (EXISTS, DEL, STRLEN).
_SMALL_BATCH = 2048
#: SCAN ``COUNT`` hint.
_SCAN_COUNT = 1000
#: Record size assumed for splitting GET pipelines before any record was seen.
_DEFAULT_RECORD_GUESS = 256 << 10
_GLOB_SPECIAL = frozenset(b"*?[]\\")

# Deletes a key only if it still holds the bytes we judged corrupt, so a fresh record written
# concurrently by another client is never dropped. ARGV: SHA-1 of the bytes seen, their length,
# "1" if they were the whole value (else a prefix: the value must still start with them). The
# value is never read past those bytes (it may be huge).
_DEL_IF_SAME = """
local len = tonumber(ARGV[2])
local n = redis.call('STRLEN', KEYS[1])
if n < len or (ARGV[3] == '1' and n ~= len) then return 0 end
local v = ''
if len > 0 then v = redis.call('GETRANGE', KEYS[1], 0, len - 1) end
if redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# ---- key layout ------------------------------------------------------------------------


def _bucket(block_hash: bytes, buckets: int) -> int:
    return int.from_bytes(block_hash[:4], "big") % buckets


def redis_key(prefix: bytes, key: bytes, buckets: int) -> bytes:
    """The Redis key of stored key ``key`` (see the module docstring for the layout)."""
    fp = key_fingerprint(key)
    rest = chunk_key_of(key)
    bucket = _bucket(key_hash(rest), buckets)
    return b"%s:{%s.%x}:%s" % (prefix, fp.hex().encode(), bucket, rest.hex().encode())


def parse_redis_key(prefix: bytes, rkey: bytes) -> bytes | None:
    """The stored key behind Redis key ``rkey``, or ``None`` if it is not one of ours."""
    head = prefix + b":{"
    if not rkey.startswith(head):
        return None
    end = rkey.find(b"}:", len(head))
    if end < 0:
        return None
    fp_hex, dot, _bucket_hex = rkey[len(head) : end].partition(b".")
    try:
        fp = bytes.fromhex(fp_hex.decode("ascii"))
        rest = bytes.fromhex(rkey[end + 2 :].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not dot or len(fp) != FINGERPRINT_BYTES or len(rest) <= GROUP_BYTES:
        return None
    return stored_key(fp, rest)


def _each(method: str, keys: Sequence[bytes], *args: Any) -> Callable[[Any, int], Any]:
    """``add(pipe, i)`` for :meth:`RedisTier._per_key`: queue ``pipe.<method>(*args, keys[i])``."""
    return lambda pipe, i: getattr(pipe, method)(*args, keys[i])


def _glob_escape(raw: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in raw)


# ---- the tier --------------------------------------------------------------------------


class RedisTier(Tier):
    """A Redis server or Redis Cluster as a tier.

    Args:
        config: :class:`~tieredkv.config.RedisTierConfig`.
        name: overrides ``config.name``.

    Example::

        async with RedisTier(RedisTierConfig(url="redis://127.0.0.1:6379/0")) as tier:
            await tier.put_many([(key, payload)])
    """

    kind: ClassVar[str] = "redis"
    #: Two batches in flight per lane: the server takes the next while the last one's replies come
    #: back (measured, ``bench_tiers.py --tiers redis``, three runs each way, store over redis-py
    #: at 256 KiB: 1.02-1.05x against 0.89-0.92x with one). A key a later call shares with an
    #: earlier one still in flight waits for that call (:meth:`_put_many`): writes to a key land
    #: in call order.
    capabilities = TierCapabilities(
        access_stamps=False, local_eviction=False, shared=True, writes_in_flight=2, medium="remote", tenants=True
    )
    config_model = RedisTierConfig

    config: RedisTierConfig
    # passive_scans (see Tier): ``scan`` then never touches a key (it sizes values with ``MEMORY
    # USAGE``, an upper bound, instead of ``STRLEN``), so listing records does not reset the idle
    # time that ``evict --older-than`` / ``--to-size`` read. Off, sizes are exact.

    def __init__(self, config: RedisTierConfig, *, name: str | None = None) -> None:
        super().__init__(config, name=name)
        if "{" in config.key_prefix or "}" in config.key_prefix:
            # A brace in the prefix would become the cluster hash tag and put every key
            # of every namespace in one slot.
            raise ConfigError(
                f"tier {self.name!r}: key_prefix {config.key_prefix!r} must not contain '{{' or '}}'"
                " (the hash tag is added by the tier); use e.g. 'tkv' or 'tkv-prod'"
            )
        self._client: Any = None
        self._batches: ClusterBatches | None = None  # a cluster's batches (routing, redirects, retries)
        self._native: RespPool | None = None  # the data path's own connections (native_io)
        self._writing: dict[bytes, asyncio.Future[None]] = {}  # key -> the put_many writing it now
        self._prefix = config.key_prefix.encode()
        self._buckets = config.hash_tag_buckets
        self._max_batch = int(config.max_batch_bytes)
        self._record_guess = _DEFAULT_RECORD_GUESS
        #: Per-tenant usage kept in Redis (:mod:`~tieredkv.backends.redis.tenants`).
        self._books = TenantBooks(self._prefix, self._per_key, self._count, self.name)
        #: The servers' maxmemory summed over primaries (None: some primary has none): what a
        #: quota given as a share of the tier's capacity is a share of.
        self._capacity: int | None = None
        parts = urlsplit(config.url)
        self._where = f"{parts.scheme}://{parts.hostname or parts.path}{f':{parts.port}' if parts.port else ''}"

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits:
        """The server at ``config.url``: redis-py pipelined SET/GET of the chunks (the baseline:
        the same client library and loop as the tier, without records or hash tags) and, for a
        plain ``redis://`` URL without a password, ``redis-benchmark`` (the server's own limit
        over one connection); and the redis-py run with an xxh3 of every payload on both paths,
        the floor: what that client does with records whose integrity is checked. All delete every
        key they wrote; see :func:`~tieredkv.backends._rawbench.redis_benchmark` for how a user's
        key is spared."""
        from tieredkv.backends._rawbench import gbps, raw_redis, redis_benchmark

        nbytes, (n, size) = src.numel(), src.shape
        auth = {k: v for k, v in (("username", config.username), ("password", config.password)) if v is not None}
        w, r = raw_redis(src, dst, config.url, **auth)
        figures = {"redis_py.store": gbps(nbytes, w), "redis_py.load": gbps(nbytes, r)}
        w, r = raw_redis(src, dst, config.url, checked=True, **auth)
        figures |= {"redis_checked.store": gbps(nbytes, w), "redis_checked.load": gbps(nbytes, r)}
        parts = urlsplit(config.url)
        if parts.scheme == "redis" and parts.password is None and config.password is None:
            rb = redis_benchmark(parts.port or 6379, size, min(n, 2000), host=parts.hostname or "127.0.0.1")
            if rb:
                figures |= {"redis_benchmark.store": rb[0], "redis_benchmark.load": rb[1]}
        notes = ("the raw Redis figures use one node of the cluster",) if config.cluster else ()
        return RawLimits(
            figures,
            {"store": "redis_py.store", "load": "redis_py.load"},
            notes,
            floor={"store": "redis_checked.store", "load": "redis_checked.load"},
        )

    # ---- helpers ----------------------------------------------------------------------

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key this tier stores ``key`` under."""
        return redis_key(self._prefix, key, self._buckets)

    def _client_kwargs(self) -> dict[str, Any]:
        c = self.config
        kw: dict[str, Any] = {
            "socket_timeout": c.socket_timeout_s,
            "socket_connect_timeout": c.connect_timeout_s,
            # One immediate retry: enough to replace a pooled connection that died with a
            # restarted server, few enough that a dead server fails in milliseconds. On a
            # cluster none: the tier retries per node and follows redirections itself (see
            # _cluster.ClusterBatches), so a failed node costs its own keys, not the batch.
            "retry": Retry(NoBackoff(), 0 if c.cluster else 1),
        }
        if c.username is not None:
            kw["username"] = c.username
        if c.password is not None:
            kw["password"] = c.password
        tls = {
            k: v
            for k, v in (
                ("ssl_ca_certs", c.ssl_ca_certs),
                ("ssl_certfile", c.ssl_certfile),
                ("ssl_keyfile", c.ssl_keyfile),
            )
            if v
        }
        if tls and not c.url.startswith("rediss://"):
            raise ConfigError(
                f"tier {self.name!r}: {', '.join(sorted(tls))} set but url {self._where!r} is not TLS;"
                " use a rediss:// url"
            )
        kw.update(tls)
        return kw

    def _pipeline(self) -> Any:
        return self._client.pipeline(transaction=False)

    async def _per_key(
        self, rkeys: list[bytes], add: Callable[[Any, int], Any], *, ncmd: int = 1, data: bool = False
    ) -> list[Any]:
        """``ncmd`` commands per key (``add(pipe, i)`` queues them for ``rkeys[i]``): one pipeline
        on a single node; on a cluster a pipeline per node, run concurrently, following MOVED /
        ASK / TRYAGAIN and retrying a failed node's keys, bounded in sends and time
        (:class:`~tieredkv.backends.redis.cluster.ClusterBatches`).

        Returns each key's reply (a tuple of ``ncmd`` replies when ``ncmd > 1``) — an exception
        object for a command the server refused (e.g. WRONGTYPE), for a key still redirected when
        the retries ran out, or for every key of a node that could not be reached. Raises only
        when every key's node failed, so a dead master costs its own keys, never the batch.

        ``data``: a data-path batch (SET / EXISTS+GETRANGE / GET); with ``native_io`` it runs on
        the tier's own connections, split over them (``add`` then gets a :class:`_NativePipe`)."""
        if self._batches is not None:
            out, down = await self._batches.run(rkeys, add, ncmd=ncmd)
        else:
            if data and self._native is not None:
                res = await self._native_run(self._native, list(range(len(rkeys))), add)
            else:
                pipe = self._pipeline()
                for i in range(len(rkeys)):
                    add(pipe, i)
                res = await pipe.execute(raise_on_error=False)
            return res if ncmd == 1 else [tuple(res[j * ncmd : (j + 1) * ncmd]) for j in range(len(rkeys))]
        if down and len(down) == len(rkeys):
            raise next(iter(down.values()))
        if down:
            errs = list(dict.fromkeys(down.values()))
            self._count("node_errors", len(errs))
            log.warning(
                "tier %s: %d of %d keys are on %d unreachable node(s) and were not served: %s",
                self.name,
                len(down),
                len(rkeys),
                len(errs),
                errs[0],
            )
        return out

    def _run_bytes(self) -> int:
        """Bytes of a data-path run: ``max_batch_bytes`` per round trip, times the native
        connections a run is split over (they work at once)."""
        return self._max_batch * (self._native.size if self._native is not None else 1)

    @staticmethod
    async def _native_run(pool: RespPool, idx: list[int], add: Callable[[Any, int], Any]) -> list[Any]:
        """The commands ``add`` queues for ``idx``, split in order over the pool's connections
        (run concurrently); replies in order. One slice failing fails the batch (as a node would):
        the others are stopped and what any of them placed in a destination is zeroed."""
        k = max(1, min(pool.size, len(idx)))
        step = -(-len(idx) // k)
        pipes = []
        for a in range(0, len(idx), step):
            pipe = _NativePipe()
            for i in idx[a : a + step]:
                add(pipe, i)
            pipes.append(pipe)
        if len(pipes) == 1:
            return await pool.execute(pipes[0].commands, pipes[0].intos)
        parts = await pool.execute_split([(p.commands, p.intos) for p in pipes])
        return [r for part in parts for r in part]

    def _note_size(self, record_len: int) -> None:
        # Running estimate of record size, used to split GET pipelines by bytes.
        self._record_guess = (self._record_guess * 7 + record_len) // 8

    # ---- lifecycle --------------------------------------------------------------------

    async def _open(self) -> None:
        kw = self._client_kwargs()
        if self.config.cluster:
            client: Any = RedisCluster.from_url(self.config.url, **kw)
        else:
            client = aioredis.Redis.from_url(self.config.url, **kw)
        try:
            if self.config.cluster:
                await client.initialize()
            else:
                await client.ping()
        except BaseException:
            await _aclose_quietly(client)
            raise
        self._client = client
        if self.config.cluster:
            budget = (self.op_timeout or 5.0) / 2  # retry rounds start within half the op deadline
            self._batches = ClusterBatches(
                client, name=self.name, budget_s=budget, count=self._count, pipeline=lambda: self._pipeline()
            )
        target = native_target(self.config.url) if self.config.native_io and not self.config.cluster else None
        if target is not None:
            if self.config.username is not None:
                target["username"] = self.config.username
            if self.config.password is not None:
                target["password"] = self.config.password
            self._native = RespPool(
                target,
                size=self.config.connections,
                socket_timeout=self.config.socket_timeout_s,
                connect_timeout=self.config.connect_timeout_s,
            )

        try:
            await self._books.tenants(client)  # (books exist: deletions take records out of them)
        except ResponseError as e:  # an ACL without +smembers, a foreign key of that name: no books here
            log.warning("tier %s: tenant books not read: %s", self.name, e)
        if self.quotas.enabled:
            self._capacity = (await self._memory())[0]

    async def _memory(self) -> tuple[int | None, list[dict[str, Any]], list[int]]:
        """maxmemory summed over the primaries (None when one has none), each one's INFO memory
        and DBSIZE."""
        infos: list[dict[str, Any]] = []
        sizes: list[int] = []
        if self.config.cluster:
            for node in self._client.get_primaries():
                infos.append(await self._client.info("memory", target_nodes=node))
                sizes.append(int(await self._client.dbsize(target_nodes=node)))
        else:
            infos.append(await self._client.info("memory"))
            sizes.append(int(await self._client.dbsize()))
        maxmem = [int(i.get("maxmemory", 0)) for i in infos]
        return (sum(maxmem) if maxmem and all(maxmem) else None), infos, sizes

    async def _close(self) -> None:
        native, self._native = self._native, None
        if native is not None:
            await native.aclose()
        client, self._client = self._client, None
        self._batches = None
        if client is not None:
            await client.aclose()

    # ---- data path --------------------------------------------------------------------

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

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        """:meth:`_read_records`; when it fails (or is cancelled) part way, the records it had
        already delivered into destinations are zeroed too: a failed load leaves nothing in the
        blocks it touched (a failed batch zeroes its own placed bytes, see ``_resp``)."""
        out: list[int | bytes | None] = [None] * len(keys)
        try:
            return await self._read_records(keys, into, out)
        except BaseException:
            for dst, n in zip(into, out, strict=True):
                if dst is not None and type(n) is int:
                    dst[:n] = bytes(n)
            raise

    async def _read_records(
        self, keys: list[bytes], into: list[memoryview | None], out: list[int | bytes | None]
    ) -> list[int | bytes | None]:
        corrupt: list[tuple[bytes, bytes, bool]] = []  # (redis key, bytes seen, whole value?)
        rest: list[tuple[int, bytes, bytes, int]] = []  # (index, redis key, head read, record size its header claims)

        def cap(i: int) -> int:
            """The most bytes key ``i`` may hold to be served: a longer value is not read."""
            dst = into[i]
            return self._max_batch if dst is None else HEADER_SIZE + len(dst)

        def size(i: int) -> int:
            dst = into[i]
            return self._record_guess if dst is None else HEADER_SIZE + len(dst)

        for run in runs(range(len(keys)), size, self._run_bytes()):
            rkeys = [self.redis_key(keys[i]) for i in run]
            caps = [cap(i) for i in run]

            heads = [bytearray(HEADER_SIZE) for _ in run] if self._native is not None else []

            def add(
                pipe: Any,
                j: int,
                rkeys: list[bytes] = rkeys,
                caps: list[int] = caps,
                run: Sequence[int] = run,
                heads: list[bytearray] = heads,
            ) -> None:
                pipe.exists(rkeys[j])  # tells an empty value (corrupt) from no key (a plain miss)
                dst = into[run[j]]
                if isinstance(pipe, _NativePipe) and dst is not None:  # the payload lands in dst
                    pipe.getrange(rkeys[j], 0, caps[j], into=Into(memoryview(heads[j]), dst))
                else:
                    pipe.getrange(rkeys[j], 0, caps[j])  # at most caps[j] + 1 bytes: longer means too long

            replies = await self._per_key(rkeys, add, ncmd=2, data=True)
            for j, (i, rk, limit, reply) in enumerate(zip(run, rkeys, caps, replies, strict=True)):
                if isinstance(reply, BaseException):  # its node is down: a miss (counted node_errors)
                    continue
                exists, value = reply
                if isinstance(value, Placed):  # header in heads[j], payload already in its buffer
                    out[i] = self._verify_placed(keys[i], rk, heads[j], into[i], int(value), corrupt)  # type: ignore[arg-type]
                    continue
                if isinstance(value, BaseException):
                    if _wrongtype(value):  # a foreign non-string value under our key: a miss
                        self._on_corrupt(keys[i], value)
                    continue
                if not value and not (isinstance(exists, int) and exists > 0):
                    continue  # no such key
                if len(value) > limit:
                    claimed = _claimed_record_size(value, keys[i])
                    if claimed is None or claimed <= limit:  # not our record, or longer than it says
                        says = "no header for this key" if claimed is None else f"a header for {claimed} bytes"
                        self._on_corrupt(
                            keys[i],
                            CorruptRecordError(f"a value longer than {limit} bytes with {says} (not read further)"),
                        )
                        corrupt.append((rk, value, False))
                    elif into[i] is not None:  # a record for this key, larger than the destination
                        self._count("oversize")
                        log.warning(
                            "tier %s: record of %d bytes does not fit a %d-byte buffer; miss",
                            self.name,
                            claimed - HEADER_SIZE,
                            len(into[i]),  # type: ignore[arg-type]  # not None: a buffer was given
                        )
                    else:  # bytes wanted and the header vouches for the size: read the rest
                        rest.append((i, rk, value, claimed))
                    continue
                out[i] = self._verify_deliver(keys[i], rk, value, into[i], corrupt)
        if rest:
            rks = [rk for _, rk, _, _ in rest]
            try:
                tails = await self._per_key(
                    rks, lambda pipe, j: pipe.getrange(rks[j], len(rest[j][2]), rest[j][3])
                )  # ≤ claimed + 1 bytes
            except RedisError as e:  # their nodes went down since the first read: misses, not an error
                log.warning("tier %s: could not read the rest of %d large records: %s", self.name, len(rks), e)
                tails = [e] * len(rks)
            for (i, rk, head, claimed), tail in zip(rest, tails, strict=True):
                if isinstance(tail, BaseException):
                    continue
                out[i] = self._verify_deliver(
                    keys[i], rk, head + tail, None, corrupt, whole=len(head) + len(tail) <= claimed
                )
        if corrupt:
            await self._drop_corrupt(corrupt)
        return out

    def _verify_deliver(
        self,
        key: bytes,
        rk: bytes,
        value: bytes,
        dst: memoryview | None,
        corrupt: list[tuple[bytes, bytes, bool]],
        *,
        whole: bool = True,
    ) -> int | bytes | None:
        try:
            if dst is None:
                got: int | bytes = bytes(verify_record(value, key))
            else:
                got = verify_into(value, key, dst)  # checked and copied in one C call where built
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            corrupt.append((rk, value, whole))
            return None
        self._note_size(len(value))
        if got == -1:  # a good record, larger than its destination
            self._oversize(key, len(value) - HEADER_SIZE, dst)  # type: ignore[arg-type]  # dst given
            return None
        return got

    def _verify_placed(
        self,
        key: bytes,
        rk: bytes,
        head: bytearray,
        dst: memoryview,
        length: int,
        corrupt: list[tuple[bytes, bytes, bool]],
    ) -> int | None:
        """Verify a record read in place (header apart, payload in ``dst``); the payload's length,
        or None (a miss: what landed in ``dst`` is zeroed, so no damaged byte stays there)."""
        n = length - HEADER_SIZE
        try:
            verify_parts(memoryview(head), dst[:n], key)
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            landed = dst[: max(0, min(n, len(dst)))]
            corrupt.append((rk, bytes(head) + bytes(landed), True))
            landed[:] = bytes(len(landed))
            return None
        self._note_size(length)
        return n

    async def _drop_corrupt(self, corrupt: list[tuple[bytes, bytes, bool]]) -> None:
        """Delete values judged corrupt (``(redis key, bytes seen, whether they were the whole
        value)``), unless rewritten meanwhile (rare path)."""
        try:
            await self._del_if_same(corrupt)
        except RedisError as e:  # best effort: the read's results stand; the next read retries
            log.warning("tier %s: could not delete a corrupt value: %s", self.name, e)

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        return await self._del_if_same([(self.redis_key(k), raw, True) for k, raw in items])

    async def _del_if_same(self, entries: list[tuple[bytes, bytes, bool]]) -> int:
        """Delete each ``(redis key, bytes, whole)`` while the value still is those bytes (``whole``)
        or still starts with them: a Lua script per key (pipelined; on a cluster through
        :meth:`_per_key`, so a slot in migration is followed), or, where scripting is refused (a
        managed Redis, an ACL without ``+eval``), a ``WATCH``ed transaction. Never a blind ``DEL``:
        a record another client wrote meanwhile stays."""
        deleted = 0
        for run in runs(entries, lambda _: 1, _SMALL_BATCH):
            rks = [rk for rk, _, _ in run]
            argv = [
                (hashlib.sha1(seen, usedforsecurity=False).hexdigest(), len(seen), int(whole)) for _, seen, whole in run
            ]

            def add(pipe: Any, i: int, rks: list[bytes] = rks, argv: list[tuple[str, int, int]] = argv) -> None:
                pipe.execute_command("EVAL", _DEL_IF_SAME, 1, rks[i], *argv[i])

            for (rk, seen, whole), reply in zip(run, await self._per_key(rks, add), strict=True):
                if isinstance(reply, ResponseError) and not isinstance(reply, _UNSETTLED):
                    deleted += await self._del_if_same_watched(rk, seen, whole)  # scripting refused
                elif isinstance(reply, BaseException):
                    raise reply
                else:
                    deleted += int(reply)
        return deleted

    async def _del_if_same_watched(self, rk: bytes, seen: bytes, whole: bool) -> int:
        async with self._client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(rk)
                value = await pipe.getrange(rk, 0, len(seen)) if not whole else await pipe.get(rk)
                same = value == seen if whole else value is not None and value[: len(seen)] == seen
                if not same:
                    await pipe.unwatch()
                    return 0
                pipe.multi()
                pipe.delete(rk)
                (n,) = await pipe.execute()
                return int(n)
            except WatchError:  # written meanwhile: kept
                return 0

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for run in runs(keys, lambda _: self._record_guess, self._max_batch):
            rkeys = [self.redis_key(k) for k in run]
            out.extend(_raise_first(await self._per_key(rkeys, _each("get", rkeys))))
        return out

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        """SET whole records as given. With quotas configured (a store's tier: the records of a
        sealed tier come this way), each record counts in the books of the tenant its header
        names, as :meth:`_set_records` counts them; an admin tool's tier has no quotas."""
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
        if booked:
            assert quotas is not None
            await self._keep_books(booked, quotas, len(items))

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        out: list[bool] = []
        for run in runs(keys, lambda _: 1, _SMALL_BATCH):
            rkeys = [self.redis_key(k) for k in run]
            replies = await self._per_key(rkeys, _each("exists", rkeys))
            out.extend(r is True or (isinstance(r, int) and r > 0) for r in replies)
        return out

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

    # ---- scan -------------------------------------------------------------------------

    def _match(self, fingerprint: bytes | None) -> bytes:
        head = _glob_escape(self._prefix) + b":{"
        return head + (fingerprint.hex().encode() + b".*" if fingerprint is not None else b"*")

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

    # ---- errors -----------------------------------------------------------------------

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        """Map redis-py errors to the tieredkv tree (the caller chains ``exc`` as the cause)."""
        where = f"tier {self.name!r} (redis at {self._where})"
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and str(exc).startswith("OOM")):
            return TierFullError(
                f"{where}: {op} refused, the server is out of memory ({detail}); raise its maxmemory,"
                " use maxmemory-policy allkeys-lru so Redis evicts, or set ttl_s"
            )
        if isinstance(exc, AuthenticationError):
            return TierUnavailableError(
                f"{where}: {op}: authentication failed ({detail}); check the tier's username/password"
                " (or the credentials in its url) against the server's requirepass / ACL users"
            )
        if isinstance(exc, NoPermissionError):
            return TierUnavailableError(
                f"{where}: {op}: the ACL user lacks a permission ({detail}); it needs"
                " +get +getrange +set +del +exists +strlen +scan +eval +info +dbsize +object +memory on the key prefix"
            )
        if isinstance(exc, RedisTimeoutError):
            return TierTimeoutError(
                f"{where}: {op}: no reply within socket_timeout_s={self.config.socket_timeout_s} ({detail})"
            )
        if isinstance(exc, (RedisConnectionError, OSError)):
            return TierUnavailableError(f"{where}: {op}: cannot reach the server ({detail})")
        if isinstance(exc, (ClusterError, RedisClusterException)):
            return TierUnavailableError(f"{where}: {op}: the cluster is unavailable ({detail})")
        return TierUnavailableError(f"{where}: {op} failed ({detail})")


class _NativePipe:
    """Collects data-path commands for :class:`~tieredkv.backends.redis.resp.RespPool` with the method
    names of a redis-py pipeline (so one ``add`` serves both)."""

    __slots__ = ("commands", "intos")

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []
        self.intos: list[Into | None] = []

    def _add(self, cmd: list[Any], into: Into | None = None) -> None:
        self.commands.append(cmd)
        self.intos.append(into)

    def set(self, name: bytes, value: Any, ex: int | None = None) -> None:
        self._add(["SET", name, value] if ex is None else ["SET", name, value, "EX", ex])

    def getrange(self, name: bytes, start: int, end: int, into: Into | None = None) -> None:
        self._add(["GETRANGE", name, start, end], into)

    def exists(self, name: bytes) -> None:
        self._add(["EXISTS", name])


#: Replies of a cluster whose slot did not settle in the retries (not a refusal of the command).
_UNSETTLED = (AskError, TryAgainError, ClusterDownError)


def _raise_first(replies: list[Any]) -> list[Any]:
    """``replies`` when none is an error; else raise the first."""
    for r in replies:
        if isinstance(r, BaseException):
            raise r
    return replies


def _claimed_record_size(head: bytes, key: bytes) -> int | None:
    """The record size (header + payload) the header at the start of ``head`` states, if it is a
    well-formed header for stored key ``key``; else ``None``. The checksum is not checked."""
    if len(head) < HEADER_SIZE:
        return None
    n = int.from_bytes(head[32:40], "little")
    try:
        hdr = decode_header(head[:HEADER_SIZE], n)
    except CorruptRecordError:
        return None
    if hdr.fingerprint != key_fingerprint(key) or hdr.group != key_group(key):
        return None
    return HEADER_SIZE + n


def _header_tenant(record: memoryview | bytes) -> int:
    """The tenant a whole record's header names (0: version 1, the default tenant, or no header)."""
    if len(record) < HEADER_SIZE or bytes(record[4:6]) != b"\x02\x00":
        return 0
    return int.from_bytes(record[TENANT_AT : TENANT_AT + 8], "little")


def _stamp(idle: Any, now: float) -> float | None:
    """Unix time of the last access from an ``OBJECT IDLETIME`` reply (``None``: an error, e.g. LFU)."""
    return now - float(idle) if isinstance(idle, int) and not isinstance(idle, bool) else None


#: What ``MEMORY USAGE`` counts besides the value and the key at least (object header, dict entry).
_MEMORY_OVERHEAD = 16 + 24


def _payload_upper_bound(memory_usage: int, key_len: int) -> int:
    """A payload size no smaller than the real one, from ``MEMORY USAGE`` less what it surely
    counts besides the value (allocation rounding still makes it larger)."""
    return max(memory_usage - _MEMORY_OVERHEAD - (key_len + 4) - HEADER_SIZE, 0)


def _wrongtype(e: BaseException) -> bool:
    return isinstance(e, ResponseError) and str(e).startswith("WRONGTYPE")


def _scan_reply(reply: Any) -> tuple[int, list[bytes]]:
    """Normalise a SCAN reply sent to one cluster node (``[cursor, keys]`` or ``{node: ...}``)."""
    if isinstance(reply, dict):  # {node_name: [cursor, keys]}
        (reply,) = reply.values()
    cursor, keys = reply
    if isinstance(cursor, dict):  # redis-py's cluster callback: ({node_name: cursor}, keys)
        (cursor,) = cursor.values()
    return int(cursor), list(keys)


async def _aclose_quietly(client: Any) -> None:
    try:
        await client.aclose()
    except Exception as e:  # noqa: BLE001 - already failing; keep the original error
        log.debug("closing a half-open redis client failed: %s", e)

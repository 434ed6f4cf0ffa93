"""The Redis tier's connections and batches: :class:`RedisTierBase`, the state and the
plumbing every path of :class:`~tieredkv.backends.redis.tier.RedisTier` builds on.

* The client: redis-py asyncio (hiredis when installed), a ``Redis`` or a ``RedisCluster`` made
  from the URL with the tier's timeouts, credentials and TLS files (a ``rediss://`` URL only).
  With ``native_io`` on a single node over ``redis://`` or ``unix://``, the data path (SET,
  EXISTS + GETRANGE) runs on the tier's own connections
  (:class:`~tieredkv.backends.redis.pool.RespPool`, through
  :mod:`~tieredkv.backends.redis.native`); TLS, clusters and the admin commands stay on redis-py.
* :meth:`RedisTierBase._per_key`, the one way a batch goes out: a pipeline on a single node (or
  the native connections), a pipeline per node on a cluster.
* :meth:`RedisTierBase._translate`: redis-py's errors (the native connections raise the same
  classes) as tieredkv's.

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
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tieredkv.backends.base import RemovalListener, Tier
from tieredkv.backends.redis.cluster import ClusterBatches
from tieredkv.backends.redis.config import RedisTierConfig
from tieredkv.backends.redis.keys import redis_key
from tieredkv.backends.redis.native import native_run
from tieredkv.backends.redis.pool import RespPool, native_target
from tieredkv.backends.redis.probe import BoundedExists, Where, command, literal_address
from tieredkv.backends.redis.removals import RemovalWatch
from tieredkv.backends.redis.tenants import TenantBooks
from tieredkv.errors import (
    ConfigError,
    TieredKVError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)

__all__ = ["RedisTierBase"]

log = logging.getLogger(__name__)


#: Keys per pipeline for commands whose replies are small (EXISTS, DEL, STRLEN).
_SMALL_BATCH = 2048
#: Record size assumed for splitting GET pipelines before any record was seen.
_DEFAULT_RECORD_GUESS = 256 << 10


def _each(method: str, keys: Sequence[bytes], *args: Any) -> Callable[[Any, int], Any]:
    """``add(pipe, i)`` for :meth:`RedisTierBase._per_key`: queue ``pipe.<method>(*args, keys[i])``."""
    return lambda pipe, i: getattr(pipe, method)(*args, keys[i])


def _raise_first(replies: list[Any]) -> list[Any]:
    """``replies`` when none is an error; else raise the first."""
    for r in replies:
        if isinstance(r, BaseException):
            raise r
    return replies


class RedisTierBase(Tier):
    """What every part of :class:`~tieredkv.backends.redis.tier.RedisTier` shares: its state,
    client, open / close, the batch runner :meth:`_per_key` and the error mapping. Not a tier
    by itself (the data and admin paths are :mod:`~tieredkv.backends.redis.reads`,
    :mod:`~tieredkv.backends.redis.writes` and :mod:`~tieredkv.backends.redis.admin`)."""

    config: RedisTierConfig

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
        #: In-step lookups (``probe_batch``): None when off (``lookup_budget_ms: 0``, TLS) or closed.
        self._bounded: BoundedExists | None = None
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
        #: What the server removes by itself, watched while a removal listener is set
        #: (:mod:`~tieredkv.backends.redis.removals`).
        self._removal_watch: RemovalWatch | None = None

    @property
    def removal_watch(self) -> RemovalWatch | None:
        """The watch of the server's own removals, once a removal listener is set and the tier open."""
        return self._removal_watch

    def set_removal_listener(self, fn: RemovalListener | None) -> None:
        """As :meth:`Tier.set_removal_listener`; the server's own removals (``maxmemory``, TTL) are
        watched from then on (:mod:`~tieredkv.backends.redis.removals`): started here when the
        tier is open (call it on the tier's loop), else when it opens."""
        super().set_removal_listener(fn)
        if fn is not None and self._opened and self._client is not None and self._removal_watch is None:
            self._removal_watch = RemovalWatch(self)
            self._removal_watch.start()

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
            # cluster.ClusterBatches), so a failed node costs its own keys, not the batch.
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
        the tier's own connections, split over them (``add`` then gets a
        :class:`~tieredkv.backends.redis.native._NativePipe`)."""
        if self._batches is not None:
            out, down = await self._batches.run(rkeys, add, ncmd=ncmd)
        else:
            if data and self._native is not None:
                res = await native_run(self._native, list(range(len(rkeys))), add)
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

        self._bounded = await self._bounded_exists(client)

        try:
            await self._books.tenants(client)  # (books exist: deletions take records out of them)
        except ResponseError as e:  # an ACL without +smembers, a foreign key of that name: no books here
            log.warning("tier %s: tenant books not read: %s", self.name, e)
        if self.quotas.enabled:
            self._capacity = (await self._memory())[0]
        if self._removal_listener is not None and self._removal_watch is None:
            self._removal_watch = RemovalWatch(self)
            self._removal_watch.start()

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

    async def _bounded_exists(self, client: Any) -> BoundedExists | None:
        """The in-step lookup path (:mod:`~tieredkv.backends.redis.probe`), or None: off
        (``lookup_budget_ms: 0``), TLS, or a node address that cannot be had without a resolver."""
        c = self.config
        if not c.lookup_budget_ms or c.url.startswith("rediss://"):
            return None
        target = native_target(c.url)
        if target is None:
            return None
        user = c.username if c.username is not None else target["username"]
        password = c.password if c.password is not None else target["password"]
        hello = []
        if password is not None:
            hello.append(
                command(b"AUTH", user.encode(), password.encode()) if user else command(b"AUTH", password.encode())
            )
        if c.cluster:
            route = self._slot_route(client)
            if route is None:
                return None
        else:
            if target["db"]:
                hello.append(command(b"SELECT", b"%d" % target["db"]))
            if "path" in target:
                where: Where | None = (socket.AF_UNIX, target["path"])
            else:
                where = literal_address(target["host"], target["port"])
                if where is None:  # a host name: resolved once, here, never on the caller's thread
                    try:
                        infos = await asyncio.get_running_loop().getaddrinfo(
                            target["host"], target["port"], type=socket.SOCK_STREAM
                        )
                    except OSError as e:
                        log.warning("tier %s: in-step lookups off: %s not resolved (%s)", self.name, target["host"], e)
                        return None
                    where = (infos[0][0], infos[0][4])

            def route(_rkey: bytes, where: Where | None = where) -> Where | None:
                return where

        return BoundedExists(
            budget_s=c.lookup_budget_ms / 1000, route=route, hello=hello, count=self._count, name=self.name
        )

    @staticmethod
    def _slot_route(client: Any) -> Callable[[bytes], Where | None] | None:
        """A Redis Cluster key's node from the client's slot map, read here and never changed
        (redis-py's ``NodesManager.slots_cache``, which the tier's batches keep current): None
        for a key when the map has no node for its slot or names it by a host name; None in all
        when the client keeps no such map (another redis-py)."""
        from redis.crc import key_slot

        nodes: Any = getattr(client, "nodes_manager", None)
        if not isinstance(getattr(nodes, "slots_cache", None), dict):
            return None
        known: dict[tuple[str, int], Where | None] = {}

        def route(rkey: bytes) -> Where | None:
            owners = nodes.slots_cache.get(key_slot(rkey))
            if not owners:
                return None
            node = owners[0]
            at = (node.host, node.port)
            where = known.get(at, False)
            if where is False:
                where = known[at] = literal_address(node.host, node.port)
            return where  # type: ignore[return-value]

        return route

    async def _close(self) -> None:
        bounded, self._bounded = self._bounded, None
        if bounded is not None:
            bounded.close()
        watch, self._removal_watch = self._removal_watch, None
        if watch is not None:
            await watch.stop()
        native, self._native = self._native, None
        if native is not None:
            await native.aclose()
        client, self._client = self._client, None
        self._batches = None
        if client is not None:
            await client.aclose()

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


async def _aclose_quietly(client: Any) -> None:
    try:
        await client.aclose()
    except Exception as e:  # noqa: BLE001 - already failing; keep the original error
        log.debug("closing a half-open redis client failed: %s", e)

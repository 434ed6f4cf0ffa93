"""Redis tier: one Redis key per record, batched through pipelines (single node or Cluster).

:class:`RedisTier` (``kind = "redis"``) is put together from one module per job:

* :mod:`~tieredkv.backends.redis.keys` — the key layout (one hash tag per namespace and bucket)
  and its inverse;
* :mod:`~tieredkv.backends.redis.client` — state, the redis-py client (or the data path's own
  connections, ``native_io``), open / close, the batch runner (a pipeline, or one per cluster
  node following redirections) and the error mapping;
* :mod:`~tieredkv.backends.redis.writes` — ``SET`` of whole records, all or nothing; tenants'
  books and quotas;
* :mod:`~tieredkv.backends.redis.reads` — bounded, verified reads, in place on the native
  connections; corrupt values deleted only while unchanged;
* :mod:`~tieredkv.backends.redis.admin` — ``scan`` (passive for admin tools), ages from
  ``OBJECT IDLETIME``, the server's figures;

and, below them, :mod:`~tieredkv.backends.redis.cluster` (a cluster's batches),
:mod:`~tieredkv.backends.redis.tenants` (tenant quotas kept in Redis),
:mod:`~tieredkv.backends.redis.resp` / :mod:`~tieredkv.backends.redis.pool` /
:mod:`~tieredkv.backends.redis.native` (the native RESP connections).

Capacity is the server's (``maxmemory``): the tier does not evict (``evicts_locally`` is false).
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlsplit

from tieredkv.backends.base import RawLimits, TierCapabilities
from tieredkv.backends.redis.admin import RedisAdmin
from tieredkv.backends.redis.config import RedisTierConfig
from tieredkv.backends.redis.reads import RedisReads
from tieredkv.backends.redis.writes import RedisWrites

__all__ = ["RedisTier"]


class RedisTier(RedisReads, RedisWrites, RedisAdmin):
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

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits:
        """The server at ``config.url``: redis-py pipelined SET/GET of the chunks (the baseline:
        the same client library and loop as the tier, without records or hash tags) and, for a
        plain ``redis://`` URL without a password, ``redis-benchmark`` (the server's own limit
        over one connection, one request in flight and as many as the tier pipelines); the
        limit is the strongest of them. And the redis-py run with an xxh3 of every payload on both paths,
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
            host, port = parts.hostname or "127.0.0.1", parts.port or 6379
            rb = redis_benchmark(port, size, min(n, 2000), host=host)
            if rb:
                figures |= {"redis_benchmark.store": rb[0], "redis_benchmark.load": rb[1]}
            depth = max(1, min(64, (8 << 20) // size))  # the tier's pipelines: up to 64 values, 8 MiB
            rb = redis_benchmark(port, size, min(n, 2000), host=host, pipeline=depth)
            if rb:
                figures |= {"redis_benchmark_pipelined.store": rb[0], "redis_benchmark_pipelined.load": rb[1]}
        notes = ("the raw Redis figures use one node of the cluster",) if config.cluster else ()
        return RawLimits(
            figures,  # the strongest of redis-py and the server's own client
            {
                "store": ("redis_py.store", "redis_benchmark.store", "redis_benchmark_pipelined.store"),
                "load": ("redis_py.load", "redis_benchmark.load", "redis_benchmark_pipelined.load"),
            },
            notes,
            floor={"store": "redis_checked.store", "load": "redis_checked.load"},
        )

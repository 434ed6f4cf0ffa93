"""The tier contract against a real redis-server and a real 3-master Redis Cluster."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tieredkv.backends.base import Tier
from tieredkv.backends.registry import build_tier
from tieredkv.config import RedisTierConfig
from tieredkv.format import SEAL_TAG
from tieredkv.testing.contract import TierContract, made_tiers
from tieredkv.testing.servers import RedisCluster, RedisServer


def _limit_memory(clients: list[redis.Redis], capacity_bytes: int) -> None:
    for c in clients:
        base = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory-policy", "allkeys-lru")
        c.config_set("maxmemory-samples", 64)  # near-exact LRU for the test
        c.config_set("maxmemory", base + capacity_bytes)


def _reset(clients: list[redis.Redis]) -> None:
    for c in clients:
        c.config_set("maxmemory", 0)
        c.flushall()
        c.close()


class _RedisContract(TierContract):
    cluster = False
    sealed = False  # with encryption (the registry wraps the tier: SealedTier)
    native_io = True

    def nodes(self, request: Any) -> tuple[str, list[redis.Redis]]:
        raise NotImplementedError

    @pytest.fixture
    async def make_tier(self, request: Any) -> Any:
        url, clients = self.nodes(request)

        def build(capacity_bytes: int | None, _: int) -> Tier:
            extra: dict[str, Any] = {"native_io": self.native_io}
            if capacity_bytes is not None:
                _limit_memory(clients, capacity_bytes)
                extra["hash_tag_buckets"] = 1  # one node holds the namespace: its maxmemory applies
            if self.sealed:
                extra["encryption"] = {"keys_file": request.getfixturevalue("sealed_keys_file")}
            return build_tier(RedisTierConfig(url=url, cluster=self.cluster, **extra))

        async with made_tiers(build) as make:
            yield make
        _reset(clients)


class TestRedisSingleNode(_RedisContract):
    def nodes(self, request: Any) -> tuple[str, list[redis.Redis]]:
        srv: RedisServer = request.getfixturevalue("redis_server")
        return srv.url, [redis.Redis(host="127.0.0.1", port=srv.port)]


class TestRedisCluster(_RedisContract):
    cluster = True

    def nodes(self, request: Any) -> tuple[str, list[redis.Redis]]:
        cl: RedisCluster = request.getfixturevalue("redis_cluster")
        return cl.url, [redis.Redis(host=h, port=p) for h, p in cl.nodes]


class TestSealedRedisSingleNode(TestRedisSingleNode):
    sealed = True
    record_tail = SEAL_TAG


class TestSealedRedisSingleNodeRedisPy(TestRedisSingleNode):
    """Sealed, over redis-py (``native_io: false``): the reads' other path."""

    sealed = True
    native_io = False
    record_tail = SEAL_TAG


class TestSealedRedisCluster(TestRedisCluster):
    sealed = True
    record_tail = SEAL_TAG

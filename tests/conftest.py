"""Shared fixtures: real redis-server and Redis Cluster processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tieredkv.testing.servers import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (tests isolate by namespace and flush after)."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real 3-master Redis Cluster for the session."""
    with RedisCluster(masters=3) as cluster:
        yield cluster

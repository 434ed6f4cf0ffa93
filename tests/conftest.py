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


@pytest.fixture(scope="session")
def sealed_keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A key file of two fresh master keys (owner-only), for tiers with ``encryption``."""
    import os

    path = tmp_path_factory.mktemp("keys") / "tieredkv.keys"
    path.write_text(f"# newest first\n{os.urandom(32).hex()}\n{os.urandom(32).hex()}\n")
    path.chmod(0o600)
    return str(path)

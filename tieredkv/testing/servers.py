"""Throw-away Redis processes for tests: re-exported from :mod:`tieredkv.localredis` and
:mod:`tieredkv.localcluster` (the CLI's ``cluster up`` / ``down`` uses the same code, so it lives
outside :mod:`tieredkv.testing`)."""

from __future__ import annotations

from tieredkv.localcluster import RedisCluster, detached_cluster_state, start_detached_cluster, stop_detached_cluster
from tieredkv.localredis import HOST, INSTALL_HINT, RedisServer, _bindable, free_port, redis_command

__all__ = [
    "HOST",
    "INSTALL_HINT",
    "RedisCluster",
    "RedisServer",
    "_bindable",
    "detached_cluster_state",
    "free_port",
    "redis_command",
    "start_detached_cluster",
    "stop_detached_cluster",
]

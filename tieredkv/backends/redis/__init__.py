"""The Redis tier: a single node or a Redis Cluster.

* ``tier`` — :class:`RedisTier`.
* ``resp`` — the data path's own RESP connections (``native_io``).
* ``cluster`` — Redis Cluster batches: a pipeline per node, MOVED / ASK / TRYAGAIN followed.
* ``tenants`` — tenant quotas kept in Redis.
* ``config`` — :class:`RedisTierConfig` (importing it imports no redis-py).

The tier class is imported on first use (``from tieredkv.backends.redis import RedisTier``), so
importing the package, or its ``config``, does not import the tier's client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tieredkv.backends.redis.config import RedisTierConfig

if TYPE_CHECKING:
    from tieredkv.backends.redis.tier import RedisTier

__all__ = ["RedisTier", "RedisTierConfig"]


def __getattr__(name: str) -> Any:
    if name == "RedisTier":
        from tieredkv.backends.redis.tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

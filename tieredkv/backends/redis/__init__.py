"""The Redis tier: a single node or a Redis Cluster.

* ``tier`` — :class:`RedisTier`, put together from:
* ``client`` — its state, the redis-py client, open / close, the batch runner, the error mapping;
* ``writes`` — ``put_many`` (whole records, all or nothing), ``delete_many``, tenants' books;
* ``reads`` — bounded, verified reads; corrupt values deleted only while unchanged;
* ``admin`` — ``scan``, ages, the server's figures;
* ``keys`` — the key layout (hash tags) and its inverse;
* ``cluster`` — Redis Cluster batches: a pipeline per node, MOVED / ASK / TRYAGAIN followed;
* ``tenants`` — tenant quotas kept in Redis;
* ``resp`` / ``pool`` / ``native`` — the data path's own RESP connections (``native_io``): the
  bounded protocol, the connections to a node, the glue to the tier's batches;
* ``config`` — :class:`RedisTierConfig` (importing it imports no redis-py).

The tier class is imported on first use (``from tieredkv.backends.redis import RedisTier``), so
importing the package, or its ``config``, does not import the tier's client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv._lazy import lazy_names
from tieredkv.backends.redis.config import RedisTierConfig

if TYPE_CHECKING:
    from tieredkv.backends.redis.tier import RedisTier

__all__ = ["RedisTier", "RedisTierConfig"]


__getattr__ = lazy_names(__name__, {"RedisTier": "tier"})

"""tieredkv — a tiered KV-cache store (CPU, LMDB-on-NVMe, Redis / Redis Cluster) for LLM engines."""

from __future__ import annotations

from tieredkv.config import TieredKVConfig, load_config
from tieredkv.errors import (
    ConfigError,
    CorruptRecordError,
    TierClosedError,
    TieredKVError,
    TierFullError,
    TierTimeoutError,
    TierUnavailableError,
)
from tieredkv.keys import Namespace, make_chunk_key

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # open_store / TieredStore pull in torch: import them on first use only.
    if name in ("open_store", "TieredStore"):
        from tieredkv import store

        return getattr(store, name)
    raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "CorruptRecordError",
    "Namespace",
    "TierClosedError",
    "TierFullError",
    "TierTimeoutError",
    "TierUnavailableError",
    "TieredKVConfig",
    "TieredKVError",
    "TieredStore",
    "__version__",
    "load_config",
    "make_chunk_key",
    "open_store",
]

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


#: The engine-side API: it needs torch, so it is imported on first use (``import tieredkv`` and
#: the admin CLI work in an install without torch: ``pip install 'tieredkv[admin]'``).
_ENGINE_API = {"open_store": "tieredkv.store", "TieredStore": "tieredkv.store"}
ENGINE_HINT = "pip install 'tieredkv[engine]'"


def __getattr__(name: str) -> object:
    module_name = _ENGINE_API.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name != "torch":
            raise
        raise ImportError(
            f"tieredkv.{name} is the engine-side API and needs torch, which is not installed;"
            f" install it with: {ENGINE_HINT}",
            name="torch",
        ) from e
    return getattr(module, name)


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

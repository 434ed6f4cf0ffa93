"""Tier backends: the Tier ABC, the registry and the built-in CPU, LMDB and Redis tiers.

Every name is imported on first use, so importing a tier's config model
(``tieredkv.backends.<kind>.config``, which loading a config does) imports neither the Tier
contract nor any backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv._lazy import lazy_names

if TYPE_CHECKING:
    from tieredkv.backends.base import RecordInfo, Tier, TierCapabilities, TierStats
    from tieredkv.backends.registry import (
        TierEntry,
        build_tier,
        get_tier_class,
        known_kinds,
        register_tier,
        tier_capabilities,
        tier_entry,
    )

_HOMES = {
    "RecordInfo": "base",
    "Tier": "base",
    "TierCapabilities": "base",
    "TierStats": "base",
    "TierEntry": "registry",
    "build_tier": "registry",
    "get_tier_class": "registry",
    "known_kinds": "registry",
    "register_tier": "registry",
    "tier_capabilities": "registry",
    "tier_entry": "registry",
}

__all__ = [
    "RecordInfo",
    "Tier",
    "TierCapabilities",
    "TierEntry",
    "TierStats",
    "build_tier",
    "get_tier_class",
    "known_kinds",
    "register_tier",
    "tier_capabilities",
    "tier_entry",
]


__getattr__ = lazy_names(__name__, _HOMES)

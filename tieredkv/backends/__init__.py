"""Tier backends: the Tier ABC, the registry and the built-in CPU, LMDB and Redis tiers."""

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

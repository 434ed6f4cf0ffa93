"""Tier backends: the Tier ABC, the registry and the built-in CPU, LMDB and Redis tiers."""

from tieredkv.backends.base import RecordInfo, Tier, TierStats
from tieredkv.backends.registry import build_tier, get_tier_class, register_tier

__all__ = ["RecordInfo", "Tier", "TierStats", "build_tier", "get_tier_class", "register_tier"]

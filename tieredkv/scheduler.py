"""Compatibility name of the planner core: everything here lives in :mod:`tieredkv.planner`.

``from tieredkv.scheduler import OffloadScheduler, StoreOutcome`` keeps working; new code imports
from :mod:`tieredkv.planner`.
"""

from __future__ import annotations

from tieredkv.planner import (
    DEFAULT_MAX_CHUNKS_PER_PLAN,
    ChunkLedger,
    ChunkToStore,
    GroupLoadPlan,
    GroupLookup,
    GroupProgress,
    GroupStorePlan,
    LoadPlan,
    LookupPlan,
    OffloadScheduler,
    StoreOutcome,
    StorePlan,
)

__all__ = [
    "DEFAULT_MAX_CHUNKS_PER_PLAN",
    "ChunkLedger",
    "ChunkToStore",
    "GroupLoadPlan",
    "GroupLookup",
    "GroupProgress",
    "GroupStorePlan",
    "LoadPlan",
    "LookupPlan",
    "OffloadScheduler",
    "StoreOutcome",
    "StorePlan",
]

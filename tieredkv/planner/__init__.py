"""The planner core: what to store and what a lookup may hit, per request and KV group.

One vLLM-free core, used by every engine tieredkv plans for: the library's
:class:`OffloadScheduler` (so ``TieredStore.planner()`` and ``tieredkv demo``) and the vLLM
connector ``TieredKVConnector`` (:mod:`tieredkv.integrations.vllm.connector`, a thin adapter from
vLLM's scheduler hooks to this core). A rule fixed here is fixed for both.

Modules, one job each:

- :mod:`~tieredkv.planner.ledger` -- :class:`ChunkLedger` (per request and group: chunk status,
  scan position, waiting list, the store cursor) and :class:`RequestStore` (a request's ledgers
  and latest plan).
- :mod:`~tieredkv.planner.store` -- :class:`StorePlanner`: which whole chunks to offer now
  (whole or validly partial chunks, a cursor that never passes a refused chunk, bounded plans),
  and what the store's answer does.
- :mod:`~tieredkv.planner.lookup` -- hits whole chunks in every group, on every group's grid
  (:func:`plan_lookup`, :func:`align_hit`); misses fed back to the ledgers.
- :mod:`~tieredkv.planner.load` -- the keys and destination blocks of an accepted hit.
- :mod:`~tieredkv.planner.hold` -- finished requests held while refused (:class:`HoldBook`),
  boundary states offered until taken (:class:`HandoffQueue`).
- :mod:`~tieredkv.planner.plans` -- the plans and outcomes exchanged with an engine.
- :mod:`~tieredkv.planner.scheduler` -- :class:`OffloadScheduler`, the library's planner.
"""

from __future__ import annotations

from tieredkv.planner.hold import Handoff, HandoffQueue, HoldBook, drop_reused_blocks
from tieredkv.planner.ledger import ChunkLedger, RequestStore
from tieredkv.planner.lookup import align_hit, plan_lookup
from tieredkv.planner.plans import (
    ChunkToStore,
    GroupLoadPlan,
    GroupLookup,
    GroupProgress,
    GroupStorePlan,
    LoadPlan,
    LookupPlan,
    StoreAnswer,
    StoreOutcome,
    StorePlan,
    split_answer,
)
from tieredkv.planner.scheduler import OffloadScheduler
from tieredkv.planner.store import DEFAULT_MAX_CHUNKS_PER_PLAN, GroupFacts, StorePlanner

__all__ = [
    "DEFAULT_MAX_CHUNKS_PER_PLAN",
    "ChunkLedger",
    "ChunkToStore",
    "GroupFacts",
    "GroupLoadPlan",
    "GroupLookup",
    "GroupProgress",
    "GroupStorePlan",
    "Handoff",
    "HandoffQueue",
    "HoldBook",
    "LoadPlan",
    "LookupPlan",
    "OffloadScheduler",
    "RequestStore",
    "StoreAnswer",
    "StoreOutcome",
    "StorePlan",
    "StorePlanner",
    "align_hit",
    "drop_reused_blocks",
    "plan_lookup",
    "split_answer",
]

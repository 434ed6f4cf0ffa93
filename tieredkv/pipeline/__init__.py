"""The asyncio store/load pipeline: an event loop on its own thread between the engine and the tiers.

Modules, one job each:

* :mod:`~tieredkv.pipeline.jobs` — what the engine submits and polls (:class:`ChunkRef`,
  :class:`StoreJob`, :class:`LoadJob`, :class:`JobResult`, :class:`KeyState`), the job skeleton
  every job kind runs in (:class:`~tieredkv.pipeline.jobs.JobRun`) and the jobs/keys in flight.
* :mod:`~tieredkv.pipeline.loop` — the loop bridge (:class:`~tieredkv.pipeline.loop.LoopThread`:
  ``run(coro, timeout)``, ``submit``, ``spawn``).
* :mod:`~tieredkv.pipeline.lanes` — one writer lane and circuit breaker per tier.
* :mod:`~tieredkv.pipeline.transfer` — transfer strategies (slots / direct / staged), chosen by
  tier capabilities, never by a tier's class.
* :mod:`~tieredkv.pipeline.route` — the one walk over a key's route every lookup asks
  (:class:`~tieredkv.pipeline.route.RouteWalker`: plans per group, the walk that does not wait,
  the batched one that does).
* :mod:`~tieredkv.pipeline.writeback` — write-back of dirty chunks and promotion of lower-tier hits.
* :mod:`~tieredkv.pipeline.events` — tier events (:class:`TierEvent`): what each tier came to
  hold and stopped holding, in order, once :meth:`Pipeline.record_tier_events` asked (KV events).
* :mod:`~tieredkv.pipeline.stats` — typed stats (:class:`PipelineStats`, :class:`GroupStats`,
  :class:`LaneStats`) shared by the pipeline and :mod:`tieredkv.metrics`.
* :mod:`~tieredkv.pipeline.core` — :class:`Pipeline`: admission and the two job families
  (store/load of engine blocks; put/get of host buffers), lookups and probes (over the route
  walker).

``submit_store`` / ``submit_load`` return at once (the engine is never blocked by a tier);
bytes move GPU → staging → tiers and back on the loop thread. The staging pool bounds the bytes
in flight: a job that does not fit now is refused (back-pressure; offer it again later), and one
larger than the whole pool is staged in parts through as much of the pool as is free, so it is
never refused for good. ``drain()`` waits for everything in flight (write-backs included);
``close()`` drains, writes every chunk a write-back route acknowledged in the CPU tier down to
the next tier (bounded by its timeout), cancels what is left, closes the tiers and joins the
thread. A key is *pending* from ``submit_store`` until its writes finish, so a lookup never
reports a hit for bytes that are not written yet. The engine must leave a store's GPU blocks
alone until its result is polled (vLLM's connector guarantees that).

Most callers want :class:`tieredkv.store.TieredStore`, the facade over all of this.
"""

from tieredkv.pipeline.core import Pipeline
from tieredkv.pipeline.events import TierEvent, TierEvents
from tieredkv.pipeline.jobs import ChunkRef, JobResult, KeyState, LoadJob, StoreJob
from tieredkv.pipeline.stats import GroupStats, LaneStats, PipelineStats, StagingStats

__all__ = [
    "ChunkRef",
    "GroupStats",
    "JobResult",
    "KeyState",
    "LaneStats",
    "LoadJob",
    "Pipeline",
    "PipelineStats",
    "StagingStats",
    "StoreJob",
    "TierEvent",
    "TierEvents",
]

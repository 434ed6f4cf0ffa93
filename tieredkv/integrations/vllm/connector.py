"""``TieredKVConnector``: vLLM 0.33's ``OffloadingConnector`` with tieredkv's store planning.

vLLM's worker side, wire format (``OffloadingConnectorMetadata``, ``TransferJob``,
``GPULoadStoreSpec``) and request/job bookkeeping (``_req_status``, ``_jobs``, fences, events,
stats) are kept; any ``OffloadingSpec`` works behind it (tieredkv's, vLLM's ``CPUOffloadingSpec``,
``TieringOffloadingSpec`` with tieredkv secondary tiers). What changes is what the scheduler
side decides, with the rules of :class:`tieredkv.scheduler.ChunkLedger` (the planner's ledger):

* **Per-group ledgers instead of one cursor.** A chunk is done only when the manager accepted it
  or already holds it; refused chunks (``prepare_store`` → ``None``) and keys a manager left out
  of a partial ``keys_to_store`` (told apart from "already present" by ``lookup``) stay waiting
  and are offered again, oldest first, at most ``max_store_keys_per_step`` keys per request and
  step. Chunks already done are never offered again (GPU-only prefix hits and resumes used to
  re-offer every chunk from 0).
* **Finished requests are planned at once and held while refused.** ``request_finished`` runs
  the request's last store pass immediately; only if something was refused are its blocks held
  (``delay_free_blocks``) and the pass retried each step, until everything is accepted or
  ``hold_finished_steps`` steps passed, with at most ``hold_max_blocks`` blocks held in all. The
  blocks are released through ``finished_sending``. Nothing changes for requests whose stores are
  accepted: their blocks are freed as under vLLM's connector.
* **Sliding-window chunks, once selected, stay candidates** (the reachability filter is applied
  when a chunk is first seen; a later shift of the reachable boundaries does not drop it), and
  **Mamba boundary states** (offered by the engine exactly once) are kept and offered again
  while their block has not been reallocated.
* **A hit is aligned to every group's grid, the Mamba grid included**: vLLM rounds to the Mamba
  chunk once and another group can then shrink the hit off it (a state from a later boundary
  would be loaded); the lookup is repeated with the bound on the grid until it agrees.
* **Misses are fed back**: a full-attention lookup that misses a chunk the ledger counted as
  stored (evicted since) makes it storable again.
* **The request's ``cache_salt`` is its tenant.** vLLM hands a manager only a ``ReqContext``,
  without the salt; this connector records it there when vLLM adds the request
  (:mod:`tieredkv.integrations.vllm.tenants`), so tieredkv's spec and secondary tiers bound each
  tenant by its quota (the config's ``tenants``). Under vLLM's own ``OffloadingConnector`` they
  see a salt only if the request puts one in ``kv_transfer_params["cache_salt"]``.

**Metrics on vLLM's own ``/metrics``.** tieredkv's counters reach vLLM's connector stats through
the spec's manager (``TieredKVManager.get_stats``) or a tieredkv secondary tier, the hooks vLLM's
offloading connector already calls, so they appear as ``vllm:kv_offload_tieredkv_*`` behind this
connector and behind vLLM's own (see :mod:`tieredkv.integrations.vllm.stats`).

Extra config (``kv_connector_extra_config``, next to the spec's keys):
``max_store_keys_per_step`` (256), ``hold_finished_steps`` (16), ``hold_max_blocks`` (half the
GPU pool; 0 never holds).

Loaded by vLLM as ``"kv_connector": "TieredKVConnector", "kv_connector_module_path":
"tieredkv.integrations.vllm"``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import _ConnectorMetricName
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    RequestOffloadState,
    TransferJobStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
)
from vllm.v1.request import Request, RequestStatus

from tieredkv.groups import _check_int
from tieredkv.integrations.vllm.tenants import set_request_tenant
from tieredkv.scheduler import _WAITING, ChunkLedger

__all__ = ["ConnectorCounters", "TieredKVConnector", "TieredKVConnectorScheduler"]

_PRESENT = (LookupResult.HIT, LookupResult.HIT_PENDING)
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_UNLOCKED = contextlib.nullcontext()  # reusable: enters and leaves without a generator
_EMPTY_REGION = contextlib.ExitStack()  # holds nothing: closing it does nothing, so it serves every step


@dataclass
class ConnectorCounters:
    """What the planner did; ``chunks_given_up`` is the number of chunks lost."""

    store_passes: int = 0
    keys_offered: int = 0
    keys_accepted: int = 0
    keys_present: int = 0  # left out of keys_to_store and found by lookup
    keys_retried: int = 0  # offered again after a refusal or a partial accept
    refusals: int = 0  # prepare_store returned None
    partial_accepts: int = 0
    held_requests: int = 0
    held_steps: int = 0
    chunks_given_up: int = 0  # waiting chunks of a held request when its hold timed out
    chunks_unheld: int = 0  # waiting chunks of a finished request not held (hold_max_blocks reached)
    chunks_blocks_gone: int = 0  # waiting chunks whose blocks the engine freed and reused first
    handoffs_retried: int = 0
    handoffs_given_up: int = 0  # refused Mamba states given up after hold_finished_steps tries
    handoffs_blocks_gone: int = 0  # refused Mamba states whose block was reallocated first
    hits_realigned: int = 0  # lookups shrunk onto the Mamba grid
    ledger_forgets: int = 0  # stored chunks a lookup missed (evicted): storable again


@dataclass
class TieredKVConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's metadata plus the held finished requests whose blocks the workers release."""

    finished_holds: set[str] = field(default_factory=set)


@dataclass
class _Offer:
    pos: int  # group position in the connector's group configs
    chunk: int
    key: OffloadKey
    blocks: tuple[int, ...]  # the chunk's GPU block ids (0 = null; only leading nulls)


@dataclass
class _Held:
    status: RequestOffloadState
    num_blocks: int
    steps: int = 0


@dataclass
class _Handoff:
    req_id: str
    group_idx: int
    block_id: int
    boundary: int
    attempts: int = 0


class TieredKVConnectorScheduler(OffloadingConnectorScheduler):
    """The scheduler side: vLLM's bookkeeping, tieredkv's store planning and hit alignment."""

    _step_region: contextlib.ExitStack | None  # vLLM's: the step's region, open from its first lookup

    def __init__(self, spec: OffloadingSpec, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        grid = self._mamba_align_size
        config: Any = self.config  # type: ignore[has-type]  # set by vLLM's __init__ (untyped here)
        if grid is not None and config.alignment_tokens is not None:
            # Hits land on the Mamba grid, so the sliding-window chunks worth storing are the ones
            # a boundary on that grid needs (vLLM aligns them to the full-attention chunk only).
            self.config = config._replace(alignment_tokens=math.lcm(grid, config.alignment_tokens))
        extra = spec.extra_config or {}
        self.max_store_keys_per_step = _positive(extra, "max_store_keys_per_step", 256)
        # a store pass's budget per group (a request's groups share the step's budget)
        self._store_share = math.ceil(self.max_store_keys_per_step / len(self.config.kv_group_configs))
        self.hold_finished_steps = _positive(extra, "hold_finished_steps", 16, allow_zero=True)
        self.hold_max_blocks = _positive(
            extra, "hold_max_blocks", max(1, kv_cache_config.num_blocks // 2), allow_zero=True
        )
        self.counters = ConnectorCounters()
        self._pos_of_group = {c.group_idx: pos for pos, c in enumerate(self.config.kv_group_configs)}
        self._ledgers: dict[str, tuple[ChunkLedger, ...]] = {}
        self._held: dict[str, _Held] = {}
        self._held_blocks = 0
        self._release: set[str] = set()
        self._handoffs: list[_Handoff] = []
        # store jobs made outside schedule() (a finished request's last pass), sent with the next
        # step's metadata
        self._early_store_jobs: dict[int, TransferJob] = {}
        # a manager that answers a prefix scan in one call (tieredkv's); else key by key
        self._lookup_prefix = getattr(self.manager, "lookup_prefix", None)
        # a manager whose lock is vLLM's no-op (tieredkv's: its state is the scheduler thread's)
        self._lock_is_noop = type(self.manager).lock is OffloadingManager.lock

    def _acquire_step(self) -> None:
        # vLLM opens the step's region (an ExitStack entering ``manager.lock``) at the step's first
        # lookup and closes it in build_connector_meta; with vLLM's no-op lock the region holds
        # nothing, so one empty stack marks it open on every step.
        if self._lock_is_noop:
            if self._step_region is None:
                self._step_region = _EMPTY_REGION
            return
        super()._acquire_step()

    def _manager_locked(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        # vLLM's is a generator context manager around ``manager.lock``, entered by several hooks
        # on every step (stats, worker output, events): with vLLM's no-op lock and no step region
        # left open it does nothing, at the cost of a generator and two context managers a hook.
        if self._lock_is_noop and self._step_region is None:
            return _UNLOCKED
        return super()._manager_locked()

    # ------------------------------------------------------------------ requests

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        salt = request.cache_salt
        status = self._req_status.get(request.request_id)
        if salt and status is not None:  # the request's tenant, for the manager and secondary tiers
            set_request_tenant(status.req_context, salt)

    # ------------------------------------------------------------------ ledgers

    def _ledgers_of(self, req_id: str) -> tuple[ChunkLedger, ...]:
        led = self._ledgers.get(req_id)
        if led is None:
            led = self._ledgers[req_id] = tuple(ChunkLedger() for _ in self.config.kv_group_configs)
        return led

    def _sync_cursors(self, status: RequestOffloadState, ledgers: tuple[ChunkLedger, ...]) -> None:
        # vLLM zeroes re-allocated sliding-window block ids from next_stored_chunk_idx on: keep it
        # at the lowest chunk not done, so waiting chunks are covered.
        for gs, led in zip(status.group_states, ledgers):
            gs.next_stored_chunk_idx = led.cursor

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        ledgers = self._ledgers.get(request.request_id)
        if ledgers is not None:  # a resume: chunks passed as never storable may become whole
            for led in ledgers:
                led.rewind_dead()
        return super().get_num_new_matched_tokens(request, num_computed_tokens, max_num_new_tokens)

    def _lookup_complete_chunks(
        self, req_status: RequestOffloadState, max_num_new_tokens: int | None = None
    ) -> int | None:
        grid = self._mamba_align_size
        computed = req_status.num_locally_computed_tokens
        while True:
            hit = super()._lookup_complete_chunks(req_status, max_num_new_tokens)
            if not hit or grid is None or (computed + hit) % grid == 0:
                return hit
            # Off the Mamba grid: bound the lookup to the grid point below (+1: the last token
            # before a sliding-window boundary is taken off by the lookup itself) and ask again.
            self.counters.hits_realigned += 1
            aligned = (computed + hit) // grid * grid
            if aligned <= computed:
                return 0
            max_num_new_tokens = aligned + 1 - computed

    def _maximal_prefix_lookup(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        req: Request,
        group_config: GroupOffloadConfig,
        start_chunk_idx: int,
    ) -> int | None:
        prefix = self._lookup_prefix
        tracker = self._events_tracker
        record = tracker.record_lookup if tracker.self_describing_enabled else None  # else a no-op
        if prefix is not None:
            results = prefix(keys, req_context)
            n, hit_count = len(results), results.count(_HIT)  # count: identity tests, in C
            if n and (hit_count == n or (hit_count == n - 1 and results[-1] is _MISS)):
                # the usual answer: hits, perhaps ended by a miss
                if record is not None:
                    for i in range(hit_count):
                        record(req, group_config, start_chunk_idx + i, keys[i])
                if hit_count < len(results):
                    self._forget(req.request_id, group_config.group_idx, start_chunk_idx + hit_count)
                return hit_count
        else:
            results = _prefix_results(self.manager, keys, req_context)
        hit_count = 0
        deferred = False
        for i, (key, result) in enumerate(zip(keys, results)):
            if result in _PRESENT:
                if record is not None:
                    record(req, group_config, start_chunk_idx + i, key)
                hit_count += 1
                deferred |= result is LookupResult.HIT_PENDING
            elif result is LookupResult.RETRY:
                deferred = True  # keep scanning: the manager starts its lookups
            else:
                self._forget(req.request_id, group_config.group_idx, start_chunk_idx + i)
                break
        return None if deferred else hit_count

    def _forget(self, req_id: str, group_idx: int, chunk: int) -> None:
        ledgers = self._ledgers.get(req_id)
        pos = self._pos_of_group.get(group_idx)
        if ledgers is None or pos is None:
            return
        led = ledgers[pos]
        if led.is_done(chunk):
            self.counters.ledger_forgets += 1
            led.forget(chunk)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if not num_external_tokens:
            return
        # Loaded chunks are held by the store: done. Under vLLM's chunk-level policy the local
        # prefix before them counts as held too (vLLM moves its cursor past both).
        status = self._req_status[request.request_id]
        boundary = status.num_locally_computed_tokens + num_external_tokens
        ledgers = self._ledgers_of(request.request_id)
        chunk_level = status.offloading_context.policy == OffloadPolicy.CHUNK_LEVEL
        first = 0 if chunk_level else status.num_locally_computed_tokens
        for cfg, led in zip(self.config.kv_group_configs, ledgers):
            tpc = cfg.tokens_per_chunk
            led.mark_done_range(first // tpc, boundary // tpc)

    # ------------------------------------------------------------------ store planning

    def _build_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[int, TransferJob]:
        store_jobs, self._early_store_jobs = self._early_store_jobs, {}
        self._drop_reused_held_blocks()
        seen: set[str] = set()
        for req_id in list(scheduler_output.num_scheduled_tokens):
            seen.add(req_id)
            status = self._req_status.get(req_id)
            if status is not None:
                self._store_pass(status, scheduler_output.num_scheduled_tokens[req_id], store_jobs)
        for req_id in list(self._held):
            if req_id in seen:
                continue
            held = self._held[req_id]
            held.steps += 1
            self.counters.held_steps += 1
            self._store_pass(held.status, 0, store_jobs)
            if self._outstanding(req_id) == 0 or held.steps >= self.hold_finished_steps:
                self._unhold(req_id)
        for req_id in scheduler_output.finished_req_ids or ():
            if req_id not in self._held:
                self._ledgers.pop(req_id, None)
        return store_jobs

    def _store_pass(
        self, status: RequestOffloadState, num_scheduled_tokens: int, store_jobs: dict[int, TransferJob]
    ) -> None:
        """One store pass over a request: offer its storable chunks not done yet."""
        req = status.req
        if any(not self._jobs[j].is_store and not self._jobs[j].is_sync_load for j in status.transfer_jobs):
            return  # an async load is in flight (vLLM never stores next to one)
        if req.status is RequestStatus.FINISHED_ABORTED:
            frontier = req.num_computed_tokens
        elif req.is_finished():
            frontier = max(req.num_prompt_tokens, req.num_tokens - 1)
        else:
            frontier = req.num_computed_tokens + num_scheduled_tokens
        offloadable = self._calc_num_offloadable_tokens(status, frontier)
        prompt_offloadable = self._calc_num_offloadable_tokens(status, req.num_prompt_tokens)
        reachable: tuple[int, ...] = ()
        if self.config.retention_interval is not None:
            reachable = (req.num_prompt_tokens - 1,)
            if req.shared_prefix_boundary:
                reachable += (req.shared_prefix_boundary,)
        ledgers = self._ledgers_of(req.request_id)
        share = self._store_share
        offers: list[_Offer] = []
        for pos, (cfg, gs) in enumerate(zip(self.config.kv_group_configs, status.group_states)):
            if cfg.requires_cow_source:
                continue  # Mamba "align" states come as boundary hand-offs
            led = ledgers[pos]
            num_chunks = status.storable_chunks(cfg, gs, offloadable)
            if num_chunks <= led.cursor:
                continue
            cands = led.candidates(num_chunks, share)
            if cands:
                offers.extend(self._classify(status, pos, cfg, led, cands, num_chunks, prompt_offloadable, reachable))
            led.settle_scan()
        if offers:
            self._offer(status, offers, store_jobs)  # reads no cursor: synced once, after it
        self._sync_cursors(status, ledgers)

    def _classify(
        self,
        status: RequestOffloadState,
        pos: int,
        cfg: GroupOffloadConfig,
        led: ChunkLedger,
        cands: list[int],
        num_chunks: int,
        prompt_offloadable: int,
        reachable: tuple[int, ...],
    ) -> list[_Offer]:
        """Sort candidates into offers, waiting and never-storable chunks."""
        req = status.req
        gs = status.group_states[pos]
        bpc = self.config.blocks_per_chunk
        lo = cands[0]
        if self.config.retention_interval is not None or cfg.is_eagle_group:
            horizon = None
        elif req.is_finished():
            horizon = num_chunks
        elif num_chunks <= prompt_offloadable // cfg.tokens_per_chunk:
            horizon = prompt_offloadable // cfg.tokens_per_chunk
        else:
            horizon = None
        mask = self._reachable_store_block_mask(cfg, lo, num_chunks, horizon, reachable)
        out: list[_Offer] = []
        for k in cands:
            blocks = tuple(gs.block_ids[k * bpc : (k + 1) * bpc])
            sub = mask[(k - lo) * bpc : (k - lo + 1) * bpc] if mask is not None else None
            if sub is not None and not any(sub):
                led.mark_dead(k)  # unreachable now; reconsidered on a resume
                continue
            nulls = _leading_nulls(blocks)
            if nulls == bpc or 0 in blocks[nulls:] or (sub is not None and any(sub[b] for b in range(nulls))):
                if led.status_of(k) == _WAITING:
                    self.counters.chunks_blocks_gone += 1
                led.mark_dead(k)  # part of the chunk is gone (left the window, reused)
                continue
            if nulls and any(o.pos == pos for o in out):
                led.mark_waiting(k)  # only a group's first chunk may start mid-chunk (wire format)
                continue
            if led.status_of(k) == _WAITING:  # offered before
                self.counters.keys_retried += 1
            led.mark_waiting(k)
            out.append(_Offer(pos, k, gs.offload_keys[k], blocks))
        return out

    def _offer(self, status: RequestOffloadState, offers: list[_Offer], store_jobs: dict[int, TransferJob]) -> None:
        req = status.req
        ctx = status.req_context
        ledgers = self._ledgers_of(req.request_id)
        keys = [o.key for o in offers]
        self.counters.store_passes += 1
        self.counters.keys_offered += len(keys)
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self.counters.refusals += 1
            self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
            return  # every offer stays waiting
        accepted = set(out.keys_to_store)
        self.counters.keys_accepted += len(accepted)
        left_out = [o for o in offers if o.key not in accepted]
        partial = False
        for o in left_out:
            if self.manager.lookup(o.key, ctx) in _PRESENT:
                self.counters.keys_present += 1
                ledgers[o.pos].mark_done(o.chunk)
            else:
                partial = True  # refused for now: stays waiting
        if partial:
            self.counters.partial_accepts += 1
        if not accepted:
            return
        n_groups = len(self.config.kv_group_configs)
        by_pos: list[list[_Offer]] = [[] for _ in range(n_groups)]
        for o in offers:
            if o.key in accepted:
                by_pos[o.pos].append(o)
        src: list[int] = []
        group_sizes: list[int] = []
        block_indices: list[int] = []
        fenced: list[int] = []
        deferred: list[int] = []
        bpc = self.config.blocks_per_chunk
        tracker = self._events_tracker
        record = tracker.record_store if tracker.self_describing_enabled else None  # else a no-op
        for pos, (cfg, group_offers) in enumerate(zip(self.config.kv_group_configs, by_pos)):
            windowed = cfg.sliding_window_size_in_chunks is not None
            start: int | None = None
            n = 0
            for o in group_offers:
                if record is not None:
                    record(req, cfg, o.chunk, o.key)
                for i, bid in enumerate(o.blocks):
                    if bid == 0:
                        continue
                    if start is None:
                        start = o.chunk * bpc + i
                    src.append(bid)
                    n += 1
                    (fenced if windowed else deferred).append(bid)
                ledgers[pos].mark_done(o.chunk)
            group_sizes.append(n)
            block_indices.append(start or 0)
        job_id = self._generate_job_id()
        status.transfer_jobs.add(job_id)
        if req.request_id not in self._req_status:  # a held request whose status vLLM dropped
            self._req_status[req.request_id] = status
        for bid in fenced:
            self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
        self._jobs[job_id] = TransferJobStatus(
            req_id=req.request_id,
            pending_count=self.config.num_workers,
            keys=set(accepted),
            is_store=True,
            deferred_fence_block_ids=deferred,
            fenced_block_ids=fenced or None,
        )
        store_jobs[job_id] = TransferJob(
            req_id=req.request_id,
            src_spec=GPULoadStoreSpec(src, group_sizes=group_sizes, block_indices=block_indices),
            dst_spec=out.store_spec,
        )
        if req.is_finished():
            for bid in deferred:
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
                if bid in self._current_batch_allocated_block_ids:
                    self._current_batch_jobs_to_flush.add(job_id)

    def _outstanding(self, req_id: str) -> int:
        ledgers = self._ledgers.get(req_id, ())
        n = sum(led.num_waiting for led in ledgers)
        return n + sum(1 for h in self._handoffs if h.req_id == req_id)

    # ------------------------------------------------------------------ finished requests

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request)
        status = self._req_status.get(request.request_id)
        if status is None:
            return delay, params
        with self._manager_locked():
            self._store_pass(status, 0, self._early_store_jobs)
        if self._outstanding(request.request_id) == 0:
            return delay, params
        num_blocks = len({b for gs in status.group_states for b in gs.block_ids if b})
        if self.hold_finished_steps and self._held_blocks + num_blocks <= self.hold_max_blocks:
            self._held[request.request_id] = _Held(status, num_blocks)
            self._held_blocks += num_blocks
            self.counters.held_requests += 1
            return True, params
        self._give_up(request.request_id, held=False)
        return delay, params

    def _unhold(self, req_id: str) -> None:
        self._give_up(req_id)
        held = self._held.pop(req_id)
        self._held_blocks -= held.num_blocks
        self._release.add(req_id)

    def _give_up(self, req_id: str, held: bool = True) -> None:
        """The request's blocks go back: its waiting chunks are lost (counted)."""
        lost = sum(led.num_waiting for led in self._ledgers.pop(req_id, ()))
        if held:
            self.counters.chunks_given_up += lost
        else:
            self.counters.chunks_unheld += lost

    def _drop_reused_held_blocks(self) -> None:
        """A held request's freed sliding-window blocks may be reallocated: never store them.
        Only the chunks that may still be offered are looked at: waiting ones and those past
        the scan position (a bounded pass may not have reached them yet)."""
        allocated = self._current_batch_allocated_block_ids
        if not allocated or not self._held:
            return
        bpc = self.config.blocks_per_chunk
        for req_id, held in self._held.items():
            groups = zip(self.config.kv_group_configs, held.status.group_states, self._ledgers.get(req_id, ()))
            for cfg, gs, led in groups:
                if cfg.sliding_window_size_in_chunks is None:
                    continue
                ids = gs.block_ids
                for k in itertools.chain(led.waiting, range(led.scan, len(ids) // bpc)):
                    for j in range(k * bpc, (k + 1) * bpc):
                        if ids[j] in allocated:
                            ids[j] = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        release, self._release = self._release, set()
        return TieredKVConnectorMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            finished_holds=release,
        )

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._release or self._early_store_jobs) or super().has_pending_push_work()

    # ------------------------------------------------------------------ Mamba hand-offs

    def _build_partial_tail_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[int, TransferJob]:
        # vLLM returns early on a step without new hand-offs; refused ones are retried (and checked
        # for reallocated blocks) every step.
        block_state = scheduler_output.kv_connector_block_state
        if (block_state is None or not block_state.boundary_state_offloads) and self._handoffs:
            return self._build_aligned_boundary_store_jobs({})
        return super()._build_partial_tail_store_jobs(scheduler_output)

    def _build_aligned_boundary_store_jobs(
        self, handoffs: dict[str, list[tuple[int, int, int]]]
    ) -> dict[int, TransferJob]:
        allocated = self._current_batch_allocated_block_ids
        pending: list[_Handoff] = []
        for h in self._handoffs:  # earlier refusals: gone if the block was reallocated
            if h.block_id in allocated:
                self.counters.handoffs_blocks_gone += 1
            elif h.attempts >= max(1, self.hold_finished_steps) or self._status(h.req_id) is None:
                self.counters.handoffs_given_up += 1
            else:
                pending.append(h)
        for req_id, entries in handoffs.items():
            pending.extend(_Handoff(req_id, g, b, n) for g, b, n in entries)
        self._handoffs = []
        store_jobs: dict[int, TransferJob] = {}
        num_groups = len(self.config.kv_group_configs)
        for h in pending:
            status = self._status(h.req_id)
            pos = self._pos_of_group.get(h.group_idx)
            if status is None or pos is None:
                continue
            cfg = self.config.kv_group_configs[pos]
            req = status.req
            max_boundary = self._calc_num_offloadable_tokens(status, req.num_tokens)
            if h.block_id == 0 or h.boundary > max_boundary or h.boundary % cfg.tokens_per_chunk:
                continue
            key = self._make_boundary_key(req, h.group_idx, h.boundary, status.req_context)
            if h.attempts:
                self.counters.handoffs_retried += 1
            self.counters.keys_offered += 1
            out = self.manager.prepare_store([key], status.req_context)
            if out is None or (not out.keys_to_store and self.manager.lookup(key, status.req_context) not in _PRESENT):
                self.counters.refusals += out is None
                self._connector_stats.increase_counter(_ConnectorMetricName.ALLOCATION_FAILURE)
                h.attempts += 1
                self._handoffs.append(h)
                continue
            if not out.keys_to_store:
                self.counters.keys_present += 1
                continue
            self.counters.keys_accepted += 1
            job_id = self._generate_job_id()
            status.transfer_jobs.add(job_id)
            if req.request_id not in self._req_status:
                self._req_status[req.request_id] = status
            self._block_id_to_pending_jobs.setdefault(h.block_id, set()).add(job_id)
            self._jobs[job_id] = TransferJobStatus(
                req_id=h.req_id,
                pending_count=self.config.num_workers,
                keys={key},
                is_store=True,
                fenced_block_ids=[h.block_id],
            )
            sizes = [0] * num_groups
            sizes[pos] = 1
            indices = [0] * num_groups
            indices[pos] = h.boundary // cfg.tokens_per_block - 1
            store_jobs[job_id] = TransferJob(
                req_id=h.req_id,
                src_spec=GPULoadStoreSpec([h.block_id], group_sizes=sizes, block_indices=indices),
                dst_spec=out.store_spec,
            )
            self._events_tracker.record_store(req, cfg, h.boundary // cfg.tokens_per_chunk - 1, key)
        return store_jobs

    def _status(self, req_id: str) -> RequestOffloadState | None:
        status = self._req_status.get(req_id)
        if status is None and req_id in self._held:
            status = self._held[req_id].status
        return status

    # ------------------------------------------------------------------ reset

    def _reset_cache(self) -> None:
        for job_id in self._early_store_jobs:  # never reached a worker: nothing to fence
            job = self._jobs.pop(job_id, None)
            if job is not None:
                st = self._req_status.get(job.req_id)
                if st is not None:
                    st.transfer_jobs.discard(job_id)
                # early jobs are of finished requests: both kinds of fence were registered
                self._remove_pending_job(job_id, job.fenced_block_ids)
                self._remove_pending_job(job_id, job.deferred_fence_block_ids)
        self._early_store_jobs = {}
        for req_id in list(self._held):
            self._unhold(req_id)
        self._handoffs = []
        super()._reset_cache()
        for req_id in list(self._ledgers):
            if req_id in self._req_status:
                for led in self._ledgers[req_id]:
                    led.reset()
            else:
                del self._ledgers[req_id]


def _prefix_results(manager: Any, keys: Sequence[OffloadKey], ctx: ReqContext) -> Iterator[LookupResult]:
    """``manager.lookup`` of each key in order, lazily: the caller stops at the first miss."""
    for key in keys:
        yield manager.lookup(key, ctx)


def _leading_nulls(blocks: tuple[int, ...]) -> int:
    n = 0
    for b in blocks:
        if b:
            break
        n += 1
    return n


def _positive(extra: dict[str, Any], name: str, default: int, *, allow_zero: bool = False) -> int:
    value = extra.get(name, default)
    _check_int(f"kv_connector_extra_config.{name}", value, 0 if allow_zero else 1)
    return int(value)


class TieredKVConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` whose scheduler side is :class:`TieredKVConnectorScheduler`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        spec = OffloadingSpecFactory.create_spec(offloading_config)
        self.connector_scheduler: TieredKVConnectorScheduler | None = None  # type: ignore[assignment]
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TieredKVConnectorScheduler(spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's, plus the held requests the scheduler side released (``finished_sending``)."""
        sending, recving = super().get_finished(finished_req_ids)
        holds = getattr(self._connector_metadata, "finished_holds", None)
        if holds:
            sending = set(sending or ()) | holds
        return sending, recving

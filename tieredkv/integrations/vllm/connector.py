"""``TieredKVConnector``: vLLM 0.33's ``OffloadingConnector`` with tieredkv's store planning.

vLLM's worker side, wire format (``OffloadingConnectorMetadata``, ``TransferJob``,
``GPULoadStoreSpec``) and request/job bookkeeping (``_req_status``, ``_jobs``, fences, events,
stats) are kept; any ``OffloadingSpec`` works behind it (tieredkv's, vLLM's ``CPUOffloadingSpec``,
``TieringOffloadingSpec`` with tieredkv secondary tiers). What changes is what the scheduler
side decides. It decides nothing itself: :class:`TieredKVConnectorScheduler` is an adapter from
vLLM's scheduler hooks to tieredkv's planner core (:mod:`tieredkv.planner`: the ledgers, store
planner, hold book, hand-off queue and hit alignment the library's ``OffloadScheduler``, the demo
and ``store.planner()`` plan with too). The rules, as vLLM users see them:

* **Per-group ledgers instead of one cursor.** A chunk is done when the manager accepted it or
  left it out of ``keys_to_store`` (vLLM's contract: it holds it already, or declines it, e.g.
  vLLM's ``store_threshold`` admission); refused chunks (``prepare_store`` → ``None``) stay
  waiting and are offered again, oldest first, at most ``max_store_keys_per_step`` keys per
  request and step (``retry_left_out_keys``: a key left out and not held counts as refused, for a
  manager that leaves keys out for lack of room). Chunks already done are never offered again
  (GPU-only prefix hits and resumes used to re-offer every chunk from 0).
* **The manager's ``RequestOffloadingContext`` is honoured**: under ``REQUEST_LEVEL`` (a tier that
  supplies peers needs every chunk of the request) loaded prefix chunks are offered to
  ``prepare_store`` like the rest, as vLLM's connector offers them; under ``CHUNK_LEVEL`` they are
  done.
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
  stored (evicted since) makes it storable again, with every later chunk counted as stored (the
  lookup stops at its first miss, so it confirmed none of them), as the library planner does.
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
GPU pool; 0 never holds), ``retry_left_out_keys`` (false).

vLLM's own offloading-connector unit suite runs against this class (``./scripts/test-vllm``,
``tests/vllm/peer/``); the vLLM names it builds on come from
:mod:`~tieredkv.integrations.vllm.compat`, behind the version gate.

Loaded by vLLM as ``"kv_connector": "TieredKVConnector", "kv_connector_module_path":
"tieredkv.integrations.vllm"``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

from tieredkv.errors import ConfigError
from tieredkv.groups import _check_int
from tieredkv.integrations.vllm.compat import (
    ALLOCATION_FAILURE,
    GroupOffloadConfig,
    KVCacheConfig,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    LookupResult,
    OffloadingConnector,
    OffloadingConnectorMetadata,
    OffloadingConnectorScheduler,
    OffloadingConnectorWorker,
    OffloadingSpec,
    OffloadingSpecFactory,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    Request,
    RequestOffloadState,
    RequestStatus,
    SchedulerOutput,
    TransferJob,
    VllmConfig,
    build_offloading_config,
    check_scheduler,
)
from tieredkv.integrations.vllm.connector_jobs import boundary_job, chunks_job, drop_unsent_jobs
from tieredkv.integrations.vllm.tenants import set_request_tenant
from tieredkv.planner import (
    ChunkToStore,
    GroupFacts,
    Handoff,
    HandoffQueue,
    HoldBook,
    RequestStore,
    StorePlanner,
    align_hit,
    drop_reused_blocks,
    split_answer,
)
from tieredkv.planner.ledger import DEAD
from tieredkv.planner.store import final_segment

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
    keys_left_out: int = 0  # offered, left out of keys_to_store: held already or declined (admission)
    keys_retried: int = 0  # offered again after a refusal (or, retry_left_out_keys, a partial answer)
    refusals: int = 0  # prepare_store returned None
    partial_accepts: int = 0  # answers that left some offered keys out
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


class TieredKVConnectorScheduler(OffloadingConnectorScheduler):
    """The scheduler side: vLLM's bookkeeping; store planning and hit alignment by the planner core.

    Each hook hands the core what vLLM knows (keys, block ids, storable chunks, the blocks a later
    lookup reads) and turns its answers into vLLM's jobs, fences and events.
    """

    _step_region: contextlib.ExitStack | None  # vLLM's: the step's region, open from its first lookup

    def __init__(self, spec: OffloadingSpec, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        check_scheduler(self)
        grid = self._mamba_align_size
        config: Any = self.config  # type: ignore[has-type]  # set by vLLM's __init__ (untyped here)
        if grid is not None and config.alignment_tokens is not None:
            # Hits land on the Mamba grid, so the sliding-window chunks worth storing are the ones
            # a boundary on that grid needs (vLLM aligns them to the full-attention chunk only).
            self.config = config._replace(alignment_tokens=math.lcm(grid, config.alignment_tokens))
        extra = spec.extra_config or {}
        self.max_store_keys_per_step = _positive(extra, "max_store_keys_per_step", 256)
        self.hold_finished_steps = _positive(extra, "hold_finished_steps", 16, allow_zero=True)
        self.hold_max_blocks = _positive(
            extra, "hold_max_blocks", max(1, kv_cache_config.num_blocks // 2), allow_zero=True
        )
        #: A key left out of ``keys_to_store`` and not held by the manager: declined (vLLM's
        #: contract, the default) or refused for lack of room, offered again (opt in, for a manager
        #: that leaves keys out rather than answering None; it defeats a manager's admission).
        self.retry_left_out_keys = _boolean(extra, "retry_left_out_keys", False)
        self.counters = ConnectorCounters()
        #: The planner core's store rules: each group of a request gets an even share of the step's
        #: key budget; sliding-window chunks whose leading blocks left the window are stored.
        self.store_planner = StorePlanner(
            max_chunks=self.max_store_keys_per_step, shared=False, adaptive=False, partial_chunks=True
        )
        self._groups = self.config.kv_group_configs
        self._tpc = tuple(c.tokens_per_chunk for c in self._groups)
        self._pos_of_group = {c.group_idx: pos for pos, c in enumerate(self._groups)}
        self._stores: dict[str, RequestStore] = {}  # per request: its ledgers
        self._holds: HoldBook[RequestOffloadState] = HoldBook(self.hold_finished_steps, self.hold_max_blocks)
        self._release: set[str] = set()
        self._last_passed: set[str] = set()  # finished requests whose last pass request_finished ran
        self._handoffs = HandoffQueue(self.hold_finished_steps)
        # store jobs made outside schedule() (a finished request's last pass), sent with the next
        # step's metadata
        self._early_store_jobs: dict[int, TransferJob] = {}

    # vLLM's suite builds a scheduler side without ``__init__`` (``object.__new__``) and sets only
    # what vLLM's methods read; vLLM declares ``_step_region`` on its class for that. The same here
    # for what this class's overrides of those methods read: an empty, read-only default.
    _stores: dict[str, RequestStore] = MappingProxyType({})  # type: ignore[assignment]
    _pos_of_group: dict[int, int] = MappingProxyType({})  # type: ignore[assignment]

    def _acquire_step(self) -> None:
        # vLLM opens the step's region (an ExitStack entering ``self.manager.lock``) at the step's
        # first lookup and closes it in build_connector_meta. The lock is read as vLLM reads it, from
        # the manager, each time (a property or an attribute set per instance); when it is vLLM's
        # no-op (tieredkv's manager: its state is the scheduler thread's) the region holds nothing,
        # so one empty stack marks it open on every step.
        if self._step_region is None and type(self.manager.lock) is contextlib.nullcontext:
            self._step_region = _EMPTY_REGION
            return
        super()._acquire_step()

    def _manager_locked(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        # vLLM's is a generator context manager around ``manager.lock``, entered by several hooks
        # on every step (stats, worker output, events): with vLLM's no-op lock and no step region
        # left open it does nothing, at the cost of a generator and two context managers a hook.
        if self._step_region is None and type(self.manager.lock) is contextlib.nullcontext:
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

    def _store_of(self, req_id: str) -> RequestStore:
        store = self._stores.get(req_id)
        if store is None:
            store = self._stores[req_id] = self.store_planner.new_request(len(self._groups))
        return store

    @staticmethod
    def _sync_cursors(status: RequestOffloadState, store: RequestStore) -> None:
        # vLLM zeroes re-allocated sliding-window block ids from next_stored_chunk_idx on: keep it
        # at the lowest chunk not done, so waiting chunks are covered.
        for gs, led in zip(status.group_states, store.ledgers):
            gs.next_stored_chunk_idx = led.cursor

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        store = self._stores.get(request.request_id)
        if store is not None:  # a resume: chunks passed as never storable may become whole
            store.resume()
        return super().get_num_new_matched_tokens(request, num_computed_tokens, max_num_new_tokens)

    def _lookup_complete_chunks(
        self, req_status: RequestOffloadState, max_num_new_tokens: int | None = None
    ) -> int | None:
        grid = self._mamba_align_size
        lookup = super()._lookup_complete_chunks
        if grid is None:
            return lookup(req_status, max_num_new_tokens)
        return align_hit(
            partial(lookup, req_status),
            req_status.num_locally_computed_tokens,
            grid,
            max_num_new_tokens,
            on_shrink=self._realigned,
        )

    def _realigned(self) -> None:
        self.counters.hits_realigned += 1

    def _maximal_prefix_lookup(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        req: Request,
        group_config: GroupOffloadConfig,
        start_chunk_idx: int,
    ) -> int | None:
        # Reads what vLLM's reads (the manager, the events tracker): vLLM's suite calls it on a
        # stand-in holding only those. A manager that answers a prefix scan in one call (tieredkv's)
        # is asked once; any other key by key.
        prefix = getattr(self.manager, "lookup_prefix", None)
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
                    _feed_miss(self, req.request_id, group_config.group_idx, start_chunk_idx + hit_count)
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
                _feed_miss(self, req.request_id, group_config.group_idx, start_chunk_idx + i)
                break
        return None if deferred else hit_count

    def _missed(self, req_id: str, group_idx: int, chunk: int) -> None:
        """A full-attention lookup missed ``chunk``: the core forgets it if it counted it stored
        (evicted since), and every later chunk counted stored, which the lookup did not confirm."""
        store = self._stores.get(req_id)
        pos = self._pos_of_group.get(group_idx)
        if store is not None and pos is not None:
            self.counters.ledger_forgets += store.ledgers[pos].missed(chunk, full=True)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if not num_external_tokens:
            return
        status = self._req_status[request.request_id]
        if status.offloading_context.policy is not OffloadPolicy.CHUNK_LEVEL:
            # The manager's RequestOffloadingContext asks for the whole request (REQUEST_LEVEL: a
            # tier that supplies peers needs every chunk): the loaded prefix is offered to
            # prepare_store like any other chunk, as vLLM's connector does.
            return
        # Chunk level: the loaded chunks and the local prefix before them are held by the store:
        # done (vLLM moves its cursor past both).
        boundary = status.num_locally_computed_tokens + num_external_tokens
        self._store_of(request.request_id).loaded(0, boundary, self._tpc)

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
        for req_id in self._holds:
            if req_id in seen:
                continue
            held = self._holds.step(req_id)
            self.counters.held_steps += 1
            self._store_pass(held.state, 0, store_jobs)
            if self._holds.expired(req_id, self._outstanding(req_id)):
                self._unhold(req_id)
        for req_id in scheduler_output.finished_req_ids or ():
            if req_id in self._last_passed:
                self._last_passed.discard(req_id)
            elif req_id not in self._holds and (status := self._req_status.get(req_id)) is not None:
                # finished without request_finished (vLLM's suite drives the scheduler side so):
                # its last pass here, as vLLM's connector runs it
                self._store_pass(status, 0, store_jobs)
            if req_id not in self._holds:
                self._stores.pop(req_id, None)
        return store_jobs

    def _store_pass(
        self, status: RequestOffloadState, num_scheduled_tokens: int, store_jobs: dict[int, TransferJob]
    ) -> None:
        """One store pass over a request: the core plans, the manager is offered its chunks."""
        req = status.req
        if any(not self._jobs[j].is_store and not self._jobs[j].is_sync_load for j in status.transfer_jobs):
            return  # an async load is in flight (vLLM never stores next to one)
        finished = req.is_finished()
        if req.status is RequestStatus.FINISHED_ABORTED:
            frontier = req.num_computed_tokens
        elif finished:
            frontier = max(req.num_prompt_tokens, req.num_tokens - 1)
        else:
            frontier = req.num_computed_tokens + num_scheduled_tokens
        offloadable = self._calc_num_offloadable_tokens(status, frontier)
        store = self._store_of(req.request_id)
        if finished and self.config.retention_interval is None:
            self._reconsider_final_tail(status, store, offloadable)
        bpc = self.config.blocks_per_chunk
        new_facts = tuple.__new__  # GroupFacts(...) without its Python-level __new__
        facts: list[GroupFacts | None] = []
        prompt_offloadable: int | None = None
        reachable: tuple[int, ...] = ()
        for cfg, gs, led in zip(self._groups, status.group_states, store.ledgers):
            limit = 0 if cfg.requires_cow_source else status.storable_chunks(cfg, gs, offloadable)
            if limit <= led.cursor:  # Mamba "align" states come as boundary hand-offs; or nothing to plan
                facts.append(None)
                continue
            if prompt_offloadable is None:
                prompt_offloadable = self._calc_num_offloadable_tokens(status, req.num_prompt_tokens)
                if self.config.retention_interval is not None:
                    reachable = (req.num_prompt_tokens - 1,)
                    if req.shared_prefix_boundary:
                        reachable += (req.shared_prefix_boundary,)
            reach = partial(self._reach, cfg, prompt_offloadable // cfg.tokens_per_chunk, finished, reachable)
            # vLLM never hands a freed block back: a chunk not whole enough now never will be
            facts.append(new_facts(GroupFacts, (gs.offload_keys, gs.block_ids, bpc, limit, sys.maxsize, reach, False)))
        if prompt_offloadable is not None:  # a group has chunks to plan
            offers = self.store_planner.plan(store, facts, self.counters)
            if any(offers):
                self._offer(status, store, offers, store_jobs)  # reads no cursor: synced once, after it
        self._sync_cursors(status, store)

    def _reconsider_final_tail(self, status: RequestOffloadState, store: RequestStore, offloadable: int) -> None:
        """vLLM's final sliding-window tail: a request that ends off its prompt's end (an abort, a
        decode) makes reachable the chunks of its last alignment segment that a lookup could not
        reach while the prompt's end bounded it. Those passed as dead are visited again (with the
        finished request's mask): the ledger's scan goes back to the segment's start."""
        req, bpc = status.req, self.config.blocks_per_chunk
        prompt_tokens = self._calc_num_offloadable_tokens(status, req.num_prompt_tokens)
        for cfg, gs, led in zip(self._groups, status.group_states, store.ledgers):
            if cfg.sliding_window_size_in_chunks is None or cfg.requires_cow_source:
                continue
            align = self._final_swa_alignment_blocks(cfg)
            limit = status.storable_chunks(cfg, gs, offloadable)
            if align is None or limit == prompt_tokens // cfg.tokens_per_chunk:
                continue
            horizon_blocks = limit * bpc
            start = (horizon_blocks - horizon_blocks % align) // bpc
            if start < led.scan and DEAD in led.status[start : led.scan]:
                led.scan = start

    def _reach(
        self,
        cfg: GroupOffloadConfig,
        prompt_chunks: int,
        finished: bool,
        reachable: tuple[int, ...],
        lo: int,
        limit: int,
    ) -> list[bool] | None:
        """vLLM's mask of the blocks of chunks ``lo .. limit - 1`` a later lookup may read."""
        open_ended = self.config.retention_interval is not None or cfg.is_eagle_group
        horizon = final_segment(limit, prompt_chunks, finished=finished, open_ended=open_ended)
        mask = self._reachable_store_block_mask(cfg, lo, limit, horizon, reachable)
        if mask is None and cfg.sliding_window_size_in_chunks is not None:
            # vLLM's None: every block is read, a null one too. Said so explicitly, so that the
            # planner stores no windowed chunk with a null block a lookup reads (its unwritten
            # sub-block would be loaded as KV behind a spec that stores chunks whole).
            return [True] * ((limit - lo) * self.config.blocks_per_chunk)
        return mask

    def _offer(
        self,
        status: RequestOffloadState,
        store: RequestStore,
        offers: list[list[ChunkToStore]],
        store_jobs: dict[int, TransferJob],
    ) -> None:
        """Offer the planned chunks to the manager; the core settles its answer; a store job
        carries what it accepted."""
        ctx = status.req_context
        keys = [c.key for chunks in offers for c in chunks]
        self.counters.store_passes += 1
        self.counters.keys_offered += len(keys)
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            self.counters.refusals += 1
            self._connector_stats.increase_counter(ALLOCATION_FAILURE)
            self.store_planner.settle(store, ())  # every offer stays waiting
            return
        accepted = set(out.keys_to_store)
        self.counters.keys_accepted += len(accepted)
        done: set[OffloadKey] = accepted
        if len(accepted) < len(keys):
            self.counters.partial_accepts += 1
            if self.retry_left_out_keys:  # held ones are done, the rest refused: offered again
                answer = split_answer(keys, accepted, partial(self._present, ctx))
                self.counters.keys_left_out += len(answer.present)
                done = accepted.union(answer.present)
            else:
                # vLLM's contract: keys_to_store are the offered keys that need storing; one left
                # out is held already or declined (vLLM's store_threshold admission: offering it
                # again would count as one more sighting). Settled: not offered again. A manager
                # that cannot take the batch now answers None (above).
                self.counters.keys_left_out += len(keys) - len(accepted)
                done = set(keys)
        self.store_planner.settle(store, done)
        if accepted:
            job_id, store_jobs[job_id] = chunks_job(self, status, offers, accepted, out.store_spec)

    def _present(self, ctx: ReqContext, key: OffloadKey) -> bool:
        """Whether the manager holds ``key`` (a key it left out of ``keys_to_store``)."""
        return self.manager.lookup(key, ctx) in _PRESENT

    def _outstanding(self, req_id: str) -> int:
        """Chunks and boundary states of the request the store has not taken yet."""
        store = self._stores.get(req_id)
        return (0 if store is None else store.num_waiting) + self._handoffs.count(req_id)

    # ------------------------------------------------------------------ finished requests

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request)
        status = self._req_status.get(request.request_id)
        if status is None:
            return delay, params
        with self._manager_locked():
            self._store_pass(status, 0, self._early_store_jobs)
        self._last_passed.add(request.request_id)
        if self._outstanding(request.request_id) == 0:
            return delay, params
        num_blocks = len({b for gs in status.group_states for b in gs.block_ids if b})
        if self._holds.hold(request.request_id, status, num_blocks):  # its blocks wait for the retries
            self.counters.held_requests += 1
            return True, params
        self._give_up(request.request_id, held=False)
        return delay, params

    def _unhold(self, req_id: str) -> None:
        self._give_up(req_id)
        self._holds.release(req_id)
        self._release.add(req_id)

    def _give_up(self, req_id: str, held: bool = True) -> None:
        """The request's blocks go back: its waiting chunks are lost (counted)."""
        store = self._stores.pop(req_id, None)
        lost = 0 if store is None else store.num_waiting
        if held:
            self.counters.chunks_given_up += lost
        else:
            self.counters.chunks_unheld += lost

    def _drop_reused_held_blocks(self) -> None:
        """A held request's freed sliding-window blocks may be reallocated: never store them."""
        allocated = self._current_batch_allocated_block_ids
        if not allocated or not self._holds:
            return
        bpc = self.config.blocks_per_chunk
        for req_id, held in self._holds.held.items():
            store = self._stores.get(req_id)
            if store is None:
                continue
            for cfg, gs, led in zip(self._groups, held.state.group_states, store.ledgers):
                if cfg.sliding_window_size_in_chunks is not None:
                    drop_reused_blocks(led, gs.block_ids, bpc, allocated)

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
        return bool(self._holds or self._release or self._early_store_jobs) or super().has_pending_push_work()

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
        new = (Handoff(req_id, g, b, n) for req_id, entries in handoffs.items() for g, b, n in entries)
        pending, gone, given_up = self._handoffs.due(
            new, self._current_batch_allocated_block_ids, lambda req_id: self._status(req_id) is not None
        )
        self.counters.handoffs_blocks_gone += gone
        self.counters.handoffs_given_up += given_up
        store_jobs: dict[int, TransferJob] = {}
        # a group's transfer slot, from the config as it is now (as vLLM's does)
        slot_of_group = {c.group_idx: pos for pos, c in enumerate(self.config.kv_group_configs)}
        for h in pending:
            status = self._status(h.req_id)
            pos = slot_of_group.get(h.group_idx)
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
            ctx = status.req_context
            out = self.manager.prepare_store([key], ctx)
            if out is None or (
                not out.keys_to_store and self.retry_left_out_keys and not self._present(ctx, key)
            ):  # refused (see _offer)
                self.counters.refusals += out is None
                self._connector_stats.increase_counter(ALLOCATION_FAILURE)
                self._handoffs.refuse(h)  # offered again next step
                continue
            if not out.keys_to_store:  # held already, or declined (see _offer)
                self.counters.keys_left_out += 1
                continue
            self.counters.keys_accepted += 1
            job_id, store_jobs[job_id] = boundary_job(
                self, status, pos, cfg, h.block_id, h.boundary, key, out.store_spec
            )
        return store_jobs

    def _status(self, req_id: str) -> RequestOffloadState | None:
        status = self._req_status.get(req_id)
        if status is None:
            status = self._holds.get(req_id)
        return status

    # ------------------------------------------------------------------ reset

    def _reset_cache(self) -> None:
        drop_unsent_jobs(self, self._early_store_jobs)  # never reached a worker: nothing to fence
        self._early_store_jobs = {}
        self._last_passed.clear()
        for req_id in self._holds:
            self._unhold(req_id)
        self._handoffs.clear()
        super()._reset_cache()
        for req_id in list(self._stores):
            if req_id in self._req_status:
                self._stores[req_id].reset(self.store_planner.max_chunks)
            else:
                del self._stores[req_id]


def _feed_miss(sched: Any, req_id: str, group_idx: int, chunk: int) -> None:
    """A lookup's miss to the scheduler's ledgers (:meth:`TieredKVConnectorScheduler._missed`);
    vLLM's suite runs ``_maximal_prefix_lookup`` on a stand-in that has none."""
    missed = getattr(sched, "_missed", None)
    if missed is not None:
        missed(req_id, group_idx, chunk)


def _prefix_results(manager: Any, keys: Sequence[OffloadKey], ctx: ReqContext) -> Iterator[LookupResult]:
    """``manager.lookup`` of each key in order, lazily: the caller stops at the first miss."""
    for key in keys:
        yield manager.lookup(key, ctx)


def _boolean(extra: dict[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config.{name}={value!r} is invalid: expected true or false")
    return value


def _positive(extra: dict[str, Any], name: str, default: int, *, allow_zero: bool = False) -> int:
    value = extra.get(name, default)
    _check_int(f"kv_connector_extra_config.{name}", value, 0 if allow_zero else 1)
    return int(value)


class TieredKVConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` whose scheduler side is :class:`TieredKVConnectorScheduler`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
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

"""The scheduler side of :class:`~tieredkv.integrations.vllm.spec.TieredKVOffloadingSpec`:
:class:`TieredKVManager`, vLLM's ``OffloadingManager`` over tieredkv's tiers (every call returns
at once; lookups answer from the store's probe or a batched asynchronous existence check)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.integrations.vllm.controls import RequestControls, Retain, request_controls, retain_keys
from tieredkv.integrations.vllm.events import KVEvents
from tieredkv.integrations.vllm.lookups import AsyncLookups, request_offload_keys
from tieredkv.integrations.vllm.namespace import new_generation
from tieredkv.integrations.vllm.shared import TieredKVLoadStoreSpec, acquire_store, release_store
from tieredkv.integrations.vllm.stats import StoreStatsReporter, hit_source
from tieredkv.integrations.vllm.tenants import request_tenant
from tieredkv.keys import GROUP_SUFFIX, group_suffix, key_group, partial_chunk_key, stored_key, with_group
from tieredkv.pipeline import KeyState
from tieredkv.store import TieredStore

if TYPE_CHECKING:
    from tieredkv.integrations.vllm.spec import TieredKVOffloadingSpec

__all__ = ["TieredKVManager"]

log = logging.getLogger(__name__)

_HIT, _HIT_PENDING, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS  # read once per lookup
_KS_HIT, _KS_PENDING, _KS_MISS = KeyState.HIT, KeyState.PENDING, KeyState.MISS
_UNSPECIFIED = CacheHitSource.EXTERNAL_UNSPECIFIED
_MIXED = object()  # a route whose tiers' media differ: ask which tier holds the key


def _route_source(store: TieredStore, route: tuple[str, ...]) -> Any:
    """The hit source of a route whose tiers share one medium, else ``_MIXED``."""
    sources = {hit_source(store.tier_medium(name)) for name in route}
    return sources.pop() if len(sources) == 1 else _MIXED


class TieredKVManager(OffloadingManager):
    """Scheduler-side bookkeeping over tieredkv's tiers; every call returns at once.

    * ``lookup`` answers from a batched, asynchronous existence check (RETRY until it is known);
      a sliding-window or Mamba chunk is also found as a partial record (leading sub-blocks
      invalid), which ``prepare_load`` then names for the worker.
    * ``prepare_store`` defers (``None``) only batches of full-attention keys, which vLLM offers
      again; a batch with a sliding-window or Mamba key is always accepted (vLLM may never offer
      it again), even past ``max_inflight_store_chunks`` (the worker queues what staging cannot
      take yet). Every deferred key is counted.
    * ``reset_cache`` (sleep, weight update) starts a new cache generation: a fresh namespace
      fingerprint, so nothing stored before it can be hit (``keep_on_reset`` turns that off).
    * ``has_pending_work`` is true only while lookups are queued and not yet sent.
    """

    def __init__(self, spec: TieredKVOffloadingSpec) -> None:
        self.spec = spec
        self._sh = acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
        self.store = self._sh.store
        self._probe = self.store.probe
        self._probe_prefix = self.store.probe_prefix
        self._cap = spec.max_inflight_store_chunks
        self._bpc = int(spec.blocks_per_chunk)
        self._windowed = {i for i, k in enumerate(spec.group_kinds) if k != "full"}
        # group suffixes of the keys that may also be found as a partial record (several candidates)
        self._partial_groups = frozenset(group_suffix(g) for g in self._windowed) if self._bpc > 1 else frozenset()
        self._num_groups = len(spec.group_kinds)
        self._writing: collections.Counter[bytes] = collections.Counter()
        self._inflight = 0
        self._stored: dict[bytes, None] = {}  # written by this engine, not since seen missing
        self._group_sources: dict[bytes, Any] = {}  # group suffix -> its route's source, or _MIXED
        self._common_source: Any = None  # the source of every group's route if one, else _MIXED
        self._chosen: dict[bytes, bytes] = {}  # whole-chunk key -> the record a HIT found (partial or whole)
        self._loading: dict[bytes, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._lookups = AsyncLookups(
            self.store.lookup_async, probe_now=self.store.probe_many, request_keys=self._request_keys
        )
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._stats = StoreStatsReporter(lambda: [self.store])
        self._stats_at = float("-inf")
        #: requests with a load tier filter that leaves out some of the store's tiers -> controls
        self._load_filtered: dict[str, RequestControls] = {}
        #: batched lookups over some tiers only, by the tier names they may ask
        self._lookups_among: dict[frozenset[str], AsyncLookups] = {}
        #: KV events of the tiers (:mod:`~tieredkv.integrations.vllm.events`), while vLLM's are on.
        self._events: KVEvents | None = (
            KVEvents(
                self.store,
                self._writing,
                primary=True,
                partial_groups=self._partial_groups,
                blocks_per_chunk=self._bpc,
            )
            if spec.kv_events_config.enable_kv_cache_events
            else None
        )

    def get_stats(self) -> Any:
        """tieredkv's counter increments since the last report (an ``OffloadingConnectorStats`` or
        None); vLLM's scheduler side calls this every step and adds them to its connector stats.

        A step on which nothing finished (no job, write-back or batched lookup ended since the
        last read: ``TieredStore.activity``) costs a few attribute reads. Otherwise, while
        transfers or lookups are in flight, the counters are read at most every
        ``stats_interval_s`` (the increments add up, nothing is lost, they only show up to that
        much later); once nothing is in flight they are read on the next call, so an idle engine
        has reported everything."""
        if not self._stats.moved():  # most steps: nothing finished since the last read
            return None
        interval = self.spec.stats_interval_s
        if interval:
            now = time.monotonic()
            if now - self._stats_at < interval and not self._quiet():
                return None
            self._stats_at = now
        return self._stats.take()

    def _quiet(self) -> bool:
        """Nothing of this engine's is in flight: no store or load between prepare and complete,
        no lookup queued or unanswered, no job in the store's pipeline."""
        return not self._inflight and not self._loading and not self._lookups.busy() and self.store.drain(0)

    @property
    def _fp(self) -> bytes:
        return self._sh.fingerprint

    def _candidates(self, key: bytes, skey: bytes) -> list[bytes]:
        if key[GROUP_SUFFIX] not in self._partial_groups:
            return [skey]
        return [skey] + [stored_key(self._fp, partial_chunk_key(bytes(key), v)) for v in range(1, self._bpc)]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # vLLM's scheduler asks every key of every waiting request on every step: this path is
        # kept to a few dict lookups and one call into the store (its probe).
        if self._load_filtered and req_context.req_id in self._load_filtered:
            return self._lookup_filtered(key, req_context)
        skey = self._sh.skeys[key]
        if skey in self._writing:
            return _HIT_PENDING
        if self._partial_groups and key[GROUP_SUFFIX] in self._partial_groups:
            return self._lookup_partial(key, skey, req_context)
        state = self._probe(skey)  # a store in flight is pending, then the tiers that can tell
        if state is _KS_HIT:
            return _HIT
        if state is _KS_MISS:
            self._stored.pop(skey, None)
            return _MISS
        if state is None:
            known = self._lookups.answer(skey, req_context)
            return _HIT if known == "hit" else self._not_hit(key, skey, (known,))
        return self._not_hit(key, skey, (state,))

    def lookup_prefix(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> list[LookupResult]:
        """:meth:`lookup` of each key in order, up to and including the first MISS: a connector's
        prefix scan of a group in one call (``TieredKVConnector`` calls this; it is what ``lookup``
        answers, key by key). The store probes the run of keys in one call
        (``TieredStore.probe_prefix``: one route plan, one count); a key it cannot answer goes to
        the batched lookups, as in ``lookup``, and the scan goes on after it."""
        keys = list(keys)
        partial = self._partial_groups
        if (partial and any(k[GROUP_SUFFIX] in partial for k in keys)) or (
            self._load_filtered and req_context.req_id in self._load_filtered
        ):
            return self._lookup_each(keys, req_context)
        skeys = list(map(self._sh.skeys.__getitem__, keys))
        probe_prefix, answer, writing = self._probe_prefix, self._lookups.answer, self._writing
        out: list[LookupResult] = []
        i, n = 0, len(skeys)
        while i < n:
            states = probe_prefix(skeys, i, writing)
            k, last = states.count(_KS_HIT), states[-1]  # count: identity tests, in C
            if last is not _KS_PENDING and k == len(states) - (last is not _KS_HIT):
                # the usual scan: hits, then perhaps one other answer (a miss, or one to ask elsewhere)
                out += [_HIT] * k
                i += k
                states = states[k:]
            for state in states:
                if state is _KS_HIT:
                    out.append(_HIT)
                elif state is _KS_PENDING:
                    out.append(_HIT_PENDING)
                elif state is _KS_MISS:
                    self._stored.pop(skeys[i], None)
                    out.append(_MISS)
                    return out
                else:
                    known = answer(skeys[i], req_context)  # None: not known in this step
                    result = _HIT if known == "hit" else self._not_hit(keys[i], skeys[i], (known,))
                    out.append(result)
                    if result is _MISS:
                        return out
                i += 1
        return out

    def _lookup_each(self, keys: list[OffloadKey], req_context: ReqContext) -> list[LookupResult]:
        """:meth:`lookup_prefix` key by key (a scan with keys that may be found as partial records)."""
        out: list[LookupResult] = []
        for key in keys:
            result = self.lookup(key, req_context)
            out.append(result)
            if result is _MISS:
                break
        return out

    def _lookup_partial(self, key: bytes, skey: bytes, req_context: ReqContext) -> LookupResult:
        """A sliding-window or Mamba key with several chunks per block: the whole record, else
        a partial one (leading sub-blocks invalid)."""
        answer = self._lookups.answer
        states = self._first_hit(key, skey, lambda cand: self._probe(cand) or answer(cand, req_context))
        return _HIT if states is None else self._not_hit(key, skey, states)

    def _first_hit(self, key: bytes, skey: bytes, state_of: Callable[[bytes], str | None]) -> list[str | None] | None:
        """The state of each of ``key``'s record candidates in order, or None as soon as one is a
        hit (the candidate chosen for ``skey`` kept, for the load)."""
        states: list[str | None] = []
        for cand in self._candidates(key, skey):
            state = state_of(cand)
            if state == "hit":
                if cand != skey:
                    if len(self._chosen) > 65536:
                        self._chosen.clear()
                    self._chosen[skey] = cand
                return None
            states.append(state)
        return states

    def _request_keys(self, req_context: ReqContext) -> list[bytes]:
        """The stored keys (and partial-record candidates) of every key vLLM recorded for the
        request: what its lookups may ask this step, answered at once where a tier can
        (``AsyncLookups``' in-step batch)."""
        sk, partial = self._sh.skeys, self._partial_groups
        out: list[bytes] = []
        for k in request_offload_keys(req_context):
            s = sk[k]
            if partial and k[GROUP_SUFFIX] in partial:
                out += self._candidates(k, s)
            else:
                out.append(s)
        return out

    def _not_hit(self, key: bytes, skey: bytes, states: Sequence[str | None]) -> LookupResult:
        if None in states:
            self.counters["lookup_retry"] += 1
            self._prefetch_other_groups(key)
            return LookupResult.RETRY
        if "pending" in states:
            return LookupResult.HIT_PENDING
        self._stored.pop(skey, None)
        return _MISS

    def _prefetch_other_groups(self, key: bytes) -> None:
        """Ask the tiers, in the same batch, for this hash in every other group: vLLM looks up the
        full-attention groups first and the sliding-window / Mamba groups after them (their keys
        share the hash bytes where chunk boundaries coincide), so their answers are there by the
        time it asks instead of costing the request another deferred step."""
        key = bytes(key)
        own = key_group(key)
        for g in range(self._num_groups):
            if g != own:
                other = with_group(key, g)
                for cand in self._candidates(other, stored_key(self._fp, other)):
                    self._lookups.prefetch(cand)

    # Keys are vLLM's ``OffloadKey`` (bytes): a stored key is ``fingerprint + key``, one
    # concatenation (``keys.stored_key`` copies both to bytes first).

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        sk = self._sh.skeys
        chosen, loading = self._chosen, self._loading
        skeys = list(map(sk.__getitem__, keys))
        stored = [chosen.pop(s, s) for s in skeys] if chosen else skeys
        for s, rec in zip(skeys, stored):
            loading[s].append(rec)
        self.store.pin(stored)
        self.counters["load_chunks"] += len(stored)
        if stored is not skeys:
            self.counters["load_partial_chunks"] += sum(r is not s for r, s in zip(stored, skeys))
        spec = TieredKVLoadStoreSpec(list(keys), sk.fp, stored, request_tenant(req_context))
        if self._load_filtered or self.store.retention.max_chunks:
            self._controls_load(spec, req_context)
        return spec

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        sk, loading = self._sh.skeys, self._loading
        recs = []
        for k in keys:
            skey = sk[k]
            q = loading.get(skey)
            if q:
                recs.append(q.popleft())
                if not q:
                    del loading[skey]
        if recs and not self._closed:
            self.store.unpin(recs)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        controls = req_context.get_state(RequestControls)
        if (controls is not None and not controls.plain) or self.store.admission_active:
            return self._prepare_store_controlled(keys, req_context, controls)
        return self._prepare_store(keys, req_context)

    def _prepare_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        tiers: frozenset[str] | None = None,
        controls: RequestControls | None = None,
    ) -> PrepareStoreOutput | None:
        sk, stored, writing = self._sh.skeys, self._stored, self._writing
        todo: list[OffloadKey] = []
        todo_skeys: list[bytes] = []
        for k in keys:
            s = sk[k]
            if s not in stored and s not in writing:
                todo.append(k)
                todo_skeys.append(s)
        if todo and self._inflight and self._inflight + len(todo) > self._cap:
            if not any(key_group(k) in self._windowed for k in todo):
                # Full-attention keys only: vLLM offers the same range again on a later step.
                self.counters["prepare_store_deferred"] += 1
                self.counters["store_keys_deferred"] += len(todo)
                return None
            # A sliding-window or Mamba key may never be offered again: take the batch; the
            # worker queues what the staging pool cannot hold yet.
            self.counters["store_over_cap_batches"] += 1
        if controls is not None and todo:
            todo, todo_skeys = self._admitted(todo, todo_skeys, controls)
        writing.update(todo_skeys)
        if self._events is not None and not self._events.key_len and todo:
            self._events.key_len = len(todo[0])
        self._inflight += len(todo)
        self.counters["store_chunks"] += len(todo)
        return PrepareStoreOutput(
            keys_to_store=todo,
            store_spec=TieredKVLoadStoreSpec(todo, sk.fp, todo_skeys, request_tenant(req_context), tiers),
            evicted_keys=[],
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        writing, stored = self._writing, self._stored
        skeys = list(map(self._sh.skeys.__getitem__, keys))
        unstored = self._sh.unstored
        for s in skeys:
            n = writing.get(s, 0)
            if n <= 0:
                continue
            self._inflight -= 1
            if n == 1:
                del writing[s]
            else:
                writing[s] = n - 1
            if s in unstored:
                unstored.discard(s)  # refused, dropped or partial: offer it again later
                self.counters["store_chunks_not_whole"] += 1
            elif success:
                stored[s] = None
        partial = self._partial_groups
        if partial:  # the record may be partial: its candidates' kept answers are stale too
            skeys = [
                c for k, s in zip(keys, skeys) for c in (self._candidates(k, s) if k[GROUP_SUFFIX] in partial else (s,))
            ]
        self._lookups.forget(skeys)
        while len(stored) > (1 << 20):
            stored.pop(next(iter(stored)))
        if self._lookups_among or self.store.retention.max_chunks:
            self._controls_stored(skeys, req_context, success)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The cache tier a hit is loaded from, for vLLM's hits-by-source metrics: the medium of
        the tier of the key's route that holds it (``host`` for the CPU tier, ``disk`` for
        LMDB); ``external_unspecified`` for a remote store (Redis: vLLM has no member for it)
        and when the tiers cannot tell without waiting. An attribute read when every group's route
        has one medium and the same; else one dict read for a route of one medium."""
        if self._load_filtered and req_context.req_id in self._load_filtered:
            return self._filtered_source(key, req_context)
        common = self._common_source
        if common is None:
            routes = {self.store.policy.get(g).tiers for g in range(self._num_groups)}
            found = {_route_source(self.store, route) for route in routes}
            common = self._common_source = found.pop() if len(found) == 1 else _MIXED
        if common is not _MIXED:
            return common  # every group's route has one medium, the same
        skey = self._sh.skeys[key]
        q = self._loading.get(skey)
        rec = q[-1] if q else skey  # the record prepare_load chose (whole or partial)
        source = self._group_sources.get(rec[GROUP_SUFFIX])
        if source is None:
            route = self.store.policy.get(key_group(rec)).tiers
            source = self._group_sources[rec[GROUP_SUFFIX]] = _route_source(self.store, route)
        if source is not _MIXED:
            return source
        name = self.store.locate(rec)
        return hit_source(self.store.tier_medium(name)) if name else _UNSPECIFIED

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._controls_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._load_filtered.pop(req_context.req_id, None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What the tiers came to hold and stopped holding since the last call, as vLLM's
        ``OffloadingEvent``s with each tier's medium (:mod:`~tieredkv.integrations.vllm.events`);
        nothing unless vLLM's KV cache events are on."""
        if self._events is None:
            return ()
        return self._events.take(self._sh.fingerprint)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()
        self._lookups.end_step()
        if self._lookups_among or self.store.retention:
            self._controls_schedule_end()

    def has_pending_work(self) -> bool:
        # Answers resolve on tieredkv's loop thread by themselves; a request waiting for one keeps
        # the engine stepping anyway. Only keys not yet sent need another on_schedule_end.
        return self._lookups.has_unsent() or any(lk.has_unsent() for lk in self._lookups_among.values())

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every transfer and lookup in flight has finished (False on timeout).

        Not part of vLLM's interface and never called by vLLM: for tests that model a forward
        pass longer than the tier I/O it overlaps, and for an orderly stop."""
        return (
            self.store.drain(timeout)
            and self._lookups.wait(timeout)
            and all(lk.wait(timeout) for lk in self._lookups_among.values())
        )

    def reset_cache(self) -> None:
        self._controls_reset(new_generation=not self.spec.keep_on_reset)
        self._stored.clear()
        self._chosen.clear()
        self._lookups.clear()
        self._writing.clear()
        self._inflight = 0
        self._sh.unstored.clear()
        if not self.spec.keep_on_reset:
            self._sh.namespace = new_generation(self._sh.namespace)
            self.counters["cache_generations"] += 1
            log.info(
                "tieredkv: cache reset; new cache generation %s (fingerprint %s)",
                self._sh.namespace.generation,
                self._sh.fingerprint.hex(),
            )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.clear()
        release_store(self.spec.store_ident)

    # ---- request controls: tier filters, hints, admission (integrations/vllm/controls.py) ----------

    def _controls_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Read the request's controls once (its hint actions counted); a request whose load filter
        leaves out some tiers is looked up over the others only; one that asks for retention gets
        ``REQUEST_LEVEL``, so vLLM offers every chunk of it, held ones included, and they are
        retained here."""
        controls = request_controls(req_context, self.store)
        if controls.load_tiers(self.store) is not None:
            if len(self._load_filtered) >= 1 << 16:  # requests never finished: forget the oldest
                self._load_filtered.pop(next(iter(self._load_filtered)))
            self._load_filtered[req_context.req_id] = controls
        if controls.retain is not None and not controls.stores_nothing:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def _lookups_for(self, names: frozenset[str]) -> AsyncLookups:
        lk = self._lookups_among.get(names)
        if lk is None:
            lk = self._lookups_among[names] = AsyncLookups(lambda keys: self.store.lookup_async(keys, tiers=names))
        return lk

    def _lookup_filtered(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """:meth:`lookup` for a request that may load from some tiers only: HIT only when one of
        them holds the chunk (a whole record, or a partial one for a windowed key); the load then
        reads those tiers only (:meth:`_controls_load`)."""
        names = self._load_filtered[req_context.req_id].load_tiers(self.store)
        skey = self._sh.skeys[key]
        if skey in self._writing:
            return _HIT_PENDING
        if names is None:
            return self.lookup(key, ReqContext(req_id=""))  # its filter leaves out no tier of this store
        if not self.store.route_among(key_group(key), names).tiers:
            self.counters["lookup_tier_filtered"] += 1
            return _MISS
        answer = self._lookups_for(names).answer
        states = self._first_hit(key, skey, lambda cand: self.store.probe_among(cand, names) or answer(cand))
        if states is None:
            return _HIT
        if None in states:
            self.counters["lookup_retry"] += 1
            return LookupResult.RETRY
        return LookupResult.HIT_PENDING if "pending" in states else _MISS

    def _filtered_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        names = self._load_filtered[req_context.req_id].load_tiers(self.store)
        route = (
            self.store.policy.get(key_group(key)) if names is None else self.store.route_among(key_group(key), names)
        )
        source = _route_source(self.store, route.tiers)
        return _UNSPECIFIED if source is _MIXED else source

    def _controls_load(self, spec: TieredKVLoadStoreSpec, req_context: ReqContext) -> None:
        """A filtered request's load reads its allowed tiers only; a retaining one's chunks are retained."""
        controls = req_context.get_state(RequestControls)
        if controls is None or controls.plain:
            return
        spec.tiers = controls.load_tiers(self.store)
        if controls.retain is not None:
            self._retain(spec.stored, controls.retain)

    def _prepare_store_controlled(
        self, keys: Collection[OffloadKey], req_context: ReqContext, controls: RequestControls | None
    ) -> PrepareStoreOutput | None:
        """``prepare_store`` of a request with controls, or under admission: a no-store request, and
        keys whose group has no tier the request's store filter allows, are left out (declined);
        held keys of a retaining request are retained (``REQUEST_LEVEL`` offers them); the rest go
        through admission and are stored in the allowed tiers only."""
        if controls is None:
            controls = request_controls(req_context, self.store)
        sk, stored, writing = self._sh.skeys, self._stored, self._writing
        if controls.stores_nothing:
            self.counters["store_keys_not_stored_by_request"] += len(keys)
            return PrepareStoreOutput(keys_to_store=[], store_spec=TieredKVLoadStoreSpec([], sk.fp), evicted_keys=[])
        names = controls.store_tiers(self.store)
        retain = controls.retain
        held: list[bytes] = []
        rest: list[OffloadKey] = []
        for k in keys:
            s = sk[k]
            # held: stored here, being written, or (a retaining request: REQUEST_LEVEL offers its
            # loaded prefix too) held by a tier
            if s in stored or s in writing or (retain is not None and self._probe(s) is _KS_HIT):
                held.append(s)
            elif names is not None and not self.store.route_among(key_group(k), names).tiers:
                self.counters["store_keys_tier_filtered"] += 1
            else:
                rest.append(k)
        if retain is not None and held:
            self._retain(held, retain)
        return self._prepare_store(rest, req_context, names, controls)

    def _admitted(
        self, todo: list[OffloadKey], todo_skeys: list[bytes], controls: RequestControls
    ) -> tuple[list[OffloadKey], list[bytes]]:
        """Admission (the policy's ``admit_after``): the keys of ``todo`` to store now."""
        if not self.store.admission_active:
            return todo, todo_skeys
        ok = self.store.admit(todo_skeys, controls.seen)
        if all(ok):
            return todo, todo_skeys
        self.counters["store_keys_declined_by_admission"] += len(ok) - sum(ok)
        return [k for k, y in zip(todo, ok) if y], [s for s, y in zip(todo_skeys, ok) if y]

    def _controls_stored(self, skeys: list[bytes], req_context: ReqContext, success: bool) -> None:
        for lk in self._lookups_among.values():
            lk.forget(skeys)
        controls = req_context.get_state(RequestControls)
        if success and controls is not None and controls.retain is not None:
            self._retain(skeys, controls.retain)

    def _retain(self, skeys: Sequence[bytes], retain: Retain) -> None:
        """Retain ``skeys`` (stored keys of any groups) as the request's hint asked."""
        retain_keys(self.store, skeys, retain, self.counters)

    def _controls_schedule_end(self) -> None:
        for lk in self._lookups_among.values():
            lk.flush()
            lk.end_step()
        self.store.retention.expire()

    def _controls_reset(self, new_generation: bool) -> None:
        """A cache reset: answers are asked again; in a new generation what was retained or
        sighted belongs to the old one."""
        for lk in self._lookups_among.values():
            lk.clear()
        if new_generation:
            self.store.retention.release_all()
            self.store.admission.clear()

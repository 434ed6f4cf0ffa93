"""``TieredKVOffloadingSpec``: tieredkv as a whole vLLM 0.33 ``OffloadingSpec``.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_name`` / ``spec_module_path``. The
spec owns both sides:

* :class:`TieredKVManager` (scheduler side) — tracks what is being written and asks tieredkv's
  tiers what is stored, never blocking: a key being written answers HIT_PENDING, an unknown key
  RETRY until a batched ``TieredStore.lookup_async`` (sent at the end of the step) resolves it.
  ``prepare_store`` is all-or-nothing: ``None`` (retry the same range later) when the chunks in
  flight would overrun the staging budget, never a key dropped for lack of space.
  ``prepare_load`` pins the chunks in every tier until ``complete_load``. Both name the request's
  tenant (:func:`~tieredkv.integrations.vllm.tenants.request_tenant`: its ``cache_salt`` behind
  ``TieredKVConnector``, else ``kv_transfer_params["cache_salt"]``) in the transfer's spec.
* :class:`TieredKVWorker` (worker side) — registers each KV group's tensors with tieredkv's
  pipeline (staging pool + copier; CUDA or CPU tensors) and turns vLLM's
  ``GPULoadStoreSpec`` + key list into per-group store / load jobs, as records of the spec's
  tenant (bounded by its quota in every tier; a load's promotions are the loading tenant's). The
  pipeline routes each group to its tiers by tieredkv's per-group policy (chunk bytes, kind).

The manager and the worker share one :class:`~tieredkv.store.TieredStore` per engine and
process (vLLM runs the scheduler and a single worker in one process: ``world_size == 1``), so
the scheduler sees exactly the tiers the worker writes, the in-process CPU tier included.
Several workers (TP/PP > 1) run in other processes: use :class:`TieredKVSecondaryTier` under
vLLM's ``TieringOffloadingSpec`` there (refused here with a clear error).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.config import TieredKVConfig, load_config
from tieredkv.errors import ConfigError
from tieredkv.integrations.vllm.lookups import AsyncLookups
from tieredkv.integrations.vllm.namespace import group_kinds, namespace_from_offloading_config, new_generation
from tieredkv.integrations.vllm.stats import StoreStatsReporter, hit_source, metric_definitions
from tieredkv.integrations.vllm.tenants import request_tenant
from tieredkv.keys import (
    GROUP_SUFFIX,
    Namespace,
    group_suffix,
    key_group,
    partial_chunk_key,
    partial_valid_from,
    stored_key,
    with_group,
)
from tieredkv.pipeline import KeyState
from tieredkv.store import TieredStore

__all__ = ["TieredKVLoadStoreSpec", "TieredKVManager", "TieredKVOffloadingSpec", "TieredKVWorker"]

log = logging.getLogger(__name__)


class TieredKVLoadStoreSpec(LoadStoreSpec):
    """The medium side of a transfer: vLLM offload keys, group-major, ascending chunk.

    ``fingerprint`` is the namespace (cache generation included) the manager prepared the
    transfer under; ``stored`` (loads) is, per key, the stored key to read: the whole chunk or a
    partial record (:func:`~tieredkv.keys.partial_chunk_key`) whose leading sub-blocks are invalid.
    ``tenant``: the request's tenant id (its ``cache_salt``; 0: the default tenant), whose records
    a store writes and a load promotes.
    """

    def __init__(
        self,
        keys: Sequence[OffloadKey],
        fingerprint: bytes = b"",
        stored: Sequence[bytes] | None = None,
        tenant: int = 0,
    ) -> None:
        self.keys: list[OffloadKey] = list(keys)
        self.fingerprint = fingerprint
        self.stored: list[bytes] = (
            list(stored) if stored is not None else [stored_key(fingerprint, k) for k in self.keys]
        )
        self.tenant = tenant

    def __repr__(self) -> str:
        return f"TieredKVLoadStoreSpec({len(self.keys)} keys)"


_HIT, _HIT_PENDING, _MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS  # read once per lookup
_KS_HIT, _KS_PENDING, _KS_MISS = KeyState.HIT, KeyState.PENDING, KeyState.MISS
_UNSPECIFIED = CacheHitSource.EXTERNAL_UNSPECIFIED
_MIXED = object()  # a route whose tiers' media differ: ask which tier holds the key


def _route_source(store: TieredStore, route: tuple[str, ...]) -> Any:
    """The hit source of a route whose tiers share one medium, else ``_MIXED``."""
    sources = {hit_source(store.tier_medium(name)) for name in route}
    return sources.pop() if len(sources) == 1 else _MIXED


# ---- one store per engine and process, shared by manager and worker ---------------------------


class _Shared:
    """What the manager and the worker of one engine share (same process)."""

    def __init__(self, store: TieredStore, namespace: Namespace) -> None:
        self.store = store
        self.refs = 0
        self.unstored: set[bytes] = set()
        """Whole-chunk stored keys whose store job ended without the whole chunk held by a tier
        (refused, dropped, or only a partial record): the manager must not treat them as stored."""
        self.namespace = namespace

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @namespace.setter
    def namespace(self, ns: Namespace) -> None:
        self._namespace = ns
        #: A plain attribute: the scheduler reads it once per lookup.
        self.fingerprint: bytes = ns.fingerprint
        #: vLLM key -> stored key under this fingerprint (a new generation starts a new map).
        self.skeys = StoredKeys(ns.fingerprint)


class StoredKeys(dict[bytes, bytes]):
    """vLLM's key -> its stored key (``fingerprint + key``), made on first use.

    vLLM's scheduler hands the manager the same key objects step after step (a waiting request's
    keys are asked again on every step, a stored key comes back at ``complete_store``): one
    dict read, the key's hash cached in vLLM's key object, instead of a concatenation, a new
    object and its hash (SipHash over 52 bytes) per call. Holds at most ``limit`` keys: full,
    it starts again empty (what it holds is only ever recomputed, never wrong)."""

    __slots__ = ("fp", "limit")

    def __init__(self, fingerprint: bytes, limit: int = 1 << 16) -> None:
        super().__init__()
        self.fp = fingerprint
        self.limit = limit

    def __missing__(self, key: bytes) -> bytes:
        if len(self) >= self.limit:
            self.clear()
        skey = self[key] = self.fp + key
        return skey


_STORES: dict[tuple[Any, ...], _Shared] = {}
_STORES_LOCK = threading.Lock()


def _acquire_store(ident: tuple[Any, ...], cfg: TieredKVConfig, ns: Namespace) -> _Shared:
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            entry = _STORES[ident] = _Shared(TieredStore(cfg, namespace=ns).start(), ns)
        entry.refs += 1
        return entry


def _release_store(ident: tuple[Any, ...]) -> None:
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        del _STORES[ident]
    entry.store.close()


# ---- spec -------------------------------------------------------------------------------------


class TieredKVOffloadingSpec(OffloadingSpec):
    """``kv_connector_extra_config``: ``tieredkv_config`` (path of a tieredkv YAML; else
    ``$TIEREDKV_CONFIG``, else tieredkv's defaults), optional ``max_inflight_store_chunks``
    (default: what the staging pool holds), ``keep_on_reset`` (default false: a vLLM cache reset
    starts a new cache generation), ``stats_interval_s`` (0.1: how often, at most, tieredkv's
    counters are read for vLLM's stats while transfers are in flight; 0: every step), ``group_kinds`` (one of full / sliding_window / mamba per
    group, when layer names do not tell), plus vLLM's own keys (``blocks_per_chunk``, ...)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's metrics of a spec plus tieredkv's ``vllm:kv_offload_tieredkv_*``, which
        :meth:`TieredKVManager.get_stats` reports: on vLLM's ``/metrics`` under any connector."""
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        source = self.extra_config.get("tieredkv_config") or os.environ.get("TIEREDKV_CONFIG")
        self.tkv_config: TieredKVConfig = load_config(source)
        par = config.parallel
        if int(par.world_size) > 1:
            raise ConfigError(
                f"TieredKVOffloadingSpec: world_size={par.world_size} (tp={par.tp_size}, pp={par.pp_size}); the whole"
                " spec shares one tieredkv store between the scheduler and a single in-process worker. For several"
                ' workers use spec_name "TieringOffloadingSpec" with a "TieredKVSecondaryTier" secondary tier'
            )
        self.group_kinds = group_kinds(config, self.extra_config.get("group_kinds"))
        self.namespace = namespace_from_offloading_config(config, self.tkv_config, kinds=self.group_kinds)
        self.store_ident = (str(config.engine_id), self.namespace.fingerprint, str(source))
        self.keep_on_reset = _flag(self.extra_config.get("keep_on_reset", False), "keep_on_reset")
        chunk_bytes = max(1, int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk))
        staging = int(self.tkv_config.pipeline.staging_bytes)
        self.max_inflight_store_chunks = int(
            self.extra_config.get("max_inflight_store_chunks", 0) or max(1, staging // chunk_bytes // 2)
        )
        interval = self.extra_config.get("stats_interval_s", 0.1)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ConfigError(f"kv_connector_extra_config.stats_interval_s: got {interval!r}; use a number >= 0")
        self.stats_interval_s = float(interval)
        self._manager: TieredKVManager | None = None
        self._worker: TieredKVWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = TieredKVManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TieredKVWorker(self, kv_caches)
        return self._worker


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kv_connector_extra_config.{name}: got {value!r}; use true or false")


# ---- scheduler side ---------------------------------------------------------------------------


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
        self._sh = _acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
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
        self._lookups = AsyncLookups(self.store.lookup_async)
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._stats = StoreStatsReporter(lambda: [self.store])
        self._stats_at = float("-inf")

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
        skey = self._sh.skeys[key]
        if skey in self._writing:
            return _HIT_PENDING
        if self._partial_groups and key[GROUP_SUFFIX] in self._partial_groups:
            return self._lookup_partial(key, skey)
        state = self._probe(skey)  # a store in flight is pending, then the tiers that can tell
        if state is _KS_HIT:
            return _HIT
        if state is _KS_MISS:
            self._stored.pop(skey, None)
            return _MISS
        if state is None:
            known = self._lookups.answer(skey)
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
        if partial and any(k[GROUP_SUFFIX] in partial for k in keys):
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
                    known = answer(skeys[i])  # None: a tier that cannot tell without waiting
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

    def _lookup_partial(self, key: bytes, skey: bytes) -> LookupResult:
        """A sliding-window or Mamba key with several chunks per block: the whole record, else
        a partial one (leading sub-blocks invalid)."""
        states = []
        for cand in self._candidates(key, skey):
            state = self._probe(cand) or self._lookups.answer(cand)
            if state == "hit":
                if cand != skey:
                    if len(self._chosen) > 65536:
                        self._chosen.clear()
                    self._chosen[skey] = cand
                return _HIT
            states.append(state)
        return self._not_hit(key, skey, states)

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
        return TieredKVLoadStoreSpec(list(keys), sk.fp, stored, request_tenant(req_context))

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
        writing.update(todo_skeys)
        self._inflight += len(todo)
        self.counters["store_chunks"] += len(todo)
        return PrepareStoreOutput(
            keys_to_store=todo,
            store_spec=TieredKVLoadStoreSpec(todo, sk.fp, todo_skeys, request_tenant(req_context)),
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
        self._lookups.forget(skeys)
        while len(stored) > (1 << 20):
            stored.pop(next(iter(stored)))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The cache tier a hit is loaded from, for vLLM's hits-by-source metrics: the medium of
        the tier of the key's route that holds it (``host`` for the CPU tier, ``disk`` for
        LMDB); ``external_unspecified`` for a remote store (Redis: vLLM has no member for it)
        and when the tiers cannot tell without waiting. An attribute read when every group's route
        has one medium and the same; else one dict read for a route of one medium."""
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
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()
        self._lookups.end_step()

    def has_pending_work(self) -> bool:
        # Answers resolve on tieredkv's loop thread by themselves; a request waiting for one keeps
        # the engine stepping anyway. Only keys not yet sent need another on_schedule_end.
        return self._lookups.has_unsent()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every transfer and lookup in flight has finished (False on timeout).

        Not part of vLLM's interface and never called by vLLM: for tests that model a forward
        pass longer than the tier I/O it overlaps, and for an orderly stop."""
        return self.store.drain(timeout) and self._lookups.wait(timeout)

    def reset_cache(self) -> None:
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
        _release_store(self.spec.store_ident)


# ---- worker side ------------------------------------------------------------------------------


@dataclass
class _Job:
    kind: str
    subs: set[int] = field(default_factory=set)
    queued: int = 0
    ok: bool = True
    nbytes: int = 0
    t0: float = field(default_factory=time.perf_counter)
    errors: list[str] = field(default_factory=list)
    whole: dict[bytes, bytes] = field(default_factory=dict)
    """Store jobs: stored key written -> the whole-chunk stored key it stands for."""


def _chunk_positions(kind: str, n_keys: int, n_blocks: int, first: int, bpc: int) -> list[list[int]] | None:
    """Per chunk of a group's transfer, the sub-block positions its blocks fill (in block order).

    vLLM's worker convention: the group's blocks are consecutive, starting ``first % bpc`` blocks
    into the first chunk (leading blocks out of a sliding window are not sent). A Mamba group
    sends one state block per chunk, all in the same slot. None when neither fits.
    """
    skip = first % bpc
    if kind == "mamba" and n_blocks == n_keys:
        return [[skip] for _ in range(n_keys)]
    if -(-(skip + n_blocks) // bpc) != n_keys:
        return None
    out: list[list[int]] = [[] for _ in range(n_keys)]
    for j in range(n_blocks):
        p = skip + j
        out[p // bpc].append(p % bpc)
    return out


class TieredKVWorker(OffloadingWorker):
    """GPU (or CPU stand-in) KV blocks ↔ tieredkv, one vLLM job = one or more tieredkv jobs.

    A chunk whose leading sub-blocks were not sent (a sliding-window chunk partly out of the
    window, a Mamba chunk with its one state block in the last slot) is stored as a partial
    record (:func:`~tieredkv.keys.partial_chunk_key`); a load that would read one of its
    invalid sub-blocks is refused (counted), never served.
    """

    def __init__(self, spec: TieredKVOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self._sh = _acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
        self.store = self._sh.store
        self.bpc = int(spec.blocks_per_chunk)
        self.kinds = list(spec.group_kinds)
        self.chunk_bytes: dict[int, int] = {}
        staging = self.store.staging_capacity
        self._max_job_chunks: dict[int, int] = {}
        for g, refs in enumerate(kv_caches.group_data_refs):
            idxs = list(dict.fromkeys(r.tensor_idx for r in refs))
            tensors = [kv_caches.tensors[i].tensor for i in idxs]
            for t in tensors:
                if not t.is_contiguous():
                    raise NotImplementedError(
                        "TieredKVOffloadingSpec: a packed KV layout (block stride larger than the page) is not"
                        " supported; use TieringOffloadingSpec with TieredKVSecondaryTier"
                    )
            # vLLM's block 0 is its null block: a load's chunk names it for a block not to copy
            route = self.store.register_group(g, tensors, blocks_per_chunk=self.bpc, kind=self.kinds[g], null_block=0)
            cb = sum(t[0].numel() * t.element_size() for t in tensors) * self.bpc
            self.chunk_bytes[g] = cb
            self._max_job_chunks[g] = max(1, staging // (4 * cb))
            log.info("tieredkv: group %d (%s, %d-byte chunks) -> %s", g, self.kinds[g], cb, list(route.tiers))
        self._jobs: dict[int, _Job] = {}
        self._sub_to_job: dict[int, int] = {}
        # (job id, kind, group, chunks, tenant) of sub-jobs staging could not take yet
        self._retry: collections.deque[tuple[int, str, int, list[tuple[bytes, tuple[int, ...]]], int]] = (
            collections.deque()
        )
        self._results: list[TransferResult] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False

    # ---- job building ---------------------------------------------------------------------

    def _per_group(
        self, keys: Sequence[bytes], stored: Sequence[bytes], gpu: GPULoadStoreSpec
    ) -> list[tuple[int, list[bytes], list[bytes], list[int], int]]:
        """``(group, keys, stored keys, block ids, first block index)`` of each group that has keys."""
        by_group: dict[int, list[tuple[bytes, bytes]]] = collections.defaultdict(list)
        for k, s in zip(keys, stored):
            by_group[key_group(k)].append((bytes(k), s))
        ids = [int(b) for b in gpu.block_ids]
        out, off = [], 0
        for g, size in enumerate(gpu.group_sizes):
            gids = ids[off : off + int(size)]
            off += int(size)
            pairs = by_group.pop(g, None)
            if pairs:
                out.append((g, [k for k, _ in pairs], [s for _, s in pairs], gids, int(gpu.block_indices[g])))
        if by_group:
            raise ValueError(f"keys of groups {sorted(by_group)} have no GPU blocks in the spec")
        return out

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TieredKVLoadStoreSpec)
        job = self._jobs[job_id] = _Job("store")
        bpc, fp = self.bpc, dst_spec.fingerprint
        unstored = self._sh.unstored
        for g, keys, whole_keys, ids, first in self._per_group(dst_spec.keys, dst_spec.stored, src_spec):
            layout = _chunk_positions(self.kinds[g], len(keys), len(ids), first, bpc)
            if layout is None:
                self.counters["unmappable_chunks_not_stored"] += len(keys)
                unstored.update(whole_keys)
                log.warning(
                    "tieredkv: store job %d group %d: %d keys for %d blocks (first %d); not stored",
                    job_id,
                    g,
                    len(keys),
                    len(ids),
                    first,
                )
                continue
            chunks, j = [], 0
            for k, whole, positions in zip(keys, whole_keys, layout):
                blocks = ids[j : j + len(positions)]
                j += len(positions)
                valid_from = bpc - len(positions)
                if positions != list(range(valid_from, bpc)) or valid_from > 255:
                    # Sub-blocks missing after a written one: not a partial record tieredkv serves.
                    self.counters["chunks_with_holes_not_stored"] += 1
                    unstored.add(whole)
                    continue
                if valid_from:
                    skey = stored_key(fp, partial_chunk_key(k, valid_from))
                    unstored.add(whole)  # a whole chunk may still be stored later
                    self.counters["partial_chunks_stored"] += 1
                else:
                    skey = whole
                job.whole[skey] = whole
                chunks.append((skey, (0,) * valid_from + tuple(blocks)))
            if chunks:
                self._submit(job_id, "store", g, chunks, dst_spec.tenant)
        self._maybe_finish(job_id, job)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        assert isinstance(src_spec, TieredKVLoadStoreSpec)
        job = self._jobs[job_id] = _Job("load")
        bpc = self.bpc
        fp_len = len(src_spec.fingerprint)
        for g, keys, stored, ids, first in self._per_group(src_spec.keys, src_spec.stored, dst_spec):
            start = (first // bpc) * bpc
            chunks, bad = [], 0
            for i, (k, skey) in enumerate(zip(keys, stored)):
                placed = []
                for p in range(bpc):
                    logical = start + i * bpc + p - first
                    placed.append(ids[logical] if 0 <= logical < len(ids) else 0)
                valid_from = partial_valid_from(skey, fp_len + len(k))
                if any(placed[:valid_from]):
                    # The load wants a sub-block this record never held (vLLM 0.33 loads a Mamba
                    # state into a slot off the Mamba grid when the full-attention hit shrinks the
                    # boundary). Never serve unwritten bytes; leave those blocks untouched and
                    # report the rest: vLLM's connector has no load-failure path (a failed job
                    # is an assertion in the engine).
                    bad += 1
                    placed[:valid_from] = [0] * valid_from
                chunks.append((skey, tuple(placed)))
            if bad:
                self.counters["load_subblocks_never_written"] += bad
                log.warning(
                    "tieredkv: load job %d group %d (%s): %d chunks asked for sub-blocks that were never"
                    " written (an off-grid hit boundary); those GPU blocks are left as they are",
                    job_id,
                    g,
                    self.kinds[g],
                    bad,
                )
            if any(any(b for b in placed) for _, placed in chunks):
                self._submit(job_id, "load", g, chunks, src_spec.tenant)
        if expedited:
            self.wait({job_id})
        self._maybe_finish(job_id, job)
        return True

    def _submit(
        self, job_id: int, kind: str, group: int, chunks: list[tuple[bytes, tuple[int, ...]]], tenant: int = 0
    ) -> None:
        step = self._max_job_chunks[group]
        for i in range(0, len(chunks), step):
            part = chunks[i : i + step]
            sub = self._send(kind, group, part, tenant)
            if sub is None:  # staging full: keep the job open and offer it again on the next poll
                self._jobs[job_id].queued += 1
                self._retry.append((job_id, kind, group, part, tenant))
                self.counters[f"{kind}_backpressure"] += 1
            else:
                self._jobs[job_id].subs.add(sub)
                self._sub_to_job[sub] = job_id

    def _send(self, kind: str, group: int, part: list[tuple[bytes, tuple[int, ...]]], tenant: int) -> int | None:
        if kind == "store":
            return self.store.store(group, part, tenant=tenant)
        return self.store.load(group, part, tenant=tenant)

    def _resubmit(self) -> None:
        for _ in range(len(self._retry)):
            job_id, kind, group, part, tenant = self._retry.popleft()
            sub = self._send(kind, group, part, tenant)
            if sub is None:
                self._retry.append((job_id, kind, group, part, tenant))
                break
            job = self._jobs[job_id]
            job.queued -= 1
            job.subs.add(sub)
            self._sub_to_job[sub] = job_id

    # ---- completion -----------------------------------------------------------------------

    def _collect(self) -> None:
        for r in self.store.poll():
            job_id = self._sub_to_job.pop(r.job_id, None)
            if job_id is None:
                continue
            job = self._jobs[job_id]
            job.subs.discard(r.job_id)
            job.nbytes += r.nbytes
            if job.kind == "store" and r.failed:
                self._sh.unstored.update(job.whole.get(k, k) for k in r.failed)
            if not r.ok:
                if job.kind == "load":
                    job.ok = False
                job.errors.append(r.error or "failed")
                self.counters[f"{job.kind}_failed_subjobs"] += 1
            self._maybe_finish(job_id, job)
        if self._retry:
            self._resubmit()

    def _maybe_finish(self, job_id: int, job: _Job) -> None:
        if job.subs or job.queued or job_id not in self._jobs:
            return
        del self._jobs[job_id]
        if job.errors:
            # A store that tiers refused is a miss later (lookups ask the tiers), so the job itself
            # succeeds. A failed load cannot be recovered: vLLM 0.33's connector has no load-failure
            # path (it asserts success), so it is reported as it is, never as loaded garbage.
            log.warning("tieredkv %s job %d: %s", job.kind, job_id, "; ".join(job.errors[:3]))
        self._results.append(
            TransferResult(
                job_id=job_id, success=job.ok, transfer_size=job.nbytes, transfer_time=time.perf_counter() - job.t0
            )
        )

    def get_finished(self) -> list[TransferResult]:
        self._collect()
        out, self._results = self._results, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        want = {j for j in job_ids if j in self._jobs}
        while want & self._jobs.keys():
            self._collect()
            if want & self._jobs.keys():
                time.sleep(0.0005)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _release_store(self.spec.store_ident)

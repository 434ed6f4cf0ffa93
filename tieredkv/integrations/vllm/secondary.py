"""``TieredKVSecondaryTier``: tieredkv as a secondary tier under vLLM 0.33's ``TieringOffloadingSpec``.

vLLM keeps the GPU↔CPU path and its shared primary region; every chunk confirmed in the primary
is cascaded here (``submit_store``), and a primary miss that this tier answers HIT is promoted
back (``submit_load``). Row ``i`` of vLLM's primary memoryview is primary slot ``i``: one chunk
of one KV group (every worker's pages, padded to the largest group). Each row is handed, as a
host buffer, to tieredkv's store (``put_records`` / ``get_records``), which routes it by the
key's group along that group's :class:`~tieredkv.policy.GroupRoute` (LMDB, Redis, ...).

Every method runs on vLLM's scheduler thread and returns at once: I/O happens on the pipeline's
loop thread; lookups go through ``TieredStore.lookup_async`` and answer RETRY until it resolves.

Tenants: a cascade (store) or promotion (load) job carries the request's ``ReqContext``, so its
rows are stored (and promoted within tieredkv's routes) as records of the request's tenant
(:func:`~tieredkv.integrations.vllm.tenants.request_tenant`: its ``cache_salt`` when
``TieredKVConnector`` recorded it, else ``kv_transfer_params["cache_salt"]``, else the default
tenant). vLLM's own primary CPU region knows no tenants.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Collection, Container, Iterable
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.config import load_config
from tieredkv.integrations.vllm.controls import RequestControls, Retain, request_controls, retain_keys, tier_place
from tieredkv.integrations.vllm.events import KVEvents
from tieredkv.integrations.vllm.lookups import AsyncLookups, request_offload_keys
from tieredkv.integrations.vllm.namespace import group_kinds as group_kinds_of
from tieredkv.integrations.vllm.namespace import namespace_from_offloading_config, new_generation
from tieredkv.integrations.vllm.stats import StoreStatsReporter, hit_source, metric_definitions
from tieredkv.integrations.vllm.tenants import request_tenant
from tieredkv.keys import chunk_key_of, key_group, stored_key
from tieredkv.store import TieredStore

__all__ = ["TieredKVSecondaryTier"]

log = logging.getLogger(__name__)


class TieredKVSecondaryTier(SecondaryTierManager):
    """tieredkv tiers (per-group policy) behind vLLM's CPU primary tier.

    Tier kwargs (the ``secondary_tiers`` entry): ``config`` — path of a tieredkv YAML (or a
    mapping); falls back to ``$TIEREDKV_CONFIG``, then tieredkv's defaults.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        """tieredkv's ``vllm:kv_offload_tieredkv_*`` (vLLM's tiering spec adds them to its own)."""
        return metric_definitions()

    def get_stats(self) -> Any:
        """tieredkv's counter increments since the last call; vLLM's tiering manager merges them."""
        return self._stats.take()

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        config: str | dict[str, Any] | None = None,
        keep_on_reset: bool = False,
        group_kinds: list[str] | None = None,
        backpressure_detector: Any = None,
        locality: str | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if unknown:
            raise ValueError(
                f"TieredKVSecondaryTier: unknown tier options {sorted(unknown)}; the options are 'config'"
                " (path of a tieredkv YAML), 'keep_on_reset' (true: keep serving what was stored before a"
                " vLLM cache reset), 'group_kinds' (full / sliding_window / mamba per KV group) and 'locality'"
                " (LOCAL / REMOTE, for vLLM's kv_load_tiers)"
            )
        cfg = load_config(config if config is not None else os.environ.get("TIEREDKV_CONFIG"))
        ocfg = offloading_spec.config
        row_bytes = int(self.block_size_bytes)
        if not isinstance(keep_on_reset, bool):
            raise ValueError(  # noqa: TRY004 - a bad tier option, like the others: ValueError
                f"TieredKVSecondaryTier: keep_on_reset must be true or false, got {keep_on_reset!r}"
            )
        self.keep_on_reset = keep_on_reset
        self.kinds = group_kinds_of(ocfg, group_kinds)
        # A primary row holds every worker's pages of one chunk: one namespace for all ranks.
        self.namespace = namespace_from_offloading_config(
            ocfg, cfg, bytes_per_block=row_bytes, rank=0, kinds=self.kinds
        )
        self._fp = self.namespace.fingerprint
        self.store = TieredStore(cfg, namespace=self.namespace).start()
        # Routes: tieredkv's policy by each group's kind and chunk (row) bytes.
        self.routes = {i: self.store.policy.route(i, row_bytes, self.kinds[i]) for i in range(len(ocfg.groups))}
        for i, r in self.routes.items():
            log.info("tieredkv secondary tier: group %d -> %s (%s)", i, list(r.tiers), r.write)
        # vLLM's tiering manager reports a promotion from this tier under one source: the
        # outermost medium of the tiers the routes use (LMDB alone: disk; with Redis: unspecified).
        sources = [hit_source(self.store.tier_medium(name)) for r in self.routes.values() for name in r.tiers]
        self.cache_hit_source = CacheHitSource.outermost(sources) if sources else CacheHitSource.EXTERNAL_UNSPECIFIED
        self._rows = np.asarray(primary_kv_view) if primary_kv_view.nbytes else np.zeros((0, row_bytes), np.uint8)
        self._lookups = AsyncLookups(
            self.store.lookup_async,
            probe_now=self.store.probe_many,
            request_keys=lambda ctx: [self._skey(k) for k in request_offload_keys(ctx)],
        )
        self._stats = StoreStatsReporter(lambda: [self.store])
        self._writing: collections.Counter[bytes] = collections.Counter()  # stored keys in flight
        self._present: dict[bytes, None] = {}  # stored keys this tier wrote or read (insertion order)
        self._present_cap = 1 << 20
        self._jobs: dict[int, tuple[str, tuple[bytes, ...]]] = {}
        self._finished: list[JobResult] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self._init_controls(locality)

        #: Stored keys of put jobs finished here but not yet handed to vLLM (get_finished_jobs):
        #: with those being written, the stores vLLM has not seen complete (KV events only).
        self._unreported: collections.Counter[bytes] = collections.Counter()
        self._unreported_jobs: dict[int, tuple[bytes, ...]] = {}
        #: KV events of the tiers (:mod:`~tieredkv.integrations.vllm.events`), while vLLM's are on.
        self._events: KVEvents | None = (
            KVEvents(self.store, _Either(self._writing, self._unreported), primary=False)
            if offloading_spec.kv_events_config.enable_kv_cache_events
            else None
        )

    # ---- keys -----------------------------------------------------------------------------

    def _skey(self, key: bytes) -> bytes:
        return stored_key(self._fp, key)

    def _vkey(self, skey: bytes) -> OffloadKey:
        return OffloadKey(chunk_key_of(skey))

    def _row(self, chunk_id: int) -> memoryview:
        return memoryview(self._rows[int(chunk_id)])

    def _remember(self, skeys: Iterable[bytes]) -> None:
        for k in skeys:
            self._present[k] = None
        while len(self._present) > self._present_cap:
            self._present.pop(next(iter(self._present)))

    # ---- SecondaryTierManager ------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._load_filtered and req_context.req_id in self._load_filtered:
            return self._lookup_filtered(key, req_context)
        skey = self._skey(key)
        if skey in self._writing:
            self._collect()  # a finished write must not keep answering RETRY until some other call polls
            if skey in self._writing:
                return LookupResult.RETRY
        if skey in self._present:
            return LookupResult.HIT  # written or read here; a stale answer fails the promotion, not the engine
        self._collect()
        state = self.store.probe(skey) or self._lookups.answer(skey, req_context)
        if state is None:
            return LookupResult.RETRY
        if state == "hit":
            return LookupResult.HIT
        if state == "pending":
            return LookupResult.RETRY
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        items = []
        skipped = []
        for key, chunk_id in zip(job_metadata.keys, job_metadata.chunk_ids):
            skey = self._skey(key)
            if skey in self._present or skey in self._writing:
                skipped.append(skey)  # already held (or being written): nothing to copy
                continue
            items.append((skey, self._row(chunk_id)))
        job_id = int(job_metadata.job_id)
        tiers: frozenset[str] | None = None
        if self._controls_on:
            items, tiers = self._controls_store(job_id, items, skipped, job_metadata.req_context)
        if not items:
            self._finished.append(JobResult(job_id=job_id, success=True, transfer_time=0.0, transfer_bytes=0))
            return
        if self._events is not None and not self._events.key_len:
            self._events.key_len = len(items[0][0]) - len(self._fp)
        for skey, _ in items:
            self._writing[skey] += 1
        self._jobs[job_id] = ("put", tuple(k for k, _ in items))
        tenant = request_tenant(job_metadata.req_context)
        if self.store.put_records(items, job_id=job_id, tenant=tenant, tiers=tiers) is None:
            self._job_retain.pop(job_id, None)
            self._end_put(job_id)
            self.counters["store_refused"] += 1
            self._finished.append(JobResult(job_id=job_id, success=False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        items = [(self._skey(k), self._row(c)) for k, c in zip(job_metadata.keys, job_metadata.chunk_ids)]
        job_id = int(job_metadata.job_id)
        self._jobs[job_id] = ("get", tuple(k for k, _ in items))
        tenant = request_tenant(job_metadata.req_context)
        tiers = self._controls_load(job_id, job_metadata.req_context) if self._controls_on else None
        if self.store.get_records(items, job_id=job_id, tenant=tenant, tiers=tiers) is None:
            self._jobs.pop(job_id, None)
            self._job_retain.pop(job_id, None)
            self._finished.append(JobResult(job_id=job_id, success=False, successful_keys=()))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect()
        out, self._finished = self._finished, []
        if self._unreported_jobs:
            unreported = self._unreported
            for r in out:
                for k in self._unreported_jobs.pop(int(r.job_id), ()):
                    n = unreported[k] - 1
                    if n > 0:
                        unreported[k] = n
                    else:
                        del unreported[k]
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._controls_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._load_filtered.pop(req_context.req_id, None)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()
        self._lookups.end_step()
        if self._controls_on:
            self._controls_schedule_end()

    def has_pending_work(self) -> bool:
        # Transfers in flight need get_finished_jobs() calls; queued lookups need one more
        # on_schedule_end to be sent. A resolved answer nobody has read yet is not work.
        self._collect()
        return (
            bool(self._jobs)
            or self._lookups.has_unsent()
            or any(lk.has_unsent() for lk in self._lookups_among.values())
        )

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every transfer and lookup in flight has finished (tests, orderly stop;
        never called by vLLM)."""
        return self.store.drain(timeout) and self._lookups.wait(timeout)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What tieredkv's tiers came to hold and stopped holding since the last call, as vLLM's
        ``OffloadingEvent``s with each tier's medium and ``ownership="tieredkv:<tier>"``
        (:mod:`~tieredkv.integrations.vllm.events`); nothing unless vLLM's KV cache events are on."""
        if self._events is None:
            return ()
        return self._events.take(self._fp)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the tiers keep their own LRU on access

    def drain_jobs(self) -> None:
        """vLLM's ``TieringOffloadingManager.reset_cache`` (sleep, weight update) calls this, and
        only this, on a secondary tier: finish every transfer, then start a new cache generation
        (unless ``keep_on_reset``), so KV computed before the reset is never served after it."""
        self.store.drain()
        self._collect()
        if not self.keep_on_reset:
            self.reset_cache_state()

    def reset_cache_state(self) -> None:
        """Forget what this tier knows and move to a fresh cache generation (new fingerprint)."""
        self._present.clear()
        self._lookups.clear()
        self._controls_reset()
        self.namespace = new_generation(self.namespace)
        self._fp = self.namespace.fingerprint
        self.counters["cache_generations"] += 1

    def shutdown(self) -> None:
        self._lookups.clear()
        self.store.close()

    def get_tier_stats(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "pipeline": self.store.stats().as_dict()}

    # ---- plumbing --------------------------------------------------------------------------

    def _end_put(self, job_id: int) -> tuple[bytes, ...]:
        _, skeys = self._jobs.pop(job_id, ("put", ()))
        for k in skeys:
            n = self._writing[k] - 1
            if n > 0:
                self._writing[k] = n
            else:
                self._writing.pop(k, None)
        return skeys

    def _collect(self) -> None:
        for r in self.store.poll():
            entry = self._jobs.get(r.job_id)
            if entry is None:
                continue
            kind, _ = entry
            retain = self._job_retain.pop(r.job_id, None) if self._job_retain else None
            if retain is not None and r.done:
                self._retain(r.done, retain)
            if kind == "put":
                skeys = self._end_put(r.job_id)
                if self._events is not None:
                    self._unreported.update(skeys)  # announced once vLLM is told (get_finished_jobs)
                    self._unreported_jobs[r.job_id] = skeys
                self._remember(r.done)
                self._lookups.forget(r.done)
                self.counters["stored_chunks"] += len(r.done)
                self.counters["store_failed_chunks"] += len(r.failed)
                self._finished.append(
                    JobResult(job_id=r.job_id, success=r.ok, transfer_time=r.seconds, transfer_bytes=r.nbytes)
                )
            else:
                self._jobs.pop(r.job_id, None)
                self._remember(r.done)
                for k in r.failed:
                    self._present.pop(k, None)
                self._lookups.forget(r.failed)
                self.counters["loaded_chunks"] += len(r.done)
                self.counters["load_missing_chunks"] += len(r.failed)
                self._finished.append(
                    JobResult(
                        job_id=r.job_id,
                        success=r.ok,
                        successful_keys=None if r.ok else [self._vkey(k) for k in r.done],
                        transfer_time=r.seconds,
                        transfer_bytes=r.nbytes,
                    )
                )

    # ---- request controls: tier filters, hints, admission (integrations/vllm/controls.py) ----------

    def _init_controls(self, locality: str | None) -> None:
        if locality is not None:
            try:
                self.locality = Locality(str(locality).upper())
            except ValueError:
                raise ValueError(
                    f"TieredKVSecondaryTier: locality={locality!r} is invalid: expected LOCAL or REMOTE"
                ) from None
        else:  # vLLM's tiering manager filters whole secondary tiers by it: say it where every tier agrees
            places = {tier_place(self.store.tier_medium(n))[1] for r in self.routes.values() for n in r.tiers}
            self.locality = Locality(places.pop()) if len(places) == 1 and None not in places else None
        #: requests with a load tier filter that leaves out some of this tier's tiers -> controls
        self._load_filtered: dict[str, RequestControls] = {}
        self._lookups_among: dict[frozenset[str], AsyncLookups] = {}
        self._job_retain: dict[int, Retain] = {}
        #: whether any request control can apply (admission configured, or retention possible)
        self._controls_on = self.store.admission_active or bool(self.store.retention.max_chunks)

    def _controls_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """As the spec's manager: controls read once, a filtered request looked up over its allowed
        tiers only, a retaining one ``REQUEST_LEVEL`` (vLLM's tiering manager then cascades the
        request's chunks its primary already holds, and they are retained here)."""
        controls = request_controls(req_context, self.store)
        if not controls.plain:
            self._controls_on = True
        if controls.load_tiers(self.store) is not None:
            if len(self._load_filtered) >= 1 << 16:
                self._load_filtered.pop(next(iter(self._load_filtered)))
            self._load_filtered[req_context.req_id] = controls
        if controls.retain is not None and not controls.stores_nothing:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def _lookup_filtered(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """:meth:`lookup` over the tiers a request's load filter allows (a HIT is promoted from
        them only: :meth:`submit_load` reads only those)."""
        names = self._load_filtered[req_context.req_id].load_tiers(self.store)
        if names is None:
            return self.lookup(key, ReqContext(req_id=""))
        skey = self._skey(key)
        if skey in self._writing:
            self._collect()
            if skey in self._writing:
                return LookupResult.RETRY
        if not self.store.route_among(key_group(key), names).tiers:
            self.counters["lookup_tier_filtered"] += 1
            return LookupResult.MISS
        lk = self._lookups_among.get(names)
        if lk is None:
            lk = self._lookups_among[names] = AsyncLookups(lambda keys: self.store.lookup_async(keys, tiers=names))
        state = self.store.probe_among(skey, names) or lk.answer(skey)
        if state is None or state == "pending":
            return LookupResult.RETRY
        return LookupResult.HIT if state == "hit" else LookupResult.MISS

    def _controls_store(
        self, job_id: int, items: list[tuple[bytes, Any]], skipped: list[bytes], ctx: ReqContext
    ) -> tuple[list[tuple[bytes, Any]], frozenset[str] | None]:
        """A cascade under the request's controls: nothing for a no-store request, only the groups
        its store filter leaves a tier for, only what admission admits (sightings: cascades, one
        per request); held chunks of a retaining request retained now, written ones when written."""
        controls = request_controls(ctx, self.store)
        if controls.stores_nothing:
            self.counters["store_chunks_not_stored_by_request"] += len(items)
            return [], None
        names = controls.store_tiers(self.store)
        if names is not None:
            kept = [it for it in items if self.store.route_among(key_group(it[0]), names).tiers]
            self.counters["store_chunks_tier_filtered"] += len(items) - len(kept)
            items = kept
        if items and self.store.admission_active:
            ok = self.store.admit([k for k, _ in items], controls.seen, chunk_bytes=int(self.block_size_bytes))
            self.counters["store_chunks_declined_by_admission"] += len(ok) - sum(ok)
            items = [it for it, y in zip(items, ok) if y]
        if controls.retain is not None:
            if skipped:
                self._retain(skipped, controls.retain)
            if items:
                self._job_retain[job_id] = controls.retain
        return items, names

    def _controls_load(self, job_id: int, ctx: ReqContext) -> frozenset[str] | None:
        controls = ctx.get_state(RequestControls)
        if controls is None or controls.plain:
            return None
        if controls.retain is not None:
            self._job_retain[job_id] = controls.retain
        return controls.load_tiers(self.store)

    def _retain(self, skeys: Iterable[bytes], retain: Retain) -> None:
        retain_keys(self.store, skeys, retain, self.counters, nbytes=int(self.block_size_bytes))

    def _controls_schedule_end(self) -> None:
        for lk in self._lookups_among.values():
            lk.flush()
            lk.end_step()
        self.store.retention.expire()

    def _controls_reset(self) -> None:
        for lk in self._lookups_among.values():
            lk.clear()
        self._job_retain.clear()
        self.store.retention.release_all()
        self.store.admission.clear()


class _Either:
    """``key in`` either container (what KV events hold back: stores vLLM has not seen complete)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[bytes], b: Container[bytes]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b

    def __bool__(self) -> bool:
        return bool(self.a) or bool(self.b)

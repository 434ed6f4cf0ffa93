"""TieredStore: the standalone API — tiers + per-group policy + pipeline behind one object.

::

    import tieredkv
    store = tieredkv.open_store("config/tieredkv.yaml")        # or a dict / TieredKVConfig / None
    store.register_group(0, [k_cache, v_cache], blocks_per_chunk=4, kind="full")
    key = store.key(block_hash, group=0)
    job = store.store(0, [(key, (17, 18, 19, 20))])             # returns at once
    store.wait([job])                                          # or poll() from an engine loop
    state, tier = store.lookup([key])[0]                       # (KeyState.HIT, "cpu")
    store.load(0, [(key, (5, 6, 7, 8))]); store.wait_all()
    store.close()

Tensors may live on a CUDA device or on the CPU; the same code paths run in both cases.
Every store, load and record call takes a ``tenant=`` (a name: vLLM's ``cache_salt``, a
customer; see :mod:`tieredkv.tenants`): the records it writes are that tenant's, bounded by its
quota in each tier that keeps tenants, and :meth:`TieredStore.tenant_usage` reports each
tenant's bytes per tier.
Request-level planning (which chunks of which request to store or load, across several KV
groups) is :class:`tieredkv.planner.OffloadScheduler` (:meth:`TieredStore.planner`), over the
planner core the vLLM connector plans with too; ``tieredkv demo`` shows the two used together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import operator
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Self

import torch

from tieredkv.backends.base import Tier, TierStats
from tieredkv.backends.registry import build_tier
from tieredkv.catalog import write_catalog
from tieredkv.config import TieredKVConfig, load_config
from tieredkv.controls import StoreControls, TiersArg
from tieredkv.errors import ConfigError, TierClosedError, TieredKVError, TierTimeoutError
from tieredkv.groups import GroupKind, GroupLayout, GroupSpec
from tieredkv.keys import (
    MIN_STORED_KEY_BYTES,
    GroupGeometry,
    Namespace,
    ParallelLayout,
    group_suffix,
    key_fingerprint,
    key_group,
    tenant_id,
)
from tieredkv.metrics import MetricsServer, TieredKVMetrics, start_metrics_server
from tieredkv.pipeline import (
    ChunkRef,
    GroupStats,
    JobResult,
    KeyState,
    LaneStats,
    LoadJob,
    Pipeline,
    PipelineStats,
    StoreJob,
)
from tieredkv.pipeline.events import TierEvent
from tieredkv.planner import OffloadScheduler
from tieredkv.policy import GroupRoute, TierPolicy
from tieredkv.staging import KVGroupTensors
from tieredkv.tenants import TenantQuotas
from tieredkv.weights import namespace_weights

try:  # the optional C helper (setup.py): a call's chunks checked in one C call
    from tieredkv._fastrec import check_chunks as _check_chunks
except ImportError:  # not built here (or built before it had it): the Python loop below
    _check_chunks = None

__all__ = ["KeyState", "TieredStore", "open_store"]

ChunkArg = tuple[bytes, Sequence[int]]
#: A tenant as callers name it: a name (str / bytes), an id from ``tenant_id`` (int), or None.
TenantArg = str | bytes | int | None

#: Longest stored key any tier takes (LMDB's default key limit is 511 bytes).
MAX_KEY_BYTES = 511


class TieredStore(StoreControls):
    """Tiers, policy and pipeline for one namespace. Thread-safe to call from one engine thread."""

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        namespace: Namespace | None = None,
        tiers: Sequence[Tier] | None = None,
        parallel: ParallelLayout | None = None,
        catalog: bool | None = None,
    ) -> None:
        self.config = config
        # namespace catalog (tieredkv.catalog): fingerprints whose record this store has written;
        # by default only in tiers it builds itself (a caller that hands in its tiers owns them)
        self._catalog: set[bytes] | None = set() if (tiers is None if catalog is None else catalog) else None
        ns = config.namespace
        # A namespace given whole (the vLLM integrations build theirs from vLLM's config) is used as
        # is. One built from the config is completed from what the engine itself says: the dtype
        # and per-group geometry of the registered tensors, and the parallel layout (``parallel``
        # if given, else torch.distributed's rank and world size when it is initialized).
        self._derive = namespace is None
        # keys must carry this namespace's fingerprint only when the store made it (an integration
        # that passes its own namespace may move it on, e.g. a new cache generation)
        self._own_namespace = namespace is None
        self._geometry: dict[int, tuple[GroupGeometry, tuple[str, ...]]] = {}
        self._specs: dict[int, tuple[GroupSpec, bool]] = {}  # spec, and whether the caller gave it whole
        self._num_blocks: dict[int, int] = {}
        self._closed = False
        #: Whether the engine's block hashes are the same in the next process (records of persistent
        #: tiers hit after a restart): set by an integration that can tell (vLLM's hash seed), None
        #: otherwise. Reported as the ``tieredkv_block_hashes_reproducible`` gauge.
        self.block_hashes_reproducible: bool | None = None
        self.namespace = namespace or Namespace(
            model=ns.model,
            revision=ns.revision,
            dtype=ns.dtype,
            tenant_salt=ns.tenant_salt,
            parallel=parallel or _distributed_layout(),
            weights=namespace_weights(ns.weights_path, ns.weights_fingerprint),
        )
        self.tiers = list(tiers) if tiers is not None else [build_tier(t) for t in config.tiers]
        self._quotas = quotas = TenantQuotas.from_config(config.tenants)
        for t in self.tiers:
            t.set_quotas(quotas)
        self.policy = TierPolicy(config.policy, [t.name for t in self.tiers])
        self.pipeline = Pipeline(self.tiers, self.policy, config.pipeline)
        #: ``probe(key)``: answer a lookup of ``key`` at once from the calling thread when every
        #: tier of its route can tell without waiting (CPU slab, local LMDB): pending, hit or miss;
        #: None: ask :meth:`lookup_async`. The pipeline's own method (vLLM's scheduler calls it
        #: once per key per step).
        self.probe: Callable[[bytes], KeyState | None] = self.pipeline.probe
        #: ``probe_prefix(keys, start=0, writing=())``: ``probe`` of ``keys[start:]`` in order, up
        #: to and including the first answer that is neither HIT nor PENDING, counted once (a
        #: scheduler's prefix scan); keys in ``writing`` are PENDING.
        self.probe_prefix: Callable[..., list[KeyState | None]] = self.pipeline.probe_prefix
        #: ``probe_many(keys)``: ``probe`` of each key where it can be answered in the calling
        #: thread within bounded time, a tier that cannot tell without waiting asked once for all
        #: (Redis: one pipelined ``EXISTS`` within its ``lookup_budget_ms``); None: ask
        #: :meth:`lookup_async`. A scheduler's request, its whole prefix in one round trip.
        self.probe_many: Callable[[Sequence[bytes]], list[KeyState | None]] = self.pipeline.probe_many
        #: ``activity()``: a number that moves whenever a counter :meth:`stats` reports may have
        #: moved (a job, write-back or batched lookup ended, a store was refused, a group
        #: registered): a caller polling every engine step reads the counters only when it moved.
        #: The pipeline's own method, like ``probe``.
        self.activity: Callable[[], int] = self.pipeline.activity
        self._init_controls(config)
        self.metrics = TieredKVMetrics(self.tiers, pipeline=self.pipeline, engine=self)
        self.metrics_server: MetricsServer | None = None
        self._ids = itertools.count(1)
        self._results: dict[int, JobResult] = {}
        self._open_jobs: set[int] = set()

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, *, stats_interval_s: float = 5.0) -> Self:
        """Start the pipeline (opening the tiers) and, when ``metrics.port`` is set, ``/metrics``."""
        self.pipeline.start()
        self.metrics_server = start_metrics_server(self.config.metrics, self.metrics.registry)
        if self.metrics_server is not None:
            self.pipeline.run_background(self._refresh_stats(stats_interval_s))
        return self

    async def _refresh_stats(self, interval: float) -> None:
        while True:  # capacity / usage gauges; counters are read live at scrape time
            await self.metrics.refresh_stats()
            await asyncio.sleep(interval)

    def close(self, timeout: float = 10.0) -> None:
        """Finish (or cancel after ``timeout``) every job, close the tiers and the metrics endpoint.
        Idempotent."""
        self._closed = True
        self.pipeline.close(timeout)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- groups and keys ---------------------------------------------------------------

    def register_group(
        self,
        group: int | GroupSpec,
        tensors: Sequence[Any],
        *,
        blocks_per_chunk: int = 1,
        kind: str = "full",
        null_block: int | None = None,
    ) -> GroupRoute:
        """Declare a KV group and its tensors (block id first): a whole
        :class:`~tieredkv.groups.GroupSpec` (what :meth:`planner` needs), or an index with the
        chunk size in blocks and the kind. The one place a group's spec is built: it feeds the
        pipeline (route, transfers), the namespace and the planner.

        Register every group before making keys: unless the store was given a whole namespace,
        the group's dtype and geometry join the namespace fingerprint (an fp16 and a bf16 engine
        on one YAML never share a record). Registering a group again with another shape raises
        ``ValueError``.

        ``null_block``: a block id that, in a :meth:`load`'s chunk, marks a position not to copy
        (vLLM's null block is 0: a sliding-window chunk partly out of the window). By default no
        id is special: a load into block 0 fills block 0."""
        self._check_open("register_group")
        index = group.index if isinstance(group, GroupSpec) else group
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**32:
            raise ValueError(f"register_group: group={index!r} is invalid: expected an integer 0..2**32-1")
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise ValueError(
                f"register_group({index}): blocks_per_chunk={blocks_per_chunk!r} is invalid: "
                "expected an integer >= 1 (GPU blocks per stored chunk)"
            )
        _check_tensors(index, tensors)
        n_blocks = int(tensors[0].shape[0])
        if null_block is not None and (
            isinstance(null_block, bool) or not isinstance(null_block, int) or not 0 <= null_block < n_blocks
        ):
            raise ValueError(
                f"register_group({index}): null_block={null_block!r} is invalid: expected None (no null block)"
                f" or a block id 0..{n_blocks - 1} (vLLM's is 0)"
            )
        kv = KVGroupTensors(tensors)
        spec, exact = _group_spec(group, kv, blocks_per_chunk, kind)
        geometry = GroupGeometry.from_spec(spec, exact=exact)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
        old = self._geometry.get(index)
        if old is not None and old != (geometry, dtypes):
            raise ValueError(
                f"register_group({index}): group {index} is registered already as {old[0]} {list(old[1])}; "
                f"got {geometry} {list(dtypes)}. Register each group once (a new shape needs a new store)"
            )
        route = self.pipeline.register_group(spec, tensors, null_block=null_block)
        self._specs[index] = (spec, exact)
        self._geometry[index] = (geometry, dtypes)
        self._num_blocks[index] = n_blocks  # one count for all (_check_tensors)
        if self._derive:
            ordered = [self._geometry[g] for g in sorted(self._geometry)]
            self.namespace = dataclasses.replace(
                self.namespace,
                groups=tuple(geo for geo, _ in ordered),
                dtype="+".join(sorted({d for _, ds in ordered for d in ds})),
            )
        return route

    @property
    def groups(self) -> dict[int, GroupSpec]:
        """The registered groups' specs, by index."""
        return {g: spec for g, (spec, _) in sorted(self._specs.items())}

    def planner(self, tokens_per_hash: int, **options: Any) -> OffloadScheduler:
        """An :class:`~tieredkv.planner.OffloadScheduler` over the registered groups, in
        registration order (``options``: its keyword arguments). Every group must have been
        registered with a whole :class:`~tieredkv.groups.GroupSpec` (tokens per block known)."""
        partial = [g for g, (_, exact) in self._specs.items() if not exact]
        if partial:
            raise ConfigError(
                f"planner: groups {partial} were registered by index, so their tokens per block are"
                " unknown; register them with a GroupSpec (register_group(GroupSpec(...), tensors))"
            )
        return OffloadScheduler(GroupLayout(tuple(s for s, _ in self._specs.values()), tokens_per_hash), **options)

    def with_geometry(self, groups: Sequence[GroupGeometry]) -> TieredStore:
        """Bind the namespace to the KV geometry (call before storing anything); it then stays as
        given (registered tensors no longer change it)."""
        self.namespace = dataclasses.replace(self.namespace, groups=tuple(groups))
        self._derive = False
        return self

    def key(self, block_hash: bytes, group: int) -> bytes:
        """The stored key of ``block_hash`` in ``group`` under this store's namespace."""
        return self.namespace.key(block_hash, group)

    def stored_key(self, chunk_key: bytes) -> bytes:
        """The stored key of a chunk key (``hash + group``, e.g. vLLM's ``OffloadKey``)."""
        return self.namespace.stored_key(chunk_key)

    # ---- operations --------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], timeout: float | None = 5.0) -> list[tuple[KeyState, str | None]]:
        """Per key: ``(HIT, tier)``, ``(PENDING, None)`` while a store is in flight, or ``(MISS, None)``."""
        return self.pipeline.lookup(keys, timeout)

    def store(
        self, group: int, chunks: Iterable[ChunkArg], *, tenant: TenantArg = None, tiers: TiersArg = None
    ) -> int | None:
        """Submit whole chunks ``(key, block_ids)`` of ``group`` for storing. Returns the job id at
        once, or None when refused (staging full: back-pressure; offer the chunks again later).
        A job larger than the whole staging pool is accepted once some staging is free and moves
        through it in parts (see :meth:`tieredkv.pipeline.Pipeline.submit_store`).

        ``tenant``: whose records these are — a name (``str`` / ``bytes``: vLLM's
        ``cache_salt``, a customer id), an id :func:`~tieredkv.keys.tenant_id` made (``int``), or
        None (the default tenant, no quota). A tier that keeps tenants bounds each by its quota
        (the config's ``tenants``): a store that would take the tenant over it evicts that
        tenant's own oldest records there first, and one larger than its whole quota is refused
        there (the job's ``failed`` keys).

        ``tiers``: write only the group's route tiers among these names (a request's tier filter;
        :meth:`route_among`); None: the whole route."""
        refs = self._checked(group, chunks, "store")
        route = self._job_route(group, tiers, "store")
        self._catalog_namespace()
        job_id = next(self._ids)
        tid = 0 if tenant is None else as_tenant_id(tenant)
        if not self.pipeline.submit_store(StoreJob(job_id, group, refs, tid, route)):
            return None
        self._open_jobs.add(job_id)
        return job_id

    def load(
        self,
        group: int,
        chunks: Iterable[ChunkArg],
        *,
        skip_blocks: int = 0,
        tenant: TenantArg = None,
        tiers: TiersArg = None,
    ) -> int | None:
        """Submit a load of whole chunks into their blocks (see :class:`~tieredkv.pipeline.LoadJob`).
        Returns the job id at once, or None when refused (back-pressure). A job larger than the
        whole staging pool moves through it in parts, like :meth:`store`. ``tenant`` (as in
        :meth:`store`): a chunk promoted from a lower tier into the first one becomes that
        tenant's record there, counted against its quota. ``tiers``: read (and promote into) only
        the group's route tiers among these names, as in :meth:`store`."""
        refs = self._checked(group, chunks, "load")
        route = self._job_route(group, tiers, "load")
        bpc = self._geometry[group][0].blocks_per_chunk
        if isinstance(skip_blocks, bool) or not isinstance(skip_blocks, int) or not 0 <= skip_blocks < bpc:
            raise ValueError(
                f"load: skip_blocks={skip_blocks!r} is invalid: expected 0..{bpc - 1} "
                f"(blocks to skip inside the first chunk of group {group})"
            )
        job_id = next(self._ids)
        tid = 0 if tenant is None else as_tenant_id(tenant)
        if not self.pipeline.submit_load(LoadJob(job_id, group, refs, skip_blocks, tid, route)):
            return None
        self._open_jobs.add(job_id)
        return job_id

    def locate(self, key: bytes) -> str | None:
        """The name of the first tier of ``key``'s route that holds it, as far as the tiers can
        tell without waiting (see :meth:`Pipeline.locate`); None when unknown."""
        return self.pipeline.locate(key)

    def tier_medium(self, name: str) -> str:
        """Where tier ``name``'s records live (:attr:`TierCapabilities.medium`)."""
        for t in self.tiers:
            if t.name == name:
                return t.capabilities.medium
        return "unspecified"

    def pin(self, keys: Sequence[bytes]) -> None:
        """Protect ``keys`` from eviction (an accepted hit about to be loaded)."""
        self.pipeline.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.pipeline.unpin(keys)

    def poll(self) -> list[JobResult]:
        """Results finished since the last call, including ones a ``wait`` collected but did not ask for."""
        self._collect()
        out = list(self._results.values())
        self._results.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = 30.0) -> dict[int, JobResult]:
        """Block until the given jobs finish; returns their results (others stay for ``poll``)."""
        want = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._collect()
            if want <= self._results.keys():
                return {j: self._results.pop(j) for j in want}
            if deadline is not None and time.monotonic() > deadline:
                raise TierTimeoutError(f"jobs {sorted(want - self._results.keys())} not finished after {timeout}s")
            time.sleep(0.0005)

    def wait_all(self, timeout: float | None = 30.0) -> dict[int, JobResult]:
        return self.wait(set(self._open_jobs) | set(self._results), timeout)

    def stats(self) -> PipelineStats:
        """The pipeline's typed stats (what ``/metrics`` exports): counters, per-tier lanes,
        per-group hits/misses/stores/bytes, staging."""
        return self.pipeline.stats()

    def live_counts(self) -> tuple[dict[str, LaneStats], dict[int, GroupStats]]:
        """Per-tier lane stats and the *live* per-group counters (read, never write): the cheap
        read for a caller polling every engine step; :meth:`stats` is the full snapshot."""
        return self.pipeline.live_counts()

    # ---- raw records (callers that hold the bytes in host memory: vLLM's secondary tier) -------

    def put_records(
        self,
        items: Sequence[tuple[bytes, Any]],
        *,
        job_id: int | None = None,
        tenant: TenantArg = None,
        tiers: TiersArg = None,
    ) -> int | None:
        """Store ``(stored key, host buffer)`` records (of ``tenant``, as in :meth:`store`), each
        routed by its key's group (over its route tiers among ``tiers``, when given). Returns the
        job id (``job_id`` if given) at once, or None when refused (store closed). Keep the buffers
        unchanged until the job's result (kind ``"put"``) is polled."""
        return self._submit_records("put", items, job_id, tenant, tiers)

    def get_records(
        self,
        items: Sequence[tuple[bytes, Any]],
        *,
        job_id: int | None = None,
        tenant: TenantArg = None,
        tiers: TiersArg = None,
    ) -> int | None:
        """Read ``(stored key, writable host buffer)`` records, each buffer filled completely by its
        record. Result kind ``"get"``: ``done`` found and copied, ``failed`` missing. ``tenant``:
        as in :meth:`load` (promotions are its records); ``tiers``: as in :meth:`put_records`."""
        return self._submit_records("get", items, job_id, tenant, tiers)

    def _submit_records(
        self,
        kind: str,
        items: Sequence[tuple[bytes, Any]],
        job_id: int | None,
        tenant: TenantArg,
        tiers: TiersArg = None,
    ) -> int | None:
        jid = next(self._ids) if job_id is None else int(job_id)
        if kind == "put":
            self._catalog_namespace()
        submit = self.pipeline.submit_put if kind == "put" else self.pipeline.submit_get
        allowed = None if tiers is None else frozenset(tiers)
        if not submit(jid, items, 0 if tenant is None else as_tenant_id(tenant), allowed):
            return None
        self._open_jobs.add(jid)
        return jid

    def _catalog_namespace(self) -> None:
        """The first store under a namespace writes its catalog record (model, revision, weights)
        in the persistent tiers, in the background (:mod:`tieredkv.catalog`)."""
        if self._catalog is not None and self.namespace.fingerprint not in self._catalog:
            self._catalog.add(self.namespace.fingerprint)
            self.pipeline.run_background(write_catalog(self.tiers, self.namespace))

    # ---- non-blocking lookups and tier calls --------------------------------------------------

    def lookup_async(
        self, keys: Sequence[bytes], tiers: TiersArg = None
    ) -> concurrent.futures.Future[list[tuple[KeyState, str | None]]]:
        """Like :meth:`lookup` but a ``concurrent.futures.Future`` at once (never blocks); raises
        :class:`~tieredkv.errors.TierClosedError` when the store is not running. ``tiers``: ask
        only each key's route tiers among these names (a request's tier filter)."""
        return self.pipeline.lookup_future(keys, None if tiers is None else frozenset(tiers))

    def is_pending(self, key: bytes) -> bool:
        """Is a store of ``key`` in flight (submitted, not yet written)?"""
        return self.pipeline.is_pending(key)

    def record_tier_events(self) -> None:
        """From now on keep, per tier, the stored keys it comes to hold (each batch its writers
        store, write back or promote) and those it stops holding by its own doing (evictions,
        its server's expiries, corrupt records), in order, for :meth:`take_tier_events`: what an
        engine's KV events are made of (vLLM: :mod:`tieredkv.integrations.vllm.events`). Costs
        nothing until called; a store that is recording must be taken from regularly."""
        self._check_open("record_tier_events")
        self.pipeline.record_tier_events()

    def take_tier_events(self) -> list[TierEvent]:
        """The tier events since the last call, oldest first (none unless
        :meth:`record_tier_events` was called): ``TierEvent(tier, removed, keys)``."""
        events = self.pipeline.events
        return events.take() if events is not None else []

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job (write-backs included) has finished; False on timeout.
        Results stay for :meth:`poll` / :meth:`wait`."""
        return self.pipeline.drain(timeout)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 30.0) -> Any:
        """Run ``coro`` — a call on one of :attr:`tiers`, e.g. ``tier.stats()`` or
        ``tier.delete_many(keys)`` — on the store's loop (where the tiers live) and return its result."""
        return self.pipeline.run(coro, timeout)

    def tenant_usage(self, timeout: float = 10.0) -> dict[str, dict[int, int] | None]:
        """Per tier, the bytes each tenant holds there (by tenant id, :func:`~tieredkv.keys.tenant_id`;
        the default tenant under 0; label them with ``quotas.label``); None for a tier that does
        not keep tenants or cannot answer (unreachable or past ``timeout``)."""
        out: dict[str, dict[int, int] | None] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = self.run(tier.tenant_usage(), timeout)
            except (TieredKVError, TimeoutError):
                out[tier.name] = None
        return out

    @property
    def quotas(self) -> TenantQuotas:
        """The tenants' quotas (the config's ``tenants`` section), as every tier applies them."""
        return self._quotas

    def tier_stats(self, timeout: float = 10.0) -> dict[str, TierStats | None]:
        """Each tier's :class:`~tieredkv.backends.base.TierStats` now; None for a tier that cannot
        answer (unreachable or past ``timeout``)."""
        out: dict[str, TierStats | None] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = self.run(tier.stats(), timeout)
            except (TieredKVError, TimeoutError):
                out[tier.name] = None
        return out

    def prefault_staging(self) -> None:
        """Touch every page of the staging pool now (:meth:`~tieredkv.staging.StagingPool.prefault`):
        the state of a store that has moved its pool's capacity once. For benches, whose fresh
        stores would otherwise time the first touch of the pool; an engine need not call it."""
        self.pipeline.staging.prefault()

    @property
    def staging_capacity(self) -> int:
        """Bytes of the staging pool (a job larger than this moves through it in parts)."""
        return int(self.pipeline.staging.capacity)

    # ---- input checks (at the call: nothing a caller passes reaches a writer lane unchecked) ----

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise TierClosedError(f"{op}: the store is closed; open a new one with tieredkv.open_store()")

    def _checked(self, group: int, chunks: Iterable[ChunkArg], op: str) -> tuple[ChunkRef, ...]:
        """Validate a store/load call's chunks: registered group, well-formed keys of that group and
        this namespace, whole chunks of in-range block ids. Raises ``ValueError`` / ``TypeError``.

        Once per chunk on the engine thread, so the loop body is C calls only: the key's bounds,
        namespace and group in one test, the ids' range once for the whole call; a chunk that
        fails is examined again by :meth:`_bad_chunk` to say what is wrong with it."""
        self._check_open(op)
        if group not in self._geometry:
            raise ValueError(f"{op}: group={group!r} is not registered; call register_group({group!r}, ...) first")
        bpc = self._geometry[group][0].blocks_per_chunk
        fp = self.namespace.fingerprint if self._own_namespace else b""
        suffix = group_suffix(group)
        if _check_chunks is not None:  # the C helper takes the common forms in one call
            if type(chunks) is not list and type(chunks) is not tuple:
                chunks = list(chunks)
            got = _check_chunks(
                chunks, ChunkRef, fp, suffix, bpc, self._num_blocks[group], MIN_STORED_KEY_BYTES, MAX_KEY_BYTES
            )
            if type(got) is tuple:
                return got
            # a chunk it does not take: checked again below, which says what is wrong with it
        index = operator.index
        new = tuple.__new__
        refs: list[ChunkRef] = []
        every: list[int] = []  # every block id of the call, range-checked at the end
        for i, item in enumerate(chunks):
            try:
                key, ids = item
                if type(key) is not bytes:
                    key = bytes(key) if isinstance(key, (bytes, bytearray, memoryview)) else None
                block_ids = tuple(map(index, ids))
            except (TypeError, ValueError):
                raise self._bad_chunk(op, group, i, item) from None
            if (
                key is None
                or not MIN_STORED_KEY_BYTES <= len(key) <= MAX_KEY_BYTES
                or not key.startswith(fp)
                or not key.endswith(suffix)
                or len(block_ids) != bpc
            ):
                raise self._bad_chunk(op, group, i, item)
            refs.append(new(ChunkRef, (key, block_ids)))
            every += block_ids
        n_blocks = self._num_blocks[group]
        if every and (min(every) < 0 or max(every) >= n_blocks):
            i = next(i for i, r in enumerate(refs) if not all(0 <= b < n_blocks for b in r.block_ids))
            raise self._bad_chunk(op, group, i, refs[i])
        return tuple(refs)

    def _bad_chunk(self, op: str, group: int, i: int, item: Any) -> Exception:
        """What is wrong with chunk ``i`` of a call :meth:`_checked` refused (the slow path)."""
        try:
            key, ids = item
        except (TypeError, ValueError):
            return TypeError(f"{op}: chunk {i} is {item!r}; expected (key: bytes, block_ids)")
        if not isinstance(key, (bytes, bytearray, memoryview)):
            return TypeError(f"{op}: chunk {i} key is {type(key).__name__}; expected bytes from store.key()")
        key = bytes(key)
        if not MIN_STORED_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            return ValueError(
                f"{op}: chunk {i} key is {len(key)} bytes; expected {MIN_STORED_KEY_BYTES}..{MAX_KEY_BYTES} bytes from store.key()"
            )
        fp = self.namespace.fingerprint
        if self._own_namespace and not key.startswith(fp):
            return ValueError(
                f"{op}: chunk {i} key belongs to another namespace (fingerprint "
                f"{key_fingerprint(key).hex()}, this store's is {fp.hex()}); build keys "
                "with this store's key() after registering its groups"
            )
        if key_group(key) != group:
            return ValueError(f"{op}: chunk {i} key is of group {key_group(key)}, not of group {group}")
        try:
            block_ids = tuple(map(operator.index, ids))
        except TypeError:
            return TypeError(f"{op}: chunk {i} block ids {ids!r} are not integers")
        bpc = self._geometry[group][0].blocks_per_chunk
        if len(block_ids) != bpc:
            return ValueError(
                f"{op}: chunk {i} has {len(block_ids)} block ids; group {group} chunks are "
                f"{bpc} blocks (blocks_per_chunk)"
            )
        n_blocks = self._num_blocks[group]
        bad = [b for b in block_ids if not 0 <= b < n_blocks]
        return ValueError(
            f"{op}: chunk {i} block ids {bad} are out of range 0..{n_blocks - 1} of group {group}'s tensors"
        )

    def _collect(self) -> None:
        for r in self.pipeline.poll_finished():
            self._results[r.job_id] = r
            self._open_jobs.discard(r.job_id)


def as_tenant_id(tenant: str | bytes | int) -> int:
    """The tenant id of a call's ``tenant=``: a name (``str`` / ``bytes``, hashed by
    :func:`~tieredkv.keys.tenant_id`; empty: the default tenant) or an id it made (``int``)."""
    if isinstance(tenant, (str, bytes)):
        return tenant_id(tenant)
    if isinstance(tenant, int) and not isinstance(tenant, bool) and 0 <= tenant < 2**64:
        return tenant
    raise TypeError(
        f"tenant={tenant!r} is not a tenant: expected a name (str or bytes, e.g. vLLM's cache_salt),"
        " an id from tieredkv.keys.tenant_id (int), or None"
    )


def _check_tensors(group: int, tensors: Sequence[Any]) -> None:
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence) or not tensors:
        raise TypeError(f"register_group({group}): tensors must be a non-empty list of tensors (block id first)")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"register_group({group}): tensors[{i}] is {type(t).__name__}; expected a torch.Tensor")
        if t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(
                f"register_group({group}): tensors[{i}] has shape {tuple(t.shape)}; "
                "expected the block id as the first dimension"
            )
        if not t[0].is_contiguous():
            raise ValueError(
                f"register_group({group}): tensors[{i}] (shape {tuple(t.shape)}, stride {t.stride()}) "
                "does not hold each block contiguously; pass the KV cache tensor itself, not a "
                "transposed or strided view"
            )
    if len({int(t.shape[0]) for t in tensors}) > 1:
        raise ValueError(
            f"register_group({group}): tensors have different block counts {[int(t.shape[0]) for t in tensors]}"
        )


def _distributed_layout() -> ParallelLayout:
    """torch.distributed's rank and world size when it is initialized (each rank's KV bytes are its
    own shard), else a single worker."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return ParallelLayout(tp_size=dist.get_world_size(), rank=dist.get_rank())
    except (ImportError, RuntimeError):
        pass
    return ParallelLayout()


def _group_spec(group: int | GroupSpec, kv: KVGroupTensors, blocks_per_chunk: int, kind: str) -> tuple[GroupSpec, bool]:
    """The spec of a group being registered, and whether the caller gave it whole. By index, the
    tokens per block (and a sliding window's size) are unknown (:meth:`GroupSpec.by_index`), and
    the namespace records them as 0 (``GroupGeometry.from_spec(exact=False)``)."""
    if isinstance(group, GroupSpec):
        if group.bytes_per_block not in (0, kv.bytes_per_block):
            raise ValueError(
                f"register_group({group.index}): spec.bytes_per_block={group.bytes_per_block} but the tensors"
                f" hold {kv.bytes_per_block} bytes per block; fix the spec or pass the group's own tensors"
            )
        return dataclasses.replace(group, bytes_per_block=kv.bytes_per_block), True
    try:
        gkind = GroupKind(str(kind))
    except ValueError:
        raise ValueError(
            f"register_group({group}): kind={kind!r} is unknown; allowed: {[k.value for k in GroupKind]}"
        ) from None
    return GroupSpec.by_index(group, gkind, blocks_per_chunk, kv.bytes_per_block), False


def open_store(
    config: TieredKVConfig | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    namespace: Namespace | None = None,
    parallel: ParallelLayout | None = None,
) -> TieredStore:
    """Build and start a :class:`TieredStore` from a config (object, path, dict or defaults).

    ``parallel`` (tensor-parallel size and this worker's rank) wins over torch.distributed's; both
    are ignored when a whole ``namespace`` is given."""
    cfg = config if isinstance(config, TieredKVConfig) else load_config(config)
    return TieredStore(cfg, namespace=namespace, parallel=parallel).start()

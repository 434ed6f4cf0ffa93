"""``TieredKVOffloadingSpec``: tieredkv as a whole vLLM 0.33 ``OffloadingSpec``.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_name`` / ``spec_module_path``. The
spec owns both sides:

* :class:`TieredKVManager` (scheduler side) — tracks what is being written and asks tieredkv's
  tiers what is stored, never blocking: a key being written answers HIT_PENDING, an unknown key
  RETRY until a batched ``lookup_future`` (sent at the end of the step) resolves it.
  ``prepare_store`` is all-or-nothing: ``None`` (retry the same range later) when the chunks in
  flight would overrun the staging budget, never a key dropped for lack of space.
  ``prepare_load`` pins the chunks in every tier until ``complete_load``.
* :class:`TieredKVWorker` (worker side) — registers each KV group's tensors with tieredkv's
  pipeline (staging pool + copier; CUDA or CPU tensors) and turns vLLM's
  ``GPULoadStoreSpec`` + key list into per-group store / load jobs. The pipeline routes each
  group to its tiers by tieredkv's per-group policy (chunk bytes, kind).

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
from collections.abc import Collection, Sequence
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

from tieredkv.config import TieredKVConfig, load_config
from tieredkv.errors import ConfigError
from tieredkv.integrations.vllm.lookups import AsyncLookups
from tieredkv.integrations.vllm.namespace import group_kind, namespace_from_offloading_config
from tieredkv.keys import Namespace
from tieredkv.store import TieredStore

__all__ = ["TieredKVLoadStoreSpec", "TieredKVManager", "TieredKVOffloadingSpec", "TieredKVWorker"]

log = logging.getLogger(__name__)


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big")


class TieredKVLoadStoreSpec(LoadStoreSpec):
    """The medium side of a transfer: vLLM offload keys, group-major, ascending chunk."""

    def __init__(self, keys: Sequence[OffloadKey]) -> None:
        self.keys: list[OffloadKey] = list(keys)

    def __repr__(self) -> str:
        return f"TieredKVLoadStoreSpec({len(self.keys)} keys)"


# ---- one store per engine and process, shared by manager and worker ---------------------------

_STORES: dict[tuple[Any, ...], list[Any]] = {}
_STORES_LOCK = threading.Lock()


def _acquire_store(ident: tuple[Any, ...], cfg: TieredKVConfig, ns: Namespace) -> TieredStore:
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            entry = _STORES[ident] = [TieredStore(cfg, namespace=ns).start(), 0]
        entry[1] += 1
        return entry[0]


def _release_store(ident: tuple[Any, ...]) -> None:
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _STORES[ident]
    entry[0].close()


# ---- spec -------------------------------------------------------------------------------------


class TieredKVOffloadingSpec(OffloadingSpec):
    """``kv_connector_extra_config``: ``tieredkv_config`` (path of a tieredkv YAML; else
    ``$TIEREDKV_CONFIG``, else tieredkv's defaults), optional ``max_inflight_store_chunks``
    (default: what the staging pool holds), plus vLLM's own keys (``blocks_per_chunk``, ...)."""

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
        self.namespace = namespace_from_offloading_config(config, self.tkv_config)
        self.store_ident = (str(config.engine_id), self.namespace.fingerprint, str(source))
        chunk_bytes = max(1, int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk))
        staging = int(self.tkv_config.pipeline.staging_bytes)
        self.max_inflight_store_chunks = int(
            self.extra_config.get("max_inflight_store_chunks", 0) or max(1, staging // chunk_bytes // 2)
        )
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


# ---- scheduler side ---------------------------------------------------------------------------


class TieredKVManager(OffloadingManager):
    """Scheduler-side bookkeeping over tieredkv's tiers; every call returns at once."""

    def __init__(self, spec: TieredKVOffloadingSpec) -> None:
        self.spec = spec
        self.store = _acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
        self._fp = spec.namespace.fingerprint
        self._cap = spec.max_inflight_store_chunks
        self._writing: collections.Counter[bytes] = collections.Counter()
        self._inflight = 0
        self._stored: dict[bytes, None] = {}  # written by this engine, not since seen missing
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._lookups = AsyncLookups(self.store.pipeline)
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False

    def _skey(self, key: bytes) -> bytes:
        return self._fp + bytes(key)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        skey = self._skey(key)
        if skey in self._writing or self.store.pipeline.is_pending(skey):
            return LookupResult.HIT_PENDING
        state = self._lookups.answer(skey)
        if state is None:
            self.counters["lookup_retry"] += 1
            return LookupResult.RETRY
        if state == "hit":
            return LookupResult.HIT
        if state == "pending":
            return LookupResult.HIT_PENDING
        self._stored.pop(skey, None)
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        skeys = [self._skey(k) for k in keys]
        self.store.pin(skeys)
        self._pins.update(skeys)
        self.counters["load_chunks"] += len(skeys)
        return TieredKVLoadStoreSpec(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        skeys = [k for k in (self._skey(k) for k in keys) if self._pins[k] > 0]
        for k in skeys:
            self._pins[k] -= 1
            if not self._pins[k]:
                del self._pins[k]
        if skeys and not self._closed:
            self.store.unpin(skeys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        todo = [k for k in keys if (s := self._skey(k)) not in self._stored and s not in self._writing]
        if todo and self._inflight and self._inflight + len(todo) > self._cap:
            self.counters["prepare_store_deferred"] += 1
            return None  # all or nothing: the scheduler offers the same range again next step
        for k in todo:
            self._writing[self._skey(k)] += 1
        self._inflight += len(todo)
        self.counters["store_chunks"] += len(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=TieredKVLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        skeys = [self._skey(k) for k in keys]
        for s in skeys:
            n = self._writing.get(s, 0)
            if n <= 0:
                continue
            self._inflight -= 1
            if n == 1:
                del self._writing[s]
            else:
                self._writing[s] = n - 1
            if success:
                self._stored[s] = None
        self._lookups.forget(skeys)
        while len(self._stored) > (1 << 20):
            self._stored.pop(next(iter(self._stored)))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()
        self._lookups.end_step()

    def has_pending_work(self) -> bool:
        return self._lookups.busy()

    def reset_cache(self) -> None:
        self._stored.clear()
        self._lookups.clear()

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


class TieredKVWorker(OffloadingWorker):
    """GPU (or CPU stand-in) KV blocks ↔ tieredkv, one vLLM job = one or more tieredkv jobs."""

    def __init__(self, spec: TieredKVOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.store = _acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
        self._fp = spec.namespace.fingerprint
        self.bpc = int(spec.blocks_per_chunk)
        self.chunk_bytes: dict[int, int] = {}
        staging = int(self.store.pipeline.staging.capacity)
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
            route = self.store.register_group(g, tensors, blocks_per_chunk=self.bpc,
                                              kind=group_kind(spec.config.groups[g]))
            cb = sum(t[0].numel() * t.element_size() for t in tensors) * self.bpc
            self.chunk_bytes[g] = cb
            self._max_job_chunks[g] = max(1, staging // (4 * cb))
            log.info("tieredkv: group %d (%d-byte chunks) -> %s", g, cb, list(route.tiers))
        self._jobs: dict[int, _Job] = {}
        self._sub_to_job: dict[int, int] = {}
        self._retry: collections.deque[tuple[int, str, int, list[tuple[bytes, tuple[int, ...]]]]] = collections.deque()
        self._results: list[TransferResult] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False

    # ---- job building ---------------------------------------------------------------------

    def _per_group(self, keys: Sequence[bytes], gpu: GPULoadStoreSpec) -> list[tuple[int, list[bytes], list[int], int]]:
        """``(group, keys, block ids, first block index)`` of each group that has keys."""
        by_group: dict[int, list[bytes]] = collections.defaultdict(list)
        for k in keys:
            by_group[_group_of(k)].append(bytes(k))
        ids = [int(b) for b in gpu.block_ids]
        out, off = [], 0
        for g, size in enumerate(gpu.group_sizes):
            gids = ids[off : off + int(size)]
            off += int(size)
            if by_group.get(g):
                out.append((g, by_group.pop(g), gids, int(gpu.block_indices[g])))
        if by_group:
            raise ValueError(f"keys of groups {sorted(by_group)} have no GPU blocks in the spec")
        return out

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TieredKVLoadStoreSpec)
        job = self._jobs[job_id] = _Job("store")
        bpc = self.bpc
        for g, keys, ids, first in self._per_group(dst_spec.keys, src_spec):
            n = len(keys)
            missing = n * bpc - len(ids)
            if missing == 0 and first % bpc == 0:
                chunk_keys, chunk_ids = keys, ids
            elif missing > 0 and first % bpc == missing:
                # vLLM stores a chunk whose leading blocks are null (out of the window) partially;
                # tieredkv keeps whole chunks only: skip it (a later lookup answers MISS for it).
                chunk_keys, chunk_ids = keys[1:], ids[bpc - missing :]
                self.counters["partial_chunks_not_stored"] += 1
            else:
                self.counters["unmappable_chunks_not_stored"] += n
                log.warning("tieredkv: store job %d group %d: %d keys for %d blocks (first %d); not stored",
                            job_id, g, n, len(ids), first)
                continue
            chunks = [(self._fp + k, tuple(chunk_ids[i * bpc : (i + 1) * bpc])) for i, k in enumerate(chunk_keys)]
            self._submit(job_id, "store", g, chunks)
        self._maybe_finish(job_id, job)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, TieredKVLoadStoreSpec)
        job = self._jobs[job_id] = _Job("load")
        bpc = self.bpc
        for g, keys, ids, first in self._per_group(src_spec.keys, dst_spec):
            start = (first // bpc) * bpc
            chunks = []
            for i, k in enumerate(keys):
                placed = []
                for p in range(bpc):
                    logical = start + i * bpc + p - first
                    placed.append(ids[logical] if 0 <= logical < len(ids) else 0)
                chunks.append((self._fp + k, tuple(placed)))
            self._submit(job_id, "load", g, chunks)
        if expedited:
            self.wait({job_id})
        self._maybe_finish(job_id, job)
        return True

    def _submit(self, job_id: int, kind: str, group: int, chunks: list[tuple[bytes, tuple[int, ...]]]) -> None:
        step = self._max_job_chunks[group]
        for i in range(0, len(chunks), step):
            part = chunks[i : i + step]
            sub = self.store.store(group, part) if kind == "store" else self.store.load(group, part)
            if sub is None:  # staging full: keep the job open and offer it again on the next poll
                self._jobs[job_id].queued += 1
                self._retry.append((job_id, kind, group, part))
                self.counters[f"{kind}_backpressure"] += 1
            else:
                self._jobs[job_id].subs.add(sub)
                self._sub_to_job[sub] = job_id

    def _resubmit(self) -> None:
        for _ in range(len(self._retry)):
            job_id, kind, group, part = self._retry.popleft()
            sub = self.store.store(group, part) if kind == "store" else self.store.load(group, part)
            if sub is None:
                self._retry.append((job_id, kind, group, part))
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
        self._results.append(TransferResult(job_id=job_id, success=job.ok, transfer_size=job.nbytes,
                                            transfer_time=time.perf_counter() - job.t0))

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

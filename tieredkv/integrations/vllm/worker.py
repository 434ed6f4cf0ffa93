"""The worker side of :class:`~tieredkv.integrations.vllm.spec.TieredKVOffloadingSpec`:
:class:`TieredKVWorker`, vLLM's ``OffloadingWorker`` that turns a transfer's GPU blocks and keys
into tieredkv store / load jobs, per KV group."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tieredkv.integrations.vllm.shared import TieredKVLoadStoreSpec, acquire_store, release_store
from tieredkv.keys import key_group, partial_chunk_key, partial_valid_from, stored_key

if TYPE_CHECKING:
    from tieredkv.integrations.vllm.spec import TieredKVOffloadingSpec

__all__ = ["TieredKVWorker"]

log = logging.getLogger(__name__)


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


#: A transfer's request: its tenant id, and the tier names its tier filter allows (None: all).
_Whose = tuple[int, frozenset[str] | None]


class TieredKVWorker(OffloadingWorker):
    """GPU (or CPU stand-in) KV blocks ↔ tieredkv, one vLLM job = one or more tieredkv jobs.

    A chunk whose leading sub-blocks were not sent (a sliding-window chunk partly out of the
    window, a Mamba chunk with its one state block in the last slot) is stored as a partial
    record (:func:`~tieredkv.keys.partial_chunk_key`); a load that would read one of its
    invalid sub-blocks is refused (counted), never served.
    """

    def __init__(self, spec: TieredKVOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self._sh = acquire_store(spec.store_ident, spec.tkv_config, spec.namespace)
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
        # (job id, kind, group, chunks, (tenant, tiers)) of sub-jobs staging could not take yet
        self._retry: collections.deque[tuple[int, str, int, list[tuple[bytes, tuple[int, ...]]], _Whose]] = (
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
                self._submit(job_id, "store", g, chunks, (dst_spec.tenant, dst_spec.tiers))
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
                self._submit(job_id, "load", g, chunks, (src_spec.tenant, src_spec.tiers))
        if expedited:
            self.wait({job_id})
        self._maybe_finish(job_id, job)
        return True

    def _submit(
        self,
        job_id: int,
        kind: str,
        group: int,
        chunks: list[tuple[bytes, tuple[int, ...]]],
        whose: _Whose = (0, None),
    ) -> None:
        step = self._max_job_chunks[group]
        for i in range(0, len(chunks), step):
            part = chunks[i : i + step]
            sub = self._send(kind, group, part, whose)
            if sub is None:  # staging full: keep the job open and offer it again on the next poll
                self._jobs[job_id].queued += 1
                self._retry.append((job_id, kind, group, part, whose))
                self.counters[f"{kind}_backpressure"] += 1
            else:
                self._jobs[job_id].subs.add(sub)
                self._sub_to_job[sub] = job_id

    def _send(self, kind: str, group: int, part: list[tuple[bytes, tuple[int, ...]]], whose: _Whose) -> int | None:
        tenant, tiers = whose  # the request's tenant, and the tiers its tier filter allows (None: all)
        if kind == "store":
            return self.store.store(group, part, tenant=tenant, tiers=tiers)
        return self.store.load(group, part, tenant=tenant, tiers=tiers)

    def _resubmit(self) -> None:
        for _ in range(len(self._retry)):
            job_id, kind, group, part, whose = self._retry.popleft()
            sub = self._send(kind, group, part, whose)
            if sub is None:
                self._retry.append((job_id, kind, group, part, whose))
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
        release_store(self.spec.store_ident)

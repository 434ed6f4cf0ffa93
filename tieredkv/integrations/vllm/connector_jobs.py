"""vLLM's wire for ``TieredKVConnector``: the store jobs, fences and events of what was decided.

The planner core (:mod:`tieredkv.planner`) decides which chunks and boundary states to offer, and
what the manager's answer does; these functions only register what the manager accepted the way
vLLM 0.33's ``OffloadingConnectorScheduler`` does for its own stores: a job id in the request's
``transfer_jobs``, a ``TransferJobStatus`` in ``_jobs``, fences on the source blocks (sliding-window
and Mamba blocks at once, full-attention blocks deferred, or at once for a finished request),
``KV events`` when self-describing events are on, and the ``TransferJob`` the workers run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from tieredkv.integrations.vllm.compat import (
    GPULoadStoreSpec,
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    OffloadKey,
    RequestOffloadState,
    TransferJob,
    TransferJobStatus,
)
from tieredkv.planner import ChunkToStore

__all__ = ["boundary_job", "chunks_job", "drop_unsent_jobs"]


def chunks_job(
    sched: OffloadingConnectorScheduler,
    status: RequestOffloadState,
    offers: Sequence[Sequence[ChunkToStore]],
    accepted: Collection[OffloadKey],
    dst_spec: Any,
) -> tuple[int, TransferJob]:
    """Register the store of the ``accepted`` chunks of a plan (``offers``: per group, in the
    connector's group order) and return its job id and job. A group's blocks run from the first
    non-null block of its first accepted chunk (a partial sliding-window chunk starts mid-chunk)."""
    req = status.req
    src: list[int] = []
    group_sizes: list[int] = []
    block_indices: list[int] = []
    fenced: list[int] = []
    deferred: list[int] = []
    bpc = sched.config.blocks_per_chunk
    tracker = sched._events_tracker
    record = tracker.record_store if tracker.self_describing_enabled else None  # else a no-op
    for cfg, chunks in zip(sched.config.kv_group_configs, offers):
        windowed = cfg.sliding_window_size_in_chunks is not None
        start: int | None = None
        n = 0
        for c in chunks:
            if c.key not in accepted:
                continue
            if record is not None:
                record(req, cfg, c.chunk_index, c.key)
            for i, bid in enumerate(c.block_ids):
                if bid == 0:
                    continue
                if start is None:
                    start = c.chunk_index * bpc + i
                src.append(bid)
                n += 1
                (fenced if windowed else deferred).append(bid)
        group_sizes.append(n)
        block_indices.append(start or 0)
    job_id = _new_job(sched, status)
    for bid in fenced:
        sched._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
    sched._jobs[job_id] = TransferJobStatus(
        req_id=req.request_id,
        pending_count=sched.config.num_workers,
        keys=set(accepted),
        is_store=True,
        deferred_fence_block_ids=deferred,
        fenced_block_ids=fenced or None,
    )
    if req.is_finished():  # its blocks are freed: fence them now
        for bid in deferred:
            sched._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
            if bid in sched._current_batch_allocated_block_ids:
                sched._current_batch_jobs_to_flush.add(job_id)
    job = TransferJob(
        req_id=req.request_id,
        src_spec=GPULoadStoreSpec(src, group_sizes=group_sizes, block_indices=block_indices),
        dst_spec=dst_spec,
    )
    return job_id, job


def boundary_job(
    sched: OffloadingConnectorScheduler,
    status: RequestOffloadState,
    pos: int,
    cfg: GroupOffloadConfig,
    block_id: int,
    boundary: int,
    key: OffloadKey,
    dst_spec: Any,
) -> tuple[int, TransferJob]:
    """Register the store of a Mamba boundary state (one block of group position ``pos``, the
    state at ``boundary`` tokens) and return its job id and job."""
    req = status.req
    job_id = _new_job(sched, status)
    sched._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)
    sched._jobs[job_id] = TransferJobStatus(
        req_id=req.request_id,
        pending_count=sched.config.num_workers,
        keys={key},
        is_store=True,
        fenced_block_ids=[block_id],
    )
    num_groups = len(sched.config.kv_group_configs)
    sizes = [0] * num_groups
    sizes[pos] = 1
    indices = [0] * num_groups
    indices[pos] = boundary // cfg.tokens_per_block - 1
    job = TransferJob(
        req_id=req.request_id,
        src_spec=GPULoadStoreSpec([block_id], group_sizes=sizes, block_indices=indices),
        dst_spec=dst_spec,
    )
    sched._events_tracker.record_store(req, cfg, boundary // cfg.tokens_per_chunk - 1, key)
    return job_id, job


def drop_unsent_jobs(sched: OffloadingConnectorScheduler, job_ids: Iterable[int]) -> None:
    """Forget store jobs that never reached a worker (a finished request's early jobs, at a cache
    reset): out of ``_jobs`` and the request's jobs, both kinds of fence lifted."""
    for job_id in job_ids:
        job = sched._jobs.pop(job_id, None)
        if job is None:
            continue
        st = sched._req_status.get(job.req_id)
        if st is not None:
            st.transfer_jobs.discard(job_id)
        # early jobs are of finished requests: both kinds of fence were registered
        sched._remove_pending_job(job_id, job.fenced_block_ids)
        sched._remove_pending_job(job_id, job.deferred_fence_block_ids)


def _new_job(sched: OffloadingConnectorScheduler, status: RequestOffloadState) -> int:
    job_id = sched._generate_job_id()
    status.transfer_jobs.add(job_id)
    if status.req.request_id not in sched._req_status:  # a held request whose status vLLM dropped
        sched._req_status[status.req.request_id] = status
    return job_id

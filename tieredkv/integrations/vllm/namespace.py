"""The tieredkv namespace of a vLLM deployment, derived from vLLM's ``OffloadingConfig``.

No vLLM import: the function reads attributes only, so it is testable without vLLM.
"""

from __future__ import annotations

from typing import Any

from tieredkv.config import TieredKVConfig
from tieredkv.keys import GroupGeometry, Namespace, ParallelLayout

__all__ = ["group_kind", "namespace_from_offloading_config"]


def group_kind(group: Any) -> str:
    """tieredkv's kind of an ``OffloadingGroupConfig``: a bounded window means sliding window."""
    return "full" if getattr(group, "sliding_window_size_in_chunks", None) is None else "sliding_window"


def namespace_from_offloading_config(
    config: Any,
    tkv: TieredKVConfig | None = None,
    *,
    bytes_per_block: int | None = None,
    rank: int | None = None,
) -> Namespace:
    """Namespace for the bytes vLLM offloads under ``config`` (a vLLM ``OffloadingConfig``).

    Model name and KV dtype come from ``config.model``; every group's tokens per block, window
    and the global blocks per chunk from ``config.groups`` / ``config.cache``; the parallel layout
    (TP / PP / PCP / DCP sizes and, for per-rank bytes, the rank) from ``config.parallel``.
    Revision and tenant salt come from the tieredkv config. ``bytes_per_block`` defaults to
    ``config.worker_kv_bytes_per_block``; ``rank`` to ``config.parallel.rank`` (pass 0 for bytes
    that hold every rank's pages, such as vLLM's primary rows).
    """
    bpc = int(config.cache.blocks_per_chunk)
    per_block = int(config.worker_kv_bytes_per_block if bytes_per_block is None else bytes_per_block)
    groups = []
    for g in config.groups:
        tpb = int(g.tokens_per_block)
        window_chunks = getattr(g, "sliding_window_size_in_chunks", None)
        groups.append(
            GroupGeometry(
                kind=group_kind(g),
                tokens_per_block=tpb,
                blocks_per_chunk=bpc,
                bytes_per_block=per_block,
                window_tokens=int(window_chunks) * tpb * bpc if window_chunks else 0,
            )
        )
    par = config.parallel
    agnostic = bool(getattr(par, "is_parallelism_agnostic", False))
    parallel = ParallelLayout(
        tp_size=1 if agnostic else int(par.tp_size),
        pp_size=1 if agnostic else int(par.pp_size),
        pcp_size=1 if agnostic else int(par.pcp_size),
        dcp_size=1 if agnostic else int(par.dcp_size),
        rank=int(par.rank if rank is None else rank),
    )
    ns = tkv.namespace if tkv is not None else None
    return Namespace(
        model=str(config.model.name),
        revision=ns.revision if ns is not None else "",
        dtype=str(config.model.dtype),
        groups=tuple(groups),
        parallel=parallel,
        tenant_salt=ns.tenant_salt if ns is not None else "",
    )

"""Load planning: the keys and destination blocks of an accepted hit, and what loading marks.

Rules: a load starts on whole GPU blocks and ends on a hit boundary (whole chunks of every group,
as :func:`tieredkv.planner.lookup.plan_lookup` answers); a group reads the chunks the hit needs
(full attention: all from the local prefix, sliding window: the window's, Mamba: the last one)
into its non-null blocks only; the loaded chunks count as stored (never offered again).
"""

from __future__ import annotations

from collections.abc import Sequence

from tieredkv.groups import GroupSpec
from tieredkv.planner.ledger import ChunkLedger
from tieredkv.planner.lookup import hit_chunks
from tieredkv.planner.plans import GroupLoadPlan
from tieredkv.planner.store import NULL_BLOCK

__all__ = ["check_load", "plan_group_load"]


def check_load(spec: GroupSpec, num_keys: int, num_blocks: int, computed: int, boundary: int) -> None:
    """Raise ValueError unless a load from ``computed`` to ``boundary`` tokens is possible in the group."""
    name = f"group {spec.index}"
    if computed % spec.tokens_per_block:
        raise ValueError(
            f"{name}: num_computed_tokens={computed} is not whole GPU blocks of {spec.tokens_per_block} tokens"
        )
    if boundary % spec.tokens_per_chunk:
        raise ValueError(
            f"{name}: hit boundary {boundary} is not whole chunks of "
            f"{spec.tokens_per_chunk} tokens; use plan_lookup's answer"
        )
    if boundary // spec.tokens_per_chunk > num_keys:
        raise ValueError(f"{name}: no keys up to token {boundary}")
    if num_blocks < boundary // spec.tokens_per_block:
        raise ValueError(f"{name}: blocks not allocated up to token {boundary}")


def plan_group_load(
    spec: GroupSpec,
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    led: ChunkLedger,
    computed: int,
    boundary: int,
) -> tuple[GroupLoadPlan, int]:
    """One group's load of a hit; its loaded chunks are marked done. Returns the plan and the
    group's hit end (in chunks)."""
    bpc = spec.blocks_per_chunk
    first_chunk, end_chunk = hit_chunks(spec, computed, boundary)
    first_block = max(computed // spec.tokens_per_block, first_chunk * bpc)
    dst: list[int] = []
    positions: list[int] = []
    for b in range(first_block, end_chunk * bpc):
        if block_ids[b] != NULL_BLOCK:
            dst.append(block_ids[b])
            positions.append(b)
    chunks = sorted({p // bpc for p in positions})
    led.mark_done_range(first_chunk, end_chunk)
    plan = GroupLoadPlan(
        group=spec.index,
        keys=tuple(keys[k] for k in chunks),
        chunk_indices=tuple(chunks),
        dst_block_ids=tuple(dst),
        block_positions=tuple(positions),
        start_offset=positions[0] - chunks[0] * bpc if positions else 0,
    )
    return plan, end_chunk

"""Lookup planning: what a hit may be, and what a lookup's misses tell the store ledger.

Rules, by construction:

1. A hit is a boundary every group serves with stored chunks: full-attention groups every chunk
   from the local prefix to the boundary, sliding-window groups the window's chunks before it,
   Mamba/SSM groups the chunk ending at it. So a hit is whole chunks in every group -- on every
   group's grid, the Mamba grid included: groups are asked again with the bound one of them
   lowered until they agree (:func:`plan_lookup`; the vLLM connector, over vLLM's own lookup:
   :func:`align_hit`). The last known token is always recomputed.
2. Misses are fed back (:meth:`~tieredkv.planner.ledger.ChunkLedger.missed`): a chunk the ledger
   counted as stored that a lookup finds missing was evicted, and is storable again -- in a
   full-attention group with every later chunk counted as stored, which the lookup did not
   confirm -- so a preempted request stores what it recomputes instead of trusting stale marks.

Every function here is vLLM-free; a lookup asks the store each key at most once (:class:`Probe`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from tieredkv.groups import GroupLayout, GroupSpec
from tieredkv.planner.ledger import ChunkLedger
from tieredkv.planner.plans import GroupLookup, LookupPlan

__all__ = ["Probe", "align_hit", "hit_chunks", "plan_lookup"]


class Probe:
    """Memoizes ``is_stored`` so a lookup asks about each key at most once."""

    __slots__ = ("_ask", "_seen")

    def __init__(self, is_stored: Callable[[bytes], bool] | Container[bytes]) -> None:
        self._ask: Callable[[bytes], bool] = is_stored if callable(is_stored) else is_stored.__contains__
        self._seen: dict[bytes, bool] = {}

    def __call__(self, key: bytes) -> bool:
        hit = self._seen.get(key)
        if hit is None:
            hit = self._seen[key] = bool(self._ask(key))
        return hit


def plan_lookup(
    layout: GroupLayout,
    groups: Sequence[tuple[Sequence[bytes], ChunkLedger]],
    *,
    num_tokens: int,
    num_computed_tokens: int,
    is_stored: Callable[[bytes], bool] | Container[bytes],
    max_load_tokens: int | None = None,
) -> LookupPlan:
    """The longest hit that is whole chunks in every group (rule 1), misses fed back (rule 2).

    Args:
        layout: The groups.
        groups: Per group (layout order), the request's chunk keys and store ledger.
        num_tokens: The request's known tokens (the last one is recomputed).
        num_computed_tokens: The local (GPU prefix cache) hit in tokens.
        is_stored: Answers whether a key is readable in the store.
        max_load_tokens: Optional cap on the tokens loaded beyond the prefix.
    """
    computed = num_computed_tokens
    probe = Probe(is_stored)
    bound = num_tokens - 1  # the last known token is always recomputed
    if max_load_tokens is not None:
        bound = min(bound, computed + max_load_tokens)
    for spec, (keys, _) in zip(layout.groups, groups):
        bound = min(bound, len(keys) * spec.tokens_per_chunk)
    full_prefix: dict[int, int] = {}
    while bound > computed:
        new = bound
        for pos, (spec, (keys, led)) in enumerate(zip(layout.groups, groups)):
            new = _group_boundary(spec, keys, led, computed, new, probe, full_prefix, pos)
            if new <= computed:
                break
        if new == bound:
            return _lookup_plan(layout, groups, computed, bound)
        bound = new
    return LookupPlan(computed, computed, 0)


def _group_boundary(
    spec: GroupSpec,
    keys: Sequence[bytes],
    led: ChunkLedger,
    computed: int,
    bound: int,
    probe: Probe,
    full_prefix: dict[int, int],
    pos: int,
) -> int:
    """Largest boundary <= ``bound`` this group can serve (<= computed: none)."""
    tpc = spec.tokens_per_chunk
    first, end = computed // tpc, bound // tpc
    wc = spec.window_chunks
    if wc is None:
        if pos not in full_prefix:  # scanned once per lookup; bound only shrinks
            k = first
            while k < end and probe(keys[k]):
                k += 1
            if k < end:
                led.missed(k, full=True)
            full_prefix[pos] = k
        return min(full_prefix[pos], end) * tpc
    while end > first:
        low = max(end - wc, first)
        k = end - 1
        while k >= low and probe(keys[k]):
            k -= 1
        if k < low:
            return end * tpc
        led.missed(k, full=False)
        end = k  # chunk k is missing: a valid end is at most k
    return 0


def _lookup_plan(
    layout: GroupLayout, groups: Sequence[tuple[Sequence[bytes], ChunkLedger]], computed: int, boundary: int
) -> LookupPlan:
    out = []
    for spec, (keys, _) in zip(layout.groups, groups):
        first, end = hit_chunks(spec, computed, boundary)
        out.append(GroupLookup(spec.index, first, end, tuple(keys[first:end])))
    return LookupPlan(computed, boundary, boundary - computed, tuple(out))


def hit_chunks(spec: GroupSpec, computed: int, boundary: int) -> tuple[int, int]:
    """The chunks of a group that a hit from ``computed`` to ``boundary`` reads: first, end."""
    tpc = spec.tokens_per_chunk
    end = boundary // tpc
    wc = spec.window_chunks
    first = computed // tpc
    return (first if wc is None else max(first, end - wc)), end


def align_hit(
    lookup: Callable[[int | None], int | None],
    num_computed_tokens: int,
    grid: int | None,
    max_new_tokens: int | None = None,
    *,
    slack: int = 1,
    on_shrink: Callable[[], None] | None = None,
) -> int | None:
    """A hit on ``grid`` (rule 1, over a lookup that aligns every group but that one).

    ``lookup(max_new_tokens)`` answers the tokens it can load beyond the local prefix (None: not
    known yet). While the boundary lands off ``grid`` (e.g. vLLM rounds to the Mamba chunk once,
    then another group shrinks the hit off it, and a state from a later boundary would be
    loaded), the lookup is asked again bounded at the grid point below (plus ``slack`` tokens:
    vLLM's lookup takes the last token off a bound itself when sliding-window groups exist).
    ``on_shrink`` is called for each such retry. Returns 0 when no grid point is above the prefix.
    """
    computed = num_computed_tokens
    while True:
        hit = lookup(max_new_tokens)
        if not hit or grid is None or (computed + hit) % grid == 0:
            return hit
        if on_shrink is not None:
            on_shrink()
        aligned = (computed + hit) // grid * grid
        if aligned <= computed:
            return 0
        max_new_tokens = aligned + slack - computed

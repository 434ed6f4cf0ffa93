"""What the planner answers: store plans, store outcomes, lookup plans and load plans.

Frozen dataclasses, no vLLM import. :class:`StorePlan` / :class:`StoreOutcome` travel between a
planner and the store side; :class:`LookupPlan` and :class:`LoadPlan` are the library's
(``OffloadScheduler``'s) answers to a lookup and to an accepted hit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "ChunkToStore",
    "GroupLoadPlan",
    "GroupLookup",
    "GroupProgress",
    "GroupStorePlan",
    "LoadPlan",
    "LookupPlan",
    "StoreAnswer",
    "StoreOutcome",
    "StorePlan",
    "split_answer",
]


class ChunkToStore(NamedTuple):
    """One whole chunk to store: its key, index in the group, and GPU blocks.

    A named tuple: a plan makes one per chunk it offers, on the engine's step. ``block_ids`` has
    no null id, except leading ones in a planner that stores partial sliding-window chunks (the
    vLLM connector's): those sub-blocks are out of the window for good and no lookup reads them.
    """

    key: bytes
    chunk_index: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class GroupStorePlan:
    """The chunks of one group to store this step, ascending."""

    group: int
    chunks: tuple[ChunkToStore, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Keys of the chunks, in chunk order."""
        return tuple(c.key for c in self.chunks)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every source GPU block id, chunk-major (never a null id)."""
        return tuple(b for c in self.chunks for b in c.block_ids)


@dataclass(frozen=True)
class StorePlan:
    """What to store for one request after one step, one entry per group."""

    req_id: str
    num_offloadable_tokens: int
    groups: tuple[GroupStorePlan, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, group-major then ascending chunk (vLLM's spec order)."""
        return tuple(k for g in self.groups for k in g.keys)

    def __bool__(self) -> bool:
        return any(g.chunks for g in self.groups)


@dataclass(frozen=True)
class StoreOutcome:
    """What the store side did with a :class:`StorePlan`.

    Attributes:
        accepted: Keys it will write.
        present: Keys it already holds.
        refused: Keys it could not take now (capacity); offered again later.
        declined: Keys it chose not to store (admission: not seen often enough yet); done, like
            present ones, and not offered again by this request.

    A planned key in none of the sets is treated as refused.
    """

    accepted: frozenset[bytes] = frozenset()
    present: frozenset[bytes] = frozenset()
    refused: frozenset[bytes] = frozenset()
    declined: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for name in ("accepted", "present", "refused", "declined"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        sets = (self.accepted, self.present, self.refused, self.declined)
        if sum(map(len, sets)) != len(frozenset().union(*sets)):
            raise ValueError("a key can be in only one of accepted/present/refused/declined")

    @classmethod
    def from_prepare_store(
        cls,
        plan: StorePlan,
        keys_to_store: Iterable[bytes] | None,
        is_present: Callable[[bytes], bool] | None = None,
    ) -> StoreOutcome:
        """Translate vLLM's all-or-nothing ``prepare_store`` answer.

        ``None`` refuses the whole plan; otherwise ``keys_to_store`` are
        accepted and every other planned key is already present -- or, with
        ``is_present`` (e.g. the manager's ``lookup``), present only if it says
        so and refused if not (a manager that took part of the plan), as the
        vLLM connector reads it (:func:`split_answer`).
        """
        if is_present is not None:
            answer = split_answer(plan.keys, keys_to_store, is_present)
            return cls(
                accepted=frozenset(answer.accepted) & frozenset(plan.keys),
                present=frozenset(answer.present),
                refused=frozenset(answer.refused),
            )
        keys = frozenset(plan.keys)
        if keys_to_store is None:
            return cls(refused=keys)
        accepted = frozenset(keys_to_store) & keys
        return cls(accepted=accepted, present=keys - accepted)


class StoreAnswer(NamedTuple):
    """A store's answer to an offer, split: ``accepted`` (it writes them), ``present`` (it holds
    them already) and ``refused`` (no room now: they stay waiting and are offered again)."""

    accepted: set[bytes]
    present: list[bytes]
    refused: list[bytes]


def split_answer(
    offered: Iterable[bytes], keys_to_store: Iterable[bytes] | None, is_present: Callable[[bytes], bool]
) -> StoreAnswer:
    """Split an all-or-nothing answer (vLLM's ``prepare_store``): ``None`` refuses every offered
    key; otherwise ``keys_to_store`` are accepted, and a key left out is present only if
    ``is_present`` says so -- a key a manager left out for lack of room is refused, never skipped."""
    if keys_to_store is None:
        return StoreAnswer(set(), [], list(offered))
    accepted = set(keys_to_store)
    present: list[bytes] = []
    refused: list[bytes] = []
    for key in offered:
        if key not in accepted:
            (present if is_present(key) else refused).append(key)
    return StoreAnswer(accepted, present, refused)


@dataclass(frozen=True)
class GroupLookup:
    """The chunks of one group that a hit needs from the store."""

    group: int
    first_chunk: int
    end_chunk: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class LookupPlan:
    """The longest hit whole in every group; ``num_hit_tokens`` is 0 on a miss.

    Attributes:
        num_computed_tokens: The local (GPU) prefix the lookup started from.
        boundary_tokens: Local prefix plus hit (== num_computed_tokens on a miss).
        num_hit_tokens: Tokens the store can provide beyond the local prefix.
        groups: Per group, the stored chunks the hit relies on (empty on a miss).
    """

    num_computed_tokens: int
    boundary_tokens: int
    num_hit_tokens: int
    groups: tuple[GroupLookup, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every key the hit relies on, group-major."""
        return tuple(k for g in self.groups for k in g.keys)


@dataclass(frozen=True)
class GroupLoadPlan:
    """Keys and GPU destinations of one group for a load.

    Attributes:
        group: The group index.
        keys: Chunk keys to read, ascending.
        chunk_indices: The chunk index of each key.
        dst_block_ids: Destination GPU block ids, ascending position, no nulls.
        block_positions: Each destination's block index within the request.
        start_offset: Blocks to skip inside the first chunk (the local prefix
            or a null placeholder ends mid-chunk).
    """

    group: int
    keys: tuple[bytes, ...] = ()
    chunk_indices: tuple[int, ...] = ()
    dst_block_ids: tuple[int, ...] = ()
    block_positions: tuple[int, ...] = ()
    start_offset: int = 0

    @property
    def is_contiguous(self) -> bool:
        """True when destinations are one run from ``start_offset`` (vLLM's layout)."""
        if not self.block_positions:
            return True
        first = self.block_positions[0]
        return self.block_positions[-1] - first + 1 == len(self.block_positions)


@dataclass(frozen=True)
class LoadPlan:
    """Everything to load for an accepted hit, one entry per group."""

    req_id: str
    num_computed_tokens: int
    boundary_tokens: int
    groups: tuple[GroupLoadPlan, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, group-major then ascending chunk."""
        return tuple(k for g in self.groups for k in g.keys)


@dataclass(frozen=True)
class GroupProgress:
    """A snapshot of one group's bookkeeping for a request."""

    group: int
    num_keys: int
    num_blocks: int
    cursor: int
    num_waiting: int
    hit_chunks: int

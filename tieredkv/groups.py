"""KV-cache group geometry.

A hybrid model gives every request several KV groups (full attention, sliding
window, mamba/SSM), each with its own GPU block size. tieredkv offloads a group
in *chunks*: ``blocks_per_chunk`` consecutive GPU blocks of that group, named by
the engine's block hash at the chunk's last hash position plus the group index.

Primitives:

- :class:`GroupKind` -- full attention, sliding window, or mamba.
- :class:`GroupSpec` -- one group's geometry: block size in tokens, blocks per
  chunk, bytes per block, window (sliding window only).
- :class:`GroupLayout` -- every offloaded group plus the engine's global
  ``tokens_per_hash``; checks that each group's chunk spans a whole number of
  hash blocks.

Bad values raise :class:`~tieredkv.errors.ConfigError` naming the field, the
value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tieredkv.errors import ConfigError

__all__ = ["MAX_GROUP_INDEX", "GroupKind", "GroupLayout", "GroupSpec"]

#: Group indices are encoded as 4 unsigned big-endian bytes in offload keys.
MAX_GROUP_INDEX = 2**32 - 1


class GroupKind(str, Enum):
    """The attention kind of a KV group; decides what a load needs from it."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(field: str, value: object, minimum: int) -> None:
    """Raise ConfigError unless ``value`` is an int >= ``minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field}={value!r} is invalid: expected an integer >= {minimum}")


@dataclass(frozen=True)
class GroupSpec:
    """Geometry of one KV group.

    Attributes:
        index: The engine's group index (the 4-byte suffix of the group's keys).
        kind: Full attention, sliding window or mamba. Strings are accepted.
        tokens_per_block: Tokens per GPU block of this group.
        blocks_per_chunk: GPU blocks per offloaded chunk of this group (the
            HMA series' per-group ``block_size_factor``).
        bytes_per_block: Bytes of one GPU block of this group (0 = unknown).
        window_tokens: Sliding-window size in tokens; required for, and only
            allowed on, sliding-window groups.
    """

    index: int
    kind: GroupKind
    tokens_per_block: int
    blocks_per_chunk: int = 1
    bytes_per_block: int = 0
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        name = f"groups[{self.index!r}]"
        _check_int(f"{name}.index", self.index, 0)
        if self.index > MAX_GROUP_INDEX:
            raise ConfigError(f"{name}.index={self.index} does not fit in 4 bytes; use an index <= {MAX_GROUP_INDEX}")
        try:
            object.__setattr__(self, "kind", GroupKind(self.kind))
        except ValueError:
            allowed = [k.value for k in GroupKind]
            raise ConfigError(f"{name}.kind={self.kind!r} is unknown; allowed: {allowed}") from None
        _check_int(f"{name}.tokens_per_block", self.tokens_per_block, 1)
        _check_int(f"{name}.blocks_per_chunk", self.blocks_per_chunk, 1)
        _check_int(f"{name}.bytes_per_block", self.bytes_per_block, 0)
        self._check_window(name)

    def _check_window(self, name: str) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.window_tokens is None:
                raise ConfigError(f"{name}.window_tokens=None: a sliding_window group needs its window size in tokens")
            _check_int(f"{name}.window_tokens", self.window_tokens, 1)
        elif self.window_tokens is not None:
            raise ConfigError(
                f"{name}.window_tokens={self.window_tokens!r} is only allowed on "
                f"sliding_window groups, not {self.kind.value!r}; remove it"
            )

    @classmethod
    def by_index(cls, index: int, kind: GroupKind | str, blocks_per_chunk: int, bytes_per_block: int) -> GroupSpec:
        """The spec of a group known only by index, kind and chunk size (e.g. registered with
        ``TieredStore.register_group(3, tensors)``): tokens per block, and a sliding window's
        size, are unknown, and a placeholder of 1 stands in for them. Good for routing and
        transfers; the planner needs a whole spec."""
        sliding = str(getattr(kind, "value", kind)) == GroupKind.SLIDING_WINDOW.value
        # a kind string is converted (or refused, naming it) by __post_init__
        return cls(index, kind, 1, blocks_per_chunk, bytes_per_block, 1 if sliding else None)  # type: ignore[arg-type]

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens covered by one offloaded chunk (one key) of this group."""
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one whole chunk of this group."""
        return self.bytes_per_block * self.blocks_per_chunk

    @property
    def window_chunks(self) -> int | None:
        """Chunks a load needs before its boundary; None means a whole prefix.

        Sliding window: the first recomputed token (the one at the boundary)
        attends to itself and the ``window_tokens - 1`` tokens before it, so
        a load needs ``cdiv(window_tokens - 1, tokens_per_chunk)`` chunks (as
        vLLM's GPU prefix cache: ``cdiv(sliding_window - 1, block_size)``); a
        one-token window needs none. Mamba: one chunk, the state at the
        boundary. Full attention: None (every chunk).
        """
        if self.kind is GroupKind.SLIDING_WINDOW:
            assert self.window_tokens is not None
            return _cdiv(self.window_tokens - 1, self.tokens_per_chunk)
        if self.kind is GroupKind.MAMBA:
            return 1
        return None

    @property
    def reach_tokens(self) -> int | None:
        """How far behind the compute frontier a chunk's end is still needed.

        A chunk ending at token ``end`` (exclusive) has left the window for
        good once ``end + reach_tokens <= frontier``. Sliding window:
        ``window_tokens - 1``, since token ``t`` is attended to by the queries
        ``t .. t + window_tokens - 1`` -- the same rule as
        :attr:`window_chunks`, so a chunk a lookup at some boundary at or past
        the frontier needs is never declared out of reach. None (full
        attention) means it never leaves.
        """
        if self.kind is GroupKind.SLIDING_WINDOW:
            assert self.window_tokens is not None
            return self.window_tokens - 1
        if self.kind is GroupKind.MAMBA:
            return self.tokens_per_chunk
        return None


@dataclass(frozen=True)
class GroupLayout:
    """All offloaded KV groups of a model plus the engine's hash granularity.

    The position of a group in ``groups`` is the position of its block-id list
    in every per-group sequence handed to the scheduler adapter.

    Attributes:
        groups: One :class:`GroupSpec` per offloaded group, unique indices.
        tokens_per_hash: Tokens per entry of a request's block-hash list.
    """

    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        _check_int("tokens_per_hash", self.tokens_per_hash, 1)
        if not self.groups:
            raise ConfigError("groups=() is empty: give at least one KV group")
        seen: set[int] = set()
        for pos, group in enumerate(self.groups):
            if not isinstance(group, GroupSpec):
                raise ConfigError(f"groups[{pos}]={group!r} is not a GroupSpec")
            if group.index in seen:
                raise ConfigError(f"groups[{pos}].index={group.index} is used twice; every group needs its own index")
            seen.add(group.index)
            self._check_chunk(pos, group)

    def _check_chunk(self, pos: int, group: GroupSpec) -> None:
        tph = self.tokens_per_hash
        if group.tokens_per_chunk % tph == 0:
            return
        step = tph // math.gcd(group.tokens_per_block, tph)
        raise ConfigError(
            f"groups[{pos}].blocks_per_chunk={group.blocks_per_chunk}: a chunk of "
            f"group {group.index} is {group.tokens_per_chunk} tokens "
            f"({group.tokens_per_block} tokens/block x {group.blocks_per_chunk} "
            f"blocks), not a whole number of hash blocks (tokens_per_hash={tph}); "
            f"set blocks_per_chunk to a multiple of {step}"
        )

    def hashes_per_chunk(self, pos: int) -> int:
        """Block hashes covered by one chunk of the group at position ``pos``."""
        return self.groups[pos].tokens_per_chunk // self.tokens_per_hash

    @property
    def alignment_tokens(self) -> int:
        """Least common multiple of every group's chunk size, in tokens.

        Every lookup boundary is a multiple of this.
        """
        return math.lcm(*(g.tokens_per_chunk for g in self.groups))

    def __len__(self) -> int:
        return len(self.groups)

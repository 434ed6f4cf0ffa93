"""Block-id layouts: the order an engine's pool hands out KV block ids, for the benches.

``permuted``: a churned pool, whose free queue hands blocks out in the order they were freed
(vLLM's ``FreeKVCacheBlockQueue``): a random permutation of the pool. ``fragmented``: a free list
of short runs (1 to 8 consecutive blocks, in random order). ``consecutive``: a fresh pool, ids in
order, the best case (every chunk's blocks are one range).

NumPy and the standard library only, and no import of the rest of tieredkv: the peers bench's
LMCache child (``benchmarks/_lmcache_child.py``), which runs in LMCache's virtualenv without
tieredkv, loads this file by its path, so both sides draw the same ids from one definition
(each side still reports :func:`ids_digest`, in case their NumPy versions draw differently).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = ["BLOCKS_PER_CHUNK", "LAYOUTS", "block_ids", "ids_digest", "round_ids"]

#: Blocks per chunk of the benches' KV group (a chunk of 64 KiB is 4 blocks of 16 KiB).
BLOCKS_PER_CHUNK = 4
#: The layouts, the default (engine-like) first.
LAYOUTS = ("permuted", "fragmented", "consecutive")


def block_ids(layout: str, count: int, first: int, rng: Any) -> list[int]:
    """``count`` distinct block ids from ``first .. first+count-1`` in the order a pool with
    ``layout`` (:data:`LAYOUTS`) hands them out; ``rng`` a ``numpy.random.Generator``."""
    if layout == "consecutive":
        return list(range(first, first + count))
    if layout == "permuted":
        return (rng.permutation(count) + first).tolist()  # type: ignore[no-any-return]
    if layout == "fragmented":
        cuts = np.cumsum(rng.integers(1, 9, size=count))  # runs of 1-8 blocks
        starts = np.concatenate([[0], cuts[cuts < count]])
        ends = np.append(starts[1:], count)
        order = rng.permutation(len(starts))
        return [first + i for k in order for i in range(int(starts[k]), int(ends[k]))]
    raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def round_ids(layout: str, nb: int, seed: int) -> tuple[list[int], list[int]]:
    """(store ids, load ids) of one bench round: ``nb`` blocks among ``1 .. nb``, then ``nb``
    among ``nb+1 .. 2nb`` (block 0 is the engine's null block), from one generator seeded with
    ``seed``."""
    rng = np.random.default_rng(seed)
    store = block_ids(layout, nb, 1, rng)
    return store, block_ids(layout, nb, 1 + nb, rng)


def ids_digest(layout: str, nb: int, rounds: int) -> str:
    """sha1 of the block ids of rounds ``0 .. rounds-1`` (:func:`round_ids`)."""
    h = hashlib.sha1(usedforsecurity=False)
    for k in range(rounds):
        for ids in round_ids(layout, nb, k):
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()

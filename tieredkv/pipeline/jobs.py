"""What the engine submits and what it polls, and the one skeleton every job runs in.

* :class:`ChunkRef`, :class:`StoreJob`, :class:`LoadJob` — per KV group, chunk keys with the
  GPU block ids of each chunk (engine-block jobs).
* :class:`JobResult` — what :meth:`Pipeline.poll_finished <tieredkv.pipeline.Pipeline.poll_finished>`
  returns, for both job families (store/load of engine blocks, put/get of host buffers).
* :class:`JobRun` — the skeleton shared by all four job kinds: the job timeout, "cancelled at
  close", and any other exception turned into the result's error string (never into the engine).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from tieredkv.keys import key_group
from tieredkv.policy import GroupRoute

__all__ = [
    "ChunkRef",
    "InFlight",
    "JobResult",
    "JobRun",
    "KeyState",
    "LoadJob",
    "StoreJob",
    "by_group",
    "parts",
]

log = logging.getLogger(__name__)


class ChunkRef(NamedTuple):
    """One chunk: its stored key and the GPU block ids it occupies, in order. A named tuple: the
    engine thread builds one per chunk of every call (``tuple.__new__(ChunkRef, (key, ids))`` is a
    single C call)."""

    key: bytes
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Store whole chunks from GPU blocks, as records of ``tenant`` (a
    :func:`~tieredkv.keys.tenant_id`; 0: the default tenant)."""

    job_id: int
    group: int
    chunks: tuple[ChunkRef, ...]
    tenant: int = 0
    route: GroupRoute | None = None  # this job's route (a request's tier filter), else the group's


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load whole chunks into GPU blocks.

    A chunk's ``block_ids`` either list one destination per block of the chunk — where the
    group was registered with a null block (vLLM's block 0), that id marks a block not to copy —
    or (first chunk only) just the blocks after ``skip_blocks`` blocks that are not copied (the
    local prefix ends mid-chunk). ``tenant``: who loads them; a chunk promoted from a lower tier
    into the first one is that tenant's record there.
    """

    job_id: int
    group: int
    chunks: tuple[ChunkRef, ...]
    skip_blocks: int = 0
    tenant: int = 0
    route: GroupRoute | None = None  # this job's route (a request's tier filter), else the group's

    def placements(self, i: int, blocks_per_chunk: int, null_block: int | None = None) -> list[tuple[int, int]]:
        """``(position_in_chunk, block_id)`` pairs to copy for chunk ``i`` (``null_block``: the
        group's null block id, whose positions are not copied; None: every id is a block)."""
        ids = self.chunks[i].block_ids
        if len(ids) == blocks_per_chunk:
            if null_block is None or null_block not in ids:  # the common case, once per chunk: C calls only
                return list(enumerate(ids))
            return [(p, b) for p, b in enumerate(ids) if b != null_block]
        skip = self.skip_blocks if i == 0 else 0
        if skip + len(ids) != blocks_per_chunk:
            raise ValueError(
                f"load job {self.job_id}: chunk {i} has {len(ids)} block ids (+{skip} skipped),"
                f" a chunk has {blocks_per_chunk} blocks"
            )
        return [(skip + p, b) for p, b in enumerate(ids)]


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    kind: str  # "store" | "load" (KV tensors) or "put" | "get" (host buffers)
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None
    done: tuple[bytes, ...] = ()
    """Store: keys now held by at least one tier. Load: keys copied into their blocks."""
    failed: tuple[bytes, ...] = ()
    """Store: keys refused or dropped (offer them again later). Load: keys not found."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Store: chunks written per tier. Load: chunks read per tier."""
    finished_at: float = 0.0
    """``time.perf_counter()`` when the job finished."""


class KeyState(str, Enum):
    HIT = "hit"
    PENDING = "pending"
    MISS = "miss"


class JobRun:
    """One job on the loop: its kind, id and error. ``async with run.guard():`` runs the body
    under ``job_timeout_s`` and turns what it raises into :attr:`error` (a cancel at close is
    recorded and re-raised), so every job family finishes the same way whatever happened."""

    __slots__ = ("error", "job_id", "kind", "timeout_s")

    def __init__(self, kind: str, job_id: int, timeout_s: float | None) -> None:
        self.kind = kind
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.error: str | None = None

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except asyncio.CancelledError:
            self.error = "cancelled at close"
            raise
        except Exception as e:  # noqa: BLE001 - never into the engine
            self.error = self._describe(e)

    def _describe(self, e: BaseException) -> str:
        if isinstance(e, TimeoutError):
            return f"{self.kind} job ran past job_timeout_s={self.timeout_s}"
        log.error("%s job %s failed", self.kind, self.job_id, exc_info=e)
        return f"{type(e).__name__}: {e}"


def parts(n: int, per: int) -> list[range]:
    """Indices ``0 .. n-1`` in consecutive parts of ``per`` (a staging buffer's worth of chunks)."""
    per = max(1, per)
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


def by_group(items: Sequence[tuple[bytes, Any]]) -> dict[int, list[int]]:
    """Indices of ``(key, ...)`` items per KV group of their key."""
    out: dict[int, list[int]] = collections.defaultdict(list)
    for i, (k, _) in enumerate(items):
        out[key_group(k)].append(i)
    return out


class InFlight:
    """Jobs in flight (for ``drain``) and keys pending a write (for lookups), shared by the engine
    threads that submit and the loop thread that finishes. A key is pending from submit until its
    writes finish, so a lookup never reports a hit for bytes that are not written yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        #: key -> stores of it in flight (read it anywhere, e.g. ``key in inflight.pending``;
        #: only :meth:`begin` / :meth:`unpend` write it, under the lock).
        self.pending: collections.Counter[bytes] = collections.Counter()
        self.jobs = 0
        self.ended = 0  # jobs ever ended (Pipeline.activity)

    def begin(self, keys: Sequence[bytes] = ()) -> None:
        with self.lock:
            self.jobs += 1
            self.pending.update(keys)  # one C loop

    def unpend(self, keys: Sequence[bytes]) -> None:
        pending = self.pending
        with self.lock:
            for k in keys:
                n = pending.pop(k, 0) - 1
                if n > 0:
                    pending[k] = n

    def end(self) -> None:
        with self._idle:
            self.jobs -= 1
            self.ended += 1
            if not self.jobs:
                self._idle.notify_all()

    def is_pending(self, key: bytes) -> bool:
        return key in self.pending

    def pending_per_group(self) -> dict[int, int]:
        with self.lock:
            keys = list(self.pending)
        return dict(collections.Counter(key_group(k) for k in keys))

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no job is in flight; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self.jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

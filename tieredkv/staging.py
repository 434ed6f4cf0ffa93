"""Staging: a bounded pool of host buffers and the copies between device blocks and them.

Primitives:

* :class:`StagingPool` — one preallocated ``uint8`` slab (pinned when CUDA is available,
  plain otherwise) handed out as byte ranges by a first-fit allocator. ``try_acquire`` never
  blocks: an exhausted pool returns ``None`` and the caller defers or drops the work
  (back-pressure), counted in :attr:`StagingPool.refusals`. ``try_acquire_part`` hands out
  whole units (chunks) of the largest free range, for work larger than the whole pool that
  is staged in parts.
* :class:`KVGroupTensors` — the KV cache of one group: tensors whose first dimension is the
  block id (one per layer, or one packed tensor). A chunk's payload is, tensor by tensor, the
  bytes of its blocks in order.
* :class:`Copier` — gathers blocks into a staging buffer (D2H) and scatters them back (H2D).
  With CUDA tensors the copies run on a dedicated stream after an event recorded on the
  caller's stream, and completion is an event; with CPU tensors a job's blocks move in one call
  per tensor (the C helper's ``move_pieces``: scattered blocks, non-temporal stores, the GIL
  released, split over ``threads``), or, without the helper, one NumPy copy per run of
  consecutive blocks (``index_copy_`` on bytes is ~12x slower here). Asked to ``defer``, a host
  move is queued to the C helper's mover thread and its completion is a :class:`HostMove` the
  loop awaits (:meth:`Copier.wait`: woken through a pipe the mover writes to, no polling) while
  it goes on with other jobs; :func:`settle` ends what a job that stops early has in flight.
"""

from __future__ import annotations

import asyncio
import os
import threading
from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:  # the optional C helper (setup.py): a job's scattered blocks in one call
    from tieredkv._fastrec import move_pieces as _move_pieces
except ImportError:  # not built here: NumPy's copy per run of blocks
    _move_pieces = None
try:  # its helper threads woken ahead of a move (a build older than that lacks it)
    from tieredkv._fastrec import move_wake as _move_wake
except ImportError:
    _move_wake = None
try:  # a move queued to the helper's own thread (deferred moves; older builds: none)
    from tieredkv._fastrec import move_fence as _move_fence
    from tieredkv._fastrec import move_pieces_async as _move_pieces_async
except ImportError:
    _move_pieces_async = _move_fence = None

__all__ = ["Copier", "HostMove", "KVGroupTensors", "StagingBuffer", "StagingPool", "settle"]

_ALIGN = 4096


@dataclass(eq=False, slots=True)
class StagingBuffer:
    """A byte range of the staging slab; ``tensor`` is a ``uint8`` view of exactly ``nbytes``."""

    offset: int
    size: int  # aligned size reserved
    nbytes: int
    tensor: torch.Tensor

    _bytes: memoryview | None = field(default=None, init=False, repr=False)

    def view(self, start: int, length: int) -> torch.Tensor:
        return self.tensor[start : start + length]

    def mview(self, start: int, length: int) -> memoryview:
        """The same bytes as :meth:`view`, as a ``memoryview`` (what tiers read and write)."""
        if self._bytes is None:
            self._bytes = memoryview(self.tensor.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        return self._bytes[start : start + length]


class StagingPool:
    """Bounded staging memory. Thread-safe: acquire on the engine thread, release on the loop."""

    def __init__(self, capacity_bytes: int, *, pin: bool | None = None) -> None:
        self.capacity = (capacity_bytes // _ALIGN) * _ALIGN
        if self.capacity <= 0:
            raise ValueError(f"staging capacity must be at least {_ALIGN} bytes, got {capacity_bytes}")
        self.pinned = torch.cuda.is_available() if pin is None else pin
        # Pinned memory is resident once allocated. An unpinned slab is left to fault in on first
        # use, like the CPU tier's slab without ``prefault``: a CPU engine's chunks usually move
        # directly (transfer.py) and never touch it, and touching it all at start takes hundreds
        # of MiB of warm free pages from the tiers' own writes (measured: an LMDB tier's page-cache
        # writes right after a store opened ran at 0.23-0.34 GB/s with the slab zero-filled at
        # start, 0.9-1.7 GB/s without, on this kind of VM).
        self._slab = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pinned)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._lock = threading.Lock()
        self.in_use = 0
        self.refusals = 0
        self.high_water = 0

    def try_acquire(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of ``nbytes``, or ``None`` at once when the pool cannot hold it now."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self.in_use += size
                    self.high_water = max(self.high_water, self.in_use)
                    return StagingBuffer(off, size, nbytes, self._slab[off : off + nbytes])
            self.refusals += 1
            return None

    def try_acquire_part(self, unit: int, max_bytes: int) -> StagingBuffer | None:
        """A buffer of as many whole ``unit``-byte pieces as the largest free range holds (at
        most ``max_bytes``), or ``None`` at once when not even one fits now. For work larger
        than the pool, staged through the buffer piece by piece."""
        if unit <= 0:
            raise ValueError(f"unit must be positive, got {unit}")
        with self._lock:
            best = max(range(len(self._free)), key=lambda i: self._free[i][1], default=None)
            n = 0 if best is None else min(self._free[best][1], max_bytes) // unit
            if best is None or n == 0:
                self.refusals += 1
                return None
            off, free = self._free[best]
            nbytes = n * unit
            size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)  # <= free: free ranges are aligned
            if free == size:
                del self._free[best]
            else:
                self._free[best] = (off + size, free - size)
            self.in_use += size
            self.high_water = max(self.high_water, self.in_use)
            return StagingBuffer(off, size, nbytes, self._slab[off : off + nbytes])

    def release(self, buf: StagingBuffer) -> None:
        """Return ``buf`` to the pool (coalescing neighbours). Releasing twice is a bug."""
        with self._lock:
            insort(self._free, (buf.offset, buf.size))
            self.in_use -= buf.size
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged

    def prefault(self) -> None:
        """Touch every page of the slab now (pinned memory already is resident): the state of
        a pool that has moved its capacity once, as an engine's has after its first minutes.
        For benches, whose fresh stores would otherwise time first-touch faults (several
        hundred MiB here, at the speed the VM backs pages) that a running engine never pays."""
        with self._lock:  # no buffer can be handed out meanwhile
            if self.in_use:
                raise RuntimeError(f"staging prefault with {self.in_use} bytes in use: call it before any job")
            if not self.pinned and self.capacity:
                self._slab.zero_()

    def free(self) -> None:
        """Give the memory back (the pool refuses everything after)."""
        with self._lock:
            self._slab = torch.empty(0, dtype=torch.uint8)
            self._free = []
            self.capacity = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.in_use


class KVGroupTensors:
    """The KV cache tensors of one group; dimension 0 of each is the block id."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a KV group needs at least one tensor")
        self.tensors = [self._as_blocks(t) for t in tensors]
        n = {t.shape[0] for t in self.tensors}
        if len(n) != 1:
            raise ValueError(f"every tensor of a group must have the same number of blocks, got {sorted(n)}")
        self.num_blocks = n.pop()
        self.device = self.tensors[0].device
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.bytes_per_block = sum(self.block_bytes)
        #: In host memory: each tensor as a (blocks, block bytes) NumPy array over the same memory,
        #: for :class:`Copier` (a NumPy copy costs a third of a torch ``copy_``'s fixed cost).
        self.host_arrays: list[np.ndarray] | None = None
        #: The bytes of the only tensor, block after block, when the group is one tensor in host
        #: memory (a chunk of consecutive blocks is then a slice of it: no staging copy).
        self.host_bytes: memoryview | None = None
        if self.device.type == "cpu":
            self.host_arrays = [t.numpy() for t in self.tensors]
            if len(self.host_arrays) == 1:
                self.host_bytes = memoryview(self.host_arrays[0].reshape(-1))  # type: ignore[arg-type]

    @staticmethod
    def _as_blocks(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 1 or not t.is_contiguous():
            raise ValueError("KV tensors must be contiguous with the block id as dimension 0")
        return t.view(t.shape[0], -1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(t.shape[0], -1)

    def chunk_bytes(self, nblocks: int) -> int:
        return nblocks * self.bytes_per_block


class Copier:
    """Block gathers/scatters between one group's KV tensors and staging buffers."""

    def __init__(self, threads: int = 1) -> None:
        self.cuda = torch.cuda.is_available()
        self._streams: dict[Any, Any] = {}
        #: Deferred host moves: the pipe the mover thread writes a byte to as each ends (read
        #: end, write end; made at the first), the moves not seen over yet (:meth:`close`
        #: settles them before the pipe goes), and the loop's waiters.
        self._notify: tuple[int, int] | None = None
        self._moves: list[HostMove] = []
        self._waiters: list[tuple[HostMove, asyncio.Future[None]]] = []
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 8:
            raise ValueError(f"Copier threads must be an int from 1 to 8, got {threads!r}")
        #: Host copies of one call are split over this many threads (:func:`_move_host`).
        self.threads = threads

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def _defer(self, calls: list[tuple[Any, ...]]) -> HostMove:
        assert _move_pieces_async is not None
        if self._notify is None:
            self._notify = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        fd = self._notify[1]
        move = HostMove([_move_pieces_async(*call, self.threads, fd) for call in calls])
        self._moves.append(move)
        return move

    async def wait(self, *evs: Any) -> None:
        """Wait, on the loop, for what moves returned: None (nothing), :class:`HostMove` (woken
        by the mover's pipe) or CUDA events (polled); all of a job's at once.

        Host moves end in the order they were queued, and their waiters return in the order they
        came: one whose moves are over still waits behind an earlier waiter. So jobs that queued
        their copies in turn resume in turn (the CPU tier commits a tenant's stores, and so
        orders its evictions, as they came)."""
        host: list[Any] = []
        for ev in evs:
            if ev is None:
                continue
            if isinstance(ev, HostMove):
                host += ev.tickets
                continue
            while not ev.query():
                await asyncio.sleep(0.0002)
        if not host:
            return
        move = HostMove(host)
        if not self._waiters and move.query():  # over, and no earlier waiter to let go first
            return
        assert self._notify is not None
        loop = asyncio.get_running_loop()
        if self._reader_loop is not loop:
            self._unwatch()
            loop.add_reader(self._notify[0], self._on_notify)
            self._reader_loop = loop
        fut: asyncio.Future[None] = loop.create_future()
        entry = (move, fut)
        self._waiters.append(entry)
        if move.query():  # over already, its byte maybe read: wake it in turn, after those woken
            loop.call_soon(self._wake)
        try:
            await fut
        finally:  # a waiter is one until it runs again (woken ones run in turn, as they were woken)
            if entry in self._waiters:  # else closed under it: the list was dropped
                self._waiters.remove(entry)
                if fut.cancelled() or not fut.done():  # cancelled: the next may wait only for it
                    self._wake()

    def _on_notify(self) -> None:
        """The mover's pipe is readable: some move ended. Wake the waiters whose moves are over."""
        assert self._notify is not None
        try:
            while os.read(self._notify[0], 4096):
                pass
        except BlockingIOError:
            pass
        self._wake()
        self._moves = [m for m in self._moves if not m.query()]

    def _wake(self) -> None:
        """Wake waiters in the order they came, up to the first whose moves are not over (a
        woken waiter stays listed until it runs, so a later one cannot return before it)."""
        for move, fut in self._waiters:
            if not fut.done():
                if not move.query():
                    return
                fut.set_result(None)

    def _unwatch(self) -> None:
        if self._reader_loop is not None and self._notify is not None:
            try:
                self._reader_loop.remove_reader(self._notify[0])
            except RuntimeError:  # the loop is closed: nothing to remove
                pass
        self._reader_loop = None

    def close(self) -> None:
        """Settle the deferred moves not seen over (none writes to the pipe after this) and close
        the pipe (idempotent; a move deferred afterwards makes a new one)."""
        settle(self._moves)
        self._moves = []
        self._waiters = []
        self._unwatch()
        if self._notify is not None:
            if _move_fence is not None:  # a move seen done may still be writing its byte
                _move_fence()
            for fd in self._notify:
                os.close(fd)
            self._notify = None

    def wake(self, group: KVGroupTensors) -> None:
        """On the engine thread when a job of ``group`` is queued: wake the C helper's threads
        that its host moves will use, so they are running when the move starts (a vCPU that
        went idle takes about a millisecond to wake on this machine kind; the loop's work before
        the move hides it). Nothing for CUDA tensors, one thread, or without the helper."""
        if _move_wake is not None and self.threads > 1 and group.host_arrays is not None:
            _move_wake(self.threads)

    def record_ready(self, group: KVGroupTensors) -> Any:
        """On the engine thread at submit: an event marking the KV bytes as written (CUDA), else None."""
        if group.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(group.device))
        return ev

    def gather(
        self,
        group: KVGroupTensors,
        block_ids: Sequence[int],
        dst: torch.Tensor,
        after: Any = None,
        *,
        chunk_blocks: int | None = None,
        defer: bool = False,
    ) -> Any:
        """Copy blocks ``block_ids`` into ``dst`` in payload layout. With ``chunk_blocks``, the ids
        are those of ``len(block_ids) // chunk_blocks`` whole chunks, one after another, and
        ``dst`` receives their payloads back to back (one call for a job's chunks); else they
        are one chunk. Returns a completion event or None (``defer``: see :meth:`_move`)."""
        bpc = chunk_blocks or len(block_ids)
        if bpc and len(block_ids) % bpc:
            raise ValueError(f"{len(block_ids)} block ids are not whole chunks of {bpc} blocks")
        return self._move(group, _Places(None, block_ids), bpc, dst, after, to_staging=True, defer=defer)

    def scatter(
        self,
        group: KVGroupTensors,
        placements: Sequence[tuple[int, int]],
        src: torch.Tensor,
        chunk_blocks: int,
        *,
        defer: bool = False,
    ) -> Any:
        """Copy payloads ``src`` (chunks of ``chunk_blocks`` blocks, back to back) into the device:
        each ``(position, block_id)`` of ``placements``, position ``q`` being block
        ``q % chunk_blocks`` of chunk ``q // chunk_blocks``; positions not listed are not copied."""
        return self._move(group, _Places.of(placements), chunk_blocks, src, None, to_staging=False, defer=defer)

    def scatter_blocks(
        self,
        group: KVGroupTensors,
        block_ids: Sequence[int],
        src: torch.Tensor,
        chunk_blocks: int,
        *,
        defer: bool = False,
    ) -> Any:
        """:meth:`scatter` of whole chunks: block ``block_ids[q]`` gets position ``q`` (the
        reverse of :meth:`gather` with ``chunk_blocks``)."""
        if len(block_ids) % chunk_blocks:
            raise ValueError(f"{len(block_ids)} block ids are not whole chunks of {chunk_blocks} blocks")
        return self._move(group, _Places(None, block_ids), chunk_blocks, src, None, to_staging=False, defer=defer)

    def can_place(self, group: KVGroupTensors, buf: torch.Tensor) -> bool:
        """Whether :meth:`place` can move ``group``'s chunks to and from ``buf`` (host tensors on
        both sides, and the C helper's deferred moves)."""
        return _move_pieces_async is not None and group.host_arrays is not None and buf.device.type == "cpu"

    def place(
        self,
        group: KVGroupTensors,
        block_ids: Sequence[int],
        buf: torch.Tensor,
        starts: Sequence[int],
        chunk_blocks: int,
        *,
        to_buf: bool,
    ) -> HostMove | None:
        """A deferred host move of whole chunks between their blocks and payloads wherever they
        lie in ``buf``: chunk ``c`` is blocks ``block_ids[c * chunk_blocks : (c + 1) *
        chunk_blocks]`` and its payload starts at byte ``starts[c]`` of ``buf`` (``to_buf``: a
        gather into ``buf``, else a scatter out of it). One ``move_pieces_async`` call per tensor
        whatever the payloads' order: the CPU tier's slots, scattered over its slab once
        evictions have churned it, move with a job's one call as slots back to back do. Checked
        as :meth:`gather` (ids, sizes; each payload inside ``buf``); only where
        :meth:`can_place`."""
        if not self.can_place(group, buf):
            raise ValueError("place: host tensors and the C helper's deferred moves only (see can_place)")
        bpc = chunk_blocks
        if not block_ids:
            return None
        if bpc < 1 or len(block_ids) != len(starts) * bpc:
            raise ValueError(f"{len(block_ids)} block ids are not {len(starts)} whole chunks of {bpc} blocks")
        _check_ids(group, block_ids)
        cb = group.chunk_bytes(bpc)
        first = np.fromiter(starts, np.int64, len(starts))
        if first.min() < 0 or first.max() > buf.numel() - cb:
            raise ValueError(f"a payload of {cb} bytes at {int(first.max())} lies outside {buf.numel()} bytes")
        return self._defer(_host_pieces(group, _Places(None, block_ids), bpc, buf.numpy(), to_buf, starts=first))

    def _move(
        self,
        group: KVGroupTensors,
        places: _Places,
        bpc: int,
        buf: torch.Tensor,
        after: Any,
        *,
        to_staging: bool,
        defer: bool = False,
    ) -> Any:
        """The move, checked here whatever the path. With ``defer``, a host move with the C helper
        is queued to its mover thread (moves run in the order they were queued) and a
        :class:`HostMove` is returned: :meth:`wait` for it before using the bytes, and
        :func:`settle` it before the memory on either side is reused."""
        if not places.ids:
            return None
        _check_ids(group, places.ids)
        chunks = places.chunks(bpc)
        if buf.numel() < group.chunk_bytes(bpc) * chunks:
            raise ValueError(
                f"staging view of {buf.numel()} bytes is smaller than {chunks} chunks of {bpc} blocks"
                f" ({group.chunk_bytes(bpc) * chunks})"
            )
        if group.host_arrays is not None and buf.device.type == "cpu":
            if defer and _move_pieces_async is not None:
                return self._defer(_host_pieces(group, places, bpc, buf.numpy(), to_staging))
            return _move_host(group, places, bpc, buf.numpy(), to_staging, self.threads)
        on_cuda = group.device.type == "cuda"
        if on_cuda:
            stream = self._stream(group.device)
            if after is not None:
                stream.wait_event(after)
            ctx: Any = torch.cuda.stream(stream)
        else:
            ctx = _NullCtx()
        runs = _runs(places.pairs(), bpc if len(group.tensors) > 1 else None)
        with ctx:
            if len(runs) > _INDEXED_AT:  # scattered ids: kernels gather/scatter, one copy moves them
                _move_indexed(group, places, bpc, buf, to_staging, non_blocking=on_cuda)
            else:
                cb = group.chunk_bytes(bpc)
                base = 0
                for t, bb in zip(group.tensors, group.block_bytes):
                    for q, b, k in runs:  # one copy per run of consecutive blocks
                        at = (q // bpc) * cb + base + (q % bpc) * bb
                        view = buf[at : at + k * bb]
                        dev = t[b] if k == 1 else t[b : b + k].view(-1)
                        if to_staging:
                            view.copy_(dev, non_blocking=on_cuda)
                        else:
                            dev.copy_(view, non_blocking=on_cuda)
                    base += bpc * bb
            if on_cuda:
                ev = torch.cuda.Event()
                ev.record(stream)
                return ev
        return None


#: Device (CUDA) moves of more runs of consecutive blocks than this go through the device's
#: gather/scatter kernels and one copy (:func:`_move_indexed`) instead of a copy per run.
_INDEXED_AT = 2


@dataclass(slots=True)
class _Places:
    """Where a move's blocks go: block ``ids[i]`` is at position ``pos[i]`` of the payloads
    (``pos`` None: positions ``0..len(ids)-1``, whole chunks in order). Position ``q`` is block
    ``q % bpc`` of chunk ``q // bpc``."""

    pos: Sequence[int] | None
    ids: Sequence[int]

    @classmethod
    def of(cls, placements: Sequence[tuple[int, int]]) -> _Places:
        if not placements:
            return cls(None, ())
        pos, ids = zip(*placements)
        return cls(pos, ids)

    def chunks(self, bpc: int) -> int:
        """Chunks the payloads span."""
        if self.pos is None:
            return -(-len(self.ids) // bpc)
        if min(self.pos) < 0:
            raise ValueError(f"block positions must be >= 0, got {min(self.pos)}")
        return max(self.pos) // bpc + 1

    def pairs(self) -> list[tuple[int, int]]:
        return list(enumerate(self.ids)) if self.pos is None else list(zip(self.pos, self.ids))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, block ids) as int64 arrays."""
        ids = np.fromiter(self.ids, np.int64, len(self.ids))
        pos = np.arange(len(ids), dtype=np.int64) if self.pos is None else np.fromiter(self.pos, np.int64, len(ids))
        return pos, ids


def _check_ids(group: KVGroupTensors, ids: Sequence[int]) -> None:
    """Block ids (not empty) inside ``group``: never a negative index's wrap, a short copy or a
    device assert."""
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= group.num_blocks:
        raise ValueError(f"block ids must be in 0..{group.num_blocks - 1}, got {lo if lo < 0 else hi}")


def _payload_offsets(
    group: KVGroupTensors, pos: np.ndarray, bpc: int, starts: np.ndarray | None = None
) -> list[np.ndarray]:
    """Per tensor of ``group``, the byte offset in the payloads of each position of ``pos``:
    chunk ``q // bpc`` starts at its multiple of the chunk's bytes (or at ``starts[q // bpc]``:
    payloads wherever they lie) and holds, tensor by tensor, the bytes of its ``bpc`` blocks."""
    if starts is None and len(group.block_bytes) == 1:  # chunks back to back are their blocks back to back
        return [pos * group.block_bytes[0]]
    chunk, inner = np.divmod(pos, bpc)
    start = chunk * group.chunk_bytes(bpc) if starts is None else starts[chunk]
    out, base = [], 0
    for bb in group.block_bytes:
        out.append(start + (inner * bb + base))
        base += bpc * bb
    return out


def _move_indexed(
    group: KVGroupTensors, places: _Places, bpc: int, buf: torch.Tensor, to_staging: bool, *, non_blocking: bool
) -> None:
    """A move through a device buffer in payload layout: a gather is one ``index_select`` per
    tensor into it, then one copy into ``buf``; a scatter one copy out of ``buf``, then one
    ``index_copy_`` per tensor. With CUDA tensors that is a kernel per tensor and one DMA,
    whatever the block ids (a copy per block is a DMA per block). Runs on the caller's stream;
    any device (the tests run it on CPU tensors)."""
    pos_np, ids_np = places.arrays()
    dev = group.device
    chunks = places.chunks(bpc)
    cb = group.chunk_bytes(bpc)
    ids = torch.from_numpy(ids_np).to(dev, non_blocking=non_blocking)
    pos = torch.from_numpy(pos_np).to(dev, non_blocking=non_blocking)
    host = buf[: chunks * cb]
    if to_staging and places.pos is None:  # every position is written
        tmp = torch.empty(chunks * cb, dtype=torch.uint8, device=dev)
    else:  # the chunks' bytes (positions not listed keep theirs), then the positions asked
        tmp = host.to(dev, non_blocking=non_blocking)
    base = 0
    for t, bb in zip(group.tensors, group.block_bytes):
        # this tensor's part of every chunk, as rows of bb bytes: row q is position q
        part = tmp.view(chunks, cb)[:, base : base + bpc * bb].reshape(chunks, bpc, bb)
        rows = part.view(chunks * bpc, bb) if part.is_contiguous() else None
        if to_staging:
            got = t.index_select(0, ids)
            if rows is not None and places.pos is None:  # a gather's positions: the rows in order
                rows[: len(ids_np)].copy_(got)
            elif places.pos is None:  # whole chunks of several tensors: one strided copy
                part.copy_(got.view(chunks, bpc, bb))
            elif rows is not None:
                rows.index_copy_(0, pos, got)
            else:  # a strided part (several tensors): through its own rows
                flat = part.reshape(chunks * bpc, bb)
                flat.index_copy_(0, pos, got)
                part.copy_(flat.view(chunks, bpc, bb))
        else:
            src = rows if rows is not None else part.reshape(chunks * bpc, bb)
            t.index_copy_(0, ids, src.index_select(0, pos))
        base += bpc * bb
    if to_staging:
        host.copy_(tmp, non_blocking=non_blocking)


def _move_host(
    group: KVGroupTensors, places: _Places, bpc: int, buf: np.ndarray, to_staging: bool, threads: int = 1
) -> None:
    """:meth:`Copier._move` in host memory.

    With the C helper: one ``move_pieces`` call per tensor for the whole move, whatever the block
    ids — runs of consecutive blocks merge there, the rest move block by block in C with
    non-temporal stores, the GIL released, split over ``threads``. A churned engine pool hands
    out scattered ids; a Python copy per block ran 64 KiB chunks of 4 blocks at half of one
    ``index_select``; this runs them faster than it (docs/performance.md).
    Without the helper: one NumPy copy per run of consecutive blocks and tensor (``copyto`` has a
    third of torch ``copy_``'s fixed cost per call)."""
    arrays = group.host_arrays
    assert arrays is not None
    if _move_pieces is not None:
        for call in _host_pieces(group, places, bpc, buf, to_staging):
            _move_pieces(*call, threads)
        return
    cb = group.chunk_bytes(bpc)
    base = 0
    runs = _runs(places.pairs(), bpc if len(arrays) > 1 else None)
    for arr, bb in zip(arrays, group.block_bytes):
        for q, b, k in runs:
            at = (q // bpc) * cb + base + (q % bpc) * bb
            view = buf[at : at + k * bb]
            dev = arr[b] if k == 1 else arr[b : b + k].reshape(-1)
            if to_staging:
                np.copyto(view, dev)
            else:
                np.copyto(dev, view)
        base += bpc * bb


def _host_pieces(
    group: KVGroupTensors,
    places: _Places,
    bpc: int,
    buf: np.ndarray,
    to_staging: bool,
    starts: np.ndarray | None = None,
) -> list[tuple[Any, ...]]:
    """The ``move_pieces`` calls of a host move, one per tensor: ``(dst, dst_offsets, src,
    src_offsets, piece)`` (``starts``: each chunk's payload offset in ``buf``, see
    :func:`_payload_offsets`)."""
    arrays = group.host_arrays
    assert arrays is not None
    pos, ids = places.arrays()
    calls: list[tuple[Any, ...]] = []
    for arr, bb, at_buf in zip(arrays, group.block_bytes, _payload_offsets(group, pos, bpc, starts)):
        flat, at_dev = arr.reshape(-1), ids * bb
        calls.append((buf, at_buf, flat, at_dev, bb) if to_staging else (flat, at_dev, buf, at_buf, bb))
    return calls


class HostMove:
    """A deferred host move: one ``move_pieces_async`` ticket per tensor, over when all are.
    ``query()`` and ``synchronize()`` as a CUDA event; ``cancel()`` takes the tickets that have
    not started off the mover's queue and waits for the others. A ticket holds its buffers until
    its move is over (dropping one waits for that)."""

    __slots__ = ("tickets",)

    def __init__(self, tickets: list[Any]) -> None:
        self.tickets = tickets

    def query(self) -> bool:
        return all(t.query() for t in self.tickets)

    def synchronize(self) -> None:
        for t in self.tickets:
            t.synchronize()

    def cancel(self) -> None:
        for t in reversed(self.tickets):  # the last queued first: none starts after its turn
            t.cancel()


def settle(moves: Sequence[Any]) -> None:
    """Block until none of ``moves`` (what :class:`Copier` returned: None, a CUDA event, a
    :class:`HostMove`) can still touch memory: a deferred move not started yet is taken off the
    queue, one running is waited for, a CUDA event is synchronized. For a job that ends early (an
    error, a cancel, its timeout) before it gives back slots or staging another job may reuse."""
    for ev in reversed(moves):
        if isinstance(ev, HostMove):
            ev.cancel()
        elif ev is not None:
            ev.synchronize()


def _runs(placements: Sequence[tuple[int, int]], bpc: int | None = None) -> list[tuple[int, int, int]]:
    """``(position, block_id, count)`` runs of placements whose positions and block ids both
    step by one, never across a chunk's end (every ``bpc`` positions): each run is one contiguous
    range on both sides (one copy instead of ``count``)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in placements:
        if runs:
            p0, b0, k = runs[-1]
            if pos == p0 + k and b == b0 + k and (bpc is None or pos % bpc):
                runs[-1] = (p0, b0, k + 1)
                continue
        runs.append((pos, b, 1))
    return runs


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None

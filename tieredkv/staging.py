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
  caller's stream, and completion is an event; with CPU tensors they are plain ``copy_``\\ s
  (one ``copy_`` per run of consecutive blocks: ``index_copy_`` on bytes is ~12x slower here).
"""

from __future__ import annotations

import threading
from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:  # the optional C helper (setup.py): copies with non-temporal stores
    from tieredkv._fastrec import stream_into as _stream_into
except ImportError:  # not built here: NumPy's copy
    _stream_into = None

__all__ = ["Copier", "KVGroupTensors", "StagingBuffer", "StagingPool"]

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

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self._streams: dict[Any, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def record_ready(self, group: KVGroupTensors) -> Any:
        """On the engine thread at submit: an event marking the KV bytes as written (CUDA), else None."""
        if group.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(group.device))
        return ev

    def gather(self, group: KVGroupTensors, block_ids: Sequence[int], dst: torch.Tensor, after: Any = None) -> Any:
        """Copy blocks ``block_ids`` into ``dst`` (payload layout). Returns a completion event or None."""
        return self._move(group, list(enumerate(block_ids)), len(block_ids), dst, after, to_staging=True)

    def scatter(
        self, group: KVGroupTensors, placements: Sequence[tuple[int, int]], src: torch.Tensor, chunk_blocks: int
    ) -> Any:
        """Copy payload ``src`` (a chunk of ``chunk_blocks`` blocks) into the device: each
        ``(position_in_chunk, block_id)`` of ``placements``; positions not listed are not copied."""
        return self._move(group, placements, chunk_blocks, src, None, to_staging=False)

    def _move(
        self,
        group: KVGroupTensors,
        placements: Sequence[tuple[int, int]],
        n: int,
        buf: torch.Tensor,
        after: Any,
        *,
        to_staging: bool,
    ) -> Any:
        if buf.numel() < group.chunk_bytes(n):
            raise ValueError(f"staging view of {buf.numel()} bytes is smaller than {n} blocks ({group.chunk_bytes(n)})")
        if group.host_arrays is not None and buf.device.type == "cpu":
            return _move_host(group.host_arrays, group.block_bytes, _runs(placements), n, buf.numpy(), to_staging)
        on_cuda = group.device.type == "cuda"
        if on_cuda:
            stream = self._stream(group.device)
            if after is not None:
                stream.wait_event(after)
            ctx: Any = torch.cuda.stream(stream)
        else:
            ctx = _NullCtx()
        runs = _runs(placements)
        with ctx:
            off = 0
            for t, bb in zip(group.tensors, group.block_bytes):
                for pos, b, k in runs:  # one copy per run of consecutive blocks
                    view = buf[off + pos * bb : off + (pos + k) * bb]
                    dev = t[b] if k == 1 else t[b : b + k].view(-1)
                    if to_staging:
                        view.copy_(dev, non_blocking=on_cuda)
                    else:
                        dev.copy_(view, non_blocking=on_cuda)
                off += n * bb
            if on_cuda:
                ev = torch.cuda.Event()
                ev.record(stream)
                return ev
        return None


def _move_host(
    arrays: list[np.ndarray],
    block_bytes: list[int],
    runs: list[tuple[int, int, int]],
    n: int,
    buf: np.ndarray,
    to_staging: bool,
) -> None:
    """:meth:`Copier._move` in host memory: one copy per run of consecutive blocks and tensor,
    the GIL released. NumPy's ``copyto`` has a third of torch ``copy_``'s fixed cost per call
    (256 KiB chunks 8.0-8.3 against 5.6-6.4 GB/s); from :data:`_STREAM_AT` bytes the C helper's
    non-temporal copy writes the destination without reading it first (one thread, 256 MiB in
    4 MiB copies: 13.7 GB/s against 8.5 for ``copyto`` and 12.0 for ``copy_`` on two threads)."""
    off = 0
    for arr, bb in zip(arrays, block_bytes):
        for pos, b, k in runs:
            view = buf[off + pos * bb : off + (pos + k) * bb]
            dev = arr[b] if k == 1 else arr[b : b + k].reshape(-1)
            if to_staging:
                _copy(view, dev)
            else:
                _copy(dev, view)
        off += n * bb


#: Host copies at least this large go through the C helper's non-temporal copy (where built).
_STREAM_AT = 64 << 10


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for two contiguous uint8 ranges of the same size."""
    if _stream_into is not None and src.nbytes >= _STREAM_AT:
        _stream_into(dst, src)
    else:
        np.copyto(dst, src)


def _runs(placements: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(position, block_id, count)`` runs of placements whose positions and block ids both
    step by one: each run is one contiguous range on both sides (one copy instead of ``count``)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in placements:
        if runs:
            p0, b0, k = runs[-1]
            if pos == p0 + k and b == b0 + k:
                runs[-1] = (p0, b0, k + 1)
                continue
        runs.append((pos, b, 1))
    return runs


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None

"""Block moves between KV tensors and staging: the C helper's ``move_pieces`` fed hostile input,
and :class:`Copier` on CPU tensors byte for byte against a pure-torch reference, on every host
path (C helper, NumPy runs, NumPy without the stream copy) and on the device path's logic
(``_move_indexed`` and the per-run copies) run on CPU tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tieredkv import staging
from tieredkv.staging import Copier, KVGroupTensors, _move_indexed, _Places

# ---------------------------------------------------------------------------------------------
# move_pieces
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def move_pieces() -> Callable[..., int]:
    """The C helper's ``move_pieces``: fail where it should have been built, skip elsewhere."""
    from tests.unit.test_keys_format import CAN_BUILD

    if staging._move_pieces is None:
        if CAN_BUILD:
            pytest.fail("the C helper is not built here although it can be (reinstall: pip install -e .)")
        pytest.skip("no C compiler on this machine: the NumPy path is the one in use")
    return staging._move_pieces


def _i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def _ref_move(dst: np.ndarray, doff: np.ndarray, src: np.ndarray, soff: np.ndarray, piece: int) -> None:
    """What ``move_pieces`` must do, item by item in order."""
    for d, s in zip(doff.tolist(), soff.tolist()):
        dst[d : d + piece] = src[s : s + piece].copy()


_BAD_OFFSETS = [
    ("dst", _i64(0, -1)),
    ("dst", _i64(0, 64 - 8 + 1)),  # ends one byte past the end
    ("dst", _i64(0, 64)),
    ("dst", _i64(0, 2**63 - 1)),  # offset + piece overflows int64
    ("dst", _i64(0, -(2**63))),
    ("src", _i64(0, -1)),
    ("src", _i64(0, 96 - 8 + 1)),
    ("src", _i64(0, 2**63 - 1)),
]


@pytest.mark.parametrize(("side", "bad"), _BAD_OFFSETS)
def test_move_pieces_refuses_offsets_out_of_range_and_copies_nothing(
    move_pieces: Callable[..., int], side: str, bad: np.ndarray
) -> None:
    """Item 0 is valid, item 1 is not: the ValueError comes before any byte moves."""
    dst = np.full(64, 0xEE, dtype=np.uint8)
    src = np.arange(96, dtype=np.uint8)
    before = dst.copy()
    good = _i64(0, 8)
    doff, soff = (bad, good) if side == "dst" else (good, bad)
    with pytest.raises(ValueError, match="outside"):
        move_pieces(dst, doff, src, soff, 8)
    assert np.array_equal(dst, before)
    move_pieces(dst, good, src, good, 8)  # the same call with valid offsets does copy item 0
    assert not np.array_equal(dst, before)


@pytest.mark.parametrize("bigger", ["dst", "src"])
def test_move_pieces_refuses_a_piece_larger_than_a_buffer(move_pieces: Callable[..., int], bigger: str) -> None:
    dst = np.full(32, 7, dtype=np.uint8)
    src = np.arange(32, dtype=np.uint8)
    piece = 33
    if bigger == "src":  # the destination can hold it, the source cannot
        dst = np.full(64, 7, dtype=np.uint8)
    before = dst.copy()
    with pytest.raises(ValueError, match="outside"):
        move_pieces(dst, _i64(0), src, _i64(0), piece)
    assert np.array_equal(dst, before)


@pytest.mark.parametrize(
    "offsets",
    [
        np.array([0], dtype=np.int32),
        np.array([0.0], dtype=np.float64),
        np.array([0], dtype=np.uint64),
        np.array([0], dtype=">i8"),  # int64 of the other byte order would be misread
        [0],
        (0,),
    ],
    ids=["int32", "float64", "uint64", "big-endian", "list", "tuple"],
)
@pytest.mark.parametrize("side", ["dst", "src"])
def test_move_pieces_wants_int64_offset_arrays(move_pieces: Callable[..., int], offsets: Any, side: str) -> None:
    dst = np.zeros(16, dtype=np.uint8)
    src = np.arange(16, dtype=np.uint8)
    doff, soff = (offsets, _i64(0)) if side == "dst" else (_i64(0), offsets)
    with pytest.raises(TypeError):
        move_pieces(dst, doff, src, soff, 4)
    assert not dst.any()


def test_move_pieces_refuses_strided_offsets(move_pieces: Callable[..., int]) -> None:
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises((ValueError, BufferError)):
        move_pieces(dst, (np.arange(4, dtype=np.int64) * 4)[::2], np.arange(16, dtype=np.uint8), _i64(0, 4), 4)
    assert not dst.any()


def test_move_pieces_refuses_offset_arrays_of_different_lengths(move_pieces: Callable[..., int]) -> None:
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="offsets"):
        move_pieces(dst, _i64(0, 4), np.arange(16, dtype=np.uint8), _i64(0), 4)
    with pytest.raises(ValueError, match="offsets"):
        move_pieces(dst, _i64(0), np.arange(16, dtype=np.uint8), _i64(0, 4), 4)
    assert not dst.any()


@pytest.mark.parametrize(("piece", "threads"), [(0, 1), (-4, 1), (4, 0), (4, 9), (4, -1)])
def test_move_pieces_bounds_piece_and_threads(move_pieces: Callable[..., int], piece: int, threads: int) -> None:
    dst = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="piece must be > 0"):
        move_pieces(dst, _i64(0), np.arange(1, 17, dtype=np.uint8), _i64(0), piece, threads)
    assert not dst.any()
    assert move_pieces(dst, _i64(0), np.arange(1, 17, dtype=np.uint8), _i64(0), 4, 8) == 4  # 8 is allowed
    assert dst[:4].tolist() == [1, 2, 3, 4]


def test_move_pieces_refuses_a_read_only_destination(move_pieces: Callable[..., int]) -> None:
    src = np.arange(16, dtype=np.uint8)
    dst = bytes(16)
    with pytest.raises(BufferError):
        move_pieces(dst, _i64(0), src, _i64(0), 4)
    assert dst == bytes(16)
    frozen = np.zeros(16, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        move_pieces(frozen, _i64(0), src, _i64(0), 4)
    assert not frozen.any()
    with pytest.raises(BufferError):
        move_pieces(memoryview(bytes(16)), _i64(0), src, _i64(0), 4)


@pytest.mark.parametrize("shift", [-5, -1, 1, 3, 8])
def test_move_pieces_between_views_of_one_array_is_a_memmove(move_pieces: Callable[..., int], shift: int) -> None:
    """One piece whose source and destination overlap: the bytes land as memmove leaves them."""
    base = np.arange(64, dtype=np.uint8)
    want = base.copy()
    src, dst = base[8:56], base[8 + shift : 56 + shift]  # the same memory, ``shift`` bytes apart
    ref_src, ref_dst = want[8:56], want[8 + shift : 56 + shift]
    ref_dst[:] = ref_src.copy()
    assert move_pieces(dst, _i64(0), src, _i64(0), 48) == 48
    assert np.array_equal(base, want)


@pytest.mark.parametrize("threads", [1, 4])
def test_move_pieces_on_shared_memory_is_in_order_on_one_thread(move_pieces: Callable[..., int], threads: int) -> None:
    """A chain: item i copies slot a[i] to slot a[i+1], so every slot of the chain ends with the
    first slot's bytes only when the items run in order. Large enough that four threads would
    each get over 1 MiB if the buffers did not share memory."""
    piece = 4096 + 3
    slots = 2048
    rng = np.random.default_rng(5)
    chain = rng.permutation(slots)
    # no item next to the previous on both sides (those merge into one memmove)
    assert not any(chain[i + 1] == chain[i] + 1 and chain[i + 2] == chain[i + 1] + 1 for i in range(slots - 2))
    base = rng.integers(0, 256, slots * piece + 9, dtype=np.uint8)
    want = base.copy()
    dst, src = base[9:], base[:]  # views of the same array, 9 bytes apart
    doff = (chain[1:] * piece).astype(np.int64)
    soff = (chain[:-1] * piece + 9).astype(np.int64)  # slot a[i] of ``dst``, seen through ``src``
    _ref_move(want[9:], doff, want, soff, piece)
    assert move_pieces(dst, doff, src, soff, piece, threads) == (slots - 1) * piece
    assert np.array_equal(base, want)
    first = want[9 + chain[0] * piece : 9 + (chain[0] + 1) * piece]
    assert np.array_equal(want[9 + chain[-1] * piece :][:piece], first)  # the chain carried slot a[0]


def _scattered_items(rng: np.random.Generator, count: int, piece: int, src_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets for ``count`` items: destination slots a shuffled set of runs of 1..8 consecutive
    slots (no two overlapping), each run read from a random place of the source (runs merge in C;
    the rest are single pieces)."""
    doff, soff = [], []
    cuts = np.cumsum(rng.integers(1, 9, count))
    starts = np.concatenate([[0], cuts[cuts < count]])
    runs = [(int(a), int(min(b, count))) for a, b in zip(starts, np.append(starts[1:], count)) if a < count]
    for i in rng.permutation(len(runs)):
        a, b = runs[i]
        s = int(rng.integers(0, src_len - (b - a) * piece + 1))
        doff += [k * piece for k in range(a, b)]
        soff += [s + k * piece for k in range(b - a)]
    return np.array(doff, dtype=np.int64), np.array(soff, dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    ("piece", "count"),
    [(1, 3000), (100, 2000), (4096, 1600), (5003, 1300), (65539, 100)],
)
def test_move_pieces_is_byte_exact_against_numpy(
    move_pieces: Callable[..., int], threads: int, piece: int, count: int
) -> None:
    """Random offsets, runs and single pieces, off the 16-byte grid on both sides; the three
    largest cases are over 4 MiB so that 2 and 4 threads each get their 1 MiB and split."""
    rng = np.random.default_rng(piece * 10 + threads)
    src_len = count * piece + 777
    src = rng.integers(0, 256, src_len + 3, dtype=np.uint8)[3:]
    dst = rng.integers(0, 256, count * piece + 129, dtype=np.uint8)[5:]
    doff, soff = _scattered_items(rng, count, piece, src_len)
    doff += 13  # off the grid, and bytes before the first slot that nothing writes
    want = dst.copy()
    _ref_move(want, doff, src, soff, piece)
    if piece >= 4096:
        assert count * piece // threads >= 1 << 20  # the C code splits at >= 1 MiB per thread
    assert move_pieces(dst, doff, src, soff, piece, threads) == count * piece
    assert np.array_equal(dst, want)


def test_move_pieces_with_no_items_copies_nothing(move_pieces: Callable[..., int]) -> None:
    dst = np.zeros(16, dtype=np.uint8)
    empty = np.empty(0, dtype=np.int64)
    assert move_pieces(dst, empty, np.arange(16, dtype=np.uint8), empty, 4) == 0
    assert move_pieces(dst, empty, np.arange(16, dtype=np.uint8), empty, 1 << 20, 4) == 0  # no item to check
    assert not dst.any()


def _big_case(seed: int, piece: int = 16 << 10, count: int = 256) -> tuple[np.ndarray, ...]:
    """A 4 MiB move of scattered pieces (large enough to split over four threads): dst, doff,
    src, soff and the bytes dst must end with."""
    rng = np.random.default_rng(seed)
    src_len = count * piece * 2
    src = rng.integers(0, 256, src_len, dtype=np.uint8)
    dst = np.zeros(count * piece, dtype=np.uint8)
    doff, soff = _scattered_items(rng, count, piece, src_len)
    want = dst.copy()
    _ref_move(want, doff, src, soff, piece)
    return dst, doff, src, soff, want


def test_move_pieces_from_several_threads_at_once(move_pieces: Callable[..., int]) -> None:
    """Callers on several Python threads at once (the GIL released): one holds the helper pool,
    the others start threads of their own; every call lands byte-exact."""
    import threading

    errors: list[str] = []
    start = threading.Barrier(6)

    def caller(k: int) -> None:
        start.wait()
        for rep in range(6):
            dst, doff, src, soff, want = _big_case(100 * k + rep)
            move_pieces(dst, doff, src, soff, 16 << 10, 2 + (k + rep) % 3)
            if not np.array_equal(dst, want):
                errors.append(f"caller {k} rep {rep}")

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert errors == []


def test_move_pieces_calls_spaced_past_the_helpers_spin(move_pieces: Callable[..., int]) -> None:
    """Calls a few milliseconds apart find the pool's helpers asleep (past their 2 ms spin):
    they wake late, join a call already closed or help with what is left; the bytes are exact
    either way, and a call that asks for fewer helpers than the pool holds uses only those."""
    import time

    for rep in range(8):
        dst, doff, src, soff, want = _big_case(7 + rep)
        assert move_pieces(dst, doff, src, soff, 16 << 10, 4 if rep % 2 else 2) == dst.nbytes
        assert np.array_equal(dst, want)
        time.sleep(0.005)  # the state to test (helpers asleep), not a wait for a result


def _in_forked_child(target: Callable[[Any], None]) -> Any:
    """Run ``target(conn)`` in a forked child and return what it sent; the child must exit 0."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=target, args=(there,))
    child.start()
    assert here.poll(120), "the child did not answer"  # a bound on a hang, not a wait
    got = here.recv()
    child.join()
    assert child.exitcode == 0
    return got


def _move_in_child(conn: Any) -> None:
    import os

    dst, doff, src, soff, want = _big_case(42)
    before = len(os.listdir("/proc/self/task"))
    staging._move_pieces(dst, doff, src, soff, 16 << 10, 4)  # type: ignore[misc]
    conn.send((bool(np.array_equal(dst, want)), len(os.listdir("/proc/self/task")) - before))


def test_move_pieces_in_a_forked_child_after_the_parent_used_its_pool(move_pieces: Callable[..., int]) -> None:
    """A forked child has none of the parent's helper threads: it starts its own three (a pool
    that counted the parent's would move on the calling thread alone; one that waited for them
    would hang)."""
    dst, doff, src, soff, want = _big_case(41)
    move_pieces(dst, doff, src, soff, 16 << 10, 4)  # the parent's pool: three helpers
    assert np.array_equal(dst, want)
    assert _in_forked_child(_move_in_child) == (True, 3)


def _wake_in_child(conn: Any) -> None:
    import os

    from tieredkv._fastrec import move_wake

    def count() -> int:
        return len(os.listdir("/proc/self/task"))

    before = count()
    move_wake(4)  # a fresh pool (this is a forked child): three helpers start, awake
    woken = count() - before
    move_wake(4)  # already there: none more
    again = count() - before
    dst, doff, src, soff, want = _big_case(43)
    staging._move_pieces(dst, doff, src, soff, 16 << 10, 4)  # type: ignore[misc]
    conn.send((woken, again, count() - before, bool(np.array_equal(dst, want))))


def test_move_wake_starts_the_helpers_a_move_then_uses(move_pieces: Callable[..., int]) -> None:
    """``move_wake`` (called when a job is queued) starts the pool's helpers ahead of the move;
    the move then starts none of its own, and lands byte-exact. Its thread count is checked."""
    from tieredkv._fastrec import move_wake

    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match="threads must be 1..8"):
            move_wake(bad)
    move_wake(1)  # one thread: no helper to wake
    assert _in_forked_child(_wake_in_child) == (3, 3, 3, True)


# ---- moves queued to the mover thread (move_pieces_async) ----------------------------------


@pytest.fixture
def move_async(move_pieces: Callable[..., int]) -> Callable[..., Any]:
    assert staging._move_pieces_async is not None, "a build with move_pieces has move_pieces_async"
    return staging._move_pieces_async


def test_queued_moves_land_byte_exact_in_order_and_notify(move_async: Callable[..., Any]) -> None:
    """Twelve moves queued at once (each 4 MiB of scattered pieces), the later ones over the
    same destination as earlier ones: they run in the order queued (the last writer wins), each
    writes one byte to the notify pipe when over, and a ticket reports it."""
    import os

    r, w = os.pipe2(os.O_NONBLOCK)
    try:
        cases = [_big_case(200 + k) for k in range(6)]
        shared = np.zeros_like(cases[0][0])
        tickets = []
        for dst, doff, src, soff, _ in cases:
            tickets.append(move_async(dst, doff, src, soff, 16 << 10, 2, w))
            tickets.append(move_async(shared, doff, src, soff, 16 << 10, 2, w))  # overwritten by the next
        for t in tickets:
            t.synchronize()
            assert t.query()
        for dst, _, _, _, want in cases:
            assert np.array_equal(dst, want)
        assert np.array_equal(shared, cases[-1][4])  # the last queued wrote last
        assert len(os.read(r, 4096)) == len(tickets)
    finally:
        os.close(r)
        os.close(w)


def test_a_queued_move_checks_its_arguments_at_the_call(move_async: Callable[..., Any]) -> None:
    dst = np.zeros(64, dtype=np.uint8)
    src = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="source offset 61"):
        move_async(dst, _i64(0), src, _i64(61), 4, 1, -1)
    with pytest.raises(ValueError, match="notify_fd"):
        move_async(dst, _i64(0), src, _i64(0), 4, 1, -2)
    with pytest.raises(TypeError):
        move_async(dst, _i64(0), src, _i64(0), 4, 1)  # notify_fd is not optional
    t = move_async(dst, _i64(0), src, _i64(8), 4, 1, -1)
    t.synchronize()
    assert dst[:4].tolist() == [8, 9, 10, 11]
    assert not dst[4:].any()


def test_cancel_takes_queued_moves_off_and_they_move_nothing(move_async: Callable[..., Any]) -> None:
    """Behind a long move, queued ones cancelled before they start leave their destination as
    it was; one cancelled after it ran reports False (it moved). Every case is built before the
    first move is queued, and the round is repeated (fresh destinations) until a cancel has
    caught a move still queued: a condition, not a wait on the clock."""
    blocker = _big_case(300, count=2048)  # 32 MiB: the mover is busy with it for a while
    queued = [_big_case(301 + k) for k in range(4)]
    caught = 0
    for _ in range(20):
        for case in (blocker, *queued):
            case[0][:] = 0
        first = move_async(blocker[0], blocker[1], blocker[2], blocker[3], 16 << 10, 1, -1)
        tickets = [move_async(d, do, sr, so, 16 << 10, 2, -1) for d, do, sr, so, _ in queued]
        outcomes = [t.cancel() for t in reversed(tickets)]  # the last queued first
        first.synchronize()
        assert np.array_equal(blocker[0], blocker[4])
        for t, ok, (dst, _, _, _, want) in zip(tickets, reversed(outcomes), queued):
            assert t.query()
            if ok:  # taken off before it ran: nothing written
                assert not dst.any()
            else:
                assert np.array_equal(dst, want)
        assert first.cancel() is False  # over already: it moved
        caught += sum(outcomes)
        if caught:
            break
    assert caught, "in 20 rounds no cancel found a move still queued behind 32 MiB"


def test_dropping_tickets_waits_for_their_moves(move_async: Callable[..., Any]) -> None:
    """A ticket holds its buffers: dropping one while queued or running waits for (or cancels)
    its move before its buffers go. Dropped tickets and kept ones interleaved, then the kept ones
    land byte-exact, and the process survives the buffers being freed at once."""
    import gc

    kept = []
    for k in range(8):
        dst, doff, src, soff, want = _big_case(400 + k)
        t = move_async(dst, doff, src, soff, 16 << 10, 2, -1)
        if k % 2:
            kept.append((t, dst, want))
        del t, dst, doff, src, soff  # the odd ones live on in ``kept``; the even ones go now
        gc.collect()
    for t, dst, want in kept:
        t.synchronize()
        assert np.array_equal(dst, want)


def _async_in_child(conn: Any) -> None:
    dst, doff, src, soff, want = _big_case(45)
    t = staging._move_pieces_async(dst, doff, src, soff, 16 << 10, 2, -1)  # type: ignore[misc]
    t.synchronize()
    conn.send(bool(np.array_equal(dst, want)))


def test_queued_moves_in_a_forked_child(move_async: Callable[..., Any]) -> None:
    """The parent's mover thread is not in a forked child: the child starts its own."""
    dst, doff, src, soff, want = _big_case(44)
    move_async(dst, doff, src, soff, 16 << 10, 2, -1).synchronize()  # the parent's mover runs
    assert np.array_equal(dst, want)
    assert _in_forked_child(_async_in_child) is True


def test_copier_defers_host_moves_and_wakes_the_loop_through_its_pipe(
    move_pieces: Callable[..., int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Copier(defer=True)`` moves on the mover thread; ``Copier.wait`` returns once each move
    is over (woken by the pipe, on a real asyncio loop); ``close`` settles what is in flight,
    waits out the mover's last notification (``move_fence``: a move seen done may still be
    writing its byte) and only then closes the pipe."""
    import asyncio
    import os

    fenced: list[bool] = []
    real_fence = staging._move_fence
    assert real_fence is not None

    def fence() -> None:
        fenced.append(staging_pipe_open())
        real_fence()

    monkeypatch.setattr(staging, "_move_fence", fence)

    g = torch.Generator().manual_seed(46)
    kv = torch.randint(0, 256, (64, 64 << 10), dtype=torch.uint8, generator=g)
    group = KVGroupTensors([kv])
    copier = Copier(threads=2)

    def staging_pipe_open() -> bool:
        return copier._notify is not None and all(os.fstat(fd) is not None for fd in copier._notify)

    ids = torch.randperm(64, generator=g).tolist()
    outs = [torch.zeros(16 * (64 << 10), dtype=torch.uint8) for _ in range(4)]

    async def run() -> None:
        moves = [copier.gather(group, ids[16 * k : 16 * k + 16], outs[k], chunk_blocks=4, defer=True) for k in range(4)]
        assert all(isinstance(m, staging.HostMove) for m in moves)
        for m in moves:
            await copier.wait(m)
            assert m.query()

    asyncio.run(run())
    for k in range(4):
        assert torch.equal(outs[k].view(16, -1), kv[ids[16 * k : 16 * k + 16]])
    assert copier._notify is not None
    r, w = copier._notify
    late = copier.gather(group, ids[:16], torch.zeros_like(outs[0]), chunk_blocks=4, defer=True)
    copier.close()  # settles ``late``, fences, and closes the pipe
    assert late.query()
    assert fenced == [True]  # the fence ran while the pipe was still open
    assert copier._notify is None
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)
    copier.close()  # idempotent


def test_copier_waiters_return_in_the_order_they_came(move_pieces: Callable[..., int]) -> None:
    """A waiter whose moves are over still returns after an earlier waiter whose move is held
    (jobs resume in the order they queued their copies: the CPU tier commits a tenant's stores in
    turn); a cancelled waiter lets the ones behind it go; one wait takes a job's several moves;
    a waiter over already that comes while an earlier one is woken but has not run goes right
    after it, with no byte of the pipe left to wake it."""
    import asyncio
    import contextlib
    import os
    import threading

    g = torch.Generator().manual_seed(52)
    kv = torch.randint(0, 256, (32, 16 << 10), dtype=torch.uint8, generator=g)
    group = KVGroupTensors([kv])
    copier = Copier(threads=2)
    gate = threading.Event()
    log: list[str] = []
    order: list[str] = []

    def move(k: int, held: bool = False) -> Any:
        m = copier.gather(group, [k], torch.zeros(16 << 10, dtype=torch.uint8), defer=True)
        return staging.HostMove([_GatedTicket(t, gate, log) for t in m.tickets]) if held else m

    async def waiter(name: str, *moves: Any) -> None:
        await copier.wait(*moves)
        order.append(name)

    async def until(cond: Callable[[], bool]) -> None:
        while not cond():
            await asyncio.sleep(0)

    async def run() -> None:
        a = move(0, held=True)
        b, c = move(1), move(2)
        b.synchronize()
        c.synchronize()  # over before their waiters come: they wait behind A all the same
        ta = asyncio.create_task(waiter("a", a))
        await until(lambda: len(copier._waiters) == 1)
        tb = asyncio.create_task(waiter("b", None, b, c))
        for _ in range(20):  # the loop runs on, with the pipe's bytes read, and B stays behind
            await asyncio.sleep(0)
        assert order == [] and not tb.done()
        gate.set()
        assert copier._notify is not None
        os.write(copier._notify[1], b"w")  # the held move is over: wake the pipe's watch
        await asyncio.gather(ta, tb)
        assert order == ["a", "b"]

        gate.clear()
        d, e = move(3, held=True), move(4)
        e.synchronize()
        td = asyncio.create_task(waiter("d", d))
        await until(lambda: len(copier._waiters) == 1)
        te = asyncio.create_task(waiter("e", e))
        await until(lambda: len(copier._waiters) == 2)
        td.cancel()  # D's job is cancelled: E waited only for it
        await te
        assert order == ["a", "b", "e"] and td.cancelled()
        gate.set()
        d.synchronize()

        # F is woken and has not run yet; G, over already, comes now: no byte of the pipe is left
        # to wake it, so its own wait must see that it may go once F has
        gate.clear()
        f, g_ = move(5, held=True), move(6)
        g_.synchronize()
        f.tickets[0].real.synchronize()  # the held move is over underneath; it reports so once the gate opens
        assert staging._move_fence is not None
        staging._move_fence()  # every byte of the two moves is in the pipe: read them here
        with contextlib.suppress(BlockingIOError):
            while os.read(copier._notify[0], 4096):
                pass
        for _ in range(3):  # a watch that saw the bytes before they were read runs (and finds none)
            await asyncio.sleep(0)
        tf = asyncio.create_task(waiter("f", f))
        await until(lambda: len(copier._waiters) == 1)
        gate.set()
        copier._on_notify()  # the pipe's watch (no byte is left to call it): F's future is set
        async with asyncio.timeout(60):  # a bound for a broken build, not a wait for work
            await copier.wait(g_)  # in this task, at once: F is still listed when G comes
        order.append("g")
        await tf
        assert order == ["a", "b", "e", "f", "g"]

    asyncio.run(run())
    assert copier._waiters == []
    copier.close()


# ---------------------------------------------------------------------------------------------
# Copier on CPU tensors, against a pure-torch reference
# ---------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (blocks, block bytes) ``uint8`` over the same memory."""
    return t.view(t.shape[0], -1).view(torch.uint8)


def ref_payload(tensors: Sequence[torch.Tensor], ids: Sequence[int], bpc: int) -> torch.Tensor:
    """Chunks of ``bpc`` blocks back to back; each chunk, tensor by tensor, its blocks' bytes."""
    rows = [_rows(t) for t in tensors]
    parts = []
    for c in range(len(ids) // bpc):
        chunk = torch.tensor(ids[c * bpc : (c + 1) * bpc])
        parts += [r[chunk].reshape(-1) for r in rows]
    return torch.cat(parts)


def ref_scatter(
    tensors: Sequence[torch.Tensor], placements: Sequence[tuple[int, int]], src: torch.Tensor, bpc: int
) -> None:
    """Position ``q`` (block ``q % bpc`` of chunk ``q // bpc``) of the payloads into block ``b``."""
    rows = [_rows(t) for t in tensors]
    bbs = [r.shape[1] for r in rows]
    cb = bpc * sum(bbs)
    for q, b in placements:
        c, j = divmod(q, bpc)
        base = 0
        for r, bb in zip(rows, bbs):
            at = c * cb + base + j * bb
            r[b] = src[at : at + bb]
            base += bpc * bb


def _tensors(layout: str, num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if layout == "one":  # one tensor, 512-byte blocks
        return [torch.randn(num_blocks, 2, 8, 16, generator=g).to(torch.float16)]
    if layout == "hybrid":  # K/V of a full-attention layer and a smaller state, odd sizes
        return [
            torch.randn(num_blocks, 4, 16, generator=g).to(torch.bfloat16),  # 128 B
            torch.randn(num_blocks, 3, 7, generator=g),  # 84 B
            torch.randint(0, 256, (num_blocks, 33), dtype=torch.uint8, generator=g),  # 33 B
        ]
    raise AssertionError(layout)


def _ids(kind: str, rng: np.random.Generator, num_blocks: int, n: int) -> list[int]:
    """``n`` distinct block ids of 1..num_blocks-1 (0 is the null block)."""
    if kind == "consecutive":
        return list(range(3, 3 + n))
    if kind == "permutation":
        return [int(x) + 1 for x in rng.permutation(num_blocks - 1)[:n]]
    if kind == "runs":  # a fragmented free list: the pool cut into runs of 1..4 ids, shuffled
        runs: list[list[int]] = []
        b = 1
        while b < num_blocks:
            k = int(rng.integers(1, 5))
            runs.append(list(range(b, min(b + k, num_blocks))))
            b += k
        out = [x for i in rng.permutation(len(runs)) for x in runs[i]]
        assert len(out) >= n
        return out[:n]
    raise AssertionError(kind)


PATHS = ["c", "numpy", "device-logic"]


@pytest.fixture(params=PATHS)
def make_group(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[..., KVGroupTensors]:
    """A :class:`KVGroupTensors` whose moves take one path: ``c`` the C helper's ``move_pieces``;
    ``numpy`` one NumPy copy per run of blocks (without the helper); ``device-logic`` the CUDA branch of ``Copier._move`` (per-run ``copy_``, or ``_move_indexed``
    past two runs) on CPU tensors."""
    path = request.param
    if path == "c":
        request.getfixturevalue("move_pieces")
    if path == "numpy":
        for name in ("_move_pieces", "_move_pieces_async", "_move_wake"):  # no helper at all
            monkeypatch.setattr(staging, name, None)

    def make(tensors: Sequence[torch.Tensor]) -> KVGroupTensors:
        group = KVGroupTensors(tensors)
        if path == "device-logic":
            group.host_arrays = None
            group.host_bytes = None
        return group

    return make


def _staging(nbytes: int, pad: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """A staging view of ``nbytes`` off the 16-byte grid inside a larger buffer of 0xAB."""
    whole = torch.full((nbytes + 2 * pad,), 0xAB, dtype=torch.uint8)
    return whole, whole[pad : pad + nbytes]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ids_kind", ["consecutive", "permutation", "runs"])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_gather_of_whole_chunks_is_the_reference_payload(
    make_group: Callable[..., KVGroupTensors], layout: str, ids_kind: str, threads: int
) -> None:
    num_blocks, bpc, chunks = 64, 4, 5
    tensors = _tensors(layout, num_blocks, seed=1)
    snapshot = [t.clone() for t in tensors]
    group = make_group(tensors)
    ids = _ids(ids_kind, np.random.default_rng(2), num_blocks, bpc * chunks)
    want = ref_payload(tensors, ids, bpc)
    whole, buf = _staging(want.numel())
    assert Copier(threads=threads).gather(group, ids, buf, chunk_blocks=bpc) is None
    assert torch.equal(buf, want)
    assert (whole[:37] == 0xAB).all() and (whole[37 + want.numel() :] == 0xAB).all()
    assert all(torch.equal(a, b) for a, b in zip(tensors, snapshot))  # a gather writes no block


@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_gather_without_chunk_blocks_is_one_chunk(make_group: Callable[..., KVGroupTensors], layout: str) -> None:
    tensors = _tensors(layout, 40, seed=3)
    group = make_group(tensors)
    ids = [9, 2, 3, 4, 31, 17, 18]  # runs and single blocks
    want = ref_payload(tensors, ids, len(ids))
    whole, buf = _staging(want.numel())
    Copier().gather(group, ids, buf)
    assert torch.equal(buf, want)
    assert (whole[:37] == 0xAB).all() and (whole[37 + want.numel() :] == 0xAB).all()
    if layout == "hybrid":  # one chunk of 7 is not the same bytes as 7 chunks of 1
        assert not torch.equal(want, ref_payload(tensors, ids, 1))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ids_kind", ["consecutive", "permutation", "runs"])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_scatter_blocks_is_the_reference_and_touches_no_other_block(
    make_group: Callable[..., KVGroupTensors], layout: str, ids_kind: str, threads: int
) -> None:
    num_blocks, bpc, chunks = 64, 4, 5
    rng = np.random.default_rng(4)
    ids = _ids(ids_kind, rng, num_blocks, bpc * chunks)
    src_tensors = _tensors(layout, num_blocks, seed=5)
    payload = ref_payload(src_tensors, list(rng.permutation(num_blocks)[: bpc * chunks].tolist()), bpc)
    whole, buf = _staging(payload.numel())
    buf.copy_(payload)
    tensors = _tensors(layout, num_blocks, seed=6)
    want = [t.clone() for t in tensors]
    ref_scatter(want, list(enumerate(ids)), payload, bpc)
    assert Copier(threads=threads).scatter_blocks(make_group(tensors), ids, buf, bpc) is None
    for got, exp in zip(tensors, want):
        assert torch.equal(_rows(got), _rows(exp))
    assert torch.equal(buf, payload)  # the source is left as it was
    assert (whole[:37] == 0xAB).all() and (whole[37 + payload.numel() :] == 0xAB).all()
    untouched = sorted(set(range(num_blocks)) - set(ids))
    assert torch.equal(_rows(tensors[0])[untouched], _rows(_tensors(layout, num_blocks, seed=6)[0])[untouched])


@pytest.mark.parametrize("ids_kind", ["consecutive", "permutation", "runs"])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_round_trip_of_a_job(make_group: Callable[..., KVGroupTensors], layout: str, ids_kind: str) -> None:
    """Gather a job's chunks, scatter them into other blocks: the other blocks get the bytes."""
    num_blocks, bpc = 96, 2
    rng = np.random.default_rng(7)
    ids = _ids(ids_kind, rng, num_blocks, 24)
    others = [b for b in rng.permutation(num_blocks - 1).tolist() if b + 1 not in ids][:24]
    others = [b + 1 for b in others]
    tensors = _tensors(layout, num_blocks, seed=8)
    group = make_group(tensors)
    _, buf = _staging(group.chunk_bytes(bpc) * 12)
    copier = Copier()
    copier.gather(group, ids, buf, chunk_blocks=bpc)
    copier.scatter_blocks(group, others, buf, bpc)
    for t in tensors:
        assert torch.equal(_rows(t)[others], _rows(t)[ids])


@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_scatter_skips_positions_not_listed_so_the_null_block_keeps_its_bytes(
    make_group: Callable[..., KVGroupTensors], layout: str
) -> None:
    """A load whose chunks hold the null block (0) at some positions lists only the others: block
    0 and every block not listed keep their bytes, listed ones get their positions' bytes, in any
    order, across several chunks."""
    num_blocks, bpc, chunks = 48, 4, 4
    rng = np.random.default_rng(9)
    ids = [int(x) + 1 for x in rng.permutation(num_blocks - 1)[: bpc * chunks]]
    ids[0] = ids[5] = ids[6] = ids[15] = 0  # null block in chunks 0, 1 and 3
    placements = [(q, b) for q, b in enumerate(ids) if b != 0 and q != 9]  # position 9 not asked either
    placements = [placements[i] for i in rng.permutation(len(placements))]
    payload = ref_payload(_tensors(layout, num_blocks, seed=10), list(range(bpc * chunks)), bpc)
    tensors = _tensors(layout, num_blocks, seed=11)
    before = [t.clone() for t in tensors]
    want = [t.clone() for t in tensors]
    ref_scatter(want, placements, payload, bpc)
    _, buf = _staging(payload.numel())
    buf.copy_(payload)
    Copier().scatter(make_group(tensors), placements, buf, bpc)
    for got, exp, old in zip(tensors, want, before):
        assert torch.equal(_rows(got), _rows(exp))
        assert torch.equal(_rows(got)[0], _rows(old)[0])  # the null block
        assert torch.equal(_rows(got)[ids[9]], _rows(old)[ids[9]])  # the position not asked
    assert not torch.equal(_rows(tensors[0])[ids[1]], _rows(before[0])[ids[1]])  # a listed one moved


@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_scatter_of_a_short_last_chunk(make_group: Callable[..., KVGroupTensors], layout: str) -> None:
    """Positions of a partial last chunk: the payloads span only as many chunks as they reach."""
    bpc = 4
    tensors = _tensors(layout, 32, seed=12)
    group = make_group(tensors)
    placements = [(0, 20), (1, 3), (4, 11), (5, 12)]  # chunk 1 holds 2 of its 4 blocks
    _, buf = _staging(group.chunk_bytes(bpc) * 2)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    want = [t.clone() for t in tensors]
    ref_scatter(want, placements, buf, bpc)
    Copier().scatter(group, placements, buf, bpc)
    assert all(torch.equal(_rows(a), _rows(b)) for a, b in zip(tensors, want))
    with pytest.raises(ValueError, match="smaller"):
        Copier().scatter(group, [(8, 1)], buf, bpc)  # position 8 is in a third chunk


def test_copier_refuses_ids_that_are_not_whole_chunks_and_small_buffers() -> None:
    group = KVGroupTensors(_tensors("hybrid", 16, seed=13))
    buf = torch.zeros(group.chunk_bytes(2) * 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole chunks"):
        Copier().gather(group, [1, 2, 3], buf, chunk_blocks=2)
    with pytest.raises(ValueError, match="whole chunks"):
        Copier().scatter_blocks(group, [1, 2, 3], buf, 2)
    with pytest.raises(ValueError, match="smaller"):
        Copier().gather(group, [1, 2, 3, 4, 5, 6], buf, chunk_blocks=2)
    with pytest.raises(ValueError, match=">= 0"):
        Copier().scatter(group, [(-1, 3)], buf, 2)
    assert not buf.any()
    assert Copier().gather(group, [], buf) is None and not buf.any()


@pytest.mark.parametrize("path", ["c", "numpy", "device-logic"])
def test_every_path_refuses_block_ids_outside_the_tensors(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id past the last block or below 0 is refused before a byte moves, on every path (NumPy
    would wrap -1 to the last block; a CUDA index would assert on the device)."""
    if path == "numpy":
        monkeypatch.setattr(staging, "_move_pieces", None)
    tensors = _tensors("hybrid", 16, seed=14)
    before = [t.clone() for t in tensors]
    group = KVGroupTensors(tensors)
    if path == "device-logic":
        group.host_arrays = None
    buf = torch.zeros(group.chunk_bytes(2), dtype=torch.uint8)
    for ids, bad in (([3, 16], 16), ([-1, 3], -1)):
        with pytest.raises(ValueError, match=rf"block ids must be in 0\.\.15, got {bad}"):
            Copier().gather(group, ids, buf)
        with pytest.raises(ValueError, match=rf"got {bad}"):
            Copier().scatter_blocks(group, ids, buf, 2)
        with pytest.raises(ValueError, match=rf"got {bad}"):
            Copier().scatter(group, [(0, ids[0]), (1, ids[1])], buf, 2)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)) and not buf.any()


@pytest.mark.parametrize("threads", [0, 9, True, 1.5])
def test_copier_threads_are_checked_when_made(threads: object) -> None:
    with pytest.raises(ValueError, match="Copier threads must be an int from 1 to 8"):
        Copier(threads=threads)  # type: ignore[arg-type]


def test_copier_wakes_the_helpers_only_for_host_moves_on_several_threads(
    move_pieces: Callable[..., int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Copier.wake`` (the pipeline calls it as a job is queued) wakes the C helper's threads
    for a group in host memory and a copier of 2+ threads; not for one thread, nor for a group
    whose moves take the device path."""
    calls: list[int] = []
    real = staging._move_wake
    assert real is not None

    def counted(threads: int) -> None:
        calls.append(threads)
        real(threads)

    monkeypatch.setattr(staging, "_move_wake", counted)
    host = KVGroupTensors([torch.zeros(8, 64, dtype=torch.uint8)])
    Copier(threads=3).wake(host)
    Copier(threads=1).wake(host)
    device = KVGroupTensors([torch.zeros(8, 64, dtype=torch.uint8)])
    device.host_arrays = None  # as a CUDA group has none
    Copier(threads=2).wake(device)
    assert calls == [3]


@pytest.mark.parametrize("threads", [1, 2])
def test_host_moves_large_enough_to_split_over_threads(make_group: Callable[..., KVGroupTensors], threads: int) -> None:
    """A job of 3 MiB for one tensor: with 2 threads the C helper splits its calls (>= 1 MiB each)."""
    g = torch.Generator().manual_seed(15)
    tensors = [
        torch.randint(0, 256, (80, 64 << 10), dtype=torch.uint8, generator=g),
        torch.randn(80, 4099, generator=g),  # 16 KiB + 12 bytes per block
    ]
    group = make_group(tensors)
    ids = _ids("runs", np.random.default_rng(16), 80, 48)
    want = ref_payload(tensors, ids, 8)
    assert _rows(tensors[0])[ids].numel() >= 3 << 20
    _, buf = _staging(want.numel())
    copier = Copier(threads=threads)
    copier.gather(group, ids, buf, chunk_blocks=8)
    assert torch.equal(buf, want)
    back = [torch.zeros_like(t) for t in tensors]
    copier.scatter_blocks(make_group(back), ids, buf, 8)
    for t, b in zip(tensors, back):
        assert torch.equal(_rows(b)[ids], _rows(t)[ids])
        assert not _rows(b)[sorted(set(range(80)) - set(ids))].any()


# ---------------------------------------------------------------------------------------------
# _move_indexed (the CUDA path's logic) called directly on CPU tensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_move_indexed_gather_is_the_reference_payload(layout: str, chunks: int) -> None:
    """Several chunks of a multi-tensor group are strided parts of the temporary (its own branch)."""
    bpc = 4
    tensors = _tensors(layout, 40, seed=17)
    group = KVGroupTensors(tensors)
    ids = _ids("permutation", np.random.default_rng(18), 40, bpc * chunks)
    want = ref_payload(tensors, ids, bpc)
    whole, buf = _staging(want.numel())
    _move_indexed(group, _Places(None, ids), bpc, buf, True, non_blocking=False)
    assert torch.equal(buf, want)
    assert (whole[:37] == 0xAB).all() and (whole[37 + want.numel() :] == 0xAB).all()


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_move_indexed_gather_into_listed_positions(layout: str, chunks: int) -> None:
    """Explicit positions (not in order, some left out) on the gather side: each listed position
    holds its block's bytes."""
    bpc = 4
    tensors = _tensors(layout, 40, seed=19)
    group = KVGroupTensors(tensors)
    rng = np.random.default_rng(20)
    n = bpc * chunks
    pos = [int(q) for q in rng.permutation(n)[: n - 2]]
    ids = [int(b) + 1 for b in rng.permutation(39)[: len(pos)]]
    _, buf = _staging(group.chunk_bytes(bpc) * chunks)
    _move_indexed(group, _Places(pos, ids), bpc, buf, True, non_blocking=False)
    # the reference payload of the ids in position order
    by_pos = dict(zip(pos, ids))
    full = [by_pos.get(q, 0) for q in range(n)]
    want = ref_payload(tensors, full, bpc)
    bbs = group.block_bytes
    cb = group.chunk_bytes(bpc)
    for q in pos:
        c, j = divmod(q, bpc)
        base = 0
        for bb in bbs:
            at = c * cb + base + j * bb
            assert torch.equal(buf[at : at + bb], want[at : at + bb])
            base += bpc * bb


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_move_indexed_scatter_of_listed_positions(layout: str, chunks: int) -> None:
    bpc = 4
    n = bpc * chunks
    rng = np.random.default_rng(21)
    ids = [int(b) + 1 for b in rng.permutation(39)[:n]]
    placements = [(q, b) for q, b in enumerate(ids) if q % 3 != 1]  # a subset of the positions
    placements = [placements[i] for i in rng.permutation(len(placements))]
    payload = ref_payload(_tensors(layout, 40, seed=22), list(range(1, n + 1)), bpc)
    tensors = _tensors(layout, 40, seed=23)
    want = [t.clone() for t in tensors]
    ref_scatter(want, placements, payload, bpc)
    _, buf = _staging(payload.numel())
    buf.copy_(payload)
    _move_indexed(KVGroupTensors(tensors), _Places.of(placements), bpc, buf, False, non_blocking=False)
    assert all(torch.equal(_rows(a), _rows(b)) for a, b in zip(tensors, want))
    assert torch.equal(buf, payload)
    skipped = [b for q, b in enumerate(ids) if q % 3 == 1]
    fresh = _tensors(layout, 40, seed=23)
    assert all(torch.equal(_rows(a)[skipped], _rows(b)[skipped]) for a, b in zip(tensors, fresh))


@pytest.mark.parametrize("layout", ["one", "hybrid"])
def test_move_indexed_scatter_of_whole_chunks(layout: str) -> None:
    bpc, chunks = 2, 5
    ids = _ids("runs", np.random.default_rng(24), 40, bpc * chunks)
    payload = ref_payload(_tensors(layout, 40, seed=25), list(range(30, 30 + bpc * chunks)), bpc)
    tensors = _tensors(layout, 40, seed=26)
    want = [t.clone() for t in tensors]
    ref_scatter(want, list(enumerate(ids)), payload, bpc)
    _move_indexed(KVGroupTensors(tensors), _Places(None, ids), bpc, payload.clone(), False, non_blocking=False)
    assert all(torch.equal(_rows(a), _rows(b)) for a, b in zip(tensors, want))


def test_move_pieces_on_shared_memory_moves_item_by_item(move_pieces: Callable[..., int]) -> None:
    """Two items next to each other on both sides over one array: copied item by item, the
    second carries what the first just wrote (one merged memmove would carry the old bytes)."""
    base = np.arange(16, dtype=np.uint8)
    doff, soff = np.array([4, 8], np.int64), np.array([0, 4], np.int64)
    assert move_pieces(base, doff, base, soff, 4) == 8
    assert base[4:8].tolist() == [0, 1, 2, 3] and base[8:12].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("threads", [1, 3, "no helper"])
def test_the_pipeline_moves_scattered_blocks_on_its_configured_threads(
    threads: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipeline.copy_threads`` reaches the store's copier, and a job of chunks at scattered
    block ids (a churned pool's) goes into the CPU tier and back into other scattered blocks
    byte-exact (1 MiB and more per thread, so the C helper splits it; the slot path's copies
    deferred to its mover thread). Without the helper the same job moves by NumPy, at once."""
    from tieredkv.config import NamespaceConfig, PipelineConfig, TieredKVConfig
    from tieredkv.keys import Namespace
    from tieredkv.store import TieredStore

    if threads == "no helper":
        for name in ("_move_pieces", "_move_pieces_async", "_move_wake"):
            monkeypatch.setattr(staging, name, None)
        threads = 2
    bpc, n, bb = 4, 48, 32 << 10  # 48 chunks of 4 blocks of 32 KiB: 6 MiB a job
    g = torch.Generator().manual_seed(21)
    kv = torch.zeros(1 + 2 * n * bpc, bb, dtype=torch.uint8)
    order = torch.randperm(2 * n * bpc, generator=g) + 1
    src_ids, dst_ids = order[: n * bpc].tolist(), order[n * bpc :].tolist()
    kv[torch.tensor(src_ids)] = torch.randint(0, 256, (n * bpc, bb), dtype=torch.uint8, generator=g)
    cfg = TieredKVConfig(
        namespace=NamespaceConfig(model="moves"),
        pipeline=PipelineConfig(copy_threads=threads, max_batch_items=n),
        tiers=[{"kind": "cpu", "capacity_bytes": "64MiB"}],
    )
    ns = Namespace(model="moves")
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
    store = TieredStore(cfg, namespace=ns)
    assert store.pipeline.copier.threads == threads
    with store.start():
        store.register_group(0, [kv], blocks_per_chunk=bpc)
        for ids, submit in ((src_ids, store.store), (dst_ids, store.load)):
            job = submit(0, [(keys[i], ids[i * bpc : (i + 1) * bpc]) for i in range(n)])
            assert job is not None
            (res,) = store.wait([job]).values()
            assert res.ok, res.error
    assert torch.equal(kv[torch.tensor(dst_ids)], kv[torch.tensor(src_ids)])
    assert int(kv[0].sum()) == 0 and kv[torch.tensor(dst_ids)].any()


def test_staging_prefault_touches_the_pool_only_while_nothing_is_in_use() -> None:
    """``prefault`` (for benches) faults the whole slab in; with a buffer handed out it refuses
    rather than write over bytes a job is moving."""
    from tieredkv.staging import StagingPool

    pool = StagingPool(1 << 20, pin=False)
    pool.prefault()
    buf = pool.try_acquire(4096)
    assert buf is not None
    buf.tensor.fill_(7)
    with pytest.raises(RuntimeError, match="in use"):
        pool.prefault()
    assert int(buf.tensor.sum()) == 7 * 4096  # untouched
    pool.release(buf)
    pool.prefault()
    assert pool.free_bytes == pool.capacity


class _GatedTicket:
    """Fault injection around a real ``move_pieces_async`` ticket: it reports itself not over
    until the test opens the gate, so a job is certain to be waiting on it; ``cancel`` and
    ``synchronize`` go to the real ticket (and open the gate)."""

    def __init__(self, real: Any, gate: Any, log: list[str]) -> None:
        self.real, self.gate, self.log = real, gate, log

    def query(self) -> bool:
        return self.gate.is_set() and bool(self.real.query())

    def cancel(self) -> bool:
        self.log.append("settled")
        self.gate.set()
        return bool(self.real.cancel())

    def synchronize(self) -> None:
        self.gate.set()
        self.real.synchronize()


@pytest.mark.parametrize("op", ["store", "load"])
def test_a_job_cancelled_while_its_copies_are_deferred_settles_them_before_its_slots_go_back(
    move_pieces: Callable[..., int], monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A slot-path job whose deferred copy is not over when the store closes under it (its task
    cancelled): the copy is settled (taken off the mover's queue or waited for) before the CPU
    tier gets the slots back (``abort`` of a store's reserved slots, ``give_back`` of a load's
    borrowed ones), so no copy writes a slot another job may be handed, or reads one freed."""
    import threading

    from tieredkv.backends.cpu.slab import SlabTier
    from tieredkv.config import NamespaceConfig, PipelineConfig, TieredKVConfig
    from tieredkv.keys import Namespace
    from tieredkv.store import TieredStore

    bpc, n, bb = 4, 8, 16 << 10
    kv = torch.randint(0, 256, (1 + 2 * n * bpc, bb), dtype=torch.uint8, generator=torch.Generator().manual_seed(47))
    cfg = TieredKVConfig(
        namespace=NamespaceConfig(model="gated"),
        pipeline=PipelineConfig(max_batch_items=n),
        tiers=[{"kind": "cpu", "capacity_bytes": "64MiB"}],
    )
    ns = Namespace(model="gated")
    keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
    chunks = [(keys[i], list(range(1 + i * bpc, 1 + (i + 1) * bpc))) for i in range(n)]
    back = [(keys[i], list(range(1 + (n + i) * bpc, 1 + (n + i + 1) * bpc))) for i in range(n)]
    log: list[str] = []
    gate = threading.Event()
    queued = threading.Event()
    real_async = staging._move_pieces_async
    assert real_async is not None

    def gated(*args: Any) -> _GatedTicket:
        queued.set()
        return _GatedTicket(real_async(*args), gate, log)

    for name in ("abort", "give_back"):
        real = getattr(SlabTier, name)

        def wrapped(self: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            log.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(SlabTier, name, wrapped)
    store = TieredStore(cfg, namespace=ns)
    store.start()
    try:
        store.register_group(0, [kv], blocks_per_chunk=bpc)
        if op == "load":  # stored first, ungated
            (res,) = store.wait([store.store(0, chunks)]).values()
            assert res.ok, res.error
        monkeypatch.setattr(staging, "_move_pieces_async", gated)
        job = store.store(0, chunks) if op == "store" else store.load(0, back)
        assert job is not None
        assert queued.wait(60)  # the job's copy is queued and held: it is waiting on it
    finally:
        store.close(timeout=0)  # cancels the job under its copy
    want = "abort" if op == "store" else "give_back"
    assert want in log and "settled" in log
    assert log.index("settled") < log.index(want), log

"""Routing rules, the circuit breaker, the staging pool and block copies (CPU tensors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tieredkv.config import PolicyRule
from tieredkv.errors import ConfigError
from tieredkv.policy import BreakerState, CircuitBreaker, TierPolicy
from tieredkv.staging import Copier, KVGroupTensors, StagingPool


def test_rules_route_by_chunk_size_then_kind() -> None:
    pol = TierPolicy(
        [
            PolicyRule(max_chunk_bytes=256 << 10, tiers=["cpu", "redis"]),
            PolicyRule(kinds=["mamba"], tiers=["cpu"], promote=False),
            PolicyRule(tiers=["cpu", "lmdb"], write="back"),
        ],
        ["cpu", "lmdb", "redis"],
    )
    small = pol.route(0, 64 << 10, "full")
    assert small.tiers == ("cpu", "redis") and small.write_tiers == ("cpu", "redis")
    assert pol.route(1, 4 << 20, "mamba").tiers == ("cpu",)
    big = pol.route(2, 4 << 20, "sliding_window")
    assert big.tiers == ("cpu", "lmdb") and big.write_tiers == ("cpu",) and big.write == "back"
    assert pol.get(2) is big and pol.get(7).tiers == ("cpu", "lmdb", "redis")


def test_no_matching_rule_is_a_config_error() -> None:
    pol = TierPolicy([PolicyRule(max_chunk_bytes=1024)], ["cpu"])
    with pytest.raises(ConfigError, match="no rule matches group 3"):
        pol.route(3, 4096)


def test_breaker_opens_half_opens_and_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=3, reset_s=1.0, clock=lambda: now[0])
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state is BreakerState.CLOSED
    b.failure()
    assert b.state is BreakerState.OPEN and not b.allow() and b.opens == 1
    now[0] = 1.5
    assert b.allow() and b.state is BreakerState.HALF_OPEN
    assert not b.allow(), "half-open lets one probe through at a time"
    b.failure()
    assert b.state is BreakerState.OPEN and b.opens == 2 and not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()


def test_staging_pool_bounds_coalesces_and_counts_refusals() -> None:
    pool = StagingPool(64 * 1024, pin=False)
    a = pool.try_acquire(20_000)
    b = pool.try_acquire(20_000)
    c = pool.try_acquire(20_000)
    assert a and b and c and a.tensor.numel() == 20_000
    assert pool.try_acquire(8192) is None and pool.refusals == 1
    pool.release(b)
    pool.release(a)
    big = pool.try_acquire(40_000)  # a and b coalesced
    assert big is not None and big.offset == 0
    pool.release(big)
    pool.release(c)
    assert pool.free_bytes == pool.capacity and pool.try_acquire(64 * 1024) is not None
    assert pool.high_water == 64 * 1024


def test_staging_pool_part_is_whole_units_of_the_largest_free_range() -> None:
    pool = StagingPool(64 * 1024, pin=False)
    a = pool.try_acquire(16 * 1024)  # [0, 16K)
    b = pool.try_acquire(8 * 1024)  # [16K, 24K): free is [24K, 64K), 40 KiB
    assert a and b
    pool.release(a)  # free: [0, 16K) and [24K, 64K)
    part = pool.try_acquire_part(6000, 1 << 20)
    assert part is not None and part.offset == 24 * 1024 and part.nbytes == 6 * 6000  # 6 units of 40 KiB
    small = pool.try_acquire_part(6000, 7000)  # capped: one unit
    assert small is not None and small.nbytes == 6000 and small.offset == 0
    pool.release(part)
    pool.release(small)
    pool.release(b)
    assert pool.free_bytes == pool.capacity
    assert pool.try_acquire_part(65 * 1024, 1 << 20) is None and pool.refusals == 1  # not one unit fits
    with pytest.raises(ValueError):
        pool.try_acquire_part(0, 1)


def test_copier_gather_scatter_layout_and_skip() -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randint(0, 256, (8, 3, 5), dtype=torch.uint8, generator=g)
    v = torch.randn(8, 2, 4, generator=g).to(torch.bfloat16)
    group = KVGroupTensors([k, v])
    assert group.bytes_per_block == 15 + 16
    buf = torch.empty(group.chunk_bytes(2), dtype=torch.uint8)
    Copier().gather(group, [5, 2], buf)
    # payload = k[5], k[2], then v[5], v[2] as bytes
    assert torch.equal(buf[:15], k[5].reshape(-1)) and torch.equal(buf[15:30], k[2].reshape(-1))
    assert torch.equal(buf[30:46], v[5].reshape(-1).view(torch.uint8))
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    Copier().scatter(KVGroupTensors([k2, v2]), [(1, 7)], buf, chunk_blocks=2)
    assert torch.equal(k2[7], k[2]) and torch.equal(v2[7], v[2])
    assert not k2[:7].any()
    with pytest.raises(ValueError, match="smaller"):
        Copier().gather(group, [1, 2, 3], buf)


def _need_helper(fn: object) -> None:
    """Fail where the C helper should have been built (a C compiler and Python headers), skip elsewhere."""
    from tests.unit.test_keys_format import CAN_BUILD

    if fn is None:
        if CAN_BUILD:
            pytest.fail("the C helper is not built here although it can be (reinstall: pip install -e .)")
        pytest.skip("no C compiler on this machine: NumPy's copy is the one in use")


@pytest.mark.parametrize("helper", ["c", "numpy"])
def test_large_host_copies_land_byte_for_byte_on_both_paths(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host moves take the C helper's ``move_pieces`` where it is built, one NumPy copy per run
    of blocks without it; the bytes that land are the same, for one block, a run of blocks and
    a multi-tensor group whose block sizes are off the 16-byte grid."""
    from tieredkv import staging

    if helper == "numpy":
        monkeypatch.setattr(staging, "_move_pieces", None)
    else:
        _need_helper(staging._move_pieces)
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 256, (6, 70_001), dtype=torch.uint8, generator=g)  # odd block bytes
    v = torch.randn(6, 20_000, generator=g).to(torch.bfloat16)
    group = KVGroupTensors([k, v])
    buf = torch.zeros(group.chunk_bytes(3) + 1, dtype=torch.uint8)[1:]  # off the grid as well
    Copier().gather(group, [4, 1, 2], buf)  # a single block, then a run of two
    want = torch.cat([k[4], k[1], k[2], v[4].view(torch.uint8), v[1].view(torch.uint8), v[2].view(torch.uint8)])
    assert torch.equal(buf, want)
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    Copier().scatter(KVGroupTensors([k2, v2]), [(0, 5), (1, 2), (2, 3)], buf, chunk_blocks=3)
    assert torch.equal(k2[5], k[4]) and torch.equal(k2[2:4], k[1:3]) and torch.equal(v2[2:4], v[1:3])
    assert not k2[:2].any() and not k2[4].any() and not v2[:2].any()


def test_the_stream_copy_copies_every_byte_and_refuses_a_short_destination() -> None:
    """The C helper's non-temporal copy (the bench's two-thread raw copy, ``copy_2t_nt``)."""
    try:
        from tieredkv._fastrec import stream_into as _stream_into
    except ImportError:
        _stream_into = None
    _need_helper(_stream_into)
    assert _stream_into is not None
    src = bytes(range(256)) * 600 + b"tail"
    for shift in range(0, 17, 5):
        for n in (0, 1, 63, 16 * 1024, 64 * 1024 + 7, len(src)):
            dst = bytearray(n + 40)
            assert _stream_into(memoryview(dst)[shift:], src[:n]) == n
            assert dst[shift : shift + n] == src[:n] and not any(dst[:shift]) and not any(dst[shift + n :])
    with pytest.raises(ValueError, match="smaller"):
        _stream_into(bytearray(99_999), src[:100_000])
    with pytest.raises(BufferError):
        _stream_into(src, src)  # a read-only destination


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_direct_view_only_for_a_whole_chunk_of_consecutive_blocks_in_order(bpc: int) -> None:
    """A CPU group's chunk is moved with no staging copy exactly when its block ids are the whole
    chunk on consecutive blocks in order (for a load, not the null block); the view is those
    blocks' bytes. Every other chunk of the same call gets None."""
    from tieredkv.groups import GroupSpec
    from tieredkv.pipeline import ChunkRef
    from tieredkv.pipeline.transfer import GroupBinding
    from tieredkv.policy import GroupRoute

    kv = torch.arange(16 * 8, dtype=torch.uint8).view(16, 8)
    grp = GroupBinding(
        GroupSpec(0, "full", tokens_per_block=16, blocks_per_chunk=bpc),
        KVGroupTensors([kv]),
        GroupRoute(0, ("x",), "through", True),
        null_block=0,
    )
    run = tuple(range(5, 5 + bpc))
    cases = [run, run[:-1], tuple(range(bpc))]  # whole; short (a skipped block); from the null block
    if bpc > 1:
        cases += [run[::-1], (*run[:-1], 14), (5,) * bpc]  # out of order; not consecutive; repeated
    if bpc == 4:
        cases.append((5, 7, 6, 8))  # the right ends, the middle swapped
    chunks = [ChunkRef(b"k", ids) for ids in cases]
    for load in (True, False):
        views = grp.direct_views(chunks, load=load)
        assert views[0] is not None and bytes(views[0]) == kv[5 : 5 + bpc].numpy().tobytes()
        assert views[1] is None
        if load:
            assert views[2] is None  # a load never reads into the null block
        else:
            assert views[2] is not None and bytes(views[2]) == kv[:bpc].numpy().tobytes()
        assert all(v is None for v in views[3:])
    assert grp.direct_views(chunks[:1], load=True, skip={0}) == [None]  # e.g. served from a slot
    no_null = dataclasses.replace(grp, null_block=None)  # no null block: block 0 is a block like any
    (view,) = no_null.direct_views(chunks[2:3], load=True)
    assert view is not None and bytes(view) == kv[:bpc].numpy().tobytes()
    two = GroupBinding(
        GroupSpec(0, "full", tokens_per_block=16, blocks_per_chunk=bpc),
        KVGroupTensors([kv, kv.clone()]),
        GroupRoute(0, ("x",), "through", True),
    )
    assert two.direct_views(chunks[:1], load=False) == [None]  # several tensors: not one range

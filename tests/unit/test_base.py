"""The Tier template methods: deadlines, error translation, observers, lifecycle."""

from __future__ import annotations

import asyncio
import time

import pytest

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.cpu.config import CPUTierConfig
from tieredkv.errors import TierClosedError, TierTimeoutError, TierUnavailableError
from tieredkv.keys import Namespace
from tieredkv.testing.faulty import FaultyTier

KEY = Namespace(model="m").key(b"h" * 32, 0)


def cpu() -> CPUTier:
    return CPUTier(CPUTierConfig(capacity_bytes="16MiB", segment_bytes="1MiB"))


async def test_deadline_turns_a_slow_tier_into_timeout_quickly() -> None:
    async with FaultyTier(cpu(), delay_s=5.0, op_timeout_s=0.2, ops={"get_many"}) as tier:
        await tier.put_many([(KEY, b"abc")])
        t0 = time.perf_counter()
        with pytest.raises(TierTimeoutError, match="deadline"):
            await tier.get_many([KEY])
        assert time.perf_counter() - t0 < 1.0
        assert tier.counters["timeouts"] == 1
        assert tier.is_pinned(KEY) is False  # pins released on the error path


async def test_native_errors_are_wrapped_with_cause() -> None:
    boom = OSError(5, "I/O error")
    async with FaultyTier(cpu(), fail_with=boom, ops={"put_many"}) as tier:
        with pytest.raises(TierUnavailableError, match="put_many failed: OSError") as ei:
            await tier.put_many([(KEY, b"abc")])
        assert ei.value.__cause__ is boom
        assert tier.counters["errors"] == 1
        assert await tier.get_many([KEY]) == [None]  # nothing half-stored


async def test_cancellation_is_not_swallowed() -> None:
    async with FaultyTier(cpu(), delay_s=5.0, op_timeout_s=10) as tier:
        task = asyncio.create_task(tier.contains_many([KEY]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_observers_see_every_operation_and_outcome() -> None:
    seen = []
    tier = FaultyTier(cpu(), fail_with=RuntimeError("x"), ops={"delete_many"})
    tier.add_observer(lambda *a: seen.append(a))
    tier.add_observer(lambda *a: 1 / 0)  # a broken observer must not break the tier
    async with tier:
        await tier.put_many([(KEY, b"abcd")])
        with pytest.raises(TierUnavailableError):
            await tier.delete_many([KEY])
    ops = [(s[1], s[2], s[3], s[5]) for s in seen]
    assert ("put_many", 1, 4, "ok") in ops
    assert ("delete_many", 1, 0, "TierUnavailableError") in ops


async def test_lazy_open_idempotent_close_and_use_after_close() -> None:
    tier = cpu()
    assert await tier.contains_many([KEY]) == [False]  # opens on first use
    await tier.close()
    await tier.close()
    with pytest.raises(TierClosedError):
        await tier.open()
    never_opened = cpu()
    await never_opened.close()
    assert never_opened.closed


async def test_a_bad_item_is_named_by_its_index_and_nothing_of_the_batch_is_written() -> None:
    """``put_many`` and ``raw_put_many`` check every item before writing any (the same check the
    pipeline's host-buffer jobs make on the caller's thread): a short key or a buffer that is not
    one raises, naming the call and the item's index, and the good items before it are not stored."""
    other = Namespace(model="m").key(b"i" * 32, 0)
    async with cpu() as tier:
        for call, good, bad, message in [
            (tier.put_many, b"x" * 100, (b"short", b"y"), r"put_many: item 1: a tier key must be a stored key"),
            (tier.put_many, b"x" * 100, (other, 17), r"put_many: item 1: .*bytes-like"),
            (tier.raw_put_many, b"x" * 100, (other, 17), r"raw_put_many: item 1: .*bytes-like"),
        ]:
            with pytest.raises((TypeError, ValueError), match=message):
                await call([(KEY, good), bad])
            assert await tier.contains_many([KEY, other]) == [False, False]


async def test_counters_snapshot_and_the_evict_listener_hook_are_declared_on_every_tier() -> None:
    """What callers outside the tier modules use instead of reaching in: ``counters_snapshot``
    (a copy taken under the tier's lock) and ``set_evict_listener`` (the base passes nothing on;
    the CPU tier calls it for each record its policy evicts)."""
    async with FaultyTier(cpu()) as wrapped:  # a tier that does not override the hook
        wrapped.set_evict_listener(lambda *a: None)
        await wrapped.put_many([(KEY, b"abc")])
        snap = wrapped.counters_snapshot()
        assert snap["puts"] == 1 and type(snap) is dict
        wrapped.counters["puts"] += 1
        assert snap["puts"] == 1  # a copy, not the live counters

    evicted: list[tuple[bytes, bytes, int]] = []
    tier = CPUTier(CPUTierConfig(capacity_bytes="2MiB", segment_bytes="1MiB", min_slot_bytes="512KiB"))
    tier.set_evict_listener(lambda k, payload, tenant: evicted.append((k, bytes(payload), tenant)))  # (a view)
    async with tier:
        ns = Namespace(model="m")
        for i in range(6):  # 512 KiB records in 2 MiB: the oldest are evicted
            await tier.put_many([(ns.key(bytes([i]) * 32, 0), bytes([i]) * (400 << 10))])
    assert evicted and evicted[0] == (ns.key(bytes([0]) * 32, 0), bytes([0]) * (400 << 10), 0)
    assert tier.counters_snapshot()["evictions"] == len(evicted)

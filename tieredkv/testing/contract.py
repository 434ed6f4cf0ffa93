"""The tier contract suite, shipped so a third-party tier can run it too.

Needs pytest and pytest-asyncio: ``pip install 'tieredkv[contract]'``.

Usage — subclass :class:`TierContract` in a test module and provide one fixture::

    class TestMyTier(TierContract):
        @pytest.fixture
        async def make_tier(self, tmp_path):
            tiers = []

            async def make(capacity_bytes: int | None = None) -> Tier:
                tier = MyTier(MyTierConfig(..., capacity=capacity_bytes or DEFAULT))
                await tier.open()
                tiers.append(tier)
                return tier

            yield make
            for t in tiers:
                await t.close()

``make(capacity_bytes)`` returns an opened tier holding at most about ``capacity_bytes`` of
payload (``None``: plenty). :func:`made_tiers` writes that fixture's body for you::

    @pytest.fixture
    async def make_tier(self, tmp_path):
        async with made_tiers(lambda cap, n: MyTier(MyTierConfig(..., capacity=cap or DEFAULT))) as make:
            yield make
 What the suite demands follows the tier's
:attr:`~tieredkv.backends.base.Tier.capabilities`, never its kind: a tier whose capacity a
server enforces (``local_eviction=False``) only needs to show that old records go and new
ones stay; one with ``sync_probe=True`` must answer :meth:`~tieredkv.backends.base.Tier.probe`.
Override :meth:`TierContract.corrupt` if the tier has no raw-record hooks.

A third-party tier (see ``tests/plugin_sample/`` in the tieredkv repository) needs exactly one
such class: ``pip install 'tieredkv[contract]'`` brings pytest and pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import torch

from tieredkv.backends.base import Tier
from tieredkv.errors import TierClosedError, TierFullError
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import Namespace

__all__ = ["TierContract", "made_tiers", "payload", "uniform"]

SIZES = [1, 63, 64, 4095, 4096, 65536, 1 << 20, 4 << 20]


def payload(n: int, seed: int = 0) -> torch.Tensor:
    """Deterministic pseudo-random ``uint8`` tensor of ``n`` bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def uniform(n: int, value: int) -> torch.Tensor:
    """``n`` bytes all equal to ``value`` (a torn read shows as mixed bytes)."""
    return torch.full((n,), value, dtype=torch.uint8)


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@contextlib.asynccontextmanager
async def made_tiers(
    build: Callable[[int | None, int], Tier],
) -> AsyncIterator[Callable[[int | None], Awaitable[Tier]]]:
    """The ``make_tier`` fixture's ``make``: ``build(capacity_bytes, n)`` makes the n-th tier
    (not opened); ``make`` opens it, and every tier made is closed on the way out."""
    tiers: list[Tier] = []

    async def make(capacity_bytes: int | None = None) -> Tier:
        tier = build(capacity_bytes, len(tiers))
        await tier.open()
        tiers.append(tier)
        return tier

    try:
        yield make
    finally:
        for t in tiers:
            await t.close()


@pytest.mark.asyncio
class TierContract:
    """Behaviour every tier must show. Subclasses provide the ``make_tier`` fixture."""

    #: Bytes a stored record holds past its header and payload (as ``raw_get_many`` returns it):
    #: 0, or for a tier with encryption the AEAD tag (:data:`tieredkv.format.SEAL_TAG`).
    record_tail = 0

    @pytest.fixture
    def ns(self) -> Namespace:
        return Namespace(model="contract/model", tenant_salt=uuid.uuid4().hex)

    @pytest.fixture
    async def tier(self, make_tier: Any) -> Tier:
        return await make_tier(None)

    async def corrupt(self, tier: Tier, key: bytes) -> None:
        """Flip one payload byte of ``key``'s stored record."""
        (rec,) = await tier.raw_get_many([key])
        assert rec is not None, "record to corrupt is missing"
        buf = bytearray(rec)
        buf[HEADER_SIZE + len(buf[HEADER_SIZE:]) // 2] ^= 0xFF
        await tier.raw_put_many([(key, buf)])

    # ---- round trips -----------------------------------------------------------------

    @pytest.mark.parametrize("size", SIZES)
    async def test_round_trip_sizes(self, tier: Tier, ns: Namespace, size: int) -> None:
        key = ns.key(_h(size), 0)
        data = payload(size, seed=size)
        await tier.put_many([(key, data)])
        out = torch.empty(size, dtype=torch.uint8)
        assert await tier.get_many([key], into=[out]) == [size]
        assert torch.equal(out, data)
        (raw,) = await tier.get_many([key])
        assert raw == data.numpy().tobytes()

    async def test_into_larger_buffers_of_other_types(self, tier: Tier, ns: Namespace) -> None:
        key = ns.key(_h(1), 1)
        data = os.urandom(1000)
        await tier.put_many([(key, memoryview(data))])
        ba = bytearray(4096)
        t = torch.zeros(2048, dtype=torch.uint8)
        assert await tier.get_many([key, key], into=[ba, t]) == [1000, 1000]
        assert bytes(ba[:1000]) == data and bytes(t[:1000].numpy()) == data
        assert not any(ba[1000:]) and not bool(t[1000:].any())

    async def test_buffer_too_small_is_a_miss(self, tier: Tier, ns: Namespace) -> None:
        key = ns.key(_h(2), 0)
        await tier.put_many([(key, payload(4096))])
        assert await tier.get_many([key], into=[bytearray(100)]) == [None]
        assert tier.counters["oversize"] == 1

    async def test_batch_with_duplicates_and_missing(self, tier: Tier, ns: Namespace) -> None:
        k1, k2, missing = ns.key(_h(1), 0), ns.key(_h(2), 0), ns.key(_h(3), 0)
        a, b, c = payload(5000, 1), payload(5000, 2), payload(5000, 3)
        await tier.put_many([(k1, a), (k2, b), (k1, c)])
        got = await tier.get_many([k1, missing, k2, k1])
        assert got == [c.numpy().tobytes(), None, b.numpy().tobytes(), c.numpy().tobytes()]
        assert await tier.contains_many([k1, missing, k2]) == [True, False, True]

    async def test_overwrite_with_other_sizes(self, tier: Tier, ns: Namespace) -> None:
        key = ns.key(_h(9), 2)
        for i, size in enumerate([4096, 100_000, 10, 70_000]):
            data = payload(size, seed=i)
            await tier.put_many([(key, data)])
            assert (await tier.get_many([key]))[0] == data.numpy().tobytes()
        assert [r.size async for r in tier.scan(ns.fingerprint)] == [70_000]

    async def test_delete(self, tier: Tier, ns: Namespace) -> None:
        k1, k2 = ns.key(_h(1), 0), ns.key(_h(2), 0)
        await tier.put_many([(k1, payload(10)), (k2, payload(10))])
        assert await tier.delete_many([k1, ns.key(_h(77), 0)]) == 1
        assert await tier.contains_many([k1, k2]) == [False, True]
        assert await tier.get_many([k1]) == [None]
        assert await tier.delete_many([k1]) == 0

    @pytest.mark.parametrize("size", [100, 1 << 20])
    async def test_delete_if_same_keeps_a_record_written_since(self, tier: Tier, ns: Namespace, size: int) -> None:
        """Compare-and-delete (repairs): a record replaced after it was read stays; the one read
        goes; a key that vanished counts nothing. A tier that cannot compare and delete says so."""
        k1, k2 = ns.key(_h(1), 0), ns.key(_h(2), 0)
        await tier.put_many([(k1, payload(size, 1)), (k2, payload(size, 2))])
        old1, old2 = await tier.raw_get_many([k1, k2])
        assert old1 is not None and old2 is not None
        await tier.put_many([(k1, payload(size, 3))])  # rewritten after it was read
        try:
            n = await tier.delete_if_same([(k1, old1), (k2, old2), (ns.key(_h(3), 0), old2)])
        except NotImplementedError:
            assert await tier.contains_many([k1, k2]) == [True, True]
            return
        assert n == 1
        assert await tier.get_many([k1, k2]) == [payload(size, 3).numpy().tobytes(), None]
        (new1,) = await tier.raw_get_many([k1])
        assert new1 is not None and await tier.delete_if_same([(k1, new1)]) == 1
        assert await tier.contains_many([k1]) == [False]

    async def test_probe_agrees_with_contains(self, tier: Tier, ns: Namespace) -> None:
        """``probe`` (synchronous, from any thread) is None or the same answer as ``contains_many``."""
        import asyncio

        k1, k2, k3 = ns.key(_h(31), 0), ns.key(_h(32), 0), ns.key(_h(33), 1)
        await tier.put_many([(k1, payload(64)), (k3, payload(64))])
        await tier.delete_many([k3])
        want = await tier.contains_many([k1, k2, k3])
        assert want == [True, False, False]
        got = await asyncio.to_thread(tier.probe, [k1, k2, k3])  # another thread, as the scheduler's
        assert got is None or got == want, got
        if tier.capabilities.sync_probe:
            assert got == want, f"{tier.kind}: a tier with capabilities.sync_probe must answer probe"

    async def test_pinned_keys_are_not_deleted(self, tier: Tier, ns: Namespace) -> None:
        key = ns.key(_h(1), 0)
        await tier.put_many([(key, payload(10))])
        tier.pin_many([key])
        assert await tier.delete_many([key]) == 0
        tier.unpin_many([key])
        assert await tier.delete_many([key]) == 1

    # ---- namespaces ------------------------------------------------------------------

    async def test_scan_by_namespace(self, tier: Tier, ns: Namespace) -> None:
        other = Namespace(model="contract/other", tenant_salt=ns.tenant_salt)
        mine = {ns.key(_h(i), i % 3): 100 + i for i in range(20)}
        theirs = {other.key(_h(i), 0): 7 for i in range(5)}
        await tier.put_many([(k, payload(n)) for k, n in {**mine, **theirs}.items()])
        seen = {r.key: r.size async for r in tier.scan(ns.fingerprint)}
        assert seen == mine
        assert {r.key async for r in tier.scan(other)} == set(theirs)
        everything = {r.key async for r in tier.scan()}
        assert set(mine) | set(theirs) <= everything

    async def test_namespace_isolation(self, tier: Tier, ns: Namespace) -> None:
        other = Namespace(model="contract/other-model", tenant_salt=ns.tenant_salt)
        await tier.put_many([(ns.key(_h(5), 0), payload(100))])
        assert await tier.get_many([other.key(_h(5), 0)]) == [None]
        assert await tier.get_many([ns.key(_h(5), 1)]) == [None]

    async def test_foreign_record_under_our_key_is_a_miss(self, tier: Tier, ns: Namespace) -> None:
        other = Namespace(model="contract/other-model", tenant_salt=ns.tenant_salt)
        theirs, ours = other.key(_h(5), 0), ns.key(_h(5), 0)
        await tier.put_many([(theirs, payload(1000))])
        (rec,) = await tier.raw_get_many([theirs])
        await tier.raw_put_many([(ours, rec)])
        assert await tier.get_many([ours]) == [None]
        assert tier.counters["corrupt"] == 1
        assert await tier.contains_many([ours, theirs]) == [False, True]

    # ---- corruption ------------------------------------------------------------------

    @pytest.mark.parametrize("size", [65536, 1 << 20])
    async def test_corrupt_record_is_miss_deleted_and_counted(self, tier: Tier, ns: Namespace, size: int) -> None:
        good, bad = ns.key(_h(1), 0), ns.key(_h(2), 0)
        await tier.put_many([(good, payload(size, 1)), (bad, payload(size, 2))])
        await self.corrupt(tier, bad)
        out = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
        assert await tier.get_many([good, bad], into=out) == [size, None]
        assert torch.equal(out[0], payload(size, 1))
        assert not out[1].any()  # none of the damaged record's bytes stayed where they landed
        assert tier.counters["corrupt"] == 1
        assert await tier.contains_many([bad]) == [False]
        assert (await tier.stats()).counters["corrupt"] == 1

    @pytest.mark.parametrize("damage", ["truncated", "tiny", "empty", "bad-magic", "length-lies", "other-group"])
    async def test_damaged_record_is_a_miss(self, tier: Tier, ns: Namespace, damage: str) -> None:
        key = ns.key(_h(3), 0)
        await tier.put_many([(key, payload(100)), (ns.key(_h(3), 1), payload(100))])
        (rec,) = await tier.raw_get_many([key])
        assert rec is not None and len(rec) == HEADER_SIZE + 100 + self.record_tail
        bad = {
            "truncated": rec[: HEADER_SIZE + 2],
            "tiny": rec[:10],
            "empty": b"",
            "bad-magic": b"XXXX" + rec[4:],
            "length-lies": rec[:32] + (2**60).to_bytes(8, "little") + rec[40:],
            "other-group": (await tier.raw_get_many([ns.key(_h(3), 1)]))[0],
        }[damage]
        await tier.raw_put_many([(key, bad)])
        assert await tier.get_many([key], into=[bytearray(200)]) == [None]
        assert tier.counters["corrupt"] == 1
        assert await tier.contains_many([key]) == [False]

    # ---- capacity ----------------------------------------------------------------------

    async def test_capacity_eviction_and_pins(self, make_tier: Any, ns: Namespace) -> None:
        chunk = 256 * 1024
        tier = await make_tier(8 * chunk)
        keys = [ns.key(_h(i), 0) for i in range(24)]
        for i, k in enumerate(keys[:16]):
            await tier.put_many([(k, payload(chunk, i))])
        present = await tier.contains_many(keys[:16])
        assert present[-1] and not present[0], "LRU must evict the oldest, keep the newest"
        if not tier.capabilities.local_eviction:
            return  # the server evicts; it knows nothing of pins
        assert sum(present) <= 8
        st = await tier.stats()
        assert st.used_bytes <= st.capacity_bytes
        # Pin the newest ones, fill again: the pinned survive.
        pinned = [k for k, p in zip(keys[:16], present) if p][-3:]
        tier.pin_many(pinned)
        for i, k in enumerate(keys[16:], start=16):
            await tier.put_many([(k, payload(chunk, i))])
        assert await tier.contains_many(pinned) == [True] * 3
        # Pin everything stored: a new batch cannot fit and none of it is stored.
        alive = [r.key async for r in tier.scan(ns.fingerprint)]
        tier.pin_many(alive)
        fresh = [ns.key(_h(100 + i), 0) for i in range(2)]
        with pytest.raises(TierFullError):
            await tier.put_many([(k, payload(chunk)) for k in fresh])
        assert await tier.contains_many(fresh) == [False, False]
        assert set(await tier.contains_many(alive)) == {True}
        tier.unpin_many(alive)
        tier.unpin_many(pinned)
        await tier.put_many([(k, payload(chunk)) for k in fresh])
        assert await tier.contains_many(fresh) == [True, True]
        assert tier.counters["evictions"] > 0

    # ---- concurrency -------------------------------------------------------------------

    async def test_concurrent_puts_and_gets_never_tear(self, tier: Tier, ns: Namespace) -> None:
        size = 128 * 1024
        keys = [ns.key(_h(i), 0) for i in range(4)]
        await tier.put_many([(k, uniform(size, 0)) for k in keys])
        rng = random.Random(7)
        written: dict[bytes, set[int]] = {k: {0} for k in keys}
        torn: list[bytes] = []

        async def writer(v: int) -> None:
            batch = rng.sample(keys, 2)
            for k in batch:
                written[k].add(v)
            await tier.put_many([(k, uniform(size, v)) for k in batch])

        async def reader() -> None:
            batch = rng.sample(keys, 3)
            outs = [torch.empty(size, dtype=torch.uint8) for _ in batch]
            got = await tier.get_many(batch, into=outs)
            for k, n, out in zip(batch, got, outs):
                assert n == size, "a key that was always present read as a miss"
                first = int(out[0])
                if not bool((out == first).all()) or first not in written[k]:
                    torn.append(k)

        tasks = []
        for i in range(60):
            tasks.append(writer(1 + i % 250) if i % 2 else reader())
        await asyncio.gather(*tasks)
        assert torn == []

    # ---- lifecycle ---------------------------------------------------------------------

    async def test_close_twice_and_use_after_close(self, make_tier: Any, ns: Namespace) -> None:
        tier = await make_tier(None)
        key = ns.key(_h(1), 0)
        await tier.put_many([(key, payload(10))])
        await tier.close()
        await tier.close()
        assert tier.closed
        with pytest.raises(TierClosedError):
            await tier.get_many([key])
        with pytest.raises(TierClosedError):
            await tier.put_many([(key, payload(10))])

    async def test_stats_and_bad_input(self, tier: Tier, ns: Namespace) -> None:
        await tier.put_many([(ns.key(_h(i), 0), payload(1000)) for i in range(3)])
        st = await tier.stats()
        assert st.kind == tier.kind and st.used_bytes > 0
        assert st.counters["puts"] == 3 and st.counters["put_bytes"] == 3000
        with pytest.raises(ValueError):
            await tier.put_many([(b"short", payload(10))])
        with pytest.raises(ValueError):
            await tier.get_many([ns.key(_h(1), 0)], into=[bytearray(10), bytearray(10)])
        with pytest.raises(ValueError):
            await tier.get_many([ns.key(_h(1), 0)], into=[b"read-only"])
        assert await tier.get_many([]) == []
        await tier.put_many([])  # nothing to do, no error

"""Each tier's removal listener (``Tier.set_removal_listener``, for KV events): what a tier stops
holding by its own doing is reported, and nothing else, on the real media — a CPU slab, LMDB files,
an fs directory, a redis-server with ``maxmemory`` / TTL (keyspace notifications, and the bounded
scan where ``CONFIG`` is refused), a Redis Cluster.

The check every test makes: after storing keys into a tier too small for them, the keys reported
removed and the keys the tier still holds are disjoint and together are every key stored."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.fs import FSTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.backends.registry import build_tier
from tieredkv.config import CPUTierConfig, FSTierConfig, LMDBTierConfig, RedisTierConfig
from tieredkv.format import encode_record
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload
from tieredkv.testing.servers import RedisCluster, RedisServer

pytestmark = [pytest.mark.timeout(120)]

KiB, MiB = 1024, 1024 * 1024


def _keys(n: int) -> list[bytes]:
    ns = Namespace(model=f"removals/{uuid.uuid4().hex[:8]}")
    return [ns.key(os.urandom(32), 0) for _ in range(n)]


class Heard:
    """A removal listener: every batch it was called with."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []

    def __call__(self, keys: list[bytes]) -> None:
        assert isinstance(keys, list) and keys, "a batch is a non-empty list"
        self.batches.append(keys)

    @property
    def keys(self) -> set[bytes]:
        return {k for b in self.batches for k in b}

    def count(self) -> int:
        return sum(map(len, self.batches))


async def _fill(tier: object, keys: list[bytes], size: int, per_call: int = 1) -> None:
    for i in range(0, len(keys), per_call):
        await tier.put_many([(k, payload(size, j)) for j, k in enumerate(keys[i : i + per_call], i)])  # type: ignore[attr-defined]


async def _held(tier: object, keys: list[bytes]) -> set[bytes]:
    there = await tier.contains_many(keys)  # type: ignore[attr-defined]
    return {k for k, t in zip(keys, there, strict=True) if t}


def _accounts(heard: Heard, held: set[bytes], keys: Iterable[bytes]) -> None:
    gone = heard.keys
    assert gone, "nothing was reported removed: the tier never evicted (make it smaller)"
    assert not gone & held, f"{len(gone & held)} keys reported removed are still held"
    assert gone | held == set(keys), f"{len(set(keys) - gone - held)} keys gone without a report"


# ---- CPU slab --------------------------------------------------------------------------------


async def test_cpu_reports_each_eviction_and_only_evictions() -> None:
    keys = _keys(48)
    heard = Heard()
    async with CPUTier(CPUTierConfig(capacity_bytes=2 * MiB, segment_bytes=MiB)) as tier:
        tier.set_removal_listener(heard)
        await _fill(tier, keys[:40], 96 * KiB, per_call=3)
        _accounts(heard, await _held(tier, keys[:40]), keys[:40])
        assert heard.count() == tier.counters["evictions"]  # each eviction once
        before = heard.count()
        held = sorted(await _held(tier, keys[:40]))
        assert await tier.delete_many(held[:2]) == 2  # the caller's deletions: its own to report
        tier.set_removal_listener(None)
        await _fill(tier, keys[40:], 96 * KiB)  # evicts again, reported to no one
        assert tier.counters["evictions"] > before and heard.count() == before


async def test_cpu_reports_a_record_dropped_as_corrupt() -> None:
    [key, other] = _keys(2)
    rec = encode_record(key, payload(4 * KiB))
    rec[-1] ^= 0xFF  # the payload no longer matches its checksum
    heard = Heard()
    async with CPUTier(CPUTierConfig(capacity_bytes=MiB, segment_bytes=MiB)) as tier:
        tier.set_removal_listener(heard)
        await tier.raw_put_many([(key, bytes(rec)), (other, bytes(encode_record(other, payload(4 * KiB))))])
        assert await tier.get_many([key, other]) == [None, bytes(payload(4 * KiB))]
        assert heard.batches == [[key]] and tier.counters["corrupt"] == 1


# ---- LMDB ------------------------------------------------------------------------------------


async def test_lmdb_reports_cap_evictions(tmp_path: Path) -> None:
    keys = _keys(60)
    heard = Heard()
    cfg = LMDBTierConfig(path=str(tmp_path / "lmdb"), map_size_bytes=16 * MiB, size_cap_bytes=2 * MiB)
    async with LMDBTier(cfg) as tier:
        tier.set_removal_listener(heard)
        await _fill(tier, keys, 64 * KiB, per_call=4)
        _accounts(heard, await _held(tier, keys), keys)
        assert heard.count() == tier.counters["evictions"]
    # what was reported is gone from the files too: a fresh process's view agrees
    async with LMDBTier(cfg) as again:
        assert await _held(again, keys) == set(keys) - heard.keys


async def test_sealed_lmdb_reports_its_inner_tiers_evictions(tmp_path: Path, sealed_keys_file: str) -> None:
    keys = _keys(40)
    heard = Heard()
    tier = build_tier(
        LMDBTierConfig(
            path=str(tmp_path / "sealed"),
            map_size_bytes=16 * MiB,
            size_cap_bytes=MiB,
            encryption={"keys_file": sealed_keys_file},
        )
    )
    async with tier:
        tier.set_removal_listener(heard)
        await _fill(tier, keys, 64 * KiB, per_call=2)
        _accounts(heard, await _held(tier, keys), keys)


# ---- fs --------------------------------------------------------------------------------------


async def test_fs_reports_evictions(tmp_path: Path) -> None:
    keys = _keys(50)
    heard = Heard()
    cfg = FSTierConfig(path=str(tmp_path / "fs"), size_cap_bytes=MiB, touch_interval_s=0)
    async with FSTier(cfg) as tier:
        tier.set_removal_listener(heard)
        await _fill(tier, keys, 64 * KiB, per_call=2)
        _accounts(heard, await _held(tier, keys), keys)
        assert heard.count() == tier.counters["evictions"]
    async with FSTier(cfg) as again:
        assert await _held(again, keys) == set(keys) - heard.keys


# ---- Redis -----------------------------------------------------------------------------------


async def _until(cond: object, what: str, timeout: float = 30.0) -> None:
    """Wait for ``cond()`` (polled on the loop; the bound only turns a hang into a failure)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        if loop.time() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


async def _redis_evictions(tier: RedisTier, keys: list[bytes]) -> Heard:
    heard = Heard()
    tier.set_removal_listener(heard)
    watch = tier.removal_watch
    assert watch is not None
    await asyncio.wait_for(watch.ready.wait(), 20)
    await _fill(tier, keys, 64 * KiB)
    held = await _held(tier, keys)
    await _until(lambda: heard.keys | held == set(keys), "every evicted key reported")
    _accounts(heard, held, keys)
    return heard


async def test_redis_maxmemory_evictions_by_keyspace_notifications() -> None:
    keys = _keys(120)
    # a flag of another client's stays on: the tier only adds E, e and x
    with RedisServer(
        maxmemory="4mb", maxmemory_policy="allkeys-lru", extra_args=["--notify-keyspace-events", "Kg"]
    ) as srv:
        async with RedisTier(RedisTierConfig(url=srv.url, key_prefix="ev")) as tier:
            await _redis_evictions(tier, keys)
            assert tier.removal_watch is not None and tier.removal_watch.mode == "notify"
            flags = (await tier._client.config_get("notify-keyspace-events"))["notify-keyspace-events"]
            assert {"K", "g", "E"} <= set(flags) and ({"e", "x"} <= set(flags) or "A" in flags)


async def test_redis_falls_back_to_a_bounded_scan_where_config_is_refused() -> None:
    keys = _keys(120)
    with RedisServer(
        maxmemory="4mb",
        maxmemory_policy="allkeys-lru",
        extra_args=["--user", "app", "on", ">pw", "~*", "&*", "+@all", "-config"],
    ) as srv:
        cfg = RedisTierConfig(
            url=srv.url,
            username="app",
            password="pw",
            key_prefix="sc",
            removal_scan_interval_s=0.05,
            removal_scan_keys=32,
        )
        async with RedisTier(cfg) as tier:
            heard = await _redis_evictions(tier, keys)
            watch = tier.removal_watch
            assert watch is not None and watch.mode == "scan"
            assert max(map(len, heard.batches)) <= 32  # a round checks at most removal_scan_keys


async def test_redis_scan_keeps_at_most_its_bound_of_keys() -> None:
    keys = _keys(20)
    with RedisServer(maxmemory="4mb", maxmemory_policy="allkeys-lru") as srv:
        cfg = RedisTierConfig(
            url=srv.url, key_prefix="sb", removal_watch="scan", removal_scan_interval_s=3600, removal_scan_max_keys=8
        )
        async with RedisTier(cfg) as tier:
            heard = Heard()
            tier.set_removal_listener(heard)
            watch = tier.removal_watch
            assert watch is not None
            await asyncio.wait_for(watch.ready.wait(), 20)
            await _fill(tier, keys, KiB)
            await tier.delete_many(keys)  # gone, all of them; only the 8 newest are still checked
            await watch.scan_round(100)
            assert heard.keys == set(keys[-8:])
            await watch.scan_round(100)  # reported once: forgotten after
            assert heard.count() == 8


async def test_redis_ttl_expiries_are_reported() -> None:
    keys = _keys(24)
    with RedisServer() as srv:
        async with RedisTier(RedisTierConfig(url=srv.url, key_prefix="ttl", ttl_s=1)) as tier:
            heard = Heard()
            tier.set_removal_listener(heard)
            assert tier.removal_watch is not None
            await asyncio.wait_for(tier.removal_watch.ready.wait(), 20)
            await _fill(tier, keys, KiB, per_call=6)
            await _until(lambda: heard.keys == set(keys), "every expired key reported")
            assert await _held(tier, keys) == set()


async def test_redis_cluster_expiries_are_reported_from_every_master(redis_cluster: RedisCluster) -> None:
    keys = _keys(48)
    cfg = RedisTierConfig(url=redis_cluster.url, cluster=True, key_prefix=f"cl{uuid.uuid4().hex[:6]}", ttl_s=1)
    async with RedisTier(cfg) as tier:
        heard = Heard()
        tier.set_removal_listener(heard)
        watch = tier.removal_watch
        assert watch is not None
        await asyncio.wait_for(watch.ready.wait(), 20)
        assert watch.mode == "notify" and len(watch._subs) == 3  # one subscription per master
        await _fill(tier, keys, KiB, per_call=8)
        await _until(lambda: heard.keys == set(keys), "every expired key reported")


async def test_redis_keys_stored_again_are_not_reported_gone() -> None:
    [key] = _keys(1)
    with RedisServer() as srv:
        async with RedisTier(RedisTierConfig(url=srv.url, key_prefix="again")) as tier:
            heard = Heard()
            tier.set_removal_listener(heard)
            watch = tier.removal_watch
            assert watch is not None
            await asyncio.wait_for(watch.ready.wait(), 20)
            await _fill(tier, [key], KiB)
            await watch.confirm([key])  # a late notification of a key that is there: not reported
            assert heard.batches == []
            await tier.delete_many([key])
            await watch.confirm([key])
            assert heard.batches == [[key]]


async def test_redis_reports_a_key_its_own_put_evicted_only_after_that_put_returned() -> None:
    keys = _keys(40)
    order: list[str | frozenset[bytes]] = []
    with RedisServer(maxmemory="3mb", maxmemory_policy="allkeys-lru") as srv:
        async with RedisTier(RedisTierConfig(url=srv.url, key_prefix="own")) as tier:
            tier.set_removal_listener(lambda ks: order.append(frozenset(ks)))
            assert tier.removal_watch is not None
            await asyncio.wait_for(tier.removal_watch.ready.wait(), 20)
            await _fill(tier, keys, 64 * KiB, per_call=40)  # 2.5 MiB in one put: it evicts its own first keys
            order.append("put returned")
            held = await _held(tier, keys)
            assert len(held) < 40, "the put evicted none of its own keys: the test tests nothing"
            await _until(
                lambda: set().union(*(k for k in order if k != "put returned")) | held == set(keys), "all heard"
            )
    assert order.index("put returned") == 0, "a key was reported removed before the put that wrote it returned"

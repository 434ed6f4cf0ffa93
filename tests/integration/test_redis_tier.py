"""RedisTier against real redis-server processes (single node and a 3-master cluster).

The generic tier contract runs elsewhere (tieredkv.testing.contract); these tests cover what
is Redis-specific: key layout and hash-tag slots, faults (dead server, OOM, bad AUTH, TLS),
TTL, corrupt and foreign records in the server, scan by namespace and stats.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.crc import key_slot
from redis.exceptions import OutOfMemoryError, RedisError

from tieredkv.backends.redis import RedisTier
from tieredkv.backends.redis import resp as _resp
from tieredkv.backends.redis.keys import parse_redis_key, redis_key
from tieredkv.backends.redis.resp import REPLY_WINDOW, Placed, _Protocol
from tieredkv.config import RedisTierConfig
from tieredkv.errors import TierFullError, TierTimeoutError, TierUnavailableError
from tieredkv.format import HEADER_SIZE, encode_record
from tieredkv.keys import Namespace
from tieredkv.testing.servers import RedisCluster, RedisServer, free_port, redis_command

pytestmark = [pytest.mark.timeout(120)]


# ---- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as c:
        yield c


@pytest.fixture(params=["single", "cluster"])
def url_cluster(request: pytest.FixtureRequest) -> tuple[str, bool]:
    if request.param == "single":
        return request.getfixturevalue("server").url, False
    return request.getfixturevalue("cluster").url, True


def _ns() -> Namespace:
    return Namespace(model=f"test/{uuid.uuid4().hex[:8]}")


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _keys(ns: Namespace, n: int, groups: int = 1) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    return [ns.key(h, g) for h in hashes for g in range(groups)]


def _tier(url: str, cluster: bool = False, **kw: Any) -> RedisTier:
    kw.setdefault("key_prefix", _prefix())
    return RedisTier(RedisTierConfig(url=url, cluster=cluster, **kw))


def _raw(url: str, cluster: bool) -> Any:
    return AsyncRedisCluster.from_url(url) if cluster else aioredis.Redis.from_url(url)


@pytest_asyncio.fixture
async def raw_single(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url)
    yield client
    await client.aclose()


# ---- round trips -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_round_trip_bytes_and_buffers(url_cluster: tuple[str, bool]) -> None:
    url, cluster = url_cluster
    ns = _ns()
    keys = _keys(ns, 40, groups=2)
    items = [(k, os.urandom(1000 + 37 * i)) for i, k in enumerate(keys)]
    items.append((ns.key(os.urandom(32), 0), b""))  # empty payload is a record too
    async with _tier(url, cluster, max_batch_bytes=50_000) as tier:
        await tier.put_many(items)
        got = await tier.get_many([k for k, _ in items])
        assert got == [p for _, p in items]
        bufs = [bytearray(len(p) + 10) for _, p in items]
        lens = await tier.get_many([k for k, _ in items], bufs)
        assert lens == [len(p) for _, p in items]
        assert all(bytes(b[: len(p)]) == p for b, (_, p) in zip(bufs, items, strict=True))
        assert await tier.contains_many(keys[:3] + [ns.key(b"absent", 0)]) == [True, True, True, False]
        assert await tier.delete_many(keys[:5]) == 5
        assert await tier.get_many(keys[:6]) == [None] * 5 + [items[5][1]]
        assert tier.counters["hits"] >= 2 * len(items)


@pytest.mark.asyncio
async def test_torch_tensor_destination(server: RedisServer) -> None:
    import torch

    ns = _ns()
    key = ns.key(os.urandom(32), 3)
    src = torch.arange(4096, dtype=torch.bfloat16)
    async with _tier(server.url) as tier:
        await tier.put_many([(key, src)])
        dst = torch.empty_like(src)
        assert await tier.get_many([key], [dst]) == [src.numel() * 2]
        assert torch.equal(dst, src)


@pytest.mark.asyncio
@pytest.mark.parametrize("native_io", [True, False], ids=["native", "redis-py"])
async def test_large_batch_is_split_by_max_batch_bytes(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, native_io: bool
) -> None:
    ns = _ns()
    items = [(k, os.urandom(64 << 10)) for k in _keys(ns, 20)]
    async with _tier(server.url, max_batch_bytes=200_000, native_io=native_io) as tier:
        sizes: list[int] = []  # record bytes of the SETs of each round trip
        if native_io:
            assert tier._native is not None
            real_execute = tier._native.execute

            async def native_execute(commands: Any, intos: Any = None) -> Any:
                sizes.append(sum(c[2].size for c in commands if c[0] == "SET"))
                return await real_execute(commands, intos)

            monkeypatch.setattr(tier._native, "execute", native_execute)
        else:
            assert tier._native is None
            real = tier._pipeline

            def counting() -> Any:
                pipe = real()
                orig = pipe.execute

                async def execute(*a: Any, **kw: Any) -> Any:
                    sizes.append(sum(len(c[0][2]) for c in pipe.command_stack if c[0][0] == "SET"))
                    return await orig(*a, **kw)

                pipe.execute = execute
                return pipe

            monkeypatch.setattr(tier, "_pipeline", counting)
        await tier.put_many(items)
        assert len(sizes) >= 7  # 20 × 64 KiB in ≤ 200 kB runs: 3 records per run
        assert all(0 < s <= 200_000 for s in sizes)
        assert sum(sizes) == sum(HEADER_SIZE + len(p) for _, p in items)
        assert await tier.get_many([k for k, _ in items]) == [p for _, p in items]


# ---- key layout --------------------------------------------------------------------------


def test_key_layout_round_trips() -> None:
    ns = _ns()
    for key in [ns.key(os.urandom(32), 7), ns.key(b"\x01", 0), ns.key(os.urandom(8), 2**32 - 1)]:
        rk = redis_key(b"tkv", key, 16)
        assert rk.startswith(b"tkv:{" + ns.fingerprint.hex().encode() + b".")
        assert parse_redis_key(b"tkv", rk) == key
        assert parse_redis_key(b"other", rk) is None
    assert parse_redis_key(b"tkv", b"tkv:{zz.1}:00") is None
    with pytest.raises(ValueError, match="must not contain"):  # ConfigError
        RedisTier(RedisTierConfig(key_prefix="tkv{x}"))


@pytest.mark.asyncio
async def test_namespace_batch_touches_at_most_hash_tag_buckets_slots(cluster: RedisCluster) -> None:
    ns = _ns()
    keys = _keys(ns, 300, groups=2)
    async with _tier(cluster.url, True, hash_tag_buckets=4) as tier:
        await tier.put_many([(k, b"v") for k in keys])
        raw = _raw(cluster.url, True)
        try:
            stored = [rk async for rk in raw.scan_iter(match=tier._match(ns.fingerprint))]
            slots = {key_slot(rk) for rk in stored}
            server_slot = await raw.cluster_keyslot(stored[0])
        finally:
            await raw.aclose()
    assert len(stored) == len(keys)
    assert 1 < len(slots) <= 4  # 300 random hashes fill all 4 buckets with near certainty
    assert server_slot == key_slot(stored[0])
    # both groups of a block share a slot
    assert key_slot(tier.redis_key(keys[0])) == key_slot(tier.redis_key(keys[1]))


@pytest.mark.asyncio
async def test_cluster_spreads_namespaces_over_nodes(cluster: RedisCluster) -> None:
    ns = _ns()
    keys = _keys(ns, 200)
    async with _tier(cluster.url, True, hash_tag_buckets=64) as tier:
        await tier.put_many([(k, b"x" * 100) for k in keys])
        st = await tier.stats()
        assert st.extra["nodes"] == 3
    per_node = [int(redis_command(p, "DBSIZE")[1:]) for _, p in cluster.nodes]
    assert sum(1 for n in per_node if n > 0) >= 2


# ---- faults -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_dead_server_fails_fast_then_recovers(how: str) -> None:
    ns = _ns()
    keys = _keys(ns, 20)
    with RedisServer() as srv:
        async with _tier(srv.url, op_timeout_s=10.0) as tier:
            await tier.put_many([(k, b"before") for k in keys])
            srv.kill() if how == "kill" else srv._halt()
            for op in (tier.get_many(keys), tier.put_many([(keys[0], b"x")]), tier.contains_many(keys)):
                t0 = time.perf_counter()
                with pytest.raises(TierUnavailableError) as ei:
                    await op
                assert time.perf_counter() - t0 < 3.0
                assert not isinstance(ei.value, TierTimeoutError)
                assert isinstance(ei.value.__cause__, RedisError)
                assert "cannot reach" in str(ei.value)
            srv.restart()
            await tier.put_many([(keys[0], b"after")])
            assert await tier.get_many(keys[:2]) == [b"after", None]  # no persistence: old data gone


@pytest.mark.asyncio
async def test_open_against_nothing_fails_fast() -> None:
    port = free_port()
    for cluster in (False, True):
        tier = _tier(f"redis://127.0.0.1:{port}/0" if not cluster else f"redis://127.0.0.1:{port}", cluster)
        t0 = time.perf_counter()
        with pytest.raises(TierUnavailableError):
            await tier.get_many([_ns().key(b"h", 0)])
        assert time.perf_counter() - t0 < 3.0
        await tier.close()


@pytest.mark.asyncio
async def test_cluster_node_killed_fails_fast_then_recovers() -> None:
    with RedisCluster() as c:
        ns = _ns()
        keys = _keys(ns, 60)
        async with _tier(c.url, True, hash_tag_buckets=64) as tier:
            await tier.put_many([(k, b"v") for k in keys])
            victim = c.servers[1]
            victim.kill()
            t0 = time.perf_counter()
            got = await tier.get_many(keys)  # the dead master's keys are misses, the others served
            assert time.perf_counter() - t0 < 3.0
            assert 0 < got.count(None) < len(keys) and tier.counters["node_errors"] >= 1
            with pytest.raises(TierUnavailableError) as ei:  # a write to the dead master fails fast
                await tier.put_many([(k, b"w") for k in keys])
            assert time.perf_counter() - t0 < 6.0
            assert isinstance(ei.value.__cause__, Exception)
            victim.restart()  # same port, same nodes.conf: rejoins with its slots
            deadline = time.monotonic() + 20
            while True:
                try:
                    await tier.put_many([(keys[0], b"back")])
                    assert await tier.get_many([keys[0]]) == [b"back"]
                    break
                except TierUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)


def _slots_of(port: int) -> list[tuple[int, int]]:
    """Slot ranges node ``port`` owns, from its own CLUSTER NODES line."""
    for line in redis_command(port, "CLUSTER", "NODES").decode().splitlines():
        f = line.split()
        if "myself" in f[2]:
            return [(int(a), int(b or a)) for a, _, b in (s.partition("-") for s in f[8:] if not s.startswith("["))]
    raise AssertionError(f"no 'myself' line in CLUSTER NODES of {port}")


def _flagged_failed(observer: int, victim: int) -> bool:
    for line in redis_command(observer, "CLUSTER", "NODES").decode().splitlines():
        f = line.split()
        if f[1].split("@")[0].endswith(f":{victim}"):
            return "fail" in f[2].split(",")
    return False


@pytest.mark.asyncio
async def test_cluster_master_down_live_keys_always_served_under_concurrency() -> None:
    """A dead master costs exactly its own keys, every time: concurrent loads and stores that
    each span every node, repeated before and after the survivors flag the master failed.
    (redis-py's cluster pipeline used to close every node's connections when one node failed,
    breaking the other pipelines in flight.)"""
    args = ["--cluster-require-full-coverage", "no"]
    with RedisCluster(extra_args=args, node_timeout_ms=1000) as c:
        ns = _ns()
        keys = _keys(ns, 90)
        async with _tier(c.url, True, hash_tag_buckets=64, op_timeout_s=10.0) as tier:
            await tier.put_many([(k, b"v" + k[-8:]) for k in keys])
            victim, observer = c.servers[1], c.servers[0]
            ranges = _slots_of(victim.port)
            on_dead = [any(a <= key_slot(tier.redis_key(k)) <= b for a, b in ranges) for k in keys]
            live = [k for k, d in zip(keys, on_dead, strict=True) if not d]
            assert live and len(live) < len(keys)
            victim.kill()

            async def round_(i: int) -> None:
                loads = [tier.get_many(keys) for _ in range(4)]
                store = tier.put_many([(k, b"v" + k[-8:]) for k in live])
                *got, _ = await asyncio.gather(*loads, store)
                for g in got:
                    assert [x is None for x in g] == on_dead, f"round {i}: a live key missed or a dead one served"
                    assert all(x == b"v" + k[-8:] for x, k in zip(g, keys, strict=True) if x is not None)

            rounds = 0
            deadline = time.monotonic() + 30
            while not _flagged_failed(observer.port, victim.port):  # before the survivors agree
                assert time.monotonic() < deadline, "the survivors never flagged the dead master"
                await round_(rounds)
                rounds += 1
            for _ in range(20):  # and after
                await round_(rounds)
                rounds += 1
            assert tier.counters["node_errors"] >= rounds
            with pytest.raises(TierUnavailableError):  # a store touching the dead master fails, fast
                await tier.put_many([(k, b"w") for k in keys])


@pytest.mark.asyncio
async def test_noeviction_oom_is_tier_full_and_rolls_back() -> None:
    ns = _ns()
    with RedisServer(maxmemory="3mb", maxmemory_policy="noeviction") as srv:
        async with _tier(srv.url) as tier:
            stored: list[bytes] = []
            with pytest.raises(TierFullError) as ei:
                for _ in range(40):
                    batch = _keys(ns, 4)
                    await tier.put_many([(k, os.urandom(128 << 10)) for k in batch])
                    stored += batch
            assert "out of memory" in str(ei.value) and "maxmemory" in str(ei.value)
            assert isinstance(ei.value.__cause__, OutOfMemoryError)
            assert stored, "some puts should fit before the server fills"
            assert not any(await tier.contains_many(batch)), "the refused batch must be rolled back"
            assert all(await tier.contains_many(stored))
            st = await tier.stats()
            assert st.capacity_bytes == 3 * 1024 * 1024
            assert st.extra["maxmemory_policy"] == "noeviction"
            assert tier.evicts_locally is False


@pytest.mark.asyncio
async def test_auth_password_and_acl_user() -> None:
    ns = _ns()
    key = ns.key(os.urandom(32), 0)
    with RedisServer(requirepass="s3cret") as srv:
        acl = ("ACL", "SETUSER", "alice", "on", ">alicepw", "~*", "&*", "+@all")
        assert redis_command(srv.port, *acl, password="s3cret") == b"+OK"
        async with _tier(srv.url, password="s3cret") as tier:
            await tier.put_many([(key, b"secret bytes")])
        async with _tier(srv.url, username="alice", password="alicepw", key_prefix=tier.config.key_prefix) as t2:
            assert await t2.get_many([key]) == [b"secret bytes"]
        for kw in ({"password": "wrong"}, {}, {"username": "alice", "password": "nope"}):
            bad = _tier(srv.url, **kw)
            t0 = time.perf_counter()
            with pytest.raises(TierUnavailableError) as ei:
                await bad.get_many([key])
            assert time.perf_counter() - t0 < 3.0
            assert "authentication failed" in str(ei.value)
            assert "username/password" in str(ei.value)
            assert ei.value.__cause__ is not None
            await bad.close()


@pytest.mark.asyncio
async def test_ttl_is_set_when_configured(server: RedisServer, raw_single: aioredis.Redis) -> None:
    ns = _ns()
    k1, k2 = _keys(ns, 2)
    async with _tier(server.url, ttl_s=100) as tier:
        await tier.put_many([(k1, b"expiring")])
        pttl = await raw_single.pttl(tier.redis_key(k1))
    assert 90_000 < pttl <= 100_000
    async with _tier(server.url) as tier:
        await tier.put_many([(k2, b"forever")])
        assert await raw_single.pttl(tier.redis_key(k2)) == -1


# ---- corrupt and foreign records ---------------------------------------------------------


@pytest.mark.asyncio
async def test_garbage_record_is_miss_deleted_and_counted(url_cluster: tuple[str, bool]) -> None:
    url, cluster = url_cluster
    ns = _ns()
    good, bad = _keys(ns, 2)
    raw = _raw(url, cluster)
    try:
        async with _tier(url, cluster) as tier:
            await tier.put_many([(good, b"fine"), (bad, b"will be overwritten")])
            await raw.set(tier.redis_key(bad), b"garbage, not a record")
            assert await tier.get_many([good, bad]) == [b"fine", None]
            assert await raw.exists(tier.redis_key(bad)) == 0
            assert await raw.exists(tier.redis_key(good)) == 1
            assert tier.counters["corrupt"] == 1
            # a truncated record and a flipped payload byte are caught too
            rec = encode_record(bad, b"payload!")
            await raw.set(tier.redis_key(bad), bytes(rec[:-1]))
            rec[-1] ^= 0xFF
            await raw.set(tier.redis_key(good), bytes(rec))
            assert await tier.get_many([bad, good]) == [None, None]
            assert tier.counters["corrupt"] == 3
    finally:
        await raw.aclose()


@pytest.mark.asyncio
async def test_foreign_record_under_our_key_is_a_miss(server: RedisServer, raw_single: aioredis.Redis) -> None:
    ours, theirs = _ns(), _ns()
    h = os.urandom(32)
    mine, foreign, sibling = ours.key(h, 0), theirs.key(h, 0), ours.key(os.urandom(32), 0)
    async with _tier(server.url) as tier:
        await tier.put_many([(foreign, b"other model's bytes"), (sibling, b"other block")])
        assert await raw_single.copy(tier.redis_key(foreign), tier.redis_key(mine), replace=True)
        assert await tier.get_many([mine]) == [None]
        assert tier.counters["corrupt"] == 1
        # a record of the same namespace but another block, copied over: checksum covers the key
        await raw_single.set(tier.redis_key(mine), await raw_single.get(tier.redis_key(sibling)))
        assert await tier.get_many([mine]) == [None]
        assert tier.counters["corrupt"] == 2
        assert await tier.get_many([foreign, sibling]) == [b"other model's bytes", b"other block"]


def _count_reply_bytes(tier: RedisTier, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the bytes of every value reply the tier's pipelines receive (one entry per reply)."""
    seen: list[int] = []
    if tier._native is not None:  # native_io: a value reply is bytes, or placed in a buffer (its length)
        real_execute = tier._native.execute

        async def native_execute(commands: Any, intos: Any = None) -> Any:
            replies = await real_execute(commands, intos)
            seen.extend(
                int(r) if isinstance(r, Placed) else len(r)
                for r in replies
                if isinstance(r, (bytes, bytearray, Placed))
            )
            return replies

        monkeypatch.setattr(tier._native, "execute", native_execute)
    real = tier._pipeline

    def counting() -> Any:
        pipe = real()
        orig = pipe.execute

        async def execute(*a: Any, **kw: Any) -> Any:
            replies = await orig(*a, **kw)
            seen.extend(len(r) for r in replies if isinstance(r, (bytes, bytearray)))
            return replies

        pipe.execute = execute
        return pipe

    monkeypatch.setattr(tier, "_pipeline", counting)
    return seen


@pytest.mark.asyncio
async def test_oversized_foreign_value_is_not_read(
    url_cluster: tuple[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A huge value someone else wrote under one of our keys is a miss, counted corrupt and
    deleted, and the tier reads at most the destination's record size (+1 byte) of it."""
    url, cluster = url_cluster
    ns = _ns()
    chunk = 256 << 10
    k1, k2, k3, k4 = _keys(ns, 4)
    huge = os.urandom(4 << 20)
    raw = _raw(url, cluster)
    try:
        async with _tier(url, cluster, max_batch_bytes=1 << 20) as tier:
            await tier.put_many([(k, os.urandom(chunk)) for k in (k1, k2, k3)])
            for k in (k1, k2):
                await raw.set(tier.redis_key(k), huge)
            # our record for k3 with 3 MB of trailing junk: longer than its header says
            (rec,) = await tier.raw_get_many([k3])
            await raw.set(tier.redis_key(k3), rec + huge[: 3 << 20])
            seen = _count_reply_bytes(tier, monkeypatch)
            dst = [bytearray(chunk) for _ in range(4)]
            assert await tier.get_many([k1, k2, k3, k4], into=dst) == [None] * 4
            assert tier.counters["corrupt"] == 3
            assert seen and max(seen) <= HEADER_SIZE + chunk + 1
            assert [await raw.exists(tier.redis_key(k)) for k in (k1, k2, k3)] == [0, 0, 0]  # deleted
            # bytes wanted (no destination): bounded by max_batch_bytes
            await raw.set(tier.redis_key(k1), huge)
            seen.clear()
            assert await tier.get_many([k1]) == [None]
            assert tier.counters["corrupt"] == 4
            assert seen and max(seen) <= (1 << 20) + 1
            assert await raw.exists(tier.redis_key(k1)) == 0
    finally:
        await raw.aclose()


@pytest.mark.asyncio
async def test_records_larger_than_the_read_bound(url_cluster: tuple[str, bool]) -> None:
    """Our own records past the read bound: too big for the destination is an ``oversize`` miss
    that stays stored; with no destination, a record over max_batch_bytes is still served."""
    url, cluster = url_cluster
    ns = _ns()
    key, empty = _keys(ns, 2)
    data = os.urandom(3 << 20)
    raw = _raw(url, cluster)
    try:
        async with _tier(url, cluster, max_batch_bytes=1 << 20) as tier:
            await tier.put_many([(key, data)])
            assert await tier.get_many([key], into=[bytearray(256 << 10)]) == [None]
            assert tier.counters["oversize"] == 1 and tier.counters["corrupt"] == 0
            assert await tier.get_many([key]) == [data]
            assert await tier.get_many([key], into=[bytearray(len(data))]) == [len(data)]
            # an empty value is corrupt (not an absent key), and deleted
            await raw.set(tier.redis_key(empty), b"")
            assert await tier.get_many([empty]) == [None]
            assert tier.counters["corrupt"] == 1
            assert await raw.exists(tier.redis_key(empty)) == 0
    finally:
        await raw.aclose()


@pytest.mark.asyncio
async def test_corrupt_delete_of_a_prefix_spares_a_concurrent_rewrite(
    server: RedisServer, raw_single: aioredis.Redis
) -> None:
    ns = _ns()
    key = ns.key(os.urandom(32), 0)
    async with _tier(server.url) as tier:
        rk = tier.redis_key(key)
        huge = os.urandom(2 << 20)
        await raw_single.set(rk, huge)
        await tier._drop_corrupt([(rk, huge[:1000], False)])  # still starts with what was seen: deleted
        assert await raw_single.exists(rk) == 0
        await raw_single.set(rk, bytes(encode_record(key, b"fresh")))
        await tier._drop_corrupt([(rk, huge[:1000], False)])  # rewritten since: spared
        assert await tier.get_many([key]) == [b"fresh"]


@pytest.mark.asyncio
async def test_corrupt_delete_spares_a_concurrent_rewrite(server: RedisServer, raw_single: aioredis.Redis) -> None:
    ns = _ns()
    key = ns.key(os.urandom(32), 0)
    async with _tier(server.url) as tier:
        rk = tier.redis_key(key)
        fresh = bytes(encode_record(key, b"fresh"))
        # the record was garbage when read, but another client rewrote it before the delete
        await tier._drop_corrupt([(rk, b"garbage seen by the reader", True)])
        await raw_single.set(rk, fresh)
        await tier._drop_corrupt([(rk, b"garbage seen by the reader", True)])
        assert await tier.get_many([key]) == [b"fresh"]


# ---- scan and stats ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_scan_by_namespace_is_exact(url_cluster: tuple[str, bool]) -> None:
    url, cluster = url_cluster
    a, b = _ns(), _ns()
    ka, kb = _keys(a, 150, groups=2), _keys(b, 30)
    prefix = _prefix()
    async with _tier(url, cluster, key_prefix=prefix) as tier:
        await tier.put_many([(k, os.urandom(i % 50)) for i, k in enumerate(ka)] + [(k, b"b") for k in kb])
        # a key that looks like ours but is not a record key must be ignored
        raw = _raw(url, cluster)
        try:
            await raw.set(f"{prefix}:{{junk}}:zz".encode(), b"x")
            await raw.set(f"{prefix}x:{{{a.fingerprint.hex()}.0}}:00".encode(), b"x")
        finally:
            await raw.aclose()
        seen_a = {i.key: i for i in [i async for i in tier.scan(a)]}
        assert set(seen_a) == set(ka)
        assert all(seen_a[k].size == i % 50 and seen_a[k].stamp is None for i, k in enumerate(ka))
        assert {i.key async for i in tier.scan(b.fingerprint)} == set(kb)
        assert {i.key async for i in tier.scan()} == set(ka) | set(kb)
        assert [i async for i in tier.scan(_ns())] == []


@pytest.mark.asyncio
async def test_stats(url_cluster: tuple[str, bool]) -> None:
    url, cluster = url_cluster
    ns = _ns()
    async with _tier(url, cluster) as tier:
        await tier.put_many([(k, b"s" * 1000) for k in _keys(ns, 10)])
        st = await tier.stats()
    assert st.kind == "redis" and st.name == "redis"
    assert st.capacity_bytes is None  # no maxmemory
    assert st.used_bytes > 10_000
    assert st.records is None and st.extra["db_keys"] >= 10  # DBSIZE counts every application's keys
    assert st.extra["nodes"] == (3 if cluster else 1)
    assert st.counters["puts"] == 10


# ---- TLS --------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.crt", cwd=d)  # fmt: skip
    return d


@pytest.mark.asyncio
async def test_tls_with_client_certificate(tls_certs: Path) -> None:
    d = tls_certs
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(d / "server.crt"),
            "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
            "--tls-auth-clients", "yes"]  # fmt: skip
    key = _ns().key(os.urandom(32), 0)
    url = f"rediss://127.0.0.1:{tls_port}/0"
    with RedisServer(extra_args=args):
        mtls = {"ssl_certfile": str(d / "client.crt"), "ssl_keyfile": str(d / "client.key")}
        async with _tier(url, ssl_ca_certs=str(d / "ca.crt"), **mtls) as tier:
            await tier.put_many([(key, b"over tls")])
            assert await tier.get_many([key]) == [b"over tls"]
        no_cert = _tier(url, ssl_ca_certs=str(d / "ca.crt"))
        with pytest.raises(TierUnavailableError):
            await no_cert.get_many([key])
        await no_cert.close()
    with pytest.raises(ValueError, match="rediss://"):  # ConfigError: TLS options on a plain url
        await _tier(f"redis://127.0.0.1:{tls_port}/0", ssl_ca_certs=str(d / "ca.crt")).open()


# ---- native_io: the data path's own connections -------------------------------------------


@pytest.mark.asyncio
async def test_native_io_url_credentials_db_and_records_shared_with_redis_py() -> None:
    """Credentials and database from the URL reach the native connections; what one client path
    writes the other reads byte for byte (one record format); a wrong password is the same
    clear error on either path."""
    ns = _ns()
    keys = _keys(ns, 6)
    payloads = [os.urandom(n) for n in (1, 64, 4096, 70_000, 300_000, 1 << 20)]
    with RedisServer(requirepass="s3cret") as srv:
        url = f"redis://:s3cret@127.0.0.1:{srv.port}/3"
        prefix = _prefix()
        async with _tier(url, key_prefix=prefix) as native, _tier(url, key_prefix=prefix, native_io=False) as plain:
            assert native._native is not None and plain._native is None
            await native.put_many(list(zip(keys[:3], payloads[:3])))
            await plain.put_many(list(zip(keys[3:], payloads[3:])))
            for reader in (native, plain):
                dst = [bytearray(len(p)) for p in payloads]
                assert await reader.get_many(keys, into=dst) == [len(p) for p in payloads]
                assert [bytes(d) for d in dst] == payloads
                assert await reader.get_many(keys) == payloads
            # in database 3, not 0
            db0 = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{srv.port}/0")
            db3 = aioredis.Redis.from_url(url)
            try:
                assert await db0.exists(native.redis_key(keys[0])) == 0
                assert await db3.exists(native.redis_key(keys[0])) == 1
            finally:
                await db0.aclose()
                await db3.aclose()
        bad = _tier(f"redis://:wrong@127.0.0.1:{srv.port}/3", key_prefix=prefix)
        with pytest.raises(TierUnavailableError) as ei:
            await bad.get_many(keys[:1], into=[bytearray(1)])
        assert "authentication failed" in str(ei.value)
        await bad.close()


@pytest.mark.asyncio
async def test_native_io_damaged_records_read_into_buffers_leave_none_of_their_bytes(
    server: RedisServer, raw_single: aioredis.Redis
) -> None:
    """A record received straight into its buffer is verified there: a damaged one is a miss,
    counted and deleted, and what landed is zeroed; the records around it arrive byte for byte."""
    ns = _ns()
    keys = _keys(ns, 4)
    payloads = [os.urandom(n) for n in (4096, 70_000, 300_000, 1 << 20)]
    async with _tier(server.url) as tier:
        assert tier._native is not None
        await tier.put_many(list(zip(keys, payloads)))
        for i in (1, 3):  # a flipped payload byte: header and length still say "ours"
            rec = bytearray(await raw_single.get(tier.redis_key(keys[i])))
            rec[len(rec) // 2] ^= 0x01
            await raw_single.set(tier.redis_key(keys[i]), bytes(rec))
        dst = [bytearray(b"\xab" * len(p)) for p in payloads]
        assert await tier.get_many(keys, into=dst) == [len(payloads[0]), None, len(payloads[2]), None]
        assert bytes(dst[0]) == payloads[0] and bytes(dst[2]) == payloads[2]
        assert not any(dst[1]) and not any(dst[3])  # received, failed, zeroed
        assert tier.counters["corrupt"] == 2
        assert await raw_single.exists(tier.redis_key(keys[1]), tier.redis_key(keys[3])) == 0


@pytest.mark.asyncio
async def test_native_io_reads_go_out_in_windows(
    server: RedisServer, raw_single: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read batch of several reply windows, on a real server: the first two windows go out at
    once and every later one only after replies came back (the server never holds the whole
    batch's replies); every record lands byte for byte, a damaged one in a later window is a miss
    with its bytes zeroed, and a missing key is a plain miss."""
    ns = _ns()
    keys = _keys(ns, 30)
    payloads = [os.urandom(100 << 10) for _ in keys]
    writes: list[tuple[int, int]] = []  # (replies in when written, bytes written)
    made = _Protocol.connection_made

    class Spy:
        """The real transport, noting each write and how many replies were in by then."""

        def __init__(self, proto: _Protocol, transport: Any) -> None:
            self.proto, self.transport = proto, transport

        def writelines(self, parts: Any) -> None:
            parts = list(parts)
            writes.append((len(self.proto._replies), sum(len(p) for p in parts)))
            self.transport.writelines(parts)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.transport, name)

    def spied(proto: _Protocol, transport: Any) -> None:
        made(proto, Spy(proto, transport))

    monkeypatch.setattr(_Protocol, "connection_made", spied)
    async with _tier(server.url, connections=1, max_batch_bytes=32 << 20) as tier:
        await tier.put_many([(k, p) for k, p in zip(keys[:29], payloads[:29])])  # the last one is never stored
        rec = bytearray(await raw_single.get(tier.redis_key(keys[25])))
        rec[-1] ^= 0x80
        await raw_single.set(tier.redis_key(keys[25]), bytes(rec))
        writes.clear()
        dst = [bytearray(b"\xab" * len(p)) for p in payloads]
        got = await tier.get_many(keys, into=dst)
    assert got == [len(p) for p in payloads[:25]] + [None] + [len(p) for p in payloads[26:29]] + [None]
    assert all(bytes(d) == p for i, (d, p) in enumerate(zip(dst, payloads)) if i not in (25, 29))
    assert not any(dst[25]) and tier.counters["corrupt"] == 1
    assert dst[29] == b"\xab" * len(payloads[29])  # a miss leaves the buffer alone
    per_window = -(-REPLY_WINDOW // (HEADER_SIZE + len(payloads[0])))
    assert len(writes) == -(-len(keys) // per_window) - 1  # the first write carries two windows
    assert writes[0][0] == 0 and all(n > 0 for n, _ in writes[1:])  # later windows wait for replies
    assert [n for n, _ in writes[1:]] == sorted(n for n, _ in writes[1:])


@pytest.mark.asyncio
@pytest.mark.parametrize("window", [None, 48 << 10], ids=["one-window", "window-per-record"])
async def test_native_io_concurrent_tasks_on_the_same_keys_never_see_wrong_bytes(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """Many tasks store new versions of the same keys and read them into their own buffers at
    once, over several connections: every read is a miss or exactly one version written for that
    key, and the last versions stand at the end. Also with reads sent a record per reply window
    (later windows go out from the reply handler while writers overwrite the same keys)."""
    cut: list[int] = []  # windows per read batch
    if window is not None:
        monkeypatch.setattr(_resp, "REPLY_WINDOW", window)
        real_windows = _resp._windows

        def counted(intos: Any, size: int) -> list[int]:
            cuts = real_windows(intos, size)
            if any(i is not None for i in intos):
                cut.append(len(cuts) + 1)
            return cuts

        monkeypatch.setattr(_resp, "_windows", counted)
    ns = _ns()
    keys = _keys(ns, 12)
    size = 48 << 10

    def version(i: int, v: int) -> bytes:
        return (i.to_bytes(4, "little") + v.to_bytes(4, "little")) * (size // 8)

    async with _tier(server.url, connections=3, max_batch_bytes=256 << 10) as tier:
        assert tier._native is not None and tier._native.size == 3
        bad: list[str] = []
        seen = 0

        async def writer(w: int) -> None:
            for v in range(w, 40, 4):
                await tier.put_many([(k, version(i, v)) for i, k in enumerate(keys)])

        async def reader() -> None:
            nonlocal seen
            for _ in range(30):
                dst = [bytearray(size) for _ in keys]
                got = await tier.get_many(keys, into=dst)
                for i, (n, d) in enumerate(zip(got, dst)):
                    if n is None:
                        continue
                    seen += 1
                    v = int.from_bytes(d[4:8], "little")
                    if n != size or bytes(d) != version(i, v):
                        bad.append(f"key {i}: {n} bytes, not one version")

        await asyncio.gather(*(writer(w) for w in range(4)), *(reader() for _ in range(4)))
        assert not bad, bad[:3]
        assert seen > 0 and tier.counters["corrupt"] == 0
        final = await tier.get_many(keys)
        assert all(g is not None and int.from_bytes(g[4:8], "little") in (36, 37, 38, 39) for g in final)
        if window is not None:
            assert cut and min(cut) >= 3  # every read batch went out in three windows or more


@pytest.mark.asyncio
async def test_native_io_survives_a_server_restart_under_pooled_connections() -> None:
    """The pooled connections die with the server; the next batch reconnects once and succeeds."""
    ns = _ns()
    keys = _keys(ns, 4)
    with RedisServer() as srv:
        async with _tier(srv.url, connections=2) as tier:
            await tier.put_many([(k, b"before") for k in keys])
            assert await tier.get_many(keys) == [b"before"] * 4
            srv.restart()  # no persistence: the data is gone, the port is the same
            assert await tier.get_many(keys) == [None] * 4
            await tier.put_many([(k, b"after") for k in keys])
            assert await tier.get_many(keys, into=[bytearray(5) for _ in keys]) == [5] * 4


# ---- two writes in flight ------------------------------------------------------------------


class _Gated(RedisTier):
    """The real tier; the SETs of a call whose first key is in ``hold`` wait until ``release``."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.hold: set[bytes] = set()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def _set_records(self, items: list[tuple[bytes, memoryview]]) -> None:
        if items and items[0][0] in self.hold:
            self.entered.set()
            await self.release.wait()
        await super()._set_records(items)


@pytest.mark.asyncio
async def test_overlapping_redis_puts_land_in_call_order_on_a_shared_key(url_cluster: tuple[str, bool]) -> None:
    """A lane keeps two batches in flight on a Redis tier, and the two go out on different
    connections. A later call sharing a key with an earlier one still in flight waits for it:
    the shared key ends with the later call's value, though the earlier one was held back, and
    a later call with no shared key does not wait (it finishes while the earlier one is held)."""
    url, cluster = url_cluster
    assert RedisTier.capabilities.writes_in_flight == 2
    ns = _ns()
    a, shared, b, c = _keys(ns, 4)
    tier = _Gated(RedisTierConfig(url=url, cluster=cluster, key_prefix=_prefix()))
    async with tier:
        tier.hold.add(a)
        first = asyncio.create_task(tier.put_many([(a, b"first-a"), (shared, b"first")]))
        await asyncio.wait_for(tier.entered.wait(), 60)
        second = asyncio.create_task(tier.put_many([(shared, b"second"), (b, b"second-b")]))
        await asyncio.wait_for(tier.put_many([(c, b"third-c")]), 60)  # shares nothing: not held
        assert not first.done() and not second.done()  # the second waits behind the first
        tier.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 60)
        assert await tier.get_many([a, shared, b, c]) == [b"first-a", b"second", b"second-b", b"third-c"]
        assert tier._writing == {}


@pytest.mark.asyncio
async def test_a_cancelled_redis_put_lets_the_one_behind_it_go(server: RedisServer) -> None:
    """The earlier call given up while held: the later call on the same key goes on and lands;
    nothing is left in the in-flight map."""
    ns = _ns()
    a, shared = _keys(ns, 2)
    tier = _Gated(RedisTierConfig(url=server.url, key_prefix=_prefix()))
    async with tier:
        tier.hold.add(a)
        first = asyncio.create_task(tier.put_many([(a, b"first-a"), (shared, b"first")]))
        await asyncio.wait_for(tier.entered.wait(), 60)
        second = asyncio.create_task(tier.put_many([(shared, b"second")]))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 60)
        assert await tier.get_many([a, shared]) == [None, b"second"]
        assert tier._writing == {}

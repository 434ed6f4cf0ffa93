"""RedisTier on a Redis Cluster while a slot migrates: ASK and TRYAGAIN followed, MOVED after.

A dedicated 3-master cluster (slots are moved by hand: ``CLUSTER SETSLOT IMPORTING`` /
``MIGRATING``, ``MIGRATE ... KEYS``, ``CLUSTER SETSLOT NODE``). ``hash_tag_buckets=1`` puts every
key of a namespace in one slot. The servers' ``INFO errorstats`` show that the replies were met.
The load under a real reshard is the drill ``tests/drills/test_reshard.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.crc import key_slot
from redis.exceptions import TryAgainError

from tests.cluster_admin import ClusterAdmin
from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.keys import Namespace
from tieredkv.testing.servers import RedisCluster, redis_command

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3) as c:
        yield c


@pytest.fixture()
def admin(cluster: RedisCluster) -> Iterator[ClusterAdmin]:
    adm = ClusterAdmin(cluster)
    try:
        yield adm
    finally:
        adm.close()


def _tier(cluster: RedisCluster, **kw: Any) -> RedisTier:
    cfg: dict[str, Any] = {
        "url": cluster.url,
        "cluster": True,
        "key_prefix": f"mig{uuid.uuid4().hex[:8]}",
        "hash_tag_buckets": 1,
        "socket_timeout_s": 1.0,
        "op_timeout_s": 5.0,
    }
    return RedisTier(RedisTierConfig(**{**cfg, **kw}))


def _ns() -> Namespace:
    return Namespace(model=f"test/{uuid.uuid4().hex[:8]}")


def _keys(ns: Namespace, n: int) -> list[bytes]:
    return [ns.key(os.urandom(32), 0) for _ in range(n)]


def _keys_on(tier: RedisTier, admin: ClusterAdmin, n: int, where: Any) -> list[bytes]:
    """``n`` keys of a fresh namespace whose slot's master ``where(port)`` accepts."""
    while True:
        ks = _keys(_ns(), n)
        if where(admin.owner(key_slot(tier.redis_key(ks[0])))):
            return ks


async def _two_free_connections(tier: RedisTier, port: int, other: list[bytes]) -> None:
    """Two loads at once of keys on node ``port``: its pool then holds two free connections, as
    under any concurrent use (redis-py's own ASK handling fails on an even number of them)."""
    await asyncio.gather(tier.get_many(other), tier.get_many(other))


async def test_ask_followed_while_a_slot_migrates(cluster: RedisCluster, admin: ClusterAdmin) -> None:
    """Half of a slot's keys moved to the importing master: every key is still read, written and
    deleted through the tier, the moved ones by ASK (``ASKING`` on the connection of the command);
    then the slot is handed over and the stale slot map is corrected by MOVED."""
    async with _tier(cluster) as tier:
        ns = _ns()
        keys = _keys(ns, 20)
        slot = key_slot(tier.redis_key(keys[0]))
        src = admin.owner(slot)
        dst = next(p for p in admin.ports if p != src)
        on_dst = _keys_on(tier, admin, 8, lambda p: p == dst)
        values = {k: os.urandom(3000) for k in keys}
        await tier.put_many(list(values.items()) + [(k, b"d") for k in on_dst])
        await _two_free_connections(tier, dst, on_dst)
        before = admin.errorstats([src])

        admin.start(slot, src, dst)
        moved, kept = keys[:10], keys[10:]
        admin.migrate(src, dst, [tier.redis_key(k) for k in moved])
        assert admin.keys_in_slot(dst, slot) == {tier.redis_key(k) for k in moved}

        assert await tier.get_many(keys) == [values[k] for k in keys]
        bufs = [bytearray(3000) for _ in keys]
        assert await tier.get_many(keys, into=bufs) == [3000] * len(keys)
        assert [bytes(b) for b in bufs] == [values[k] for k in keys]
        assert await tier.contains_many(keys) == [True] * len(keys)
        (fresh,) = _keys(ns, 1)  # on no node yet: the source asks, it is written on the importing one
        fresh_rk = tier.redis_key(fresh)
        new = {k: os.urandom(2000) for k in [*moved[:3], *kept[:3]]}
        await tier.put_many([*new.items(), (fresh, b"fresh")])
        values.update(new)
        assert await tier.get_many([*keys, fresh]) == [*(values[k] for k in keys), b"fresh"]
        assert fresh_rk in admin.keys_in_slot(dst, slot)
        assert {tier.redis_key(k) for k in kept} <= admin.keys_in_slot(src, slot)
        assert await tier.delete_many([moved[0], kept[0]]) == 2
        assert await tier.contains_many([moved[0], kept[0], moved[1], kept[1]]) == [False, False, True, True]
        asked = admin.errorstats([src]).get("ASK", 0) - before.get("ASK", 0)
        assert asked > 0 and tier.counters["cluster_ask"] > 0

        admin.finish(slot, src, dst)  # the client's slot map still says src: MOVED
        assert await tier.get_many(keys[1:10] + keys[11:]) == [values[k] for k in keys[1:10] + keys[11:]]
        assert tier.counters["cluster_moved"] > 0
        assert admin.owner(slot) == dst
        assert tier.counters["node_errors"] == 0


async def test_tryagain_retried_until_the_slot_settles(cluster: RedisCluster, admin: ClusterAdmin) -> None:
    """A two-key command on a slot whose keys the migration has split is answered TRYAGAIN: the
    tier resends it with a backoff, past redis-py's 16 quick sends, and gets its answer once the
    slot has moved. A slot held split for longer costs that key only, within the time budget."""
    async with _tier(cluster, op_timeout_s=10.0) as tier:
        a, b, c, d = _keys(_ns(), 4)
        ra, rb, rc, rd = (tier.redis_key(k) for k in (a, b, c, d))
        slot = key_slot(ra)
        src = admin.owner(slot)
        dst = next(p for p in admin.ports if p != src)
        (other,) = _keys_on(tier, admin, 1, lambda p: p != src)
        await tier.put_many([(k, b"v") for k in (a, b, c, d, other)])
        admin.start(slot, src, dst)
        admin.migrate(src, dst, [ra, rc])  # a and c moved, b and d not
        before = admin.errorstats([src]).get("TRYAGAIN", 0)

        op = asyncio.create_task(tier._per_key([ra], lambda pipe, i: pipe.exists(ra, rb)))
        deadline = time.monotonic() + 30
        while admin.errorstats([src]).get("TRYAGAIN", 0) < before + 17 and not op.done():
            assert time.monotonic() < deadline, "the two-key command never met TRYAGAIN 17 times"
            await asyncio.sleep(0.005)
        admin.migrate(src, dst, [rb])  # a and b together again, on the importing master
        assert await op == [2]
        assert tier.counters["cluster_tryagain"] >= 17

        # c / d stay split: the key is given up, as TRYAGAIN, after its sends ran out and within
        # the time budget (half the op deadline); the other node's key of the batch is served.
        ro = tier.redis_key(other)
        t0 = time.monotonic()
        got = await tier._per_key([rc, ro], lambda pipe, i: pipe.exists(rc, rd) if i == 0 else pipe.exists(ro))
        took = time.monotonic() - t0
        assert isinstance(got[0], TryAgainError) and got[1] == 1
        assert took <= 0.5 * 10.0 + 1.0, took
        admin.finish(slot, src, dst)
        assert await tier._per_key([rc], lambda pipe, i: pipe.exists(rc, rd)) == [2]


async def test_slot_moved_to_a_master_added_without_slots() -> None:
    """Scale out: a master joins with no slot (so in no slot map the client has read) and a slot
    migrates to it. The first ASK names a node the client does not know; it is added, asked, and
    after the hand-over found by MOVED."""
    with RedisCluster(masters=3) as c:
        new = c._node().start()  # a cluster-enabled server, not yet in the cluster
        try:
            host, port = new.host, new.port
            redis_command(c.servers[0].port, "CLUSTER", "MEET", host, port)
            deadline = time.monotonic() + 30
            ports = (*(s.port for s in c.servers), port)
            while not all(  # every node knows the new one, and it knows every slot's owner
                b"cluster_known_nodes:4" in (info := redis_command(p, "CLUSTER", "INFO"))
                and b"cluster_state:ok" in info
                and b"cluster_slots_ok:16384" in info
                for p in ports
            ):
                assert time.monotonic() < deadline, "the new master never joined"
                await asyncio.sleep(0.05)
            c.servers.append(new)  # for the admin connections (and stopped with the cluster)
            admin = ClusterAdmin(c)
            try:
                async with _tier(c) as tier:
                    keys = _keys(_ns(), 10)
                    slot = key_slot(tier.redis_key(keys[0]))
                    src = admin.owner(slot)
                    values = {k: os.urandom(1000) for k in keys}
                    await tier.put_many(list(values.items()))
                    assert tier._client.get_node(host=host, port=port) is None
                    admin.start(slot, src, port)
                    admin.migrate(src, port, [tier.redis_key(k) for k in keys[:5]])
                    assert await tier.get_many(keys) == [values[k] for k in keys]
                    assert tier.counters["cluster_ask"] >= 5
                    admin.finish(slot, src, port)
                    assert await tier.get_many(keys) == [values[k] for k in keys]
                    assert tier.counters["cluster_moved"] >= 1
                    assert admin.keys_in_slot(port, slot) == {tier.redis_key(k) for k in keys}
            finally:
                admin.close()
        finally:
            new.stop()

"""Reshard drill: hash slots move between Redis Cluster masters under a load of stores and loads.

A dedicated 3-master cluster (moving slots must not disturb the session cluster of other tests).
An engine-like load stores and loads records through :class:`RedisTier` (two stores in flight,
then loads; each lane over keys of its own, so the version a load must find is known), and a
probe sends a two-key command (``EXISTS a b``, both keys in one slot) through the tier's cluster
batch path on a client of its own. While they run:

1. ``redis-cli --cluster reshard`` moves the lowest slots of one master to another (the load's
   keys are picked so that half of them live in those slots);
2. every slot of the load's keys is migrated again by hand: ``CLUSTER SETSLOT IMPORTING`` /
   ``MIGRATING``, half its keys ``MIGRATE``d, the slots *held* there while the load runs and the
   servers answer it ``-ASK``; then the probe is pointed at one moved and one unmoved key of each
   slot, and once a server has answered it ``-TRYAGAIN`` the rest are moved and ``CLUSTER
   SETSLOT NODE`` is sent to every master.

Every operation that overlaps a migration window is counted: at most 1% may fail (a put that
raised, a load that raised or missed a stored key, a probe without the right count), and no
load may return a byte other than the last version stored for that key.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.crc import key_slot

from tests.cluster_admin import ClusterAdmin
from tests.drills._util import block_hash, check_payload, payload, report
from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.keys import Namespace
from tieredkv.testing.servers import HOST, RedisCluster

pytestmark = [pytest.mark.timeout(180)]

SIZE = 8 << 10
BATCH = 8
BUCKETS = 256
#: ``redis-cli --cluster reshard`` moves the lowest-numbered slots of the source master.
RESHARD_SLOTS = 512
MOVING_KEYS = 160  # keys in the slots that move
STILL_KEYS = 80  # keys elsewhere
#: Operations the load runs while the slots are held half-moved.
HELD_OPS = 300
WAIT_S = 60.0  # the longest any condition is waited for (a hang otherwise)


# ---- the load --------------------------------------------------------------------------


@dataclass
class Op:
    t0: float
    t1: float
    kind: str
    failed: bool


@dataclass
class Load:
    """An engine's traffic: each step stores a batch on each of two lanes at once (the tier takes
    two writes in flight), then loads a batch of each lane, one after the other. A lane owns its
    keys, so the version a load must find is known."""

    tier: RedisTier
    keys: dict[int, bytes]  # key index -> stored key
    lanes: list[list[int]]  # per lane: the key indices it owns
    versions: dict[int, set[int]]  # key index -> the versions a load may find (more than one after a failed put)
    pairs: list[tuple[bytes, bytes]] = field(default_factory=list)  # the probe's key pairs (each in one slot)
    ops: list[Op] = field(default_factory=list)
    wrong_bytes: int = 0
    stale: int = 0
    misses: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seq: int = 1

    def _error(self, e: BaseException) -> None:
        name = f"{type(e).__name__}: {str(e)[:80]}"
        self.errors[name] = self.errors.get(name, 0) + 1

    async def engine(self) -> None:
        rng = random.Random(41)
        while not self.stop.is_set():
            self.seq += 1
            await asyncio.gather(*(self.put(rng.sample(lane, BATCH), self.seq) for lane in self.lanes))
            for lane in self.lanes:
                await self.get(rng.sample(lane, BATCH))

    async def put(self, ids: list[int], seq: int) -> None:
        t0 = time.monotonic()
        failed = False
        try:
            await self.tier.put_many([(self.keys[i], payload(i, seq, SIZE)) for i in ids])
            for i in ids:
                self.versions[i] = {seq}
        except Exception as e:  # noqa: BLE001 - counted: a failed operation
            failed = True
            self._error(e)
            for i in ids:  # written or not: either version may be found
                self.versions[i].add(seq)
        self.ops.append(Op(t0, time.monotonic(), "put", failed))

    async def get(self, ids: list[int]) -> None:
        t0 = time.monotonic()
        failed = False
        try:
            got: list[bytes | None] = await self.tier.get_many([self.keys[i] for i in ids])
        except Exception as e:  # noqa: BLE001 - counted: a failed operation
            self._error(e)
            got = []
            failed = True
        for i, g in zip(ids, got, strict=False):
            if g is None:
                self.misses += 1
                failed = True
                continue
            try:
                v = check_payload(i, g)
            except AssertionError:
                self.wrong_bytes += 1
                continue
            if v not in self.versions[i]:
                self.stale += 1
        self.ops.append(Op(t0, time.monotonic(), "get", failed))

    async def probe(self, tier: RedisTier) -> None:
        """``EXISTS a b`` with both keys in one slot, through the tier's per-node batch path."""
        while not self.stop.is_set():
            pairs = self.pairs
            if not pairs:
                await asyncio.sleep(0.005)
                continue
            a, b = pairs[len(self.ops) % len(pairs)]
            t0 = time.monotonic()
            try:
                (n,) = await tier._per_key([a], lambda pipe, i, a=a, b=b: pipe.exists(a, b))
                failed = n != 2
                if isinstance(n, BaseException):
                    self._error(n)
            except Exception as e:  # noqa: BLE001 - counted: a failed operation
                self._error(e)
                failed = True
            self.ops.append(Op(t0, time.monotonic(), "probe", failed))
            await asyncio.sleep(0.002)


def _pick_keys(
    tier: RedisTier, ns: Namespace, low_slots: int, spare: Callable[[int], bool]
) -> tuple[dict[int, bytes], list[int], list[int]]:
    """Key indices whose slots are below ``low_slots`` (the ones the reshard moves) and others,
    none in a slot for which ``spare(slot)`` holds."""
    keys: dict[int, bytes] = {}
    moving: list[int] = []
    still: list[int] = []
    i = 0
    while len(moving) < MOVING_KEYS or len(still) < STILL_KEYS:
        assert i < 200_000, f"{len(moving)} keys of {ns.model!r} in slots below {low_slots}: its buckets miss them"
        k = ns.key(block_hash(i), i % 2)
        slot = key_slot(tier.redis_key(k))
        if slot < low_slots and len(moving) < MOVING_KEYS:
            moving.append(i)
            keys[i] = k
        elif slot >= low_slots and not spare(slot) and len(still) < STILL_KEYS:
            still.append(i)
            keys[i] = k
        i += 1
    return keys, moving, still


def _in_windows(op: Op, windows: list[tuple[float, float]]) -> bool:
    return any(op.t0 <= b and op.t1 >= a for a, b in windows)


async def _until(cond: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture()
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3) as c:
        yield c


async def test_reshard_under_load(cluster: RedisCluster) -> None:
    ports = [p for _, p in cluster.nodes]
    adm = ClusterAdmin(cluster)
    cfg = RedisTierConfig(
        url=cluster.url,
        cluster=True,
        key_prefix=f"reshard{uuid.uuid4().hex[:6]}",
        hash_tag_buckets=BUCKETS,
        socket_timeout_s=1.0,
        connect_timeout_s=0.5,
        op_timeout_s=5.0,
    )
    ns = Namespace(model="drills/reshard")
    try:
        async with RedisTier(cfg) as tier, RedisTier(cfg, name="probe") as probe:
            # The reshard moves the lowest slots from their master to another; the held migrations
            # then move them on to the third, which serves none of the load's keys before (as a
            # master added to scale out): its connections are only those the redirects open.
            src = adm.owner(0)
            dst, third = (p for p in ports if p != src)
            spare = adm.slots()[third]
            keys, moving, still = _pick_keys(tier, ns, RESHARD_SLOTS, lambda s: any(a <= s <= b for a, b in spare))
            await tier.put_many([(keys[i], payload(i, 1, SIZE)) for i in keys])
            lanes = [moving[w::2] + still[w::2] for w in range(2)]
            load = Load(tier, keys, lanes, {i: {1} for i in keys})
            tasks = [asyncio.create_task(load.engine())]
            tasks.append(asyncio.create_task(load.probe(probe)))  # its own client: its own connections
            windows: list[tuple[float, float]] = []
            stats0 = await asyncio.to_thread(adm.errorstats, ports)
            try:
                await _until(lambda: len(load.ops) >= 40, "the load to start")
                await _reshard(adm, ports, src, dst, windows)
                n_ops = len(load.ops)
                await _until(lambda: len(load.ops) >= n_ops + 20, "load after the reshard")
                slots = await _held_migrations(adm, tier, load, [keys[i] for i in moving], src, dst, third, windows)
                n_ops = len(load.ops)
                await _until(lambda: len(load.ops) >= n_ops + 20, "load after the manual migrations")
            finally:
                load.stop.set()
                await asyncio.gather(*tasks)
            stats1 = await asyncio.to_thread(adm.errorstats, ports)

            # Every key holds the version last stored, on the master that now owns its slot.
            got = await tier.get_many([keys[i] for i in keys])
            for i, g in zip(keys, got, strict=True):
                assert g is not None, f"key {i} lost"
                assert check_payload(i, g) in load.versions[i]
    finally:
        adm.close()

    inside = [op for op in load.ops if _in_windows(op, windows)]
    outside = [op for op in load.ops if not _in_windows(op, windows)]
    failed_in = sum(op.failed for op in inside)
    redirects = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in ("MOVED", "ASK", "TRYAGAIN")}
    line = report(
        "redis-cluster-reshard",
        slots_resharded=RESHARD_SLOTS,
        slots_held=len(slots),
        window_s=round(sum(b - a for a, b in windows), 2),
        ops_in_windows=len(inside),
        failed_in_windows=failed_in,
        probes_in_windows=sum(op.kind == "probe" for op in inside),
        probes_failed=sum(op.failed for op in inside if op.kind == "probe"),
        ops_outside=len(outside),
        failed_outside=sum(op.failed for op in outside),
        misses=load.misses,
        wrong_bytes=load.wrong_bytes,
        stale=load.stale,
        server_redirects=redirects,
        errors=load.errors,
    )
    assert redirects["ASK"] > 0 and redirects["TRYAGAIN"] > 0 and redirects["MOVED"] > 0, line
    assert len(inside) >= 100, line
    assert load.wrong_bytes == 0 and load.stale == 0, line
    assert failed_in <= 0.01 * len(inside), line


async def _reshard(adm: ClusterAdmin, ports: list[int], src: int, dst: int, windows: list[tuple[float, float]]) -> None:
    """``redis-cli --cluster reshard``: the lowest RESHARD_SLOTS slots from ``src`` to ``dst``."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        "redis-cli",
        "--cluster",
        "reshard",
        f"{HOST}:{src}",
        "--cluster-from",
        adm.ids[src],
        "--cluster-to",
        adm.ids[dst],
        "--cluster-slots",
        str(RESHARD_SLOTS),
        "--cluster-pipeline",
        "4",
        "--cluster-yes",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), WAIT_S)
    windows.append((t0, time.monotonic()))
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    assert all(adm.owner(s, p) == dst for p in ports for s in (0, RESHARD_SLOTS - 1))


async def _held_migrations(
    adm: ClusterAdmin,
    tier: RedisTier,
    load: Load,
    moving: list[bytes],
    src: int,
    dst: int,
    third: int,
    windows: list[tuple[float, float]],
) -> list[int]:
    """Every slot of ``moving`` from ``dst`` to the third master by hand, all at once: half of
    each slot's keys moved, the slots held so until the load has run HELD_OPS operations and the
    servers have answered it ASK; then the probe is pointed at a moved and an unmoved key of each
    slot, and once a server has answered it TRYAGAIN the rest are moved and the slots given to the
    third master. Returns the slots."""
    by_slot: dict[int, list[bytes]] = {}
    for k in moving:
        rk = tier.redis_key(k)
        by_slot.setdefault(key_slot(rk), []).append(rk)
    before = await asyncio.to_thread(adm.errorstats, [dst])
    t0 = time.monotonic()
    n_ops = len(load.ops)
    pairs = []
    for slot, rks in sorted(by_slot.items()):
        adm.start(slot, dst, third)
        half = rks[: len(rks) // 2]
        await asyncio.to_thread(adm.migrate, dst, third, half)
        if half:
            pairs.append((half[0], rks[-1]))  # one key moved, one not: TRYAGAIN

    def asked() -> bool:
        s = adm.errorstats([dst])
        return len(load.ops) >= n_ops + HELD_OPS and s.get("ASK", 0) >= before.get("ASK", 0) + len(by_slot)

    await _until(asked, f"{HELD_OPS} operations and ASK replies while the slots are half-moved")
    load.pairs = pairs
    await _until(lambda: adm.errorstats([dst]).get("TRYAGAIN", 0) > before.get("TRYAGAIN", 0), "TRYAGAIN for the probe")
    for slot in sorted(by_slot):
        await asyncio.to_thread(adm.finish, slot, dst, third)
    windows.append((t0, time.monotonic()))
    n_probes = sum(op.kind == "probe" for op in load.ops)
    await _until(lambda: sum(op.kind == "probe" for op in load.ops) > n_probes, "a probe after the migration")
    load.pairs = []
    return sorted(by_slot)

"""Redis Cluster faults: the tier's own per-node retry and redirect handling against redis-py's.

    .venv/bin/python benchmarks/bench_cluster_retry.py [--reps 2] [--scenarios reshard,failover,kill]
                                                       [--variants bespoke,redispy,redispy-per-node] [--json out.json]

Variants (all :class:`~tieredkv.backends.redis.RedisTier`, records and hash tags the same):

* ``bespoke`` — the tier (:mod:`tieredkv.backends.redis.cluster`): a pipeline per node, MOVED / ASK /
  TRYAGAIN followed, a failed node's keys retried after a topology refresh (at most twice per node).
* ``redispy`` — redis-py's own cluster client does it all: one ``ClusterPipeline`` per batch,
  ``allow_redirections=True`` and the client's default retry (3 retries, exponential backoff with
  jitter, a topology refresh after a connection error).
* ``redispy-per-node`` — a pipeline per node as the tier does, each with redis-py's redirects and
  default retry (the tier before its own retry, with redis-py's retry turned on).

Scenarios, each under the reshard drill's engine-like load (``tests/drills/test_reshard.py``: two
stores in flight, then two loads, batches of 8 records of 8 KiB over 240 keys):

* ``reshard`` — 3 masters: ``redis-cli --cluster reshard`` of 512 slots, then every slot of the
  load's keys held half-moved (by hand) for 300 operations. Window: both migrations.
* ``failover`` — 3 masters + 3 replicas (``cluster-node-timeout`` 1000 ms): a master holding load
  keys is SIGKILLed. Window: the kill until its replica is promoted and the load has run 100 more
  operations.
* ``kill`` — 3 masters, no replicas: a master is SIGKILLed and stays dead. Window: 200 operations
  or 20 s, whichever comes first.
  Its keys cannot be served by anyone; ``collateral`` counts the operations that failed although
  none of their keys was on it.

Reports per variant and scenario: operations in the window, failed (a store that raised, a load
that raised or missed a stored key), collateral, wrong bytes, operations (and successful ones)
per second in the window, median and longest operation, operations per second before the window,
and the errors the operations raised. Not part of the test suite; the numbers go into the closing
note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from redis.crc import key_slot

from tests.cluster_admin import ClusterAdmin
from tests.drills._util import block_hash, check_payload, payload
from tests.drills.test_redis_faults import _ReplicatedCluster
from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.keys import Namespace
from tieredkv.testing.servers import HOST, RedisCluster

SIZE = 8 << 10
BATCH = 8
KEYS = 240
RESHARD_SLOTS = 512
HELD_OPS = 300
WAIT_S = 90.0
KILL_WINDOW_S = 20.0


# ---- the variants --------------------------------------------------------------------------


def _split(res: list[Any], n: int, ncmd: int) -> list[Any]:
    return res if ncmd == 1 else [tuple(res[j * ncmd : (j + 1) * ncmd]) for j in range(n)]


class RedisPyTier(RedisTier):
    """redis-py does routing, redirects and retries: one ClusterPipeline per batch, its default retry."""

    def _client_kwargs(self) -> dict[str, Any]:
        kw = super()._client_kwargs()
        del kw["retry"]  # RedisCluster's default: 3 retries, exponential backoff with jitter
        return kw

    async def _per_key(
        self, rkeys: list[bytes], add: Callable[[Any, int], Any], *, ncmd: int = 1, data: bool = False
    ) -> list[Any]:
        pipe = self._client.pipeline()
        for i in range(len(rkeys)):
            add(pipe, i)
        return _split(await pipe.execute(raise_on_error=False), len(rkeys), ncmd)


class RedisPyPerNodeTier(RedisPyTier):
    """A ClusterPipeline per node (redis-py's redirects and default retry in each), run concurrently."""

    async def _per_key(
        self, rkeys: list[bytes], add: Callable[[Any, int], Any], *, ncmd: int = 1, data: bool = False
    ) -> list[Any]:
        assert self._batches is not None
        groups = self._batches.by_node(rkeys, list(range(len(rkeys))))

        async def one(idx: list[int]) -> list[Any]:
            pipe = self._client.pipeline()
            for i in idx:
                add(pipe, i)
            return _split(await pipe.execute(raise_on_error=False), len(idx), ncmd)

        results = await asyncio.gather(*(one(idx) for idx in groups.values()), return_exceptions=True)
        out: list[Any] = [None] * len(rkeys)
        failed = 0
        for idx, res in zip(groups.values(), results, strict=True):
            if isinstance(res, asyncio.CancelledError):
                raise res
            for j, i in enumerate(idx):
                out[i] = res if isinstance(res, BaseException) else res[j]
            failed += isinstance(res, BaseException) * len(idx)
        if failed == len(rkeys):
            raise next(r for r in results if isinstance(r, BaseException))
        return out


VARIANTS: dict[str, type[RedisTier]] = {
    "bespoke": RedisTier,
    "redispy": RedisPyTier,
    "redispy-per-node": RedisPyPerNodeTier,
}


# ---- the load ------------------------------------------------------------------------------


@dataclass
class Op:
    t0: float
    t1: float
    kind: str
    ids: list[int]
    failed: bool


@dataclass
class Load:
    tier: RedisTier
    keys: dict[int, bytes]
    lanes: list[list[int]]
    versions: dict[int, set[int]]
    ops: list[Op] = field(default_factory=list)
    wrong_bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seq: int = 1

    def _error(self, e: BaseException) -> None:
        cause = e.__cause__ or e
        name = f"{type(e).__name__} ({type(cause).__name__}: {str(cause)[:40]})"
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
        except Exception as e:  # noqa: BLE001 - counted
            failed = True
            self._error(e)
            for i in ids:
                self.versions[i].add(seq)
        self.ops.append(Op(t0, time.monotonic(), "put", ids, failed))

    async def get(self, ids: list[int]) -> None:
        t0 = time.monotonic()
        failed = False
        try:
            got: list[bytes | None] = await self.tier.get_many([self.keys[i] for i in ids])
        except Exception as e:  # noqa: BLE001 - counted
            self._error(e)
            got, failed = [], True
        for i, g in zip(ids, got, strict=False):
            if g is None:
                failed = True
                continue
            try:
                if check_payload(i, g) not in self.versions[i]:
                    self.wrong_bytes += 1
            except AssertionError:
                self.wrong_bytes += 1
        self.ops.append(Op(t0, time.monotonic(), "get", ids, failed))


def _keys(tier: RedisTier, ns: Namespace, accept: Callable[[int], bool], n: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    i = 0
    while len(out) < n:
        k = ns.key(block_hash(i), i % 2)
        if accept(key_slot(tier.redis_key(k))):
            out[i] = k
        i += 1
    return out


async def _until(cond: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S} s for {what}")
        await asyncio.sleep(0.01)


def _cfg(url: str) -> RedisTierConfig:
    return RedisTierConfig(
        url=url,
        cluster=True,
        key_prefix=f"bench{uuid.uuid4().hex[:6]}",
        hash_tag_buckets=256,
        socket_timeout_s=1.0,
        connect_timeout_s=0.5,
        op_timeout_s=5.0,
    )


def _summary(load: Load, window: tuple[float, float], dead: Callable[[int], bool] | None = None) -> dict[str, Any]:
    a, b = window
    inside = [op for op in load.ops if op.t0 <= b and op.t1 >= a]
    before = [op for op in load.ops if op.t1 < a]
    lat = sorted(op.t1 - op.t0 for op in inside)
    span = a - min(op.t0 for op in before) if before else 0.0
    return {
        "ops": len(inside),
        "failed": sum(op.failed for op in inside),
        "collateral": sum(op.failed and not any(dead(i) for i in op.ids) for op in inside) if dead else None,
        "wrong_bytes": load.wrong_bytes,
        "window_s": round(b - a, 2),
        "ops_per_s": round(len(inside) / (b - a), 1) if b > a else None,
        "ok_ops_per_s": round(sum(not op.failed for op in inside) / (b - a), 1) if b > a else None,
        "p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
        "max_ms": round(1000 * lat[-1], 1) if lat else None,
        "ops_per_s_before": round(len(before) / span, 1) if span else None,
        "errors": load.errors,
    }


# ---- scenarios -----------------------------------------------------------------------------


async def reshard(variant: type[RedisTier]) -> dict[str, Any]:
    with RedisCluster(masters=3) as c:
        adm = ClusterAdmin(c)
        try:
            async with variant(_cfg(c.url)) as tier:
                src = adm.owner(0)
                dst, third = (p for p in adm.ports if p != src)
                spare = adm.slots()[third]
                ns = Namespace(model="bench/reshard")
                moving = _keys(tier, ns, lambda s: s < RESHARD_SLOTS, KEYS * 2 // 3)
                still = _keys(
                    tier,
                    Namespace(model="bench/reshard-still"),
                    lambda s: s >= RESHARD_SLOTS and not any(a <= s <= b for a, b in spare),
                    KEYS // 3,
                )
                keys = {**moving, **{i + 10**6: k for i, k in still.items()}}
                load = await _start(tier, keys)
                task = asyncio.create_task(load.engine())
                try:
                    await _until(lambda: len(load.ops) >= 40, "the load")
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
                        stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL,
                    )
                    await proc.wait()
                    by_slot: dict[int, list[bytes]] = {}
                    for k in moving.values():
                        rk = tier.redis_key(k)
                        by_slot.setdefault(key_slot(rk), []).append(rk)
                    n_ops = len(load.ops)
                    for slot, rks in sorted(by_slot.items()):
                        adm.start(slot, dst, third)
                        await asyncio.to_thread(adm.migrate, dst, third, rks[: len(rks) // 2])
                    await _until(lambda: len(load.ops) >= n_ops + HELD_OPS, "the held operations")
                    for slot in sorted(by_slot):
                        await asyncio.to_thread(adm.finish, slot, dst, third)
                    t1 = time.monotonic()
                    n_ops = len(load.ops)
                    await _until(lambda: len(load.ops) >= n_ops + 40, "the load after")
                finally:
                    load.stop.set()
                    await task
                return _summary(load, (t0, t1))
        finally:
            adm.close()


async def failover(variant: type[RedisTier]) -> dict[str, Any]:
    c = _ReplicatedCluster(extra_args=["--cluster-require-full-coverage", "no"], node_timeout_ms=1000)
    with c:
        c.wait_replicated()
        adm = ClusterAdmin(c)
        try:
            async with variant(_cfg(c.url)) as tier:
                masters = {p: r for p, r in adm.slots().items() if r}
                victim = next(p for p in masters if p != adm.ports[0])
                keys = _keys(tier, Namespace(model="bench/failover"), lambda s: True, KEYS)

                def on_victim(i: int) -> bool:
                    s = key_slot(tier.redis_key(keys[i]))
                    return any(a <= s <= b for a, b in masters[victim])

                load = await _start(tier, keys)
                # the replica holds every key of its master (asynchronous replication) before the kill
                replica = next(
                    p
                    for p in adm.ports
                    if adm.r[p].execute_command("ROLE")[0] == b"slave"
                    and int(adm.r[p].execute_command("ROLE")[2]) == victim
                )
                await _until(lambda: adm.r[replica].dbsize() == adm.r[victim].dbsize(), "replication")
                task = asyncio.create_task(load.engine())
                try:
                    await _until(lambda: len(load.ops) >= 40, "the load")
                    t0 = time.monotonic()
                    next(s for s in c.servers if s.port == victim).kill()
                    await _until(lambda: adm.owner(masters[victim][0][0], adm.ports[0]) == replica, "the promotion")
                    n_ops = len(load.ops)
                    await _until(lambda: len(load.ops) >= n_ops + 100, "the load after the promotion")
                    t1 = time.monotonic()
                    n_ops = len(load.ops)
                    await _until(lambda: len(load.ops) >= n_ops + 40, "the load after")
                finally:
                    load.stop.set()
                    await task
                return _summary(load, (t0, t1), on_victim)
        finally:
            adm.close()


async def kill(variant: type[RedisTier]) -> dict[str, Any]:
    with RedisCluster(masters=3, extra_args=["--cluster-require-full-coverage", "no"], node_timeout_ms=1000) as c:
        adm = ClusterAdmin(c)
        try:
            async with variant(_cfg(c.url)) as tier:
                slots = adm.slots()
                victim = adm.ports[1]
                keys = _keys(tier, Namespace(model="bench/kill"), lambda s: True, KEYS)

                def on_victim(i: int) -> bool:
                    s = key_slot(tier.redis_key(keys[i]))
                    return any(a <= s <= b for a, b in slots[victim])

                load = await _start(tier, keys)
                task = asyncio.create_task(load.engine())
                try:
                    await _until(lambda: len(load.ops) >= 40, "the load")
                    t0 = time.monotonic()
                    next(s for s in c.servers if s.port == victim).kill()
                    n_ops = len(load.ops)
                    end = t0 + KILL_WINDOW_S  # a variant whose operations wait out their deadline runs few
                    await _until(lambda: len(load.ops) >= n_ops + 200 or time.monotonic() > end, "the window")
                    t1 = time.monotonic()
                finally:
                    load.stop.set()
                    await task
                return _summary(load, (t0, t1), on_victim)
        finally:
            adm.close()


async def _start(tier: RedisTier, keys: dict[int, bytes]) -> Load:
    await tier.put_many([(k, payload(i, 1, SIZE)) for i, k in keys.items()])
    ids = list(keys)
    return Load(tier, keys, [ids[0::2], ids[1::2]], {i: {1} for i in keys})


SCENARIOS = {"reshard": reshard, "failover": failover, "kill": kill}


def table(runs: list[dict[str, Any]]) -> str:
    """Medians over the reps of each scenario and variant (collateral and wrong bytes: totals)."""
    cols = ("ops", "failed", "ops_per_s", "ok_ops_per_s", "p50_ms", "max_ms", "ops_per_s_before")
    lines = [f"{'scenario':<9} {'variant':<17} " + " ".join(f"{c:>8.8}" for c in (*cols, "collat.", "wrong"))]
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        for name in dict.fromkeys(r["variant"] for r in runs):
            rs = [r for r in runs if r["scenario"] == scenario and r["variant"] == name]
            if not rs:
                continue
            med = [statistics.median(r[k] for r in rs) for k in cols]
            coll = "-" if rs[0]["collateral"] is None else sum(r["collateral"] for r in rs)
            lines.append(
                f"{scenario:<9} {name:<17} "
                + " ".join(f"{m:>8.0f}" for m in med)
                + f" {coll!s:>8} {sum(r['wrong_bytes'] for r in rs):>8}"
                + "   failed/ops per rep: "
                + ", ".join(f"{r['failed']}/{r['ops']}" for r in rs)
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--table", help="only print the table of the runs in this JSON file (one per line, or a list)")
    a = ap.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            text = f.read().strip()
        runs = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if x[:1] == "{"]
        print(table(runs))
        return 0
    runs = []
    for scenario in a.scenarios.split(","):
        for rep in range(a.reps):
            for name in a.variants.split(","):
                fig = asyncio.run(SCENARIOS[scenario](VARIANTS[name]))
                runs.append({"scenario": scenario, "variant": name, "rep": rep, **fig})
                print(json.dumps(runs[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("\n" + table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The route walker (:mod:`tieredkv.pipeline.route`): plans per group, the walk of one key without
waiting, the batched walk answered in the step (``find_now``) and the batched asynchronous walk,
over stand-in tiers that count what they are asked."""

from __future__ import annotations

import asyncio
import collections

from tieredkv.config import PipelineConfig, PolicyRule
from tieredkv.keys import Namespace
from tieredkv.pipeline.lanes import Lanes, TierLane
from tieredkv.pipeline.route import RouteWalker
from tieredkv.pipeline.stats import GroupStats
from tieredkv.policy import TierPolicy

NS = Namespace(model="route-test")


def key(i: int, group: int = 0) -> bytes:
    return NS.key(i.to_bytes(32, "big"), group)


class Held:
    """A stand-in tier: holds ``keys``; ``sync`` says whether it can answer without waiting (a
    Redis server cannot); ``index`` offers an in-process index. Counts its calls."""

    def __init__(
        self, name: str, keys: set[bytes], *, sync: bool = True, index: bool = False, batch: bool = True
    ) -> None:
        self.name = name
        self.keys = keys
        self.sync = sync
        self.index = index
        self.batch = batch  # answers probe_batch (a server within its budget) or not (None)
        self.asked: list[list[bytes]] = []  # contains_many calls
        self.batched: list[list[bytes]] = []  # probe_batch calls
        self.probed = 0

    def probe_key(self, k: bytes) -> bool | None:
        self.probed += 1
        return (k in self.keys) if self.sync else None

    def probe_members(self) -> set[bytes] | None:
        return self.keys if self.index else None

    def probe_batch(self, keys: list[bytes]) -> list[bool] | None:
        self.batched.append(list(keys))
        return [k in self.keys for k in keys] if self.batch else None

    async def contains_many(self, keys: list[bytes]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.keys for k in keys]


_KINDS = ("full", "sliding_window", "mamba")  # group g has kind _KINDS[g]: one rule per group


def routed(tiers: list[Held], routes: dict[int, list[str]], *, live: bool = True) -> tuple[RouteWalker, Lanes]:
    """A walker over ``tiers`` (lanes in that order) whose group ``g`` routes to ``routes[g]``."""
    lanes = Lanes()
    for t in tiers:
        lanes[t.name] = TierLane(t, PipelineConfig())  # type: ignore[arg-type]
    rules = [PolicyRule(kinds=[_KINDS[g]], tiers=names) for g, names in routes.items()]
    policy = TierPolicy(rules, [t.name for t in tiers])
    for g in routes:
        policy.route(g, 1 << 10, _KINDS[g])
    stats: collections.defaultdict[int, GroupStats] = collections.defaultdict(GroupStats)
    return RouteWalker(lanes, policy, stats.__getitem__, lambda: live), lanes


def test_find_walks_the_route_in_order_and_stops_where_a_tier_cannot_tell() -> None:
    a, b, c = key(1), key(2), key(3)
    cpu = Held("cpu", {a})
    disk = Held("disk", {a, b})
    w, lanes = routed([cpu, disk], {0: ["cpu", "disk"]})
    plan = w.plan(a)
    assert plan is not None and plan.names == ("cpu", "disk")
    assert plan.find(a) == "cpu" and disk.probed == 0  # the first holder; nothing after it asked
    assert plan.find(b) == "disk"
    assert plan.find(c) is False  # no tier holds it
    lanes["disk"].breaker.trip()
    assert plan.find(a) == "cpu"  # held before the tier whose breaker is open
    assert plan.find(b) is None  # a tier on the way cannot be asked: no answer
    lanes["disk"].breaker.success()

    remote = Held("remote", {b}, sync=False)
    w, _ = routed([cpu, remote, disk], {0: ["cpu", "remote", "disk"]})
    plan = w.plan(a)
    assert plan is not None
    assert plan.find(a) == "cpu"
    assert plan.find(b) is None  # the server cannot tell without waiting, though it holds it
    assert plan.find(c) is None

    w, _ = routed([cpu, disk], {0: ["disk", "cpu"]})  # route order, not the tiers' order
    plan = w.plan(a)
    assert plan is not None and plan.find(a) == "disk"


def test_plans_are_kept_per_group_and_only_while_live() -> None:
    cpu, disk = Held("cpu", set()), Held("disk", set())
    w, _ = routed([cpu, disk], {0: ["cpu"], 1: ["cpu", "disk"]})
    p0, p1 = w.plan(key(1, 0)), w.plan(key(1, 1))
    assert p0 is not None and p1 is not None and p0.names == ("cpu",) and p1.names == ("cpu", "disk")
    assert w.plan(key(2, 0)) is p0 and set(w.plans) == {key(1, 0)[-4:], key(1, 1)[-4:]}
    w.clear()
    assert not w.plans

    w, lanes = routed([cpu, disk], {0: ["cpu", "disk"]})
    del lanes["disk"]  # a tier not opened yet: no plan, nothing kept
    assert w.plan(key(1)) is None and not w.plans

    w, _ = routed([cpu, disk], {0: ["cpu"]}, live=False)
    assert w.plan(key(1)) is None and not w.plans


def test_hit_run_is_the_leading_run_of_one_group_in_the_first_tiers_index() -> None:
    held = {key(i) for i in range(4)} | {key(0, 1)}
    cpu = Held("cpu", held, index=True)
    w, lanes = routed([cpu], {0: ["cpu"], 1: ["cpu"]})
    plan = w.plan(key(0))
    assert plan is not None
    keys = [key(0), key(1), key(2), key(9), key(3)]
    assert plan.hit_run(keys, 0) == keys[:3]
    assert plan.hit_run(keys, 1) == keys[1:3]
    assert plan.hit_run(keys, 3) == []  # the first key is not held
    assert plan.hit_run([key(0), key(0, 1)], 0) == []  # crosses into another group
    lanes["cpu"].breaker.trip()
    assert plan.hit_run(keys, 0) == []
    w, _ = routed([Held("cpu", held)], {0: ["cpu"]})  # no in-process index
    plan = w.plan(key(0))
    assert plan is not None and plan.hit_run(keys, 0) == []


def test_find_many_asks_each_tier_once_for_every_key_that_reached_it() -> None:
    """Routes in the tiers' order: one pass, one ``contains_many`` per tier, for the keys of every
    group whose route reached it; a key held by an earlier tier of its route is not asked again."""
    k = [key(i, g) for g in (0, 1) for i in range(3)]  # group 0: k[0:3], group 1: k[3:6]
    cpu = Held("cpu", {k[0], k[3]})
    disk = Held("disk", {k[0], k[1], k[4]})
    remote = Held("remote", {k[2], k[5]})
    w, _ = routed([cpu, disk, remote], {0: ["cpu", "disk", "remote"], 1: ["cpu", "remote"]})
    found = asyncio.run(w.find_many(k, range(6)))
    assert found == {0: "cpu", 1: "disk", 2: "remote", 3: "cpu", 5: "remote"}
    assert cpu.asked == [k]
    assert disk.asked == [[k[1], k[2]]]  # group 1 does not route to it
    assert remote.asked == [[k[2], k[4], k[5]]]
    assert asyncio.run(w.find_many(k, [1, 4])) == {1: "disk"}  # only the indices asked


def test_find_many_follows_route_order_and_passes_over_a_tier_it_cannot_ask() -> None:
    a, b = key(1), key(2)
    cpu, disk = Held("cpu", {a, b}), Held("disk", {a})
    w, lanes = routed([cpu, disk], {0: ["disk", "cpu"]})  # against the tiers' order
    assert asyncio.run(w.find_many([a, b], [0, 1])) == {0: "disk", 1: "cpu"}
    assert disk.asked == [[a, b]] and cpu.asked == [[b]]

    lanes["disk"].breaker.trip()  # open: passed over, the keys asked of the next tier
    assert asyncio.run(w.find_many([a, b], [0, 1])) == {0: "cpu", 1: "cpu"}
    assert len(disk.asked) == 1

    w, lanes = routed([cpu, disk], {0: ["cpu", "disk"]})
    del lanes["cpu"]  # a route's tier without a lane is skipped
    assert asyncio.run(w.find_many([a, b], [0, 1])) == {0: "disk"}


def test_find_now_asks_a_tier_that_cannot_tell_once_for_every_key_that_reached_it() -> None:
    """In-process tiers answer key by key; a server (``probe_key`` None) is asked once, in one
    ``probe_batch``, for every key whose walk stopped at it, and a key it does not hold walks on."""
    k = [key(i, g) for g in (0, 1) for i in range(4)]  # group 0: k[0:4], group 1: k[4:8]
    cpu = Held("cpu", {k[0], k[4]})
    remote = Held("remote", {k[1], k[5]}, sync=False)
    disk = Held("disk", {k[2]})
    w, _ = routed([cpu, remote, disk], {0: ["cpu", "remote", "disk"], 1: ["cpu", "remote"]})
    found = w.find_now(k, range(8))
    assert {i: name for i, (_, name) in found.items()} == {
        0: "cpu",
        1: "remote",
        2: "disk",
        3: False,
        4: "cpu",
        5: "remote",
        6: False,
        7: False,
    }
    assert remote.batched == [[k[1], k[2], k[3], k[5], k[6], k[7]]]  # one batch, both groups
    assert found[0][0] is w.plan(k[0]) and found[4][0] is w.plan(k[4])  # where each is counted
    assert w.find_now(k, [1]) == {1: (w.plan(k[1]), "remote")} and remote.batched[-1] == [k[1]]


def test_find_now_leaves_to_the_asynchronous_walk_what_it_cannot_answer() -> None:
    a, b, c = key(1), key(2), key(3)
    cpu = Held("cpu", {a})
    remote = Held("remote", {b}, sync=False, batch=False)  # over its budget, or down
    w, lanes = routed([cpu, remote], {0: ["cpu", "remote"]})
    found = w.find_now([a, b, c], range(3))
    assert {i: n for i, (_, n) in found.items()} == {0: "cpu"} and remote.batched == [[b, c]]

    remote.batch = True
    lanes["remote"].breaker.trip()  # not closed: not asked at all
    assert {i: n for i, (_, n) in w.find_now([a, b, c], range(3)).items()} == {0: "cpu"}
    assert len(remote.batched) == 1
    lanes["remote"].breaker.success()

    # Two servers, routes in opposite orders: each server is asked once per call, so a key that
    # reaches a server after its batch went out is left unanswered (bounded: one wait per server).
    x, y = key(5, 0), key(6, 1)
    remote.keys, remote.batched = {y}, []
    r2 = Held("r2", {x}, sync=False)
    w, _ = routed([cpu, remote, r2], {0: ["remote", "r2"], 1: ["r2", "remote"]})
    found = w.find_now([x, y], range(2))
    assert {i: n for i, (_, n) in found.items()} == {0: "r2"}
    assert remote.batched == [[x]] and r2.batched == [[y, x]]  # y would reach remote after its batch

    w, _ = routed([cpu, remote], {0: ["cpu", "remote"]}, live=False)  # no plan: nothing answered
    assert w.find_now([a, b], range(2)) == {}

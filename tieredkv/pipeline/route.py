"""Route walks: which tier of a key's route holds it, its tiers asked in route order.

The pipeline's four lookups (``lookup``, ``probe``, ``probe_prefix``, ``locate``) all ask one
:class:`RouteWalker`:

* :meth:`RouteWalker.plan` — a group's route resolved once (:class:`RoutePlan`: its tiers'
  breakers and :meth:`Tier.probe_key <tieredkv.backends.base.Tier.probe_key>`, its group's
  stats, the first tier's in-process index) and kept under the group's key suffix;
* :meth:`RoutePlan.find` — the walk of one key without waiting (``probe``, ``probe_prefix``,
  ``locate``): the first tier that holds it; a tier before that one whose breaker is not closed,
  or that cannot tell without waiting (a Redis server), ends the walk without an answer (the
  asynchronous walk decides);
* :meth:`RouteWalker.find_now` — the batched walk that answers in the caller's step
  (``probe_many``: a scheduler's request, its whole prefix at once): each key walked as
  :meth:`RoutePlan.find` walks it, except that a tier that cannot tell without waiting is asked
  once for every key that reached it (:meth:`Tier.probe_batch
  <tieredkv.backends.base.Tier.probe_batch>`: one bounded round trip, Redis), and the walk goes
  on past it for the keys it does not hold; a key it leaves unanswered is left to the
  asynchronous walk;
* :meth:`RouteWalker.find_many` — the batched asynchronous walk (``lookup``): each key's tiers in
  its route's order, one ``contains_many`` per tier for every key that reached it; a tier its
  breaker keeps closed to calls (or that fails) is passed over, the key asked of the next one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Sequence
from itertools import islice, takewhile
from typing import Literal

from tieredkv.keys import GROUP_SUFFIX, key_group
from tieredkv.pipeline.lanes import Lanes, TierLane
from tieredkv.pipeline.stats import GroupStats
from tieredkv.policy import BreakerState, CircuitBreaker, TierPolicy

__all__ = ["RoutePlan", "RouteWalker"]

_CLOSED = BreakerState.CLOSED
_SUFFIX_OF = operator.itemgetter(GROUP_SUFFIX)


class RoutePlan:
    """One group's route, resolved for walks that do not wait (the scheduler's per-key path:
    tuples and bound methods, no dict lookup per tier)."""

    __slots__ = ("batches", "first", "names", "stats", "steps")

    def __init__(self, names: Sequence[str], lanes: Sequence[TierLane], stats: GroupStats) -> None:
        #: The route's tier names, in route order.
        self.names: tuple[str, ...] = tuple(names)
        #: Per tier, in route order: its breaker, its ``probe_key`` and its name.
        self.steps: tuple[tuple[CircuitBreaker, Callable[[bytes], bool | None], str], ...] = tuple(
            (lane.breaker, lane.tier.probe_key, name) for name, lane in zip(self.names, lanes)
        )
        #: Per tier, in route order: its ``probe_batch`` (:meth:`RouteWalker.find_now`).
        self.batches: tuple[Callable[[Sequence[bytes]], list[bool] | None], ...] = tuple(
            lane.tier.probe_batch for lane in lanes
        )
        #: The group's stats, where the callers count lookups.
        self.stats = stats
        #: The first tier's breaker and ``probe_members`` (None: an empty route).
        self.first: tuple[CircuitBreaker | None, Callable[[], Container[bytes] | None] | None] = (
            (lanes[0].breaker, lanes[0].tier.probe_members) if lanes else (None, None)
        )

    def find(self, key: bytes) -> str | Literal[False] | None:
        """The first tier of the route that holds ``key`` (its name); False when no tier does;
        None when a tier before the one holding it cannot tell without waiting or its breaker is
        not closed (the asynchronous path, with its breaker probes, decides)."""
        for breaker, probe_key, name in self.steps:
            if breaker.state is not _CLOSED:
                return None
            got = probe_key(key)
            if got:
                return name
            if got is None:
                return None
        return False

    def walk(self, key: bytes, start: int) -> tuple[str | Literal[False] | None, int]:
        """:meth:`find` from the route's tier ``start`` on: ``(answer, at)``, ``at`` the position
        of the tier that could not tell without waiting when the answer is None because of it
        (-1 when a breaker not closed ended the walk)."""
        steps = self.steps
        for at in range(start, len(steps)):
            breaker, probe_key, name = steps[at]
            if breaker.state is not _CLOSED:
                return None, -1
            got = probe_key(key)
            if got:
                return name, at
            if got is None:
                return None, at
        return False, len(steps)

    def hit_run(self, keys: Sequence[bytes], start: int) -> list[bytes]:
        """The leading keys of ``keys[start:]`` that the route's first tier holds, found without a
        Python step per key (C loops over that tier's in-process index): empty unless that tier
        has one (:meth:`Tier.probe_members <tieredkv.backends.base.Tier.probe_members>`), its
        breaker is closed and every key of the run is of this plan's group (a run that crosses
        into another group is left to the key-by-key walk)."""
        breaker, members = self.first
        if members is None or breaker is None or breaker.state is not _CLOSED:
            return []
        index = members()
        if index is None:
            return []
        run = list(takewhile(index.__contains__, islice(keys, start, None)))
        if not run or len(set(map(_SUFFIX_OF, run))) != 1:
            return []
        return run


class RouteWalker:
    """Plans and walks the routes of a pipeline's keys over its tier lanes.

    Args:
        lanes: the pipeline's lanes by tier name (filled as the tiers open; the order of their
            opening is the order the batched walk visits tiers in).
        policy: the routes of the groups.
        stats: per group, the stats a plan carries (``stats[group]`` makes a group's on first use).
        live: whether plans may be made and kept now (the pipeline is running, not closed).
    """

    def __init__(
        self,
        lanes: Lanes,
        policy: TierPolicy,
        stats: Callable[[int], GroupStats],
        live: Callable[[], bool],
    ) -> None:
        self._lanes = lanes
        self._policy = policy
        self._stats = stats
        self._live = live
        #: Group suffix (``key[GROUP_SUFFIX]``) -> its plan; read directly by hot paths.
        self.plans: dict[bytes, RoutePlan] = {}

    def plan(self, key: bytes) -> RoutePlan | None:
        """``key``'s group's plan, kept once every tier of its route has a lane (tiers opened);
        None while the walker is not live (:meth:`clear` drops the plans at close)."""
        plan = self.plans.get(key[GROUP_SUFFIX])
        if plan is not None:
            return plan
        if not self._live():
            return None
        group = key_group(key)
        names = self._policy.get(group).tiers
        lanes = [self._lanes.get(name) for name in names]
        if any(lane is None for lane in lanes):
            return None
        plan = RoutePlan(names, [lane for lane in lanes if lane is not None], self._stats(group))
        if self._live():
            self.plans[key[GROUP_SUFFIX]] = plan
        return plan

    def clear(self) -> None:
        """Drop every plan (the pipeline closes)."""
        self.plans.clear()

    def find_now(self, keys: Sequence[bytes], todo: Sequence[int]) -> dict[int, tuple[RoutePlan, str | Literal[False]]]:
        """``{i: (plan, answer)}`` for each index ``i`` of ``todo`` whose walk ends in the calling
        thread, within bounded time: ``answer`` is the first tier of its route that holds
        ``keys[i]``, or False when none does. A tier whose ``probe_key`` cannot tell is asked
        once, for every key whose walk stopped there (its ``probe_batch``), and the walk of a key
        it does not hold goes on to the next tier; each tier is asked at most once per call, so a
        call waits at most once per network tier of the routes, each bounded by that tier. Keys
        left out (a breaker not closed, a tier that did not answer, a group not planned yet) are
        for the asynchronous walk."""
        found: dict[int, tuple[RoutePlan, str | Literal[False]]] = {}
        parked: dict[str, list[tuple[int, RoutePlan, int]]] = {}  # tier -> (index, plan, its position)
        plans = self.plans
        asked: set[str] = set()

        def walk(i: int, plan: RoutePlan, start: int) -> None:
            got, at = plan.walk(keys[i], start)
            if got is not None:
                found[i] = (plan, got)
            elif at >= 0 and plan.names[at] not in asked:
                parked.setdefault(plan.names[at], []).append((i, plan, at))

        for i in todo:
            key = keys[i]
            plan = plans.get(key[GROUP_SUFFIX]) or self.plan(key)
            if plan is not None:
                walk(i, plan, 0)
        while parked:
            name, waiting = next(iter(parked.items()))
            del parked[name]
            asked.add(name)
            _, plan, at = waiting[0]
            got = plan.batches[at]([keys[i] for i, _, _ in waiting])
            if got is None:
                continue
            for (i, plan, at), held in zip(waiting, got):
                if held:
                    found[i] = (plan, name)
                else:
                    walk(i, plan, at + 1)
        return found

    async def find_many(
        self, keys: Sequence[bytes], todo: Sequence[int], tiers: Container[str] | None = None
    ) -> dict[int, str]:
        """``{i: tier}`` for each index ``i`` of ``todo`` whose key a tier of its route holds: the
        first such tier in route order. Each tier is asked once per pass, for every key whose walk
        reached it (a pass visits the tiers in lane order: routes in that order, the usual case,
        take one pass). A tier whose breaker refuses the call, or whose call fails, is passed
        over; a route's tier without a lane is skipped, and so is one not in ``tiers`` (when given:
        a request's tier filter)."""
        order = list(self._lanes)
        known = set(order)
        routes: dict[int, tuple[str, ...]] = {}  # group -> its route's tiers that have lanes
        walks: dict[int, tuple[tuple[str, ...], int]] = {}  # key index -> (its tiers, the next one's position)
        for i in todo:
            group = key_group(keys[i])
            route = routes.get(group)
            if route is None:
                route = routes[group] = tuple(
                    n for n in self._policy.get(group).tiers if n in known and (tiers is None or n in tiers)
                )
            if route:
                walks[i] = (route, 0)
        found: dict[int, str] = {}
        while walks:
            for name in order:
                ask = [i for i, (route, at) in walks.items() if route[at] == name]
                if not ask:
                    continue
                got = await self._lanes[name].contains([keys[i] for i in ask])
                for j, i in enumerate(ask):
                    if got is not None and got[j]:
                        found[i] = name
                        del walks[i]
                        continue
                    route, at = walks[i]
                    if at + 1 < len(route):
                        walks[i] = (route, at + 1)
                    else:
                        del walks[i]
        return found

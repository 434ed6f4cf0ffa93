"""Per-group tier routing and the circuit breaker that guards each tier.

Primitives:

* :class:`GroupRoute` — for one KV group: its tiers (fastest first), write mode and
  whether lower-tier hits are promoted.
* :class:`TierPolicy` — resolves every group to a route from the config's rules, keyed by the
  group's chunk size in bytes (``max_chunk_bytes``) and optionally its kind.
* :class:`CircuitBreaker` — closed → open after ``failures`` consecutive errors → half-open
  after ``reset_s`` (one probe at a time) → closed on a success, open again on a failure.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from dataclasses import dataclass
from enum import Enum

from tieredkv.config import PolicyRule
from tieredkv.errors import ConfigError
from tieredkv.groups import GroupSpec

__all__ = ["BreakerState", "CircuitBreaker", "GroupRoute", "TierPolicy"]


@dataclass(frozen=True, slots=True)
class GroupRoute:
    """Where a group's chunks go: the policy's decision for one :class:`~tieredkv.groups.GroupSpec`
    (the group model); it holds no geometry of its own."""

    group: int
    tiers: tuple[str, ...]
    write: str  # "through" | "back"
    promote: bool
    admit_after: int = 1  # store a chunk on its Nth sighting (1: always)

    @property
    def write_tiers(self) -> tuple[str, ...]:
        """Tiers a store writes at once."""
        return self.tiers if self.write == "through" else self.tiers[:1]

    def among(self, allowed: Container[str]) -> GroupRoute:
        """This route over only its tiers in ``allowed``, in route order (a request's tier filter:
        :mod:`tieredkv.integrations.vllm.controls`); itself when every tier is allowed. A route
        left with another first tier, or with one tier, writes through (write-back sends chunks
        from an in-process first tier down the route it was stored on)."""
        tiers = tuple(t for t in self.tiers if t in allowed)
        if tiers == self.tiers:
            return self
        write = self.write if len(tiers) > 1 and tiers[0] == self.tiers[0] else "through"
        return GroupRoute(self.group, tiers, write, self.promote, self.admit_after)


class TierPolicy:
    """Routes groups to tiers by the first matching rule."""

    def __init__(self, rules: Sequence[PolicyRule], tier_names: Sequence[str]) -> None:
        self.rules = list(rules)
        self.tier_names = tuple(tier_names)
        self._routes: dict[int, GroupRoute] = {}

    def route(self, group: int | GroupSpec, chunk_bytes: int | None = None, kind: str = "full") -> GroupRoute:
        """Resolve (and remember) the route of ``group``: a :class:`~tieredkv.groups.GroupSpec`
        (its index, kind and chunk bytes; ``chunk_bytes`` may override the spec's) or an index with
        its chunk bytes and kind."""
        if isinstance(group, GroupSpec):
            spec = group
            return self.route(spec.index, spec.bytes_per_chunk if chunk_bytes is None else chunk_bytes, spec.kind.value)
        if chunk_bytes is None:
            raise ValueError(f"policy.route({group}): chunk_bytes is required with a group index")
        for i, rule in enumerate(self.rules):
            if rule.max_chunk_bytes is not None and chunk_bytes > rule.max_chunk_bytes:
                continue
            if rule.kinds is not None and kind not in rule.kinds:
                continue
            tiers = tuple(rule.tiers) or self.tier_names
            r = GroupRoute(group, tiers, rule.write, rule.promote, rule.admit_after)
            self._routes[group] = r
            return r
        raise ConfigError(
            f"policy: no rule matches group {group} (kind {kind!r}, {chunk_bytes}-byte chunks);"
            " add a last rule without max_chunk_bytes/kinds as a catch-all"
        )

    def get(self, group: int) -> GroupRoute:
        """The route resolved for ``group``; groups never declared use every tier, write-through."""
        r = self._routes.get(group)
        if r is None:
            r = self._routes[group] = GroupRoute(group, self.tier_names, "through", True)
        return r


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Per-tier breaker. Not thread-safe: used on the pipeline loop only."""

    def __init__(self, failures: int = 3, reset_s: float = 1.0, clock: object = time.monotonic) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self._clock = clock
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.state = BreakerState.CLOSED
        self.opens = 0

    def allow(self) -> bool:
        """May an operation go to the tier now? (In half-open, only one probe at a time.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() - self._opened_at < self.reset_s:  # type: ignore[operator]
                return False
            self.state = BreakerState.HALF_OPEN
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        # Written only on a change: the scheduler thread reads ``state`` on every lookup, and a
        # write on every operation would take its cache line away from that thread each time.
        if self.state is not BreakerState.CLOSED or self._consecutive or self._probing:
            self._consecutive = 0
            self._probing = False
            self.state = BreakerState.CLOSED

    def trip(self) -> None:
        """Open now (e.g. the tier could not even be opened)."""
        self._consecutive = self.failures
        self.failure()

    def failure(self) -> None:
        self._consecutive += 1
        self._probing = False
        if self.state is BreakerState.HALF_OPEN or self._consecutive >= self.failures:
            if self.state is not BreakerState.OPEN:
                self.opens += 1
            self.state = BreakerState.OPEN
            self._opened_at = self._clock()  # type: ignore[operator]

"""Request controls on a :class:`~tieredkv.store.TieredStore`: per-call tier filters, admission
and retention (the store's :class:`StoreControls` part).

* **Tier filters** — :meth:`StoreControls.route_among`, :meth:`StoreControls.probe_among` and the
  ``tiers=`` of ``store`` / ``load`` / ``put_records`` / ``get_records`` / ``lookup_async``: a
  call that may use only some tiers of a group's route (a vLLM request's ``kv_load_tiers`` /
  ``kv_store_tiers``, :mod:`tieredkv.integrations.vllm.controls`) runs over the route's tiers
  among those names, in route order.
* **Admission** — :meth:`StoreControls.admit` (:mod:`tieredkv.admission`): the policy rules'
  ``admit_after``.
* **Retention** — :meth:`StoreControls.retain` (:mod:`tieredkv.retention`): chunks pinned for a
  time or until displaced, bounded by the config's ``hints``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, MutableSet, Sequence
from typing import TYPE_CHECKING

from tieredkv.admission import Admission
from tieredkv.config import TieredKVConfig
from tieredkv.keys import key_group
from tieredkv.pipeline import KeyState
from tieredkv.policy import BreakerState, GroupRoute
from tieredkv.retention import RetentionBook

if TYPE_CHECKING:
    from tieredkv.groups import GroupSpec
    from tieredkv.pipeline import Pipeline
    from tieredkv.policy import TierPolicy

__all__ = ["StoreControls", "TiersArg", "retained_bytes_cap"]

#: Tier names a call may use (a request's tier filter); None: every tier of the route.
TiersArg = Iterable[str] | None


class StoreControls:
    """The request-control part of :class:`~tieredkv.store.TieredStore`."""

    policy: TierPolicy
    pipeline: Pipeline
    _specs: dict[int, tuple[GroupSpec, bool]]

    if TYPE_CHECKING:

        def pin(self, keys: Sequence[bytes]) -> None: ...
        def unpin(self, keys: Sequence[bytes]) -> None: ...

    def _init_controls(self, config: TieredKVConfig) -> None:
        #: Admission per KV group (the policy rules' ``admit_after``): :meth:`admit`.
        self.admission = Admission(
            lambda g: self.policy.get(g).admit_after,
            config.admission.tracked_keys,
            chunk_bytes=self._chunk_bytes,
            on_decline=self._declined,
        )
        #: Whether any rule admits on a later sighting than the first (else :meth:`admit` is moot).
        self.admission_active = any(rule.admit_after > 1 for rule in config.policy)
        #: Chunks retained against eviction (:meth:`retain`), bounded by the config's ``hints``.
        self.retention = RetentionBook(
            self.pin,
            self.unpin,
            max_chunks=config.hints.max_retained_chunks,
            max_bytes=retained_bytes_cap(config),
            max_seconds=config.hints.max_retain_s,
        )
        self._among: dict[tuple[int, frozenset[str]], GroupRoute] = {}
        #: What request controls did, by ``(control, outcome)`` (a vLLM request's hint actions:
        #: ``("hint:tieredkv.retain", "accepted")``, ``("hint:other", "ignored_unknown_type")``, ...).
        self.control_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._control_events = 0

    def count_control(self, control: str, outcome: str, n: int = 1) -> None:
        """Count ``n`` of what a request control did (:attr:`control_counts`)."""
        self.control_counts[(control, outcome)] += n
        self._control_events += 1

    def control_activity(self) -> int:
        """A number that moves whenever :attr:`control_counts` or the retention's counts moved."""
        return self._control_events + self.retention.changes

    def route_among(self, group: int, tiers: Iterable[str]) -> GroupRoute:
        """Group ``group``'s route over only its tiers named in ``tiers`` (route order kept; see
        :meth:`GroupRoute.among <tieredkv.policy.GroupRoute.among>`); may be empty."""
        allowed = tiers if isinstance(tiers, frozenset) else frozenset(tiers)
        route = self._among.get((group, allowed))
        if route is None:
            if len(self._among) > 4096:
                self._among.clear()
            route = self._among[(group, allowed)] = self.policy.get(group).among(allowed)
        return route

    def _job_route(self, group: int, tiers: TiersArg, op: str) -> GroupRoute | None:
        if tiers is None:
            return None
        route = self.route_among(group, tiers)
        if not route.tiers:
            raise ValueError(
                f"{op}: no tier of group {group}'s route {list(self.policy.get(group).tiers)} is in {tiers}"
            )
        return None if route is self.policy.get(group) else route

    def probe_among(self, key: bytes, tiers: Iterable[str]) -> KeyState | None:
        """:meth:`probe` over only the tiers of ``key``'s route named in ``tiers`` (a request's tier
        filter): PENDING while a store of it is in flight, HIT when one of those tiers holds it,
        MISS when none does (or none is named); None when one of them cannot tell without waiting
        or its breaker is not closed (ask :meth:`lookup_async` with the same ``tiers``). Not
        counted as a lookup."""
        if self.pipeline.is_pending(key):
            return KeyState.PENDING
        plan = self.pipeline.routes.plan(key)
        if plan is None:
            return None
        allowed = tiers if isinstance(tiers, (frozenset, set)) else frozenset(tiers)
        for breaker, probe_key, name in plan.steps:
            if name not in allowed:
                continue
            if breaker.state is not BreakerState.CLOSED:
                return None
            got = probe_key(key)
            if got:
                return KeyState.HIT
            if got is None:
                return None
        return KeyState.MISS

    def admit(
        self, keys: Sequence[bytes], seen: MutableSet[bytes] | None = None, *, chunk_bytes: int | None = None
    ) -> list[bool]:
        """Admission (the policy rules' ``admit_after``, :mod:`tieredkv.admission`): whether to
        store each of ``keys`` (stored keys) now. Each call is a sighting of its keys, except those
        in ``seen`` (a request's keys counted already; updated). Declined chunks and their bytes
        (the group's chunk bytes, or ``chunk_bytes``) are counted per group."""
        if not self.admission_active:
            return [True] * len(keys)
        return self.admission.admit(keys, seen, chunk_bytes=chunk_bytes)

    def _chunk_bytes(self, group: int) -> int:
        spec = self._specs.get(group)
        return 0 if spec is None else int(spec[0].bytes_per_chunk)

    def _declined(self, group: int, chunks: int, nbytes: int) -> None:
        self.pipeline.add_group_counts(group, admission_declined=chunks, admission_declined_bytes=nbytes)

    def retain(self, keys: Sequence[bytes], *, seconds: float | None, priority: int = 0, nbytes: int = 0) -> int:
        """Protect ``keys`` (stored keys, each ``nbytes``: default the group's chunk bytes) from
        this process's evictions for ``seconds`` (None: a pin, until a higher priority needs the
        room or a reset), bounded by the config's ``hints`` (:mod:`tieredkv.retention`); how many
        are retained. Call ``store.retention.expire()`` as you go to end what is due."""
        if not keys:
            return 0
        n = nbytes or max(1, self._chunk_bytes(key_group(keys[0])))
        return self.retention.retain(keys, n, seconds=seconds, priority=priority)


def retained_bytes_cap(config: TieredKVConfig) -> int:
    """What retention may pin, in bytes: ``hints.max_retained_bytes``, and at most a quarter of the
    smallest capacity a tier's config states (Redis states none: its server holds it)."""
    cap = int(config.hints.max_retained_bytes)
    for t in config.tiers:
        capacity = t.configured_capacity
        if capacity:
            cap = min(cap, capacity // 4)
    return cap

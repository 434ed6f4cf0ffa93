"""A vLLM request's controls, as tieredkv reads them: tier filters and KV hints.

How they reach tieredkv in vLLM 0.33: a request's ``kv_transfer_params`` (``SamplingParams.
extra_args["kv_transfer_params"]``) and its ``kv_hints`` (a ``KvHintsEnvelope``, vLLM RFC #53421:
``LLMEngine.add_request(..., kv_hints=)`` / ``AsyncLLM.generate(..., kv_hints=)`` -> ``Request.
kv_hints``; vLLM 0.33's OpenAI server does not take them) are put by the offloading connector's
scheduler side (``_create_req_context``) on the request's ``ReqContext``, with
``load_tier_filter`` parsed from ``kv_transfer_params["kv_load_tiers"]``. That one ``ReqContext``
reaches every manager call, ``on_new_request`` and every ``TransferJob`` of the request, in both
of tieredkv's modes, behind vLLM's connector and ``TieredKVConnector`` alike. vLLM's own CPU
manager ignores the filter and the hints; its tiering manager applies ``load_tier_filter`` to
whole secondary tiers (their ``medium`` / ``locality``), never to its CPU primary, and hands the
hints only to its KVCR tier; ``max_load_tokens`` / ``max_offload_tokens`` are applied by the
connector itself (the hit and the stored prefix are capped before any manager is asked).

:func:`request_controls` reads a request's controls once (kept on its ``ReqContext``) as a
:class:`RequestControls`:

* **Tier filters** — ``kv_load_tiers`` (vLLM's) and ``kv_store_tiers`` (tieredkv's; vLLM 0.33
  has none): a list of matchers, each ``{"medium": "CPU"|"STORAGE", "locality": "LOCAL"|"REMOTE",
  "tier": "<tieredkv tier name>"}`` with any of the keys; a tier is allowed when one matcher
  matches all the keys it gives. vLLM's parsing rules are kept: no list (or a missing key): every
  tier; ``[]``: none; an entry that is not a mapping, or names an unknown medium or locality, is
  skipped; if every entry was skipped: every tier. A tieredkv tier's medium and locality come
  from its kind's :attr:`TierCapabilities.medium <tieredkv.backends.base.TierCapabilities.medium>`:
  ``host`` (the CPU slab) is CPU / LOCAL, ``disk`` (LMDB, fs) STORAGE / LOCAL, ``remote`` (Redis)
  STORAGE / REMOTE; ``tier`` matches the tier's ``name`` in the tieredkv config.
* **Hints** — the envelope's actions of tieredkv's schema (:data:`HINT_SCHEMA`, ``action_version``
  major 1 in an envelope of ``protocol_version`` major 1): ``tieredkv.retain`` (payload
  ``{"seconds": float > 0 | null, "priority": int}``: the request's prefix retained for that
  long, or pinned without ``seconds``) and ``tieredkv.no_store`` (nothing of the request is
  stored). Any other action type, another major version, a bad payload: ignored and counted
  (``TieredStore.control_counts``, ``vllm:kv_offload_tieredkv_hint_actions_total``). Several
  retain actions: the longest time and the highest priority.

What the manager, the secondary tier and the connector do with them: docs/vllm.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tieredkv.keys import GROUP_SUFFIX

__all__ = [
    "HINT_SCHEMA",
    "KV_LOAD_TIERS",
    "KV_STORE_TIERS",
    "NO_STORE",
    "RETAIN",
    "RequestControls",
    "Retain",
    "TierSelector",
    "parse_hints",
    "parse_tier_filter",
    "request_controls",
    "tier_place",
]

KV_LOAD_TIERS = "kv_load_tiers"
KV_STORE_TIERS = "kv_store_tiers"
RETAIN = "tieredkv.retain"
NO_STORE = "tieredkv.no_store"
#: tieredkv's hint actions: type -> (major version, payload fields and what they mean).
HINT_SCHEMA: dict[str, tuple[str, dict[str, str]]] = {
    RETAIN: (
        "1",
        {
            "seconds": "number > 0: retain the request's prefix that long (cut to hints.max_retain_s);"
            " absent or null: pin it (until a higher priority needs the room, a cache reset or the end)",
            "priority": "integer, default 0: a retention displaces only retentions of lower priority",
        },
    ),
    NO_STORE: ("1", {}),
}
_MEDIA = frozenset({"CPU", "STORAGE"})
_LOCALITIES = frozenset({"LOCAL", "REMOTE"})
#: tieredkv medium (``TierCapabilities.medium``) -> vLLM's (Medium, Locality) names.
_PLACES: dict[str, tuple[str | None, str | None]] = {
    "host": ("CPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"),
    "remote": ("STORAGE", "REMOTE"),
}


def tier_place(medium: str) -> tuple[str | None, str | None]:
    """vLLM's medium and locality names of a tieredkv tier whose capabilities say ``medium``
    (None: unknown, which every matcher matches, as in vLLM's ``TierMatcher``)."""
    return _PLACES.get(medium, (None, None))


class _Matcher(NamedTuple):
    medium: str | None
    locality: str | None
    tier: str | None

    def matches(self, name: str, medium: str | None, locality: str | None) -> bool:
        return (
            (self.medium is None or medium is None or self.medium == medium)
            and (self.locality is None or locality is None or self.locality == locality)
            and (self.tier is None or self.tier == name)
        )


@dataclass(frozen=True)
class TierSelector:
    """A parsed tier filter; ``matchers`` None: every tier."""

    matchers: tuple[_Matcher, ...] | None = None

    @property
    def everything(self) -> bool:
        return self.matchers is None

    @property
    def nothing(self) -> bool:
        return self.matchers == ()

    def allows(self, name: str, medium: str) -> bool:
        """Whether the tier ``name`` of tieredkv medium ``medium`` is allowed."""
        if self.matchers is None:
            return True
        med, loc = tier_place(medium)
        return any(m.matches(name, med, loc) for m in self.matchers)

    def allows_place(self, medium: str | None, locality: str | None) -> bool:
        """Whether a tier of vLLM's ``medium`` / ``locality`` names (not a tieredkv tier) is allowed:
        a matcher naming a tieredkv ``tier`` never matches it."""
        if self.matchers is None:
            return True
        return any(m.tier is None and m.matches("", medium, locality) for m in self.matchers)

    def names(self, tiers: Iterable[tuple[str, str]]) -> frozenset[str] | None:
        """The allowed names among ``(name, tieredkv medium)`` tiers; None when every one is."""
        if self.matchers is None:
            return None
        tiers = list(tiers)
        allowed = frozenset(name for name, medium in tiers if self.allows(name, medium))
        return None if len(allowed) == len(tiers) else allowed


EVERY_TIER = TierSelector()


def parse_tier_filter(raw: Any) -> TierSelector:
    """A ``kv_load_tiers`` / ``kv_store_tiers`` value, by vLLM's rules (see the module) plus ``tier``."""
    if raw is None or not isinstance(raw, list):
        return EVERY_TIER
    matchers: list[_Matcher] = []
    for entry in raw:
        if not isinstance(entry, Mapping):
            continue
        medium, locality, tier = entry.get("medium"), entry.get("locality"), entry.get("tier")
        if medium is not None:
            medium = medium.upper() if isinstance(medium, str) else None
            if medium not in _MEDIA:
                continue
        if locality is not None:
            locality = locality.upper() if isinstance(locality, str) else None
            if locality not in _LOCALITIES:
                continue
        if tier is not None and not isinstance(tier, str):
            continue
        matchers.append(_Matcher(medium, locality, tier))
    if not matchers:
        return TierSelector(()) if not raw else EVERY_TIER
    return TierSelector(tuple(matchers))


def _from_vllm(load_filter: Any) -> TierSelector:
    """vLLM's parsed ``ReqContext.load_tier_filter`` (a ``TierFilter``) as a selector."""
    matchers = getattr(load_filter, "matchers", None)
    if matchers is None or any(getattr(m, "medium", 0) is None and getattr(m, "locality", 0) is None for m in matchers):
        return EVERY_TIER  # vLLM's TierFilter.ALL is one matcher of (None, None)
    return TierSelector(
        tuple(
            _Matcher(
                getattr(m.medium, "value", None) if m.medium is not None else None,
                getattr(m.locality, "value", None) if m.locality is not None else None,
                None,
            )
            for m in matchers
        )
    )


@dataclass(frozen=True)
class Retain:
    """A retention a request's hints asked for: ``seconds`` None is a pin."""

    seconds: float | None
    priority: int


@dataclass
class RequestControls:
    """What tieredkv does differently for one request (``ReqContext`` state)."""

    load: TierSelector = EVERY_TIER
    store: TierSelector = EVERY_TIER
    no_store: bool = False
    retain: Retain | None = None
    #: This request's keys counted as sightings by admission already (one per request).
    seen: set[bytes] = field(default_factory=set)
    #: The tier names each selector allows in the store it was resolved for (a cache).
    _names: dict[tuple[int, str], frozenset[str] | None] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """Nothing special: every tier both ways, no hint."""
        return self.load.everything and self.store.everything and not self.no_store and self.retain is None

    @property
    def stores_nothing(self) -> bool:
        """Nothing of the request may be stored (a no-store hint, or ``kv_store_tiers: []``)."""
        return self.no_store or self.store.nothing

    def load_tiers(self, store: Any) -> frozenset[str] | None:
        """The names of ``store``'s tiers the request may load from; None: every tier."""
        return self._resolve(store, "load", self.load)

    def store_tiers(self, store: Any) -> frozenset[str] | None:
        """The names of ``store``'s tiers the request may store into; None: every tier."""
        if self.stores_nothing:
            return frozenset()
        return self._resolve(store, "store", self.store)

    def _resolve(self, store: Any, which: str, sel: TierSelector) -> frozenset[str] | None:
        if sel.everything:
            return None
        k = (id(store), which)
        if k not in self._names:
            self._names[k] = sel.names((t.name, t.capabilities.medium) for t in store.tiers)
        return self._names[k]


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _major(version: Any) -> str | None:
    if not isinstance(version, str):
        return None
    return version.strip().lstrip("vV").split(".", 1)[0]


def parse_hints(envelope: Any, count: Any = None, enabled: bool = True) -> tuple[bool, Retain | None]:
    """``(no_store, retain)`` from a ``KvHintsEnvelope`` (or its builtins form); each action counted
    through ``count(control, outcome)`` (``TieredStore.count_control``)."""

    def counted(action: str, outcome: str) -> None:
        if count is not None:
            count(f"hint:{action}", outcome)

    if envelope is None:
        return False, None
    actions = _get(envelope, "actions")
    if not isinstance(actions, list | tuple):
        counted("other", "ignored_invalid")
        return False, None
    envelope_ok = _major(_get(envelope, "protocol_version")) == "1"
    no_store, seconds, priority, retained = False, 0.0, None, False
    for action in actions:
        kind = _get(action, "action_type")
        label = kind if kind in HINT_SCHEMA else "other"
        if label == "other":
            counted(label, "ignored_unknown_type")
            continue
        if not enabled:
            counted(label, "ignored_disabled")
            continue
        if not envelope_ok:
            counted(label, "ignored_unknown_version")
            continue
        if _major(_get(action, "action_version")) != HINT_SCHEMA[label][0]:
            counted(label, "ignored_unknown_version")
            continue
        payload = _get(action, "payload")
        if payload is None:
            payload = {}
        if not isinstance(payload, Mapping):
            counted(label, "ignored_invalid")
            continue
        if label == NO_STORE:
            no_store = True
            counted(label, "accepted")
            continue
        secs, prio = payload.get("seconds"), payload.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int) or not -(2**31) <= prio < 2**31:
            counted(label, "ignored_invalid")
            continue
        if secs is not None and (
            isinstance(secs, bool) or not isinstance(secs, int | float) or not math.isfinite(secs) or secs <= 0
        ):
            counted(label, "ignored_invalid")
            continue
        counted(label, "accepted")
        retained = True
        seconds = math.inf if secs is None or seconds == math.inf else max(seconds, float(secs))
        priority = prio if priority is None else max(priority, prio)
    if not retained:
        return no_store, None
    return no_store, Retain(None if seconds == math.inf else seconds, int(priority or 0))


def retain_keys(store: Any, skeys: Iterable[bytes], retain: Retain, counters: Any, nbytes: int | None = None) -> None:
    """Retain ``skeys`` (stored keys of any groups) in ``store`` as a request's hint asked, one
    call per KV group (``nbytes``: a chunk's size where the caller knows it), counting what was
    retained and what was refused in ``counters``."""
    by_group: dict[bytes, list[bytes]] = {}
    for s in skeys:
        by_group.setdefault(s[GROUP_SUFFIX], []).append(s)
    extra = {} if nbytes is None else {"nbytes": nbytes}
    for keys in by_group.values():
        n = store.retain(keys, seconds=retain.seconds, priority=retain.priority, **extra)
        counters["retained_chunks"] += n
        counters["retain_refused_chunks"] += len(keys) - n


def request_controls(ctx: Any, store: Any = None) -> RequestControls:
    """The controls of the request of ``ctx`` (a ``ReqContext``), read once and kept on it; hint
    actions are counted on ``store`` (a ``TieredStore``, whose config's ``hints.enabled`` says
    whether they are executed) by the first call, which vLLM makes through the manager's (or the
    secondary tier's) ``on_new_request``."""
    got = ctx.get_state(RequestControls)
    if got is not None:
        return got
    hints_enabled = store is None or store.config.hints.enabled
    params = ctx.kv_transfer_params or {}
    raw_load = params.get(KV_LOAD_TIERS) if isinstance(params, Mapping) else None
    raw_store = params.get(KV_STORE_TIERS) if isinstance(params, Mapping) else None
    load = parse_tier_filter(raw_load) if raw_load is not None else _from_vllm(getattr(ctx, "load_tier_filter", None))
    store_sel = parse_tier_filter(raw_store)
    hints = getattr(ctx, "kv_hints", None)
    no_store, retain = parse_hints(hints, getattr(store, "count_control", None), hints_enabled)
    controls = RequestControls(load, store_sel, no_store, retain)
    ctx.set_state(controls)
    return controls

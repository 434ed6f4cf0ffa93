"""How a request's controls are read (``tieredkv.integrations.vllm.controls``): tier filters by vLLM
0.33's own parsing rules (checked against vLLM's ``_parse_tier_filter`` on the same inputs), tieredkv
tier names and media, and the hint schema (each action's outcome counted)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import _parse_tier_filter
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter

from tieredkv.integrations.vllm.controls import (
    HINT_SCHEMA,
    RequestControls,
    Retain,
    TierSelector,
    parse_hints,
    parse_tier_filter,
    request_controls,
    tier_place,
)

pytestmark = pytest.mark.vllm

RAW_FILTERS: list[Any] = [
    None,
    "CPU",
    [],
    [{}],
    [{"medium": "cpu"}],
    [{"medium": "STORAGE", "locality": "remote"}],
    [{"medium": "disk"}],  # unknown medium: skipped; nothing left of a non-empty list: every tier
    [{"medium": "disk"}, {"locality": "LOCAL"}],
    ["x", {"locality": "REMOTE"}],
    [{"medium": 3}],
]
PLACES = [(m, loc) for m in (Medium.CPU, Medium.STORAGE, None) for loc in (Locality.LOCAL, Locality.REMOTE, None)]


@pytest.mark.parametrize("raw", RAW_FILTERS, ids=[repr(r) for r in RAW_FILTERS])
def test_tier_filters_are_parsed_as_vllm_parses_them(raw: Any) -> None:
    ours = parse_tier_filter(raw)
    theirs = _parse_tier_filter(raw) if raw is not None else TierFilter.ALL
    for medium, locality in PLACES:
        want = theirs.allows(medium, locality)
        got = ours.allows_place(medium.value if medium else None, locality.value if locality else None)
        assert got == want, (raw, medium, locality)
    # vLLM's parsed filter on a ReqContext (no kv_load_tiers of ours to read) gives the same
    ctx = ReqContext(req_id="r", kv_transfer_params={}, load_tier_filter=theirs)
    from_ctx = request_controls(ctx).load
    for medium, locality in PLACES:
        m, loc = (medium.value if medium else None), (locality.value if locality else None)
        assert from_ctx.allows_place(m, loc) == ours.allows_place(m, loc), (raw, medium, locality)


def test_tieredkv_tiers_by_medium_locality_and_name() -> None:
    tiers = [("cpu", "host"), ("nvme", "disk"), ("shared", "disk"), ("redis", "remote"), ("odd", "unspecified")]
    assert [tier_place(m) for _, m in tiers] == [
        ("CPU", "LOCAL"),
        ("STORAGE", "LOCAL"),
        ("STORAGE", "LOCAL"),
        ("STORAGE", "REMOTE"),
        (None, None),
    ]

    def names(raw: Any) -> Any:
        return parse_tier_filter(raw).names(tiers)

    assert names(None) is None and names([{}]) is None
    assert names([]) == frozenset()
    assert names([{"medium": "CPU"}]) == {"cpu", "odd"}  # a tier that states no medium matches any (vLLM's rule)
    assert names([{"locality": "REMOTE"}]) == {"redis", "odd"}
    assert names([{"tier": "shared"}]) == {"shared"}
    assert names([{"tier": "shared", "locality": "REMOTE"}]) == frozenset()  # every key of a matcher must match
    assert names([{"tier": "nvme"}, {"medium": "CPU", "locality": "LOCAL"}]) == {"nvme", "cpu", "odd"}
    assert names([{"tier": 7}]) is None  # a bad entry is skipped; none left: every tier
    # a matcher naming a tieredkv tier never matches one of vLLM's tiers (its primary, another secondary)
    assert not TierSelector(parse_tier_filter([{"tier": "nvme"}]).matchers).allows_place("CPU", "LOCAL")


def env(*actions: tuple[Any, Any, Any], protocol: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope(
        protocol_version=protocol, message_id="m", actions=[KvHintAction(str(i), *a) for i, a in enumerate(actions)]
    )


def test_hint_schema_outcomes_and_merging() -> None:
    counted: list[tuple[str, str]] = []

    def count(control: str, outcome: str) -> None:
        counted.append((control, outcome))

    assert parse_hints(None, count) == (False, None) and counted == []
    got = parse_hints(
        env(
            ("tieredkv.retain", "1", {"seconds": 10, "priority": 1}),
            ("tieredkv.retain", "1.3", {"seconds": 30}),  # same major: accepted; longest time, highest priority
            ("tieredkv.retain", "v1", {"seconds": 20, "priority": 4, "later_field": [1]}),  # unknown fields: ignored
            ("tieredkv.no_store", "1", None),
            ("tieredkv.retain", "2", {}),
            ("tieredkv.retain", "1", {"seconds": math.inf}),
            ("tieredkv.retain", "1", {"seconds": True}),
            ("tieredkv.retain", "1", {"priority": 1.5}),
            ("tieredkv.retain", "1", ["not", "a", "mapping"]),
            ("kvcr.offload", "1", {}),
        ),
        count,
    )
    assert got == (True, Retain(30.0, 4))
    assert counted == [
        ("hint:tieredkv.retain", "accepted"),
        ("hint:tieredkv.retain", "accepted"),
        ("hint:tieredkv.retain", "accepted"),
        ("hint:tieredkv.no_store", "accepted"),
        ("hint:tieredkv.retain", "ignored_unknown_version"),
        *[("hint:tieredkv.retain", "ignored_invalid")] * 4,
        ("hint:other", "ignored_unknown_type"),
    ]
    # a pin (no seconds) wins over any time
    assert parse_hints(env(("tieredkv.retain", "1", {"seconds": 5}), ("tieredkv.retain", "1", {}))) == (
        False,
        Retain(None, 0),
    )
    # an envelope of another protocol: every action ignored, as is every action with hints disabled
    counted.clear()
    assert parse_hints(env(("tieredkv.no_store", "1", {}), protocol="2.0"), count) == (False, None)
    assert parse_hints(env(("tieredkv.no_store", "1", {})), count, enabled=False) == (False, None)
    assert counted == [
        ("hint:tieredkv.no_store", "ignored_unknown_version"),
        ("hint:tieredkv.no_store", "ignored_disabled"),
    ]
    # vLLM's builtins form (msgspec.to_builtins) reads the same
    assert parse_hints(
        {
            "protocol_version": "1",
            "actions": [{"action_type": "tieredkv.no_store", "action_version": "1", "payload": {}}],
        }
    ) == (True, None)
    assert set(HINT_SCHEMA) == {"tieredkv.retain", "tieredkv.no_store"}


def test_request_controls_are_read_once_and_kept_on_the_context() -> None:
    ctx = ReqContext(
        req_id="r",
        kv_transfer_params={"kv_load_tiers": [{"tier": "nvme"}], "kv_store_tiers": []},
        kv_hints=env(("tieredkv.retain", "1", {"priority": 2})),
        load_tier_filter=_parse_tier_filter([{"tier": "nvme"}]),
    )
    c = request_controls(ctx)
    assert isinstance(c, RequestControls) and request_controls(ctx) is c
    assert c.retain == Retain(None, 2) and c.stores_nothing and not c.plain
    assert c.load.matchers is not None and c.load.matchers[0].tier == "nvme"  # ours, with the tier name
    plain = request_controls(ReqContext(req_id="p"))
    assert plain.plain and not plain.stores_nothing

"""Admission (store on the Nth sighting, a bounded LRU of counts), retention (pins with a time and a
priority, bounded), a route restricted to some of its tiers, and their config fields."""

from __future__ import annotations

import math

import pytest

from tieredkv.admission import Admission, SightingCounter
from tieredkv.config import load_config
from tieredkv.errors import ConfigError
from tieredkv.keys import make_chunk_key
from tieredkv.policy import GroupRoute
from tieredkv.retention import RetentionBook


def key(i: int, group: int = 0) -> bytes:
    return b"F" * 8 + make_chunk_key(i.to_bytes(32, "big"), group)


# ---- admission ---------------------------------------------------------------------------------


def test_sighting_counter_is_an_lru_bounded_in_keys() -> None:
    c = SightingCounter(3)
    for k in (b"a", b"b", b"c"):
        assert c.sight(k) == 1
    assert c.sight(b"a") == 2  # a is now the most recent
    assert c.sight(b"d") == 1  # b, the least recent, goes
    assert len(c) == 3 and c.forgotten == 1
    assert c.count(b"b") == 0 and c.count(b"a") == 2
    assert c.sight(b"b") == 1  # forgotten: starts again (under-counts, never over-counts)
    with pytest.raises(ValueError, match="capacity"):
        SightingCounter(0)


def test_admission_per_group_on_the_nth_sighting_once_per_request() -> None:
    declined: list[tuple[int, int, int]] = []
    adm = Admission(
        {0: 1, 1: 3}.__getitem__,
        100,
        chunk_bytes={0: 10, 1: 7}.__getitem__,
        on_decline=lambda g, n, b: declined.append((g, n, b)),
    )
    k0, k1 = key(1, 0), key(1, 1)
    # group 0 admits always; group 1 on the third request that offers the chunk
    r1: set[bytes] = set()
    assert adm.admit([k0, k1], r1) == [True, False]
    assert adm.admit([k1], r1) == [False]  # the same request again: not a sighting
    assert adm.sightings.count(k1) == 1
    assert adm.admit([k1], set()) == [False]
    assert adm.admit([k1], set()) == [True]
    assert adm.admit([k1], set()) == [True]  # and from then on
    assert adm.sightings.count(k0) == 0  # a group that admits always counts nothing
    c = adm.counts[1]
    assert (c.admitted, c.declined, c.declined_bytes) == (2, 3, 21)
    assert declined == [(1, 1, 7)] * 3
    assert adm.admit([k1], None, chunk_bytes=99) == [True]  # no request: every call is a sighting
    adm.clear()
    assert adm.admit([k1], set(), chunk_bytes=99) == [False] and adm.counts[1].declined_bytes == 21 + 99


# ---- retention ---------------------------------------------------------------------------------


class Pins:
    def __init__(self) -> None:
        self.n: dict[bytes, int] = {}

    def pin(self, keys: object) -> None:
        for k in keys:  # type: ignore[attr-defined]
            self.n[k] = self.n.get(k, 0) + 1

    def unpin(self, keys: object) -> None:
        for k in keys:  # type: ignore[attr-defined]
            self.n[k] -= 1
            if not self.n[k]:
                del self.n[k]


def book(pins: Pins, clock: list[float], **kw: object) -> RetentionBook:
    args: dict = {"max_chunks": 4, "max_bytes": 400, "max_seconds": 100.0, **kw}
    return RetentionBook(pins.pin, pins.unpin, clock=lambda: clock[0], **args)


def test_retention_expires_after_its_time_and_pins_stay() -> None:
    pins, clock = Pins(), [0.0]
    b = book(pins, clock)
    assert b.retain([b"a", b"b"], 100, seconds=10, priority=0) == 2
    assert b.retain([b"p"], 100, seconds=None, priority=0) == 1
    assert set(pins.n) == {b"a", b"b", b"p"} and b.bytes == 300
    clock[0] = 9.99
    assert b.expire() == 0
    clock[0] = 10.0
    assert b.expire() == 2
    assert set(pins.n) == {b"p"} and b.bytes == 100 and b.until(b"p") == math.inf
    clock[0] = 1e9
    assert b.expire() == 0 and b"p" in b
    assert b.release_all() == 1 and not pins.n and b.counts["released"] == 1


def test_retention_time_is_cut_and_a_second_ask_extends() -> None:
    pins, clock = Pins(), [0.0]
    b = book(pins, clock)
    b.retain([b"a"], 10, seconds=1e6, priority=0)
    assert b.until(b"a") == 100.0  # max_seconds
    b.retain([b"a"], 10, seconds=5, priority=3)  # shorter: the later end stays, the priority rises
    assert b.until(b"a") == 100.0 and b.priority(b"a") == 3 and pins.n == {b"a": 1}
    assert b.counts["extended"] == 1


def test_retention_is_bounded_and_only_lower_priority_is_displaced() -> None:
    pins, clock = Pins(), [0.0]
    b = book(pins, clock)  # 4 chunks, 400 bytes
    assert b.retain([b"l1", b"l2"], 100, seconds=50, priority=1) == 2
    assert b.retain([b"l0"], 100, seconds=None, priority=1) == 1
    assert b.retain([b"h1", b"h2"], 100, seconds=None, priority=5) == 2  # displaces l1 (expires first)
    assert set(pins.n) == {b"l2", b"l0", b"h1", b"h2"} and b.counts["displaced"] == 1
    # a flood at the same priority as what holds the room: nothing displaced, refused
    assert b.retain([b"x1", b"x2"], 100, seconds=None, priority=1) == 0
    assert b.counts["refused"] == 2 and len(b) == 4 and b.bytes == 400
    # bytes bound: a chunk larger than the whole budget is never retained
    assert b.retain([b"big"], 401, seconds=None, priority=99) == 0
    assert b.retain([b"top"], 200, seconds=None, priority=9) == 1  # displaces l2 then l0 (pin, last)
    assert set(pins.n) == {b"h1", b"h2", b"top"} and b.bytes == 400
    assert (
        RetentionBook(pins.pin, pins.unpin, max_chunks=0, max_bytes=1, max_seconds=1).retain([b"z"], 1, seconds=1) == 0
    )


def test_retention_many_retains_keep_the_heaps_small() -> None:
    pins, clock = Pins(), [0.0]
    b = book(pins, clock, max_chunks=10, max_bytes=10)
    for i in range(1000):
        b.retain([b"k"], 1, seconds=float(i % 7) + i / 1000, priority=i % 5)
    assert len(b._rank) <= 4 * len(b) + 65 and len(b) == 1


# ---- routes ------------------------------------------------------------------------------------


def test_route_among_keeps_order_and_drops_write_back_off_its_first_tier() -> None:
    r = GroupRoute(0, ("cpu", "nvme", "redis"), "back", True, 2)
    assert r.among({"cpu", "nvme", "redis", "other"}) is r
    assert r.among({"redis", "cpu"}) == GroupRoute(0, ("cpu", "redis"), "back", True, 2)
    assert r.among({"nvme", "redis"}) == GroupRoute(0, ("nvme", "redis"), "through", True, 2)
    assert r.among({"cpu"}) == GroupRoute(0, ("cpu",), "through", True, 2)
    assert r.among(set()).tiers == ()


# ---- config ------------------------------------------------------------------------------------


def test_admit_after_and_hints_are_validated() -> None:
    cfg = load_config({"policy": [{"kinds": ["mamba"], "admit_after": 3}, {}]}, env={})
    assert [r.admit_after for r in cfg.policy] == [3, 1]
    assert cfg.admission.tracked_keys == 65536 and cfg.hints.enabled and cfg.hints.max_retained_chunks == 16384
    for bad in (0, -1, 65, "two"):
        with pytest.raises(ConfigError, match=r"policy\.0\.admit_after"):
            load_config({"policy": [{"admit_after": bad}]}, env={})
    with pytest.raises(ConfigError, match=r"admission\.tracked_keys"):
        load_config({"admission": {"tracked_keys": 1}}, env={})
    with pytest.raises(ConfigError, match=r"hints\.max_retain_s"):
        load_config({"hints": {"max_retain_s": 0}}, env={})
    with pytest.raises(ConfigError, match=r"hints\.unknown"):
        load_config({"hints": {"unknown": 1}}, env={})

"""tieredkv's non-blocking lookups for vLLM's scheduler thread (no vLLM needed), on a real store.

vLLM asks one key at a time, defers a request whose lookup met a RETRY and asks all its keys again
on a later step. The answers must stay until they are asked for again (else a long prefix's
answered and queued keys swap places every step), must not live on once nobody asks for ``ttl_steps`` steps, and a
resolved answer that nobody has read yet is not work the engine has to step for.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tieredkv.integrations.vllm.lookups import AsyncLookups
from tieredkv.store import TieredStore, open_store


@pytest.fixture
def stored() -> Iterator[tuple[TieredStore, list[bytes]]]:
    """A real store over a CPU tier holding keys 0-3 of 8 (4-7 never stored)."""
    cpu = {"kind": "cpu", "capacity_bytes": "8MiB", "segment_bytes": "1MiB"}
    store = open_store({"namespace": {"model": "lookups-test"}, "tiers": [cpu]})
    try:
        kv = torch.arange(16 * 256, dtype=torch.int32).view(16, 256).to(torch.uint8).contiguous()
        store.register_group(0, [kv], blocks_per_chunk=1)
        keys = [store.key(i.to_bytes(32, "big"), 0) for i in range(8)]
        job = store.store(0, [(k, (i,)) for i, k in enumerate(keys[:4])])
        assert job is not None and store.wait([job])[job].ok
        yield store, keys
    finally:
        store.close()


def _settle(lk: AsyncLookups) -> None:
    """Wait (for the futures, not a time) until every lookup sent has resolved."""
    assert lk.wait(10.0), "lookup never resolved"


def _step(lk: AsyncLookups, keys: list[bytes]) -> list[Any]:
    got = [lk.answer(k) for k in keys]
    lk.flush()  # on_schedule_end
    lk.end_step()
    return got


def test_answers_stay_until_asked_and_expire_when_not(stored: tuple[TieredStore, list[bytes]]) -> None:
    p, keys = stored
    lk = AsyncLookups(p.lookup_async, ttl_steps=3)
    asked = keys[:6]  # 4 stored, 2 never stored
    assert _step(lk, asked) == [None] * 6
    assert not lk.has_unsent() and lk.queries == 1
    _settle(lk)
    # Every answer of the request arrives together, and again on each later ask: no alternation.
    for _ in range(3):
        assert _step(lk, asked) == ["hit"] * 4 + ["miss"] * 2
    assert lk.queries == 1, "kept answers must not be asked of the tiers again"
    # A deferred request the scheduler does not reach for a few steps still finds its answers.
    _step(lk, [])
    _step(lk, [])
    assert _step(lk, asked) == ["hit"] * 4 + ["miss"] * 2
    assert lk.queries == 1
    # ttl_steps without anyone asking drops them: a later ask goes to the tiers again.
    for _ in range(4):
        _step(lk, [])
    assert _step(lk, asked[:1]) == [None]
    assert lk.queries == 2


def test_answers_are_bounded(stored: tuple[TieredStore, list[bytes]]) -> None:
    p, keys = stored
    lk = AsyncLookups(p.lookup_async, max_answers=3)
    _step(lk, keys)
    _settle(lk)
    _step(lk, [])
    assert len(lk._answers) == 3
    # the most recently asked stay and are served without asking the tiers again
    assert _step(lk, keys[-3:]) == ["miss"] * 3 and lk.queries == 1


def test_deferred_request_gets_all_answers_at_once(stored: tuple[TieredStore, list[bytes]]) -> None:
    """The shape that made vLLM wait thousands of steps: keys 0-2 known, key 3 first asked later."""
    p, keys = stored
    lk = AsyncLookups(p.lookup_async)
    _step(lk, keys[:3])
    _settle(lk)
    first = _step(lk, keys[:4])  # 0-2 answered, 3 queued
    assert first == ["hit", "hit", "hit", None]
    _settle(lk)
    assert _step(lk, keys[:4]) == ["hit"] * 4


def test_pending_work_is_only_unsent_keys(stored: tuple[TieredStore, list[bytes]]) -> None:
    p, keys = stored
    lk = AsyncLookups(p.lookup_async)
    assert not lk.has_unsent()
    lk.answer(keys[0])
    assert lk.has_unsent()  # needs one more on_schedule_end to go out
    lk.flush()
    assert not lk.has_unsent()
    _settle(lk)
    # Resolved, never read: an idle engine must be allowed to stop here.
    assert not lk.has_unsent() and not lk.busy()


def _first_batch_held(store: TieredStore) -> tuple[list[Future[Any]], Any]:
    """Fault injection around the real store: the first batch's future is held (the test gives
    its answer), every later batch goes to the store."""
    held: list[Future[Any]] = []

    def lookup_async(batch: list[bytes]) -> Future[Any]:
        if not held:
            held.append(Future())
            return held[0]
        return store.lookup_async(batch)

    return held, lookup_async


def test_a_pending_answer_is_read_once_then_asked_again(stored: tuple[TieredStore, list[bytes]]) -> None:
    """A lookup that met a store in flight answers "pending". The store may be another
    manager's (no ``forget`` here ever comes): kept and refreshed by every ask, the answer would
    keep the request waiting for ever (a stall seen in the engine loop on Redis). Fault
    injection: the first batch's answer is held and given as PENDING, the real store answers
    the rest."""
    from tieredkv.pipeline import KeyState

    p, keys = stored
    held, lookup_async = _first_batch_held(p)
    lk = AsyncLookups(lookup_async, ttl_steps=8)
    k = keys[0]
    assert _step(lk, [k]) == [None]
    held[0].set_result([(KeyState.PENDING, None)])
    assert _step(lk, [k]) == ["pending"]
    assert _step(lk, [k]) == [None], "a pending answer must not be kept: the key is asked again"
    _settle(lk)
    assert [_step(lk, [k]) for _ in range(3)] == [["hit"]] * 3


@pytest.mark.parametrize("late", ["pending", "miss"])
def test_an_answer_sent_before_a_forget_is_discarded(stored: tuple[TieredStore, list[bytes]], late: str) -> None:
    """A lookup asked before the key's store completed may answer PENDING or MISS after
    ``complete_store`` forgot the key; kept, a MISS would be refreshed by every ask and hide a
    stored chunk for as long as it is asked. Fault injection: the first batch's answer is held
    and given after the forget; the next ask goes to the real store, which holds the key."""
    from tieredkv.pipeline import KeyState

    p, keys = stored
    held, lookup_async = _first_batch_held(p)
    lk = AsyncLookups(lookup_async, ttl_steps=8)
    k = keys[1]
    assert _step(lk, [k]) == [None]
    lk.forget([k])
    held[0].set_result([(KeyState(late), None)])
    assert _step(lk, [k]) == [None], f"a {late} answer sent before the forget must be discarded"
    _settle(lk)
    assert [_step(lk, [k]) for _ in range(3)] == [["hit"]] * 3

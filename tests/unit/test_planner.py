"""The planner core (``tieredkv.planner``), rule by rule, under both of its configurations.

The library's ``OffloadScheduler`` (so ``store.planner()`` and the demo) and the vLLM connector
``TieredKVConnector`` plan with the same core; they configure it differently (the connector takes
partial sliding-window chunks and shares its per-step key budget evenly). The tests here pin the
core's rules without vLLM; ``tests/vllm/test_connector.py`` shows the connector going through it.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tieredkv.groups import GroupLayout, GroupSpec
from tieredkv.planner import (
    ChunkLedger,
    ChunkToStore,
    GroupFacts,
    GroupStorePlan,
    Handoff,
    HandoffQueue,
    HoldBook,
    OffloadScheduler,
    RequestStore,
    StoreOutcome,
    StorePlan,
    StorePlanner,
    align_hit,
    split_answer,
)
from tieredkv.planner.store import final_segment

LIBRARY = {"shared": True, "adaptive": True, "partial_chunks": False}  # OffloadScheduler's
CONNECTOR = {"shared": False, "adaptive": False, "partial_chunks": True}  # TieredKVConnectorScheduler's


def keys(n: int, group: int = 0) -> list[bytes]:
    return [bytes([group, k]) for k in range(n)]


def offered(offers: list[Any]) -> list[list[int]]:
    return [[c.chunk_index for c in chunks] for chunks in offers]


class Tally:
    keys_retried = 0
    chunks_blocks_gone = 0


# ------------------------------------------------------------------ one core, both engines


def test_library_planner_is_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OffloadScheduler`` plans and settles through ``StorePlanner`` (the class the connector
    holds as ``store_planner``), and keeps each request's ledgers in a ``RequestStore``."""
    seen: list[str] = []
    plan, settle = StorePlanner.plan, StorePlanner.settle

    def spy_plan(self: StorePlanner, req: RequestStore, groups: Any, tally: Any = None) -> Any:
        seen.append("plan")
        return plan(self, req, groups, tally)

    def spy_settle(self: StorePlanner, req: RequestStore, done: Any, final: bool = False) -> bool:
        seen.append("settle")
        return settle(self, req, done, final)

    monkeypatch.setattr(StorePlanner, "plan", spy_plan)
    monkeypatch.setattr(StorePlanner, "settle", spy_settle)
    s = OffloadScheduler(GroupLayout((GroupSpec(0, "full", tokens_per_block=4),), tokens_per_hash=4))
    assert type(s.store_planner) is StorePlanner
    s.add_request("r", 8, block_hashes=[b"a" * 8, b"b" * 8])
    s.update_request("r", block_ids=[[1, 2]])
    p = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    s.complete_store("r", StoreOutcome(refused=frozenset(p.keys)))
    assert seen == ["plan", "settle"]
    assert s.cursor("r", 0) == 0


@pytest.mark.parametrize("config", [LIBRARY, CONNECTOR], ids=["library", "connector"])
def test_a_refused_chunk_is_offered_again_first_under_both_configurations(config: dict[str, bool]) -> None:
    """The same facts give the same plans under both configurations (whole chunks, one group):
    a refused chunk stays below the cursor and comes first in the next plan; a partial answer
    leaves the rest waiting; nothing is skipped."""
    p = StorePlanner(max_chunks=2, **config)
    req = p.new_request(1)
    ks, ids = keys(6), list(range(1, 7))

    def plan(limit: int) -> list[int]:
        return offered(p.plan(req, [GroupFacts(ks, ids, 1, limit)]))[0]

    assert plan(4) == [0, 1]
    p.settle(req, [])  # refused whole
    budget = 1 if config["adaptive"] else 2  # the library halves its budget after a refusal
    assert plan(4) == [0, 1][:budget]
    p.settle(req, [ks[0]])
    assert req.ledgers[0].cursor == 1
    assert plan(6)[0] == 1  # the refused chunk first, before any new one
    p.settle(req, [ks[1]])
    assert req.ledgers[0].cursor == 2
    while req.ledgers[0].cursor < 6:
        chunks = plan(6)
        assert chunks and chunks[0] == req.ledgers[0].cursor
        p.settle(req, [ks[k] for k in chunks])


# ------------------------------------------------------------------ partial chunks (the connector's)


def test_partial_chunk_leading_nulls_only_first_in_its_group() -> None:
    """A chunk whose leading blocks left the window is offered (partial_chunks), but only as a
    group's first offered chunk (a store job starts mid-chunk only there); a chunk with a null
    after a block, or with no block, is dead, and a waiting one that dies is counted."""
    p = StorePlanner(max_chunks=None, **CONNECTOR)
    req = p.new_request(1)
    ids = [0, 0, 5, 6, 0, 7, 8, 9, 1, 2, 3, 4, 10, 0, 11, 12, 0, 0, 0, 0]
    tally = Tally()
    facts = GroupFacts(keys(5), ids, 4, 5, sys.maxsize)
    assert offered(p.plan(req, [facts], tally)) == [[0, 2]]
    led = req.ledgers[0]
    assert led.waiting == [0, 1, 2]  # chunk 1 waits: it would start mid-chunk after chunk 0
    assert led.cursor == 0 and led.status_of(3) == led.status_of(4) == 3  # dead
    p.settle(req, [keys(5)[0], keys(5)[2]])
    assert offered(p.plan(req, [facts], tally)) == [[1]] and tally.keys_retried == 1
    ids[6] = 0  # the engine freed one of chunk 1's blocks before it was taken: never whole again
    p.settle(req, [])
    assert offered(p.plan(req, [facts], tally)) == [[]] and tally.chunks_blocks_gone == 1
    assert led.cursor == 5


def test_library_configuration_never_stores_a_chunk_with_a_null_block() -> None:
    """Without partial chunks a chunk with any null block waits while it may become whole
    (above ``final_below``) and is dead below it."""
    p = StorePlanner(max_chunks=None, **LIBRARY)
    req = p.new_request(1)
    ids = [0, 0, 5, 6, 1, 2, 3, 4]
    assert offered(p.plan(req, [GroupFacts(keys(2), ids, 4, 2, 0)])) == [[1]]
    assert req.ledgers[0].waiting == [0, 1]
    p.settle(req, [keys(2)[1]])
    assert offered(p.plan(req, [GroupFacts(keys(2), ids, 4, 2, 1)])) == [[]]
    assert req.ledgers[0].cursor == 2  # chunk 0 out of reach for good: dead


def test_blocks_no_lookup_reads_make_a_chunk_dead() -> None:
    """``reach`` says which blocks a later lookup may read: a chunk none of whose blocks are read is
    dead (reconsidered on a resume); a partial chunk must keep every block a lookup reads."""
    p = StorePlanner(max_chunks=None, **CONNECTOR)
    req = p.new_request(1)
    ids = [1, 2, 0, 3, 4, 5]

    def reach(lo: int, limit: int) -> list[bool]:
        assert (lo, limit) == (0, 3)
        return [False, False, True, True, True, True]

    assert offered(p.plan(req, [GroupFacts(keys(3), ids, 2, 3, sys.maxsize, reach)])) == [[2]]
    led = req.ledgers[0]
    assert led.status_of(0) == 3 and led.status_of(1) == 3  # dead: unread, and a read block is null
    req.resume()
    assert led.cursor == 0


def test_per_group_share_and_water_filling() -> None:
    """The connector's budget is an even share per group; the library's is water-filled (an idle
    group's share goes to the others)."""
    ks0, ks1 = keys(8, 0), keys(8, 1)
    ids = list(range(1, 9))
    both = [GroupFacts(ks0, ids, 1, 8), GroupFacts(ks1, ids, 1, 1)]
    conn = StorePlanner(max_chunks=4, **CONNECTOR)
    assert offered(conn.plan(conn.new_request(2), both)) == [[0, 1], [0]]
    lib = StorePlanner(max_chunks=4, **LIBRARY)
    assert offered(lib.plan(lib.new_request(2), both)) == [[0, 1, 2], [0]]


# ------------------------------------------------------------------ answers, misses, holds, hand-offs


def test_split_answer_tells_present_from_refused() -> None:
    ks = keys(4)
    a = split_answer(ks, [ks[0]], lambda k: k == ks[1])
    assert a.accepted == {ks[0]} and a.present == [ks[1]] and a.refused == [ks[2], ks[3]]
    assert split_answer(ks, None, lambda k: True).refused == ks
    plan = StorePlan("r", 16, (GroupStorePlan(0, tuple(ChunkToStore(k, i, (i + 1,)) for i, k in enumerate(ks))),))
    outcome = StoreOutcome.from_prepare_store(plan, [ks[0]])
    assert outcome.present == frozenset(ks[1:])  # vLLM's contract: a key left out is present
    outcome = StoreOutcome.from_prepare_store(plan, [ks[0]], lambda k: k == ks[1])
    assert outcome.accepted == {ks[0]} and outcome.present == {ks[1]} and outcome.refused == {ks[2], ks[3]}


def test_a_miss_forgets_the_chunk_and_in_full_attention_every_later_stored_one() -> None:
    for full, forgotten in ((True, [2, 3, 5]), (False, [2])):
        led = ChunkLedger()
        for k in (0, 1, 2, 3, 5):
            led.mark_done(k)
        led.mark_waiting(4)
        assert led.missed(2, full=full) == len(forgotten)
        assert [k for k in range(6) if led.status_of(k) == 0] == forgotten
        assert led.cursor == 2
    assert ChunkLedger().missed(0, full=False) == 0


def test_hold_book_bounds_blocks_and_steps() -> None:
    book: HoldBook[str] = HoldBook(max_steps=2, max_blocks=10)
    assert book.hold("a", "state-a", 6) and not book.hold("b", "state-b", 5) and book.hold("c", "state-c", 4)
    assert "a" in book and book.get("a") == "state-a" and book.num_blocks == 10
    assert book.step("a").steps == 1 and not book.expired("a", num_waiting=3)
    assert book.expired("c", num_waiting=0)
    book.step("a")
    assert book.expired("a", num_waiting=3)  # held max_steps steps
    book.release("a")
    assert book.num_blocks == 4 and list(book) == ["c"]
    assert not HoldBook[str](max_steps=0, max_blocks=100).hold("x", "s", 1)  # 0 never holds


def test_handoff_queue_offers_a_refused_state_until_its_block_is_reused() -> None:
    q = HandoffQueue(max_attempts=2)
    due, gone, given_up = q.due([Handoff("r", 2, 7, 64), Handoff("s", 2, 8, 64)], set(), lambda r: True)
    assert len(due) == 2 and not q
    for h in due:
        q.refuse(h)
    assert q.count("r") == 1
    due, gone, given_up = q.due([], {8}, lambda r: True)  # s's block was reallocated
    assert [h.req_id for h in due] == ["r"] and (gone, given_up) == (1, 0)
    q.refuse(due[0])
    due, gone, given_up = q.due([], set(), lambda r: True)
    assert due == [] and (gone, given_up) == (0, 1)  # tried max_attempts times
    q.refuse(Handoff("t", 2, 9, 64))
    assert q.due([], set(), lambda r: r != "t")[2] == 1  # its request is gone


def test_align_hit_lands_on_the_grid() -> None:
    """A hit off the Mamba grid is asked again bounded at the grid point below (+ slack)."""
    asked: list[int | None] = []
    answers: dict[int | None, int] = {None: 100, 65: 64}

    def lookup(max_new: int | None) -> int | None:
        asked.append(max_new)
        return answers[max_new]

    shrunk: list[int] = []
    assert align_hit(lookup, 0, 64, on_shrink=lambda: shrunk.append(1)) == 64
    assert asked == [None, 65] and shrunk == [1]
    assert align_hit(lambda n: 40 if n is None else 16, 16, 32) == 16  # 16 + 40 -> 32 + 1 - 16
    assert align_hit(lambda n: 30, 16, 64) == 0  # no grid point above the prefix
    assert align_hit(lambda n: None, 0, 64) is None  # not known yet
    assert align_hit(lambda n: 40, 0, None) == 40


def test_final_segment() -> None:
    assert final_segment(5, 8, finished=True, open_ended=False) == 5
    assert final_segment(5, 8, finished=False, open_ended=False) == 8
    assert final_segment(9, 8, finished=False, open_ended=False) is None
    assert final_segment(5, 8, finished=True, open_ended=True) is None

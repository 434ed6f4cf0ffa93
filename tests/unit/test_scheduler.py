"""Scenario tests for the multi-group scheduler adapter, one rule at a time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tieredkv.groups import GroupLayout, GroupSpec
from tieredkv.planner import OffloadScheduler, StoreOutcome, StorePlan

TPH = 4  # tokens per hash


def H(i: int) -> bytes:
    return b"h" + i.to_bytes(7, "big")


def hashes(n: int, start: int = 0) -> list[bytes]:
    return [H(i) for i in range(start, start + n)]


def key(hash_index: int, group: int) -> bytes:
    return H(hash_index) + group.to_bytes(4, "big")


def layout(*groups: GroupSpec) -> GroupLayout:
    return GroupLayout(groups, tokens_per_hash=TPH)


FULL = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=1)


def accept_all(plan: StorePlan) -> StoreOutcome:
    return StoreOutcome(accepted=frozenset(plan.keys))


def chunk_indices(plan: StorePlan, pos: int) -> list[int]:
    return [c.chunk_index for c in plan.groups[pos].chunks]


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------- keys


def test_key_is_hash_at_last_position_plus_group_big_endian() -> None:
    lay = layout(GroupSpec(7, "full", tokens_per_block=4, blocks_per_chunk=3))  # 3 hashes/chunk
    s = OffloadScheduler(lay)
    s.add_request("r", 24, block_hashes=hashes(6))
    assert s.offload_keys("r", 0) == (H(2) + b"\x00\x00\x00\x07", H(5) + b"\x00\x00\x00\x07")


def test_key_layout_matches_keys_module() -> None:
    from tieredkv.keys import key_group, key_hash, make_chunk_key

    s = OffloadScheduler(layout(GroupSpec(258, "full", tokens_per_block=4)))
    s.add_request("r", 4, block_hashes=[H(9)])
    (k,) = s.offload_keys("r", 0)
    assert k == make_chunk_key(H(9), 258)
    assert key_hash(k) == H(9) and key_group(k) == 258


def test_hashes_must_be_bytes() -> None:
    s = OffloadScheduler(layout(FULL))
    with pytest.raises(TypeError, match="bytes"):
        s.add_request("r", 4, block_hashes=["abc"])  # type: ignore[list-item]


# ------------------------------------------------------------ store basics


def test_store_whole_chunks_only_and_cursor_follows() -> None:
    s = OffloadScheduler(layout(GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=2)))
    s.add_request("r", 20, block_hashes=hashes(5))
    s.update_request("r", block_ids=[ids(1, 5)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=20)
    # 20 tokens = 2 whole chunks of 8 tokens; the partial third chunk is never stored.
    assert chunk_indices(plan, 0) == [0, 1]
    assert [c.block_ids for c in plan.groups[0].chunks] == [(1, 2), (3, 4)]
    assert plan.keys == (key(1, 0), key(3, 0))
    assert s.cursor("r", 0) == 0  # nothing moves before the outcome
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 2
    assert not s.plan_store("r", num_computed_tokens=20, num_scheduled_tokens=0)


def test_chunk_is_planned_only_when_computed() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 16, block_hashes=hashes(4))
    s.update_request("r", block_ids=[ids(1, 4)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=9)
    assert chunk_indices(plan, 0) == [0, 1]  # tokens 0..8 computed: chunks 0 and 1 whole
    s.complete_store("r", accept_all(plan))
    plan = s.plan_store("r", num_computed_tokens=9, num_scheduled_tokens=7)
    assert chunk_indices(plan, 0) == [2, 3]


def test_hash_lag_holds_chunk_until_key_exists() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 12)
    s.update_request("r", block_ids=[ids(1, 3)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=12)
    assert not plan  # blocks but no keys yet
    assert s.cursor("r", 0) == 0
    s.update_request("r", block_hashes=hashes(2))
    plan = s.plan_store("r", num_computed_tokens=12)
    assert chunk_indices(plan, 0) == [0, 1]
    s.complete_store("r", accept_all(plan))
    s.update_request("r", block_hashes=hashes(1, start=2))
    plan = s.plan_store("r", num_computed_tokens=12)
    assert chunk_indices(plan, 0) == [2]


def test_offload_prompt_only_and_max_offload_tokens_cap() -> None:
    s = OffloadScheduler(layout(FULL), offload_prompt_only=True)
    s.add_request("r", 8, block_hashes=hashes(4))
    s.update_request("r", block_ids=[ids(1, 4)], num_tokens=16)
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    assert chunk_indices(plan, 0) == [0, 1] and plan.num_offloadable_tokens == 8

    s2 = OffloadScheduler(layout(FULL), offload_prompt_only=False)
    s2.add_request("r", 8, block_hashes=hashes(4), max_offload_tokens=12)
    s2.update_request("r", block_ids=[ids(1, 4)], num_tokens=16)
    plan = s2.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    assert chunk_indices(plan, 0) == [0, 1, 2] and plan.num_offloadable_tokens == 12


def test_finish_offers_final_whole_chunks_but_not_the_last_sampled_token() -> None:
    s = OffloadScheduler(layout(FULL), offload_prompt_only=False)
    s.add_request("r", 6, block_hashes=hashes(1))
    s.update_request("r", block_ids=[ids(1, 3)])
    s.complete_store("r", accept_all(s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=6)))
    # Decode to 12 tokens: the 12th token was sampled, its KV never computed.
    s.update_request("r", block_hashes=hashes(2, start=1), num_tokens=12)
    plan = s.finish_request("r", num_computed_tokens=11)
    assert chunk_indices(plan, 0) == [1]  # chunk 2 holds token 11, which has no KV
    s.complete_store("r", accept_all(plan))
    assert "r" not in s  # dropped after the final outcome

    s.add_request("q", 6, block_hashes=hashes(3))
    s.update_request("q", block_ids=[ids(1, 3)], num_tokens=13)
    plan = s.finish_request("q", num_computed_tokens=12)
    assert chunk_indices(plan, 0) == [0, 1, 2]  # 12 tokens have KV


def test_abort_offers_computed_tokens_only() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 16, block_hashes=hashes(4))
    s.update_request("r", block_ids=[ids(1, 4)])
    plan = s.finish_request("r", num_computed_tokens=9, aborted=True)
    assert chunk_indices(plan, 0) == [0, 1]
    s.complete_store("r", StoreOutcome(refused=frozenset(plan.keys)))
    assert "r" not in s  # no retry after the request ended: its blocks are freed


def test_empty_final_plan_drops_request_at_once() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 3)
    assert not s.finish_request("r", num_computed_tokens=3)
    assert "r" not in s and len(s) == 0
    s.complete_store("r", StoreOutcome())  # stale outcome for a gone request: ignored


def test_plan_store_after_finish_is_an_error() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 8, block_hashes=hashes(2))
    s.update_request("r", block_ids=[ids(1, 2)])
    s.finish_request("r", num_computed_tokens=8)
    with pytest.raises(ValueError, match="finished"):
        s.plan_store("r", num_computed_tokens=8)


# ------------------------------------------------------- the review cases


def test_review_a_null_block_in_middle_of_chunk_is_never_stored() -> None:
    # 4 blocks per chunk; the second block of chunk 0 is null (SWA skip / SSM sparsity).
    sw = GroupSpec(0, "sliding_window", tokens_per_block=4, blocks_per_chunk=4, window_tokens=20)
    s = OffloadScheduler(layout(sw))
    s.add_request("r", 64, block_hashes=hashes(16))
    s.update_request("r", block_ids=[[1, 0, 3, 4, 5, 6, 7, 8]])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=32)
    assert chunk_indices(plan, 0) == [1]  # chunk 0 skipped even though its LAST block is live
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 0  # 16 + (20 - 1) > 32: may still be read, not passed yet

    s.update_request("r", block_ids=[[9, 10, 11, 12, 13, 14, 15, 16]])
    plan = s.plan_store("r", num_computed_tokens=32, num_scheduled_tokens=32)
    assert chunk_indices(plan, 0) == [2, 3]
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 4  # chunk 0 left the window for good: now passed
    # Never stored, so never a hit: lookup of the same prompt cannot start at chunk 0.
    s.add_request("q", 64, block_hashes=hashes(16))
    stored = {key(7, 0), key(11, 0), key(15, 0)}
    look = s.plan_lookup("q", num_computed_tokens=0, is_stored=stored)
    assert look.num_hit_tokens == 48 and key(3, 0) not in look.keys


def test_review_b_refused_store_is_retried_then_stored() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 16, block_hashes=hashes(4))
    s.update_request("r", block_ids=[ids(1, 2)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    assert chunk_indices(plan, 0) == [0, 1]
    s.complete_store("r", StoreOutcome.from_prepare_store(plan, None))  # capacity: all refused
    assert s.cursor("r", 0) == 0

    s.update_request("r", block_ids=[ids(3, 2)])
    plan = s.plan_store("r", num_computed_tokens=8, num_scheduled_tokens=8)
    assert chunk_indices(plan, 0) == [0, 1, 2, 3]  # the refused chunks come back first
    s.complete_store("r", StoreOutcome.from_prepare_store(plan, [key(0, 0), key(2, 0), key(3, 0)]))
    assert s.cursor("r", 0) == 4  # key(1) was "present"
    assert not s.plan_store("r", num_computed_tokens=16)


def test_partial_refusal_keeps_cursor_at_the_refused_chunk() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 16, block_hashes=hashes(4))
    s.update_request("r", block_ids=[ids(1, 4)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    s.complete_store(
        "r",
        StoreOutcome(accepted=frozenset({key(0, 0), key(2, 0), key(3, 0)}), refused=frozenset({key(1, 0)})),
    )
    assert s.cursor("r", 0) == 1
    plan = s.plan_store("r", num_computed_tokens=16)
    assert chunk_indices(plan, 0) == [1]  # accepted chunks are not offered twice
    s.complete_store("r", StoreOutcome())  # unmentioned counts as refused
    assert chunk_indices(s.plan_store("r", num_computed_tokens=16), 0) == [1]


def test_review_c_group_with_nothing_to_store_keeps_its_cursor() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=4)  # 16-token chunks
    sw = GroupSpec(1, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=64)
    s = OffloadScheduler(layout(full, sw))
    s.add_request("r", 32, block_hashes=hashes(8))
    s.update_request("r", block_ids=[ids(1, 3), ids(101, 3)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=12)
    assert chunk_indices(plan, 0) == [] and chunk_indices(plan, 1) == [0, 1, 2]
    s.complete_store("r", accept_all(plan))
    assert (s.cursor("r", 0), s.cursor("r", 1)) == (0, 3)

    s.update_request("r", block_ids=[ids(4, 5), ids(104, 5)])
    plan = s.plan_store("r", num_computed_tokens=12, num_scheduled_tokens=20)
    assert chunk_indices(plan, 0) == [0, 1]  # chunk 0 was not skipped
    assert chunk_indices(plan, 1) == [3, 4, 5, 6, 7]


def test_waiting_null_in_one_group_does_not_block_another() -> None:
    sw = GroupSpec(0, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=12)
    s = OffloadScheduler(layout(FULL.__class__(1, "full", 4), sw))
    s.add_request("r", 32, block_hashes=hashes(8))
    s.update_request("r", block_ids=[ids(1, 4), [0, 0, 13, 14]])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    assert chunk_indices(plan, 0) == [0, 1, 2, 3]
    assert chunk_indices(plan, 1) == [2, 3]
    s.complete_store("r", accept_all(plan))
    # Chunk 0 of the SW group (tokens 0-3) is out of reach at 16 (4 + 12 - 1 <= 16): passed.
    # Chunk 1 (tokens 4-7) could still be read by the window (8 + 12 - 1 > 16): the cursor holds.
    assert s.cursor("r", 1) == 1 and s.cursor("r", 0) == 4
    s.update_request("r", block_ids=[ids(5, 1), [15]])
    s.complete_store("r", accept_all(s.plan_store("r", num_computed_tokens=16, num_scheduled_tokens=4)))
    assert s.cursor("r", 1) == 5


def test_released_blocks_are_never_stored_from_stale_ids() -> None:
    sw = GroupSpec(0, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=8)
    s = OffloadScheduler(layout(sw))
    s.add_request("r", 24, block_hashes=hashes(6))
    s.update_request("r", block_ids=[ids(1, 2)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    s.complete_store("r", StoreOutcome(refused=frozenset(plan.keys)))
    # The engine frees block 0 (left the window) and may hand it to another request.
    s.release_blocks("r", 0, [0])
    s.update_request("r", block_ids=[ids(3, 2)])
    plan = s.plan_store("r", num_computed_tokens=8, num_scheduled_tokens=8)
    assert chunk_indices(plan, 0) == [1, 2, 3]
    assert all(1 not in c.block_ids for c in plan.groups[0].chunks)
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 4  # chunk 0: null and 4 + 8 - 1 <= 16, out of the window for good


def test_mamba_sparse_chunk_with_many_blocks_is_skipped_then_passed() -> None:
    mamba = GroupSpec(0, "mamba", tokens_per_block=4, blocks_per_chunk=2)
    s = OffloadScheduler(layout(mamba))
    s.add_request("r", 32, block_hashes=hashes(8))
    s.update_request("r", block_ids=[[0, 2, 3, 4, 0, 6]])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=24)
    assert chunk_indices(plan, 0) == [1]
    s.complete_store("r", accept_all(plan))
    # Chunk 0 ends at 8, reach 8: 16 <= 24, never storable; chunk 2 (24 + 8 > 24) waits.
    assert s.cursor("r", 0) == 2
    assert s.progress("r")[0].num_waiting == 1
    assert not s.finish_request("r", num_computed_tokens=24)  # over: chunk 2 never whole
    assert "r" not in s


def test_replanning_replaces_the_previous_plan() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 8, block_hashes=hashes(2))
    s.update_request("r", block_ids=[ids(1, 2)])
    first = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    second = s.plan_store("r", num_computed_tokens=8)
    assert first.keys == second.keys
    s.complete_store("r", accept_all(second))
    assert s.cursor("r", 0) == 2


def test_outcome_validation_and_prepare_store_translation() -> None:
    with pytest.raises(ValueError, match="only one"):
        StoreOutcome(accepted=frozenset({b"k"}), refused=frozenset({b"k"}))
    plan = StorePlan("r", 0, ())
    assert StoreOutcome.from_prepare_store(plan, None) == StoreOutcome()


# ---------------------------------------------------------------- preemption


def test_preemption_resets_blocks_and_reconsiders_dead_chunks() -> None:
    sw = GroupSpec(0, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=4)
    s = OffloadScheduler(layout(FULL.__class__(1, "full", 4), sw))
    s.add_request("r", 24, block_hashes=hashes(6))
    s.update_request("r", block_ids=[ids(1, 4), [0, 0, 13, 14]])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    s.complete_store("r", accept_all(plan))
    assert (s.cursor("r", 0), s.cursor("r", 1)) == (4, 4)  # SW chunks 0, 1 never storable
    s.preempt("r")
    assert [p.num_blocks for p in s.progress("r")] == [0, 0]
    assert s.cursor("r", 0) == 4  # stored chunks stay stored
    assert s.cursor("r", 1) == 0  # dead chunks are reconsidered after recompute
    # Recompute in small steps: SW chunks 0 and 1 are whole this time.
    s.update_request("r", block_ids=[ids(21, 2), ids(31, 2)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    assert chunk_indices(plan, 0) == [] and chunk_indices(plan, 1) == [0, 1]
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 1) == 4


def test_a_chunk_passed_as_dead_again_after_a_preemption_is_reconsidered_after_the_next() -> None:
    """Shrunk from the stateful test: a Mamba checkpoint skipped (null blocks) in two runs in a
    row was never offered in the third, where it was whole -- the second pass did not re-arm
    the rewind, since the chunk was still marked dead from the first."""
    mamba = GroupSpec(1, "mamba", tokens_per_block=2, blocks_per_chunk=2)  # 4-token chunks
    s = OffloadScheduler(layout(mamba), offload_prompt_only=False)
    s.add_request("r", 16, block_hashes=hashes(2))
    for run in range(3):
        s.update_request("r", block_ids=[[0, 0, 0, 0, 0, 0]])  # this run skips every checkpoint
        plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=12)
        assert not plan and s.cursor("r", 0) == 2, run  # chunks 0 and 1: out of reach, dead
        s.preempt("r")
        assert s.cursor("r", 0) == 0, run  # reconsidered after every preemption, not only the first
    s.update_request("r", block_ids=[[5, 6, 0, 0, 0, 0]])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=12)
    assert chunk_indices(plan, 0) == [0] and plan.groups[0].chunks[0].block_ids == (5, 6)
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 2  # chunk 1 passed again (null block, out of reach)
    s.preempt("r")
    assert s.cursor("r", 0) == 1  # ... and reconsidered; chunk 0 stays stored


def test_ledger_rewinds_to_every_chunk_passed_as_dead_since_the_last_rewind() -> None:
    """The rule both planners share (OffloadScheduler and the vLLM connector's ledgers)."""
    from tieredkv.planner import ChunkLedger

    led = ChunkLedger()
    for k in range(3):
        led.mark_dead(k)
    led.settle_scan()
    led.candidates(3)
    assert led.cursor == 3
    for _ in range(3):  # each resume reconsiders them, and each pass marks them dead again
        led.rewind_dead()
        assert led.cursor == 0
        assert led.candidates(3) == [0, 1, 2]
        for k in (2, 0, 1):
            led.mark_dead(k)
        assert led.cursor == 3
    led.mark_done(0)
    led.rewind_dead()
    assert led.candidates(3) == [1, 2]  # a done chunk stays done


def test_ledger_marks_a_range_done_as_marking_each_chunk_would() -> None:
    """A loaded hit marks its chunks done in one call (the connector and the planner do it per
    load): the same statuses, waiting list, scan and cursor as one ``mark_done`` per chunk, from
    ledgers holding every mix of unseen, waiting, done and dead chunks."""
    import random

    from tieredkv.planner import ChunkLedger

    rng = random.Random(7)
    for _ in range(400):
        ops = [(rng.choice("wdxc"), rng.randrange(24)) for _ in range(rng.randrange(12))]
        lo = rng.randrange(26)
        hi = rng.randrange(30)
        one, each = ChunkLedger(), ChunkLedger()
        for led in (one, each):
            for op, k in ops:
                if op == "w":
                    led.mark_waiting(k)
                elif op == "d":
                    led.mark_done(k)
                elif op == "x":
                    led.mark_dead(k)
                else:
                    led.candidates(k, 3)
        one.mark_done_range(lo, hi)
        for k in range(lo, hi):
            each.mark_done(k)
        state = [
            (bytes(led.status).rstrip(b"\0"), led.waiting, led.scan, led.cursor, led.first_dead) for led in (one, each)
        ]
        assert state[0] == state[1], (ops, lo, hi)


def test_ledger_scan_moves_over_exactly_the_run_of_done_chunks() -> None:
    """``settle_scan`` measures a run of done chunks with C searches: it stops where the
    chunk-by-chunk rule stops (the first unseen, waiting or dead chunk, or the end), from every
    start, on ledgers holding every mix of statuses."""
    import itertools
    import random

    from tieredkv.planner.ledger import DONE as _DONE
    from tieredkv.planner.ledger import ChunkLedger

    rng = random.Random(11)
    cases = [bytes(c) for n in range(6) for c in itertools.product(range(4), repeat=n)]
    cases += [bytes(rng.choice((0, 1, 2, 2, 2, 3)) for _ in range(rng.randrange(80))) for _ in range(500)]
    cases += [bytes([2] * n) + tail for n in (15, 16, 17, 47, 48, 49, 200) for tail in (b"", b"\x00", b"\x01", b"\x03")]
    for status in cases:
        for start in range(len(status) + 2):
            led = ChunkLedger()
            led.status = bytearray(status)
            led.scan = start
            led.settle_scan()
            k = start
            while k < len(status) and status[k] == _DONE:
                k += 1
            assert led.scan == k, (status, start)


def test_refused_chunk_survives_preemption() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 8, block_hashes=hashes(2))
    s.update_request("r", block_ids=[ids(1, 2)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    s.complete_store("r", StoreOutcome(accepted=frozenset({key(0, 0)}), refused=frozenset({key(1, 0)})))
    s.preempt("r")
    assert not s.plan_store("r", num_computed_tokens=0)  # no blocks: nothing to read
    s.update_request("r", block_ids=[ids(7, 2)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)
    assert [c.block_ids for c in plan.groups[0].chunks] == [(8,)]  # new ids, refused chunk only


# -------------------------------------------------------------------- reset


def test_reset_reoffers_from_zero_and_ignores_stale_outcomes() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 8, block_hashes=hashes(2))
    s.update_request("r", block_ids=[ids(1, 2)])
    s.complete_store("r", accept_all(s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=8)))
    stale = s.plan_store("r", num_computed_tokens=8)
    assert not stale
    s.add_request("done", 4, block_hashes=hashes(1))
    s.update_request("done", block_ids=[[9]])
    assert s.finish_request("done", num_computed_tokens=4)
    s.reset()
    assert "done" not in s  # finished requests are dropped
    assert s.cursor("r", 0) == 0
    plan = s.plan_store("r", num_computed_tokens=8)
    s.reset()
    s.complete_store("r", accept_all(plan))  # made before the reset: ignored
    assert s.cursor("r", 0) == 0
    assert chunk_indices(s.plan_store("r", num_computed_tokens=8), 0) == [0, 1]


# ------------------------------------------------------------------- lookup


def _stored(*pairs: tuple[int, int]) -> set[bytes]:
    return {key(h, g) for h, g in pairs}


def test_lookup_full_prefix_stops_at_first_miss() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 40, block_hashes=hashes(10))
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=_stored((0, 0), (1, 0), (2, 0), (4, 0)))
    assert (look.boundary_tokens, look.num_hit_tokens) == (12, 12)
    assert look.groups[0].keys == (key(0, 0), key(1, 0), key(2, 0))


def test_lookup_last_prompt_token_is_recomputed() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 16, block_hashes=hashes(4))
    everything = {key(i, 0) for i in range(4)}
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=everything)
    assert look.boundary_tokens == 12  # not 16: token 15 must be recomputed


def test_lookup_is_zero_rather_than_partial() -> None:
    big = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=4)  # 16-token chunks
    s = OffloadScheduler(layout(big))
    s.add_request("r", 40, block_hashes=hashes(10))
    stored = {key(3, 0), key(7, 0)}
    assert s.plan_lookup("r", num_computed_tokens=16, is_stored=stored).boundary_tokens == 32
    # Local prefix already at 32: the next whole chunk (48) is beyond token 39 -> 0, not 7 tokens.
    look = s.plan_lookup("r", num_computed_tokens=32, is_stored=stored)
    assert (look.num_hit_tokens, look.boundary_tokens, look.groups) == (0, 32, ())


def test_lookup_sliding_window_needs_window_before_boundary() -> None:
    sw = GroupSpec(1, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=8)
    s = OffloadScheduler(layout(sw))
    s.add_request("r", 41, block_hashes=hashes(10))
    # chunks 2, 3 stored (window of 2 ending at 16) and 5, 6 stored (ending at 28); 7 missing.
    stored = _stored((2, 1), (3, 1), (5, 1), (6, 1), (9, 1))
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=stored)
    assert look.boundary_tokens == 28
    assert look.groups[0].keys == (key(5, 1), key(6, 1))
    assert (look.groups[0].first_chunk, look.groups[0].end_chunk) == (5, 7)


def test_lookup_mamba_needs_chunk_at_boundary() -> None:
    mamba = GroupSpec(2, "mamba", tokens_per_block=8, blocks_per_chunk=1)
    s = OffloadScheduler(layout(mamba))
    s.add_request("r", 40, block_hashes=hashes(10))
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=_stored((3, 2)))
    assert look.boundary_tokens == 16 and look.groups[0].keys == (key(3, 2),)


def test_lookup_iterates_until_groups_agree() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=1)
    mamba = GroupSpec(1, "mamba", tokens_per_block=4, blocks_per_chunk=3)  # 12-token chunks
    sw = GroupSpec(2, "sliding_window", tokens_per_block=8, blocks_per_chunk=1, window_tokens=8)
    s = OffloadScheduler(layout(full, mamba, sw))
    s.add_request("r", 60, block_hashes=hashes(15))
    stored = {key(i, 0) for i in range(11)}  # full prefix covers 44 tokens
    stored |= _stored((8, 1), (5, 1))  # mamba states at 36 and 24
    stored |= _stored((5, 2), (3, 2))  # SW chunks ending at 24 and 16 (not 40)
    calls: list[bytes] = []

    def is_stored(k: bytes) -> bool:
        calls.append(k)
        return k in stored

    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=is_stored)
    # full -> 44; mamba -> 36 (state at 36); SW at 32 needs chunk 3 (h7): missing -> 24;
    # mamba at 24 ok (h5), full ok: all agree on 24.
    assert look.boundary_tokens == 24
    assert len(calls) == len(set(calls))  # each key asked at most once
    for spec, g in zip(s.layout.groups, look.groups):
        assert look.boundary_tokens % spec.tokens_per_chunk == 0
        assert all(k in stored for k in g.keys)


def test_lookup_local_prefix_mid_chunk_and_max_load_tokens() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=4)
    s = OffloadScheduler(layout(full))
    s.add_request("r", 64, block_hashes=hashes(16))
    stored = {key(i, 0) for i in (3, 7, 11)}
    look = s.plan_lookup("r", num_computed_tokens=8, is_stored=stored)
    assert (look.boundary_tokens, look.num_hit_tokens) == (48, 40)
    assert look.groups[0].first_chunk == 0  # chunk 0 is half local, half loaded
    capped = s.plan_lookup("r", num_computed_tokens=8, is_stored=stored, max_load_tokens=30)
    assert capped.boundary_tokens == 32


def test_lookup_without_keys_is_a_miss() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 40)
    assert s.plan_lookup("r", num_computed_tokens=0, is_stored=lambda k: True).num_hit_tokens == 0


# --------------------------------------------------------------------- load


def test_load_plan_start_offset_and_hits_not_restored() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=4)
    s = OffloadScheduler(layout(full))
    s.add_request("r", 64, block_hashes=hashes(16))
    stored = {key(i, 0) for i in (3, 7, 11)}
    look = s.plan_lookup("r", num_computed_tokens=8, is_stored=stored)
    s.update_request("r", block_ids=[ids(1, 12)])
    load = s.plan_load("r", num_computed_tokens=8, num_external_tokens=look.num_hit_tokens)
    g = load.groups[0]
    assert g.keys == (key(3, 0), key(7, 0), key(11, 0))
    assert g.start_offset == 2 and g.block_positions[0] == 2 and g.is_contiguous
    assert g.dst_block_ids == tuple(ids(3, 10))
    assert load.keys == g.keys
    assert s.progress("r")[0].hit_chunks == 3
    # Chunks 0-2 came from the store: not stored again.
    s.update_request("r", block_ids=[ids(13, 4)])
    plan = s.plan_store("r", num_computed_tokens=48, num_scheduled_tokens=16)
    assert chunk_indices(plan, 0) == [3]


def test_load_plan_skips_null_destinations_for_sliding_window() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=2)
    sw = GroupSpec(1, "sliding_window", tokens_per_block=4, blocks_per_chunk=2, window_tokens=12)
    s = OffloadScheduler(layout(full, sw))
    s.add_request("r", 40, block_hashes=hashes(10))
    stored = {key(i, 0) for i in (1, 3, 5, 7)} | {key(i, 1) for i in (3, 5, 7)}
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=stored)
    assert look.boundary_tokens == 32
    assert look.groups[1].keys == (key(5, 1), key(7, 1))  # cdiv(12, 8) = 2 chunks
    # The engine allocates only what the window needs: blocks 0-4 null, 5-7 live.
    s.update_request("r", block_ids=[ids(1, 8), [0, 0, 0, 0, 0, 16, 17, 18]])
    load = s.plan_load("r", num_computed_tokens=0, num_external_tokens=32)
    g = load.groups[1]
    assert g.keys == (key(5, 1), key(7, 1)) and g.chunk_indices == (2, 3)
    assert g.dst_block_ids == (16, 17, 18) and g.start_offset == 1
    assert load.groups[0].dst_block_ids == tuple(ids(1, 8))


def test_load_plan_validates_its_inputs() -> None:
    full = GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=2)
    s = OffloadScheduler(layout(full))
    s.add_request("r", 40, block_hashes=hashes(10))
    s.update_request("r", block_ids=[ids(1, 4)])
    with pytest.raises(ValueError, match="not whole chunks"):
        s.plan_load("r", num_computed_tokens=0, num_external_tokens=12)
    with pytest.raises(ValueError, match="not whole GPU blocks"):
        s.plan_load("r", num_computed_tokens=2, num_external_tokens=14)
    with pytest.raises(ValueError, match="not allocated"):
        s.plan_load("r", num_computed_tokens=0, num_external_tokens=24)
    empty = s.plan_load("r", num_computed_tokens=0, num_external_tokens=0)
    assert empty.keys == () and len(empty.groups) == 1


def test_unknown_request_and_bad_counts() -> None:
    s = OffloadScheduler(layout(FULL))
    with pytest.raises(KeyError, match="unknown request"):
        s.plan_store("nope", num_computed_tokens=0)
    s.add_request("r", 4)
    with pytest.raises(ValueError, match="already tracked"):
        s.add_request("r", 4)
    with pytest.raises(ValueError, match="num_computed_tokens=-1"):
        s.plan_store("r", num_computed_tokens=-1)
    with pytest.raises(ValueError, match="groups"):
        s.update_request("r", block_ids=[[1], [2]])


# ------------------------------------------------------- sliding-window reach


@pytest.mark.parametrize(("window", "needed"), [(17, 1), (32, 2), (33, 2), (48, 3)])
def test_sliding_window_hit_needs_cdiv_window_minus_one_chunks(window: int, needed: int) -> None:
    # The token at the boundary is recomputed and attends to the window - 1 tokens before it:
    # cdiv(window - 1, 16) chunks of 16 tokens, as vLLM's GPU prefix cache.
    full = GroupSpec(0, "full", tokens_per_block=16)
    sw = GroupSpec(1, "sliding_window", tokens_per_block=16, window_tokens=window)
    s = OffloadScheduler(layout(full, sw))
    s.add_request("r", 100, block_hashes=hashes(25))  # 6 whole chunks; token 99 is recomputed
    first = 6 - needed
    stored = {key(4 * k + 3, 0) for k in range(6)} | {key(4 * k + 3, 1) for k in range(first, 6)}
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=stored)
    assert (look.boundary_tokens, look.num_hit_tokens) == (96, 96)  # the full hit
    assert (look.groups[1].first_chunk, look.groups[1].end_chunk) == (first, 6)
    # One chunk fewer is not enough for boundary 96.
    short = s.plan_lookup("r", num_computed_tokens=0, is_stored=stored - {key(4 * first + 3, 1)})
    assert short.boundary_tokens < 96
    # The engine allocates the window of boundary 96: blocks b with (b + 1) * 16 >= 96 - window + 2.
    live = [b for b in range(6) if (b + 1) * 16 >= 96 - window + 2]
    assert live == list(range(first, 6))
    s.update_request("r", block_ids=[ids(1, 6), [100 + b if b in live else 0 for b in range(6)]])
    load = s.plan_load("r", num_computed_tokens=0, num_external_tokens=96)
    g = load.groups[1]
    assert g.chunk_indices == tuple(range(first, 6))  # exactly the chunks needed, not one more
    assert g.keys == tuple(key(4 * k + 3, 1) for k in range(first, 6))
    assert g.dst_block_ids == tuple(100 + b for b in live)


def test_one_token_window_needs_no_chunk_and_keeps_the_hit_on_its_grid() -> None:
    full = GroupSpec(0, "full", tokens_per_block=16)  # 16-token chunks
    sw = GroupSpec(1, "sliding_window", tokens_per_block=16, blocks_per_chunk=2, window_tokens=1)  # 32
    assert sw.window_chunks == 0 and sw.reach_tokens == 0
    s = OffloadScheduler(layout(full, sw))
    s.add_request("r", 90, block_hashes=hashes(22))  # full chunks up to 80, SW chunks up to 64
    stored = {key(4 * k + 3, 0) for k in range(5)}  # nothing of the SW group
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=stored)
    assert look.boundary_tokens == 64  # on the SW group's 32-token grid, nothing loaded from it
    assert look.groups[1].keys == () and (look.groups[1].first_chunk, look.groups[1].end_chunk) == (2, 2)
    s.update_request("r", block_ids=[ids(1, 6), [0, 0, 0, 0, 50, 51]])
    load = s.plan_load("r", num_computed_tokens=0, num_external_tokens=64)
    assert load.groups[1].keys == () and load.groups[1].dst_block_ids == ()
    assert load.groups[0].keys == tuple(key(4 * k + 3, 0) for k in range(4))
    assert s.progress("r")[1].hit_chunks == 2
    # The SW chunks before the boundary are null and out of reach: passed, never offered.
    plan = s.plan_store("r", num_computed_tokens=64, num_scheduled_tokens=26)
    assert chunk_indices(plan, 1) == []
    assert s.cursor("r", 1) == 2


def test_window_chunk_is_passed_exactly_when_no_query_can_read_it() -> None:
    # Window 17: token 15 (the end of chunk 0) is read by the queries 15 .. 31.
    sw = GroupSpec(0, "sliding_window", tokens_per_block=16, window_tokens=17)
    s = OffloadScheduler(layout(sw))
    s.add_request("r", 64, block_hashes=hashes(16))
    s.update_request("r", block_ids=[[0, 2]])
    s.complete_store("r", accept_all(s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=31)))
    assert s.cursor("r", 0) == 0  # the next query (31) may still read chunk 0
    s.update_request("r", block_ids=[[3]])
    s.complete_store("r", accept_all(s.plan_store("r", num_computed_tokens=31, num_scheduled_tokens=1)))
    assert s.cursor("r", 0) == 2  # the next query is 32: chunk 0 has left the window for good


# ------------------------------------------------------ evictions fed back


def test_chunks_evicted_before_a_preemption_are_stored_again() -> None:
    s = OffloadScheduler(layout(FULL))
    s.add_request("r", 28, block_hashes=hashes(7))
    s.update_request("r", block_ids=[ids(1, 7)])
    store: set[bytes] = set()
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=24)
    assert chunk_indices(plan, 0) == [0, 1, 2, 3, 4, 5]
    store |= set(plan.keys)
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 6
    store -= {key(2, 0), key(4, 0)}  # the tier evicts two chunks; the adapter is not told
    s.preempt("r")
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=store)
    assert look.boundary_tokens == 8  # chunks 0, 1; chunk 2 is missing
    assert s.cursor("r", 0) == 2  # the miss is fed back: chunk 2 is storable again
    s.update_request("r", block_ids=[ids(11, 7)])  # the hit is loaded, the rest recomputed
    s.plan_load("r", num_computed_tokens=0, num_external_tokens=8)
    plan = s.plan_store("r", num_computed_tokens=8, num_scheduled_tokens=20)
    # The evicted chunks are offered again; the ones the lookup saw present are not. Chunks
    # past the miss were not confirmed by the lookup: offered too, answered "present".
    assert chunk_indices(plan, 0) == [2, 3, 4, 5, 6]
    assert [c.block_ids for c in plan.groups[0].chunks] == [(13,), (14,), (15,), (16,), (17,)]
    outcome = StoreOutcome(accepted=frozenset(plan.keys) - store, present=frozenset(plan.keys) & store)
    assert outcome.accepted == {key(2, 0), key(4, 0), key(6, 0)}
    s.complete_store("r", outcome)
    assert s.cursor("r", 0) == 7
    assert not s.plan_store("r", num_computed_tokens=28)


def test_window_miss_forgets_only_the_chunk_the_lookup_saw_missing() -> None:
    sw = GroupSpec(0, "sliding_window", tokens_per_block=4, blocks_per_chunk=1, window_tokens=8)  # 2 chunks
    s = OffloadScheduler(layout(sw))
    s.add_request("r", 33, block_hashes=hashes(8))
    s.update_request("r", block_ids=[ids(1, 8)])
    store: set[bytes] = set()
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=32)
    store |= set(plan.keys)
    s.complete_store("r", accept_all(plan))
    store -= {key(7, 0), key(3, 0)}
    s.preempt("r")
    look = s.plan_lookup("r", num_computed_tokens=0, is_stored=store)
    assert look.boundary_tokens == 28  # chunk 7 missing: the window of boundary 28 is chunks 5, 6
    s.update_request("r", block_ids=[ids(21, 8)])
    s.plan_load("r", num_computed_tokens=0, num_external_tokens=28)
    plan = s.plan_store("r", num_computed_tokens=28, num_scheduled_tokens=4)
    assert chunk_indices(plan, 0) == [7]  # chunk 3 was never asked about: still counted stored


# ------------------------------------------------------------ bounded plans


def all_or_nothing(room: int, stored: set[bytes]) -> Callable[[StorePlan], StoreOutcome]:
    """vLLM's prepare_store: the whole plan if its new keys fit in ``room`` chunks, else None."""

    def answer(plan: StorePlan) -> StoreOutcome:
        new = [k for k in plan.keys if k not in stored]
        outcome = StoreOutcome.from_prepare_store(plan, None if len(new) > room else new)
        stored.update(outcome.accepted)
        return outcome

    return answer


def backlog(s: OffloadScheduler, n: int) -> None:
    """A request with ``n`` whole prompt chunks, offered once and refused (store full)."""
    s.add_request("r", 4 * n + 1, block_hashes=hashes(n))
    s.update_request("r", block_ids=[ids(1, n)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=4 * n + 1)
    s.complete_store("r", StoreOutcome.from_prepare_store(plan, None))
    assert s.progress("r")[0].num_waiting == len(plan.keys)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_max_chunks_per_plan_is_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="max_chunks_per_plan"):
        OffloadScheduler(layout(FULL), max_chunks_per_plan=bad)  # type: ignore[arg-type]
    assert OffloadScheduler(layout(FULL), max_chunks_per_plan=None).max_chunks_per_plan is None


def test_plans_offer_the_oldest_waiting_chunks_first_up_to_the_bound() -> None:
    s = OffloadScheduler(layout(FULL), max_chunks_per_plan=4)
    s.add_request("r", 41, block_hashes=hashes(10))
    s.update_request("r", block_ids=[ids(1, 4)])
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=16)
    assert chunk_indices(plan, 0) == [0, 1, 2, 3]
    s.complete_store("r", StoreOutcome(accepted=frozenset({key(1, 0)}), refused=frozenset({key(0, 0), key(3, 0)})))
    s.update_request("r", block_ids=[ids(5, 6)])
    plan = s.plan_store("r", num_computed_tokens=16, num_scheduled_tokens=25)
    assert chunk_indices(plan, 0) == [0, 2, 3, 4]  # the refused (and unmentioned) chunks first
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 5
    assert chunk_indices(s.plan_store("r", num_computed_tokens=41), 0) == [5, 6, 7, 8]


def test_all_or_nothing_store_with_room_for_fewer_chunks_drains_the_backlog() -> None:
    # Room for 10 chunks a step, a backlog of 50: a plan of the whole backlog is refused forever.
    for bound, most_plans in ((10, 5), (None, None), (64, 16)):
        s = OffloadScheduler(layout(FULL), max_chunks_per_plan=bound)
        s.add_request("r", 201, block_hashes=hashes(50))
        s.update_request("r", block_ids=[ids(1, 50)])
        answer = all_or_nothing(10, set())
        plans = 0
        computed = 0
        while s.cursor("r", 0) < 50 and plans < 100:
            plan = s.plan_store("r", num_computed_tokens=computed, num_scheduled_tokens=201 - computed)
            computed = 201
            s.complete_store("r", answer(plan))
            plans += 1
        if most_plans is None:  # unbounded: every plan offers all 50 and is refused
            assert s.cursor("r", 0) == 0 and plans == 100
        else:
            assert s.cursor("r", 0) == 50 and plans <= most_plans, plans


def test_a_refused_plan_halves_the_bound_and_an_accepted_one_doubles_it() -> None:
    s = OffloadScheduler(layout(FULL), max_chunks_per_plan=8)
    backlog(s, 40)  # the first plan (8 chunks) was refused: the bound is 4
    sizes = []
    for answer in (None, None, None, "all", "all", "all", "all"):
        plan = s.plan_store("r", num_computed_tokens=161)
        sizes.append(len(plan.keys))
        s.complete_store("r", accept_all(plan) if answer else StoreOutcome(refused=frozenset(plan.keys)))
    assert sizes == [4, 2, 1, 1, 2, 4, 8]
    s.reset()  # a new store: the bound starts over
    assert len(s.plan_store("r", num_computed_tokens=161).keys) == 8


def test_the_bound_is_shared_by_the_groups_and_every_group_progresses() -> None:
    groups = [GroupSpec(i, "full", tokens_per_block=4) for i in range(3)]
    s = OffloadScheduler(layout(*groups), max_chunks_per_plan=2)
    s.add_request("r", 40, block_hashes=hashes(10))
    s.update_request("r", block_ids=[ids(1, 10), ids(11, 10), ids(21, 10)])
    seen = []
    for _ in range(15):
        plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=40)
        assert len(plan.keys) <= 2
        seen.append([len(g.chunks) for g in plan.groups])
        s.complete_store("r", accept_all(plan))
    assert [s.cursor("r", p) for p in range(3)] == [10, 10, 10]
    assert all(sum(x) == 2 for x in seen)  # a group with nothing left hands its share on
    # Rotation: with 2 chunks for 3 groups every group is planned within the first two plans.
    assert all(seen[0][p] + seen[1][p] > 0 for p in range(3))


def test_a_group_with_nothing_to_offer_leaves_its_share_to_the_others() -> None:
    sw = GroupSpec(1, "sliding_window", tokens_per_block=4, window_tokens=9)
    s = OffloadScheduler(layout(FULL, sw), max_chunks_per_plan=6)
    s.add_request("r", 40, block_hashes=hashes(10))
    s.update_request("r", block_ids=[ids(1, 10), []])  # no SW blocks yet
    plan = s.plan_store("r", num_computed_tokens=0, num_scheduled_tokens=40)
    assert chunk_indices(plan, 0) == [0, 1, 2, 3, 4, 5] and chunk_indices(plan, 1) == []


def test_per_plan_work_does_not_grow_with_the_backlog() -> None:
    s = OffloadScheduler(layout(FULL), max_chunks_per_plan=64)
    backlog(s, 1000)
    plan = s.plan_store("r", num_computed_tokens=4001)
    assert len(plan.keys) == 32  # the first (64-chunk) plan was refused whole: bound halved
    assert s.progress("r")[0].num_waiting == 64  # 936 chunks were never visited yet
    s.complete_store("r", accept_all(plan))
    assert s.cursor("r", 0) == 32


def test_bounded_final_plans_offer_every_chunk_once_then_drop_the_request() -> None:
    s = OffloadScheduler(layout(FULL), max_chunks_per_plan=3)
    s.add_request("r", 32, block_hashes=hashes(8))
    s.update_request("r", block_ids=[ids(1, 8)])
    plan = s.finish_request("r", num_computed_tokens=32)
    assert chunk_indices(plan, 0) == [0, 1, 2]
    assert s.finished_requests() == ("r",)
    s.complete_store("r", StoreOutcome(accepted=frozenset({key(0, 0)}), refused=frozenset({key(1, 0)})))
    assert "r" in s and s.finished_requests() == ("r",)  # chunks 3-7 were never offered
    with pytest.raises(ValueError, match="finished"):
        s.plan_store("r", num_computed_tokens=32)
    offered = [0, 1, 2]
    while "r" in s:
        plan = s.plan_finished("r")
        offered += chunk_indices(plan, 0)
        s.complete_store("r", accept_all(plan))
    assert offered == list(range(8))  # each once: refused chunk 1 is not offered again
    assert s.finished_requests() == ()
    s.add_request("q", 8)
    with pytest.raises(ValueError, match="not finished"):
        s.plan_finished("q")


def test_a_final_plan_is_never_empty_while_chunks_are_left() -> None:
    # The bound is spent on chunks that are never storable (null blocks): the adapter plans on.
    mamba = GroupSpec(0, "mamba", tokens_per_block=4)
    s = OffloadScheduler(layout(mamba), max_chunks_per_plan=2)
    s.add_request("r", 24, block_hashes=hashes(6))
    s.update_request("r", block_ids=[[0, 0, 0, 0, 5, 6]])
    plan = s.finish_request("r", num_computed_tokens=24)
    assert chunk_indices(plan, 0) == [4, 5]
    s.complete_store("r", accept_all(plan))
    assert "r" not in s
    s.add_request("q", 24, block_hashes=hashes(6))
    s.update_request("q", block_ids=[[0] * 6])
    assert not s.finish_request("q", num_computed_tokens=24) and "q" not in s


def test_a_long_run_of_never_storable_chunks_does_not_use_up_the_bound() -> None:
    # A 100-chunk hit: the window group's chunks before the window are null. With a bound of 4
    # the first plan must still offer the new chunks (else they may leave the window unoffered).
    sw = GroupSpec(1, "sliding_window", tokens_per_block=4, window_tokens=8)  # 2 chunks of 4
    s = OffloadScheduler(layout(FULL, sw), max_chunks_per_plan=4)
    s.add_request("r", 420, block_hashes=hashes(105))
    stored = {key(i, 0) for i in range(100)} | {key(98, 1), key(99, 1)}
    assert s.plan_lookup("r", num_computed_tokens=0, is_stored=stored).boundary_tokens == 400
    s.update_request("r", block_ids=[ids(1, 100), [0] * 98 + [201, 202]])
    s.plan_load("r", num_computed_tokens=0, num_external_tokens=400)
    s.update_request("r", block_ids=[ids(101, 2), [203, 204]])
    plan = s.plan_store("r", num_computed_tokens=400, num_scheduled_tokens=8)
    assert chunk_indices(plan, 0) == [100, 101] and chunk_indices(plan, 1) == [100, 101]
    assert s.cursor("r", 1) == 100  # the 98 null chunks are passed as never storable

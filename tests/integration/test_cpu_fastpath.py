"""The CPU tier's fast path: no checksum pass in process, one copy per run of back-to-back slots.

Bytes written into the slab by this process are served without a checksum pass; a record's
header is sealed (checksum computed over the slot's bytes) when it leaves the process, and a
write-back record is checksummed by the tier it lands in. These tests pin that the fast path
is byte-exact whatever the slot layout, and that every record leaving the process verifies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.integration.test_pipeline import NS, cpu, lmdb, make, wait_results, wait_until
from tieredkv.config import PolicyRule
from tieredkv.errors import CorruptRecordError
from tieredkv.format import HEADER_SIZE, verify_record
from tieredkv.pipeline import ChunkRef, KeyState, LoadJob, StoreJob

BLOCK = 4096


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def key(i: int) -> bytes:
    return NS.key(i.to_bytes(32, "big"), 0)


def test_fragmented_slots_and_scattered_blocks_load_byte_exact(tmp_path: Path) -> None:
    """Slots not back to back (freed ones reused), block ids with gaps and reversed runs, a
    null placeholder: every chunk still lands exactly where it belongs."""
    src, dst = blocks(80, 1), torch.zeros(100, BLOCK, dtype=torch.uint8)
    top = cpu()
    with make([top, lmdb(tmp_path)], [PolicyRule(tiers=["cpu"])]) as p:
        p.register_group(0, [src], blocks_per_chunk=2)
        p.register_group(1, [dst], blocks_per_chunk=2)
        first = tuple(ChunkRef(key(i), (1 + 2 * i, 2 + 2 * i)) for i in range(8))
        assert p.submit_store(StoreJob(1, 0, first))
        assert wait_results(p, 1)[1].ok
        assert p.run(top.delete_many([key(i) for i in (1, 4, 5)]), 30) == 3  # holes in the slab
        # a job mixing consecutive blocks, a gap inside a chunk and a reversed chunk
        ids = [(20, 21), (22, 23), (30, 32), (41, 40), (50, 51), (52, 53)]
        second = tuple(ChunkRef(key(100 + i), b) for i, b in enumerate(ids))
        assert p.submit_store(StoreJob(2, 0, second))
        assert wait_results(p, 1)[2].ok
        keep = [c for i, c in enumerate(first) if i not in (1, 4, 5)]
        loads = tuple(ChunkRef(c.key, (60 + 2 * j, 61 + 2 * j)) for j, c in enumerate(keep + list(second)))
        assert p.submit_load(LoadJob(3, 1, loads))
        res = wait_results(p, 1)[3]
        assert res.ok and res.tiers == {"cpu": len(loads)}
        expect = [blk for c in keep + list(second) for blk in c.block_ids]
        assert torch.equal(dst[60 : 60 + len(expect)], src[expect])
        # a load with a null placeholder (block 0, the group's null block) skips that position only
        dst2 = torch.zeros(80, BLOCK, dtype=torch.uint8)
        p.register_group(2, [dst2], blocks_per_chunk=2, null_block=0)
        assert p.submit_load(LoadJob(4, 2, (ChunkRef(second[0].key, (0, 5)), ChunkRef(second[1].key, (6, 7)))))
        assert wait_results(p, 1)[4].ok
        assert torch.equal(dst2[5:8], src[21:24]) and not dst2[0].any()
        assert not any(top.is_pinned(c.key) for c in loads)


def test_a_load_of_slot_hits_only_copies_each_chunk_as_it_is_placed(tmp_path: Path) -> None:
    """Every chunk a hit in the slot tier (copied straight from the slots, a run per call):
    whole chunks at scattered ids land byte-exact; a first chunk cut short by ``skip_blocks``,
    or one holding the null block, copies only the blocks it lists. Every slot goes back."""
    src = blocks(40, 4)
    top = cpu()
    with make([top, lmdb(tmp_path)], [PolicyRule(tiers=["cpu"])]) as p:
        p.register_group(0, [src], blocks_per_chunk=2)
        cs = tuple(ChunkRef(key(200 + i), (1 + 2 * i, 2 + 2 * i)) for i in range(6))
        assert p.submit_store(StoreJob(1, 0, cs))
        assert wait_results(p, 1)[1].ok
        dst = torch.zeros(40, BLOCK, dtype=torch.uint8)
        p.register_group(1, [dst], blocks_per_chunk=2, null_block=0)
        scattered = [(31, 7), (12, 13), (25, 3), (9, 38), (20, 21), (33, 16)]
        assert p.submit_load(LoadJob(2, 1, tuple(ChunkRef(c.key, b) for c, b in zip(cs, scattered))))
        res = wait_results(p, 1)[2]
        assert res.ok and res.tiers == {"cpu": 6}
        flat = [b for ids in scattered for b in ids]
        assert torch.equal(dst[flat], src[1:13])
        assert not dst[0].any() and not dst[[i for i in range(40) if i not in flat]].any()
        dst.zero_()
        short = LoadJob(3, 1, (ChunkRef(cs[0].key, (5,)), ChunkRef(cs[1].key, (6, 7))), skip_blocks=1)
        assert p.submit_load(short)
        assert wait_results(p, 1)[3].ok
        assert torch.equal(dst[5:8], src[2:5]) and not dst[:5].any() and not dst[8:].any()
        dst.zero_()
        assert p.submit_load(LoadJob(4, 1, (ChunkRef(cs[2].key, (0, 9)), ChunkRef(cs[3].key, (10, 11)))))
        assert wait_results(p, 1)[4].ok
        assert torch.equal(dst[9:12], src[6:9]) and not dst[0].any() and not dst[12:].any()
        assert not any(top.is_pinned(c.key) for c in cs)
        assert p.run(top.stats(), 30).extra["lent_slots"] == 0


def test_multi_tensor_group_round_trips_through_slots(tmp_path: Path) -> None:
    """A group of several tensors (per-layer KV): chunks do not concatenate, runs stay per chunk."""
    src = [blocks(24, 2), blocks(24, 3)]
    dst = [torch.zeros(24, BLOCK, dtype=torch.uint8) for _ in range(2)]
    with make([cpu(), lmdb(tmp_path)], [PolicyRule(tiers=["cpu"])]) as p:
        p.register_group(0, src, blocks_per_chunk=2)
        p.register_group(1, dst, blocks_per_chunk=2)
        cs = tuple(ChunkRef(key(i), (2 * i, 2 * i + 1)) for i in range(6))
        assert p.submit_store(StoreJob(1, 0, cs))
        assert wait_results(p, 1)[1].ok
        assert p.submit_load(LoadJob(2, 1, tuple(ChunkRef(c.key, tuple(b + 12 for b in c.block_ids)) for c in cs)))
        assert wait_results(p, 1)[2].ok
        for s, d in zip(src, dst):
            assert torch.equal(d[12:24], s[0:12])


def test_a_job_moves_in_one_call_per_tensor_wherever_its_slots_lie(tmp_path: Path, monkeypatch: Any) -> None:
    """Once deletes and evictions have churned the slab, a job's slots no longer lie back to back
    (the free list hands them out in reverse): its store and its all-hit load still move with one
    C call per tensor (a call per chunk cost ~17 µs of the loop's time each), byte-exact, for a
    group of two tensors with blocks of different sizes."""
    from tieredkv import staging

    calls: list[int] = []
    real = staging._move_pieces_async
    assert real is not None, "the C helper is built by the test command"

    def counted(*a: Any) -> Any:
        calls.append(len(a[1]))
        return real(*a)

    monkeypatch.setattr(staging, "_move_pieces_async", counted)
    src = [blocks(64, 5), torch.randint(0, 256, (64, 1024), dtype=torch.uint8)]
    dst = [torch.zeros(64, BLOCK, dtype=torch.uint8), torch.zeros(64, 1024, dtype=torch.uint8)]
    top = cpu()
    with make([top, lmdb(tmp_path)], [PolicyRule(tiers=["cpu"])]) as p:
        p.register_group(0, src, blocks_per_chunk=2)
        p.register_group(1, dst, blocks_per_chunk=2)
        warm = tuple(ChunkRef(key(300 + i), (1 + 2 * i, 2 + 2 * i)) for i in range(10))
        assert p.submit_store(StoreJob(1, 0, warm))
        assert wait_results(p, 1)[1].ok
        assert p.run(top.delete_many([c.key for c in warm]), 30) == 10  # the churn
        ids = [(40, 3), (17, 18), (61, 9), (30, 29), (55, 12), (7, 44)]
        cs = tuple(ChunkRef(key(400 + i), b) for i, b in enumerate(ids))
        calls.clear()
        assert p.submit_store(StoreJob(2, 0, cs))
        assert wait_results(p, 1)[2].ok
        assert calls == [12, 12], "one call per tensor, a piece per block"
        slots = [top._index[c.key] for c in cs]
        assert all(top.span_view(slots[i : i + 2]) is None for i in range(len(cs) - 1)), "slots lay back to back"
        back = [(33, 34), (2, 50), (11, 10), (63, 26), (45, 46), (8, 19)]
        calls.clear()
        assert p.submit_load(LoadJob(3, 1, tuple(ChunkRef(c.key, b) for c, b in zip(cs, back))))
        res = wait_results(p, 1)[3]
        assert res.ok and res.tiers == {"cpu": len(cs)}
        assert calls == [12, 12]
        want = [blk for b in ids for blk in b]
        got = [blk for b in back for blk in b]
        for s, d in zip(src, dst):
            assert torch.equal(d[got], s[want])
        assert not any(top.is_pinned(c.key) for c in cs)


def test_records_leaving_the_process_carry_a_checksum_that_verifies(tmp_path: Path) -> None:
    """Write-back: the CPU slab evicts into LMDB, whose records verify against their checksum and
    hold the stored bytes; a damaged LMDB record is a miss. A CPU record exported raw (migrate)
    is sealed on the way out and verifies too."""
    src = blocks(40, 4)
    chunk = 2 * BLOCK
    top, low = cpu(capacity_bytes=4 * chunk, segment_bytes=chunk), lmdb(tmp_path)
    with make([top, low], [PolicyRule(tiers=["cpu", "lmdb"], write="back")]) as p:
        p.register_group(0, [src], blocks_per_chunk=2)
        cs = tuple(ChunkRef(key(i), (2 * i, 2 * i + 1)) for i in range(8))
        for i, c in enumerate(cs):
            assert p.submit_store(StoreJob(i, 0, (c,)))
            assert wait_results(p, 1)[i].ok
        assert p.drain(120)
        wait_until(lambda: not any(p.is_pending(c.key) for c in cs), "write-backs still pending")
        demoted = [c for c, (s, t) in zip(cs, p.lookup([c.key for c in cs])) if s is KeyState.HIT and t == "lmdb"]
        assert len(demoted) == 4
        recs = p.run(low.raw_get_many([c.key for c in demoted]), 30)
        for c, rec in zip(demoted, recs):
            assert rec is not None
            assert bytes(verify_record(rec, c.key)) == src[list(c.block_ids)].numpy().tobytes()
        # the CPU tier's own records, exported raw, are sealed with a checksum over their bytes
        kept = [c for c in cs if c not in demoted]
        for c, rec in zip(kept, p.run(top.raw_get_many([c.key for c in kept]), 30)):
            assert rec is not None
            assert bytes(verify_record(rec, c.key)) == src[list(c.block_ids)].numpy().tobytes()
            bad = bytearray(rec)
            bad[HEADER_SIZE + 3] ^= 0x01
            try:
                verify_record(bytes(bad), c.key)
            except CorruptRecordError:
                pass
            else:
                raise AssertionError("a damaged exported record verified")
        # a damaged write-back record in LMDB is a miss, never bytes
        bad = bytearray(recs[0])
        bad[HEADER_SIZE + 11] ^= 0x40
        p.run(low.raw_put_many([(demoted[0].key, bytes(bad))]), 30)
        dst = torch.zeros(40, BLOCK, dtype=torch.uint8)
        p.register_group(1, [dst], blocks_per_chunk=2)
        assert p.submit_load(LoadJob(100, 1, (ChunkRef(demoted[0].key, (30, 31)),)))
        assert not wait_results(p, 1)[100].ok
        assert not dst[30:32].any()
        assert low.counters["corrupt"] == 1

"""The fs tier's shared usage ledger: a recount holds it (exact; a store that waits too long is
refused, never hung), a damaged ledger rebuilt from the directory, and drift from a writer that
died after its reservation given back."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.drills._util import payload, skey
from tieredkv.backends.fs import FSTier, FSTierConfig
from tieredkv.backends.fs.layout import Layout
from tieredkv.backends.fs.ledger import LedgerState, acquire, release
from tieredkv.errors import TierTimeoutError

KiB = 1024


def tier(path: Path, **kw: Any) -> FSTier:
    return FSTier(FSTierConfig(path=str(path), **{"size_cap_bytes": "64MiB", **kw}))


def on_disk(path: Path) -> tuple[int, int]:
    found = Layout(str(path)).walk()
    return sum(st.st_size for _, _, st in found), len(found)


def hold_walks(t: FSTier) -> tuple[threading.Event, threading.Event]:
    """Hold ``t``'s directory walks once listed: the first event is set when a walk has its
    listing, which it returns once the test sets the second."""
    listed, go_on = threading.Event(), threading.Event()
    real = t.layout.walk

    def held(*a: Any) -> Any:
        got = real(*a)
        listed.set()
        assert go_on.wait(60), "the test never let the walk finish"
        return got

    t.layout.walk = held  # type: ignore[method-assign]
    return listed, go_on


def ledger(path: Path) -> LedgerState:
    led = acquire(Layout(str(path)).ledger)
    try:
        st = led.read()
    finally:
        release(led)
    assert st is not None
    return st


def test_a_recount_holds_the_ledger_and_a_store_that_waits_too_long_is_refused(tmp_path: Path) -> None:
    """A recount holds the ledger through its walk (exact counts): another writer's store waits,
    and past its ``lock_timeout_s`` is refused (counted ``ledger_busy``); once the walk is done
    stores go on, and the ledger holds exactly what the directory does."""
    d = tmp_path / "d"

    async def run() -> None:
        async with tier(d, lock_timeout_s=0.2) as writer:
            await writer.put_many([(skey(i), payload(i, 1, 32 * KiB)) for i in range(8)])
            async with tier(d) as walker:
                while (await walker.stats()).extra["records_known_here"] < 8:  # its listing at open is done
                    await asyncio.sleep(0.01)
                in_walk, go_on = hold_walks(walker)
                recount = asyncio.ensure_future(walker.reconcile())
                assert await asyncio.to_thread(in_walk.wait, 60)
                with pytest.raises(TierTimeoutError, match="usage ledger"):
                    await writer.put_many([(skey(100), payload(100, 1, 32 * KiB))])
                assert writer.counters["ledger_busy"] == 1
                assert await writer.get_many([skey(0)]) == [payload(0, 1, 32 * KiB)]  # reads go on
                go_on.set()
                assert await recount == 8 * (32 * KiB + 64)
                await writer.put_many([(skey(100), payload(100, 1, 32 * KiB))])
        st = ledger(d)
        assert (st.used, st.records) == on_disk(d) == (9 * (32 * KiB + 64), 9)

    asyncio.run(run())


def test_a_damaged_ledger_is_rebuilt_from_the_directory(tmp_path: Path) -> None:
    d = tmp_path / "d"

    async def seed() -> None:
        async with tier(d) as t:
            await t.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(5)])

    asyncio.run(seed())
    with open(Layout(str(d)).ledger, "r+b") as f:
        f.write(b"\xff" * 20)

    async def again() -> None:
        async with tier(d) as t:
            await t.put_many([(skey(9), payload(9, 1, 10 * KiB))])
            assert t.counters["recounts"] >= 1

    asyncio.run(again())
    st = ledger(d)
    assert (st.used, st.records) == on_disk(d)


def test_a_reservation_left_by_a_dead_writer_is_given_back_by_a_recount(tmp_path: Path) -> None:
    """A writer that dies between its reservation and its rename leaves the ledger counting bytes
    that are not there; the cap then holds with room to spare, until a store finds nothing left
    to evict and recounts."""
    d = tmp_path / "d"
    cap = 256 * KiB

    async def run() -> None:
        async with tier(d, size_cap_bytes=cap) as t:
            await t.put_many([(skey(1), payload(1, 1, 60 * KiB))])
            led = acquire(Layout(str(d)).ledger)
            try:
                with led.locked(5):
                    st = led.read()
                    assert st is not None
                    led.write(LedgerState(st.used + 150 * KiB, st.records + 2, st.reconciled_at))  # the ghost
            finally:
                release(led)
            await t.delete_many([skey(1)])
            # 200 KiB fit the cap; the ghost says they do not and the index has nothing to evict
            await t.put_many([(skey(2), payload(2, 1, 100 * KiB)), (skey(3), payload(3, 1, 100 * KiB))])
            assert t.counters["recounts"] >= 1

    asyncio.run(run())
    st = ledger(d)
    assert (st.used, st.records) == on_disk(d)
    assert os.listdir(Layout(str(d)).tmp) == []


def test_a_record_seen_both_as_its_temporary_file_and_in_place_is_counted_once(tmp_path: Path) -> None:
    """A recount lists tmp/ before ns/: a record renamed into place between the two is seen twice,
    as the file it was and where it is now; the temporary file's name carries the key's tag, so
    the record counts once (before the tag, a recount under load counted 43 records for 29)."""
    d = tmp_path / "d"

    async def run() -> None:
        async with tier(d) as t:
            await t.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(3)])
            size = 10 * KiB + 64
            # what a recount sees mid-rename: skey(1)'s record both in tmp/ (a live writer's file:
            # this process) and in place
            seen_twice = t._next_temp(size, skey(1))
            Path(seen_twice).write_bytes(b"\0" * size)
            assert await t.reconcile() == 3 * size
            st = ledger(d)
            assert (st.used, st.records) == (3 * size, 3)
            os.unlink(seen_twice)

    asyncio.run(run())


def _order(t: FSTier) -> list[bytes]:
    """This process's eviction order (first = evicted first)."""
    with t._index_lock:
        return list(t._policy.victims())


def test_a_record_counted_as_in_the_making_stays_in_the_eviction_index(tmp_path: Path) -> None:
    """A record renamed into place while a recount walks is counted once, as its temporary file;
    it is still a record this process can evict. (Before, the recount left it out of the index it
    rebuilt: a record nothing here would ever evict, while newer ones went in its place.)"""
    d = tmp_path / "d"
    size = 10 * KiB + 64

    async def run() -> None:
        async with tier(d, size_cap_bytes=4 * size) as t:
            await t.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(3)])
            seen_twice = t._next_temp(size, skey(0))  # skey(0) mid-rename, as in the test above
            Path(seen_twice).write_bytes(b"\0" * size)
            await t.reconcile()
            os.unlink(seen_twice)
            assert _order(t) == [skey(0), skey(1), skey(2)]
            await t.put_many([(skey(3), payload(3, 1, 10 * KiB))])
            await t.put_many([(skey(4), payload(4, 1, 10 * KiB))])  # room for it: the oldest goes
            assert await t.contains_many([skey(i) for i in range(5)]) == [False, True, True, True, True]

    asyncio.run(run())


def test_a_store_that_lands_during_a_recount_walk_stays_in_the_eviction_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store reserved before a recount took the ledger renames its record while the walk is
    held open, after its directory was listed: the recount's listing lacks it, the index this
    process keeps does not lose it, and it keeps its place (newest)."""
    import tieredkv.backends.fs.tier as fs_tier

    d = tmp_path / "d"
    real_write = fs_tier.write_slice
    at_write, write_on = threading.Event(), threading.Event()

    def gated_write(todo: Any, *a: Any) -> Any:
        at_write.set()
        assert write_on.wait(60), "the test never let the store go on"
        return real_write(todo, *a)

    async def run() -> None:
        async with tier(d) as t:
            await t.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(3)])
            while (await t.stats()).extra["records_known_here"] < 3:
                await asyncio.sleep(0.01)
            monkeypatch.setattr(fs_tier, "write_slice", gated_write)
            store = asyncio.ensure_future(t.put_many([(skey(3), payload(3, 1, 10 * KiB))]))
            assert await asyncio.to_thread(at_write.wait, 60)  # reserved, its temporary file made
            in_walk, walk_on = hold_walks(t)
            recount = asyncio.ensure_future(t.reconcile())
            assert await asyncio.to_thread(in_walk.wait, 60)
            write_on.set()
            await store  # renamed into place and known here, the listing already taken
            walk_on.set()
            await recount
            assert _order(t) == [skey(0), skey(1), skey(2), skey(3)]
        st = ledger(d)
        assert (st.used, st.records) == on_disk(d) == (4 * (10 * KiB + 64), 4)

    asyncio.run(run())


def test_a_recount_keeps_what_this_process_read_since_the_last_touch(tmp_path: Path) -> None:
    """A read within ``touch_interval_s`` of a record's last touch does not set its atime (noatime,
    relatime); this process's index saw the read. A recount orders by the later of the two, so
    the record read last here is still evicted last."""
    d = tmp_path / "d"

    async def run() -> None:
        async with tier(d, touch_interval_s=3600) as t:
            await t.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(4)])
            for i in (0, 1, 2, 3, 0):  # skey(0) read last: relatime moved its atime once at most
                assert await t.get_many([skey(i)]) == [payload(i, 1, 10 * KiB)]
            assert _order(t) == [skey(1), skey(2), skey(3), skey(0)]
            await t.reconcile()
            assert _order(t) == [skey(1), skey(2), skey(3), skey(0)]

    asyncio.run(run())


def test_records_listed_at_open_are_older_than_what_this_process_stores_meanwhile(tmp_path: Path) -> None:
    """A process lists the directory after open (on an I/O thread) while its stores already go
    on: what another node wrote before is older than those stores, and is evicted first. (Before,
    the listing went to the back of the index: this process's own new records went first.)"""
    d = tmp_path / "d"

    async def run() -> None:
        async with tier(d) as other:
            await other.put_many([(skey(i), payload(i, 1, 10 * KiB)) for i in range(3)])
        late = tier(d)
        in_walk, walk_on = hold_walks(late)
        async with late:
            assert await asyncio.to_thread(in_walk.wait, 60)  # the listing at open, held
            await late.put_many([(skey(3), payload(3, 1, 10 * KiB))])
            walk_on.set()
            while (await late.stats()).extra["records_known_here"] < 4:
                await asyncio.sleep(0.01)
            assert _order(late) == [skey(0), skey(1), skey(2), skey(3)]

    asyncio.run(run())

"""Drills: one LMDB directory shared by several processes (two engines, or an engine plus
``tieredkv verify/migrate/evict``).

Every other process is a real one (``python -c`` snippets). Processes move in lockstep over their
stdin/stdout pipes — a command line, an answer line — with bounded waits; nothing sleeps for
timing. Each drill prints its figures (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.lmdb.env import REGISTRY
from tieredkv.config import LMDBTierConfig
from tieredkv.errors import ConfigError
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload

REPO = str(Path(__file__).resolve().parents[2])
NS = Namespace(model="multiprocess")
KiB, MiB = 1024, 1024 * 1024
WAIT_S = 120.0  # bound on any one answer from a child (a loaded 2-core box is slow, never stuck)

PRELUDE = """
import asyncio, fcntl, os, sys
import lmdb
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import LMDBTierConfig
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload
NS = Namespace(model="multiprocess")
KiB, MiB = 1024, 1024 * 1024
def k(i): return NS.key(i.to_bytes(32, "big"), 0)
def say(*a): print(*a, flush=True)
def order():
    line = sys.stdin.readline()
    if not line:
        sys.exit(3)
    return line.split()
"""


def k(i: int) -> bytes:
    return NS.key(i.to_bytes(32, "big"), 0)


class Child:
    """A ``python -c`` process: ``send`` a line to its stdin, ``expect`` a line it prints."""

    def __init__(self, code: str) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close(), after the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
            cwd=REPO,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def expect(self, word: str, timeout: float = WAIT_S) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.kill()
                pytest.fail(f"no {word!r} from the child within {timeout}s; stderr:\n{self._stderr()}")
            if line is None:
                self.proc.wait(timeout=WAIT_S)
                pytest.fail(f"child exited ({self.proc.returncode}) before {word!r}; stderr:\n{self._stderr()}")
            parts = line.split()
            if parts and parts[0] == word:
                return parts[1:]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        self.send("quit")
        rc = self.proc.wait(timeout=WAIT_S)
        assert rc == 0, f"child failed ({rc}):\n{self._stderr()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for c in started:
        c.kill()


def cfg(path: Path, **kw: object) -> LMDBTierConfig:
    return LMDBTierConfig(**{"path": str(path), **kw})


# ---- 1: another process grows the map under a reader ---------------------------------------

WRITER_GROWS = """
async def main():
    cfg = LMDBTierConfig(path=sys.argv[1], map_size_bytes=1 * MiB, size_cap_bytes=900 * KiB,
                         max_map_size_bytes=64 * MiB)
    async with LMDBTier(cfg) as tier:
        say("open")
        while (cmd := order())[0] == "put":
            r = int(cmd[1])
            await tier.put_many([(k(j), payload(4097, j)) for j in range(r * 20, r * 20 + 20)])
            st = await tier.stats()
            say("put", r, st.extra["map_size"], tier.counters["map_growths"])
asyncio.run(main())
"""


async def test_reader_keeps_reading_while_another_process_grows_the_map(tmp_path: Path, children: list[Child]) -> None:
    """B opens with a 1 MiB map; A (another process) writes until it has grown the map past it.
    B's reads, contains and probes adopt the grown map and keep answering right (before: every
    read of B failed with MDB_MAP_RESIZED until B restarted)."""
    rounds = 12
    async with LMDBTier(
        cfg(tmp_path, map_size_bytes=1 * MiB, size_cap_bytes=900 * KiB, max_map_size_bytes=64 * MiB)
    ) as b:
        a = Child(WRITER_GROWS.replace("sys.argv[1]", repr(str(tmp_path))))
        children.append(a)
        a.expect("open")
        reads = read_bytes = probes_answered = 0
        a_map = growths = 0
        for r in range(rounds):
            a.send(f"put {r}")
            _, a_map_s, growths_s = a.expect("put")
            a_map, growths = int(a_map_s), int(growths_s)
            batch = [k(j) for j in range(r * 20, r * 20 + 20)]
            got = await b.get_many(batch)
            want = [payload(4097, j).numpy().tobytes() for j in range(r * 20, r * 20 + 20)]
            assert got == want, f"round {r}: B read {sum(g == w for g, w in zip(got, want))}/20 right"
            assert await b.contains_many(batch) == [True] * 20
            reads += len(batch)
            read_bytes += sum(len(g) for g in got if g is not None)
            answer = b.probe(batch)
            if answer is not None:
                assert answer == [True] * 20
                probes_answered += 1
        a.finish()
        st = await b.stats()
        print(
            f"\n[drill 1] A grew the map {growths}x to {a_map} B; B (opened at {1 * MiB} B) read {reads} records"
            f" ({read_bytes} B) in {rounds} rounds, adopted the map {b.counters['map_adoptions']}x (now"
            f" {st.extra['map_size']} B), {probes_answered}/{rounds} probes answered"
        )
        assert growths >= 1 and a_map > 1 * MiB
        assert b.counters["map_adoptions"] >= 1 and st.extra["map_size"] > 1 * MiB
        assert probes_answered >= rounds // 2


# ---- 2: two writers, one cap ------------------------------------------------------------------

WRITER = """
async def main():
    base, cap = int(sys.argv[2]), int(sys.argv[3])
    cfg = LMDBTierConfig(path=sys.argv[1], map_size_bytes=8 * cap, size_cap_bytes=cap, max_map_size_bytes=16 * cap,
                         file_batch_bytes=FILE_BATCH)
    async with LMDBTier(cfg) as tier:
        say("open")
        last = []
        while (cmd := order())[0] == "put":
            r = int(cmd[1])
            last = [k(base + j) for j in range(r * 4, r * 4 + 4)]
            await tier.put_many([(key, payload(60000, base + j)) for j, key in zip(range(r * 4, r * 4 + 4), last)])
            say("put", r)
        st = await tier.stats()
        newest = await tier.contains_many(last)
        say("done", tier.counters["evictions"], tier.counters["shared_lru_scans"], st.used_bytes,
            sum(newest), st.extra["map_size"])
asyncio.run(main())
"""


def env_figures(path: Path) -> dict[str, int]:
    """What any process sees in the environment: record bytes summed (the size each access entry
    gives), pages of the record and access B-trees, the file's high-water mark; the record files
    the files DB counts, those on disk and the disk blocks they hold."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=True)
    try:
        rec = env.open_db(b"records", create=False)
        acc = env.open_db(b"access", create=False)
        files = env.open_db(b"files", create=False)
        with env.begin() as txn:
            total = sum(struct.unpack_from("<dQ", v)[1] for v in txn.cursor(db=acc).iternext(keys=False))
            entries = txn.stat(rec)["entries"]
            pages = sum(txn.stat(db)[f] for db in (rec, acc) for f in ("branch_pages", "leaf_pages", "overflow_pages"))
            named = {bytes(t).hex() for t in txn.cursor(db=files).iternext(values=False)}
        info, psize = env.info(), env.stat()["psize"]
        on_disk = [n for n in os.listdir(path / "files") if n != "spare"]  # (spare/: files kept for reuse)
        spare = os.listdir(path / "files" / "spare")
        return {
            "record_bytes": total,
            "records": entries,
            "data_pages_bytes": pages * psize,
            "file_high_water_bytes": (info["last_pgno"] + 1) * psize,
            "record_files_named": len(named),
            "record_files_unnamed": len(set(on_disk) - named),
            "record_files_missing": len(named - set(on_disk)),
            "record_file_blocks_bytes": sum(os.stat(path / "files" / n).st_blocks * 512 for n in on_disk),
            "spare_files": len(spare),
        }
    finally:
        env.close()


@pytest.mark.parametrize("file_batch", [None, 200_000], ids=["in-lmdb", "record-files"])
def test_two_writer_processes_share_one_size_cap(tmp_path: Path, children: list[Child], file_batch: int | None) -> None:
    """Two engines with size_cap_bytes=C on one directory each write 2×C: the environment holds at
    most C of records (before: each process counted only its own, so the file held 2×C). With
    record files (each 240 KB batch one file): the files either process evicted from are
    punched or removed, so the disk holds about C of them too, and every file on disk is one the
    files DB names."""
    cap, rec = 4 * MiB, 60000 + HEADER_SIZE
    rounds = (2 * cap // rec) // 4 + 1
    code = WRITER.replace("sys.argv[1]", repr(str(tmp_path))).replace("FILE_BATCH", repr(file_batch))
    ws = [Child(code.replace("sys.argv[2]", str(base)).replace("sys.argv[3]", str(cap))) for base in (0, 1_000_000)]
    children.extend(ws)
    for w in ws:
        w.expect("open")
    for r in range(rounds):  # lockstep: both are open and writing all along
        for w in ws:
            w.send(f"put {r}")
        for w in ws:
            w.expect("put")
    done = []
    for w in ws:
        w.send("quit")
        done.append([int(x) for x in w.expect("done")])
        w.finish()
    fig = env_figures(tmp_path)
    written = 2 * rounds * 4 * rec
    print(
        f"\n[drill 2] 2 writers x {rounds} rounds x 4 records of {rec} B = {written} B written, cap {cap} B:"
        f" env holds {fig['records']} records, {fig['record_bytes']} B of records"
        f" ({fig['record_bytes'] / cap:.3f} of the cap), {fig['data_pages_bytes']} B of data pages,"
        f" file high-water {fig['file_high_water_bytes']} B; per writer [evictions, shared-LRU scans,"
        f" used, newest-of-4 present, map]: {done}; record files {fig['record_files_named']} holding"
        f" {fig['record_file_blocks_bytes']} B of disk blocks"
    )
    assert fig["record_bytes"] <= cap, "the environment holds more than one size cap of records"
    assert fig["record_bytes"] >= cap - 2 * 4 * rec, "evicted far more than needed"
    slack = 0.05  # 60064-byte records take 15 overflow pages (61440 B) plus B-tree leaves
    assert fig["file_high_water_bytes"] < 2 * cap
    assert all(d[3] == 4 for d in done), "a writer lost its newest records"
    assert fig["record_files_unnamed"] == 0 and fig["record_files_missing"] == 0
    if file_batch is None:
        assert fig["data_pages_bytes"] <= cap * (1 + slack)
        assert fig["record_files_named"] == 0
    else:
        assert fig["data_pages_bytes"] < cap // 16  # the index alone
        assert 0 < fig["record_files_named"] <= rounds * 2
        assert 0 < fig["spare_files"] <= 8  # files whose records all went, kept to be written again
        # a punched record keeps the blocks it shares with its neighbours: up to 2 x 4 KiB each
        assert fig["record_file_blocks_bytes"] <= cap * (1 + slack) + 2 * 4096 * fig["records"]


# ---- 3: a SIGKILLed reader ------------------------------------------------------------------------

STUCK_READER = """
env = lmdb.open(sys.argv[1], max_dbs=2)
rec = env.open_db(b"records", create=False)
txn = env.begin(db=rec)  # a snapshot: a killed `tieredkv ls` leaves this reader slot behind
say("holding", txn.stat(rec)["entries"], os.getpid())
order()
"""


async def test_writer_recovers_the_pages_of_a_killed_reader(tmp_path: Path, children: list[Child]) -> None:
    """A reader process is SIGKILLed inside a read transaction; its reader slot stays and pins the
    snapshot's pages. The writer clears the stale slot and reuses the pages: the map never grows
    and the tier keeps about a cap of records (before: the file grew to the map limit, then the
    limit's evictions emptied the tier)."""
    cap, rec, map0 = 2 * MiB, 60000 + HEADER_SIZE, 4 * MiB
    async with LMDBTier(cfg(tmp_path, map_size_bytes=map0, size_cap_bytes=cap, max_map_size_bytes=2 * map0)) as w:
        n0 = cap // rec
        await w.put_many([(k(i), payload(60000, i)) for i in range(n0)])
        r = Child(STUCK_READER.replace("sys.argv[1]", repr(str(tmp_path))))
        children.append(r)
        held, pid = (int(x) for x in r.expect("holding"))
        assert held == n0
        os.kill(pid, signal.SIGKILL)
        assert r.proc.wait(timeout=WAIT_S) == -signal.SIGKILL
        batches = 10 * n0 // 4  # ten caps of fresh records through the tier
        for b in range(batches):
            base = 1000 + 4 * b
            await w.put_many([(k(base + j), payload(60000, base + j)) for j in range(4)])
        st = await w.stats()
        last = [k(1000 + 4 * (batches - 1) + j) for j in range(4)]
        print(
            f"\n[drill 3] reader pid {pid} killed holding a snapshot of {held} records; then {4 * batches}"
            f" records ({4 * batches * rec} B) written through a {cap} B cap: stale readers cleared"
            f" {w.counters['stale_readers_cleared']}, map growths {w.counters['map_growths']}, map"
            f" {st.extra['map_size']} B (max {2 * map0}), file high-water {st.extra['file_high_water_bytes']} B,"
            f" {st.records} records / {st.used_bytes} B held, evictions {w.counters['evictions']}"
        )
        assert w.counters["stale_readers_cleared"] >= 1
        assert w.counters["map_growths"] == 0 and st.extra["map_size"] == map0
        assert st.extra["file_high_water_bytes"] <= map0
        assert st.used_bytes >= cap - 2 * 4 * rec, "the tier emptied itself"
        assert await w.contains_many(last) == [True] * 4


# ---- 4: two stores on one directory in one process ---------------------------------------------

LOCK_PROBE = """
fd = os.open(os.path.join(sys.argv[1], "lock.mdb"), os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, 0)  # LMDB's "am I alone" lock
    say("alone")
except OSError:
    say("shared")
"""


def lmdb_exclusive_lock_free(path: Path) -> bool:
    """Whether another process would find the environment unused (it would then reset the lock
    table under any reader still in it)."""
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + LOCK_PROBE.replace("sys.argv[1]", repr(str(path)))],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=REPO,
        check=False,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0] == "alone"


async def test_two_stores_on_one_directory_in_one_process_share_the_environment(tmp_path: Path) -> None:
    """A second store on the same directory (here reached through a symlink) shares the first one's
    environment: both see each other's records and one used-bytes figure; closing one leaves the
    other working and the environment locked; the last close releases it (before: the second
    open failed, 'already open in this process')."""
    real = tmp_path / "env"
    link = tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    t1 = LMDBTier(cfg(real, map_size_bytes=16 * MiB, size_cap_bytes=8 * MiB))
    t2 = LMDBTier(cfg(link, map_size_bytes=32 * MiB, size_cap_bytes=8 * MiB))
    await t1.open()
    try:
        await t2.open()
        assert t1._shared is t2._shared and t1._shared.refs == 2
        await t1.put_many([(k(1), payload(1000, 1))])
        await t2.put_many([(k(2), payload(2000, 2))])
        assert await t2.get_many([k(1)]) == [payload(1000, 1).numpy().tobytes()]
        assert await t1.contains_many([k(1), k(2)]) == [True, True]
        s1, s2 = await t1.stats(), await t2.stats()
        assert s1.used_bytes == s2.used_bytes == 3000 + 2 * HEADER_SIZE
        assert s2.extra["map_size"] >= 32 * MiB  # the larger map of the two configs
        with pytest.raises(ConfigError, match="already open in this process with sync_mode"):
            await LMDBTier(cfg(real, map_size_bytes=16 * MiB, size_cap_bytes=8 * MiB, sync_mode="durable")).open()
        await t1.close()
        want = [payload(1000, 1).numpy().tobytes(), payload(2000, 2).numpy().tobytes()]
        assert await t2.get_many([k(1), k(2)]) == want
        assert not lmdb_exclusive_lock_free(real), "closing one store dropped the environment's locks"
    finally:
        await t1.close()
        await t2.close()
    assert not REGISTRY and lmdb_exclusive_lock_free(real)
    print(
        f"\n[drill 4] two stores on {real} (one via a symlink) shared one environment: 2 puts seen by both,"
        f" used {s1.used_bytes} B in both, map {s2.extra['map_size']} B; after one close the other read 2"
        " records and the env stayed locked; after both, released"
    )


def _open_put_close(path: Path, i: int, barrier: threading.Barrier, errors: list[Exception]) -> None:
    """One engine's start: its own loop and tier, released with the others by ``barrier``."""

    async def go() -> None:
        tier = LMDBTier(cfg(path, map_size_bytes=8 * MiB, size_cap_bytes=4 * MiB))
        barrier.wait(timeout=WAIT_S)
        await tier.open()
        try:
            await tier.put_many([(k(i), payload(100, i))])
        finally:
            await tier.close()

    try:
        asyncio.run(go())
    except Exception as e:  # noqa: BLE001 - collected, the test names them
        errors.append(e)


async def test_many_opens_of_one_fresh_directory_at_once_all_succeed(tmp_path: Path) -> None:
    """Engines starting together open one directory at the same moment. Each open proves the
    directory writable with a probe file of its own name (before: one fixed name, so one open's
    unlink removed another's probe, and that open failed with 'cannot hold an LMDB environment').
    Threads here, each with its own loop and tier, released by one barrier per round; the CI
    failure this pins was two processes."""
    rounds, width = 12, 6
    for r in range(rounds):
        path = tmp_path / f"round{r}"
        barrier = threading.Barrier(width)
        errors: list[Exception] = []
        threads = [threading.Thread(target=_open_put_close, args=(path, i, barrier, errors)) for i in range(width)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not errors, f"round {r}: {errors!r}"
        tier = LMDBTier(cfg(path, map_size_bytes=8 * MiB, size_cap_bytes=4 * MiB))
        async with tier:
            assert await tier.contains_many([k(i) for i in range(width)]) == [True] * width
        assert not [p.name for p in path.iterdir() if p.name.startswith(".tieredkv-write-test")]


# ---- 5: two processes flooding as different tenants -------------------------------------------------

TENANT_WRITER = """
from tieredkv.keys import tenant_id
from tieredkv.tenants import TenantQuotas
async def main():
    cap, quota, base = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = LMDBTierConfig(path=sys.argv[1], map_size_bytes=8 * cap, size_cap_bytes=cap, max_map_size_bytes=16 * cap,
                         file_batch_bytes=FILE_BATCH)
    tier = LMDBTier(cfg)
    tier.set_quotas(TenantQuotas(default=quota))
    async with tier:
        say("open")
        while (cmd := order())[0] == "put":
            r, name = int(cmd[1]), cmd[2]
            first = base + r * 4
            await tier.put_many([(k(first + j), payload(30000, first + j)) for j in range(4)],
                                tenants=[tenant_id(name)] * 4)
            say("put", r)
        say("done", *(f"{t:x}={n}" for t, n in sorted((await tier.tenant_usage()).items())))
asyncio.run(main())
"""


@pytest.mark.parametrize("file_batch", [None, 100_000], ids=["in-lmdb", "record-files"])
async def test_two_processes_flooding_as_tenants_keep_exact_per_tenant_accounting(
    tmp_path: Path, children: list[Child], file_batch: int | None
) -> None:
    """Process 1 floods as tenant a; process 2 floods as b and a by turns (so each sees only part
    of a's records: the other's are evicted by the shared stamps), each 7 MiB against a 1 MiB
    quota, after this process stored tenant c's records (within its quota) and the default
    tenant's. The per-tenant counters both keep in the environment stay exact (equal to a count
    of every record's header), a and b stay within their quota with their newest records, and
    none of c's or the default tenant's records is lost (before: no counters, and the flood
    evicted c and the default tenant)."""
    from tieredkv.backends.lmdb.tenants import count_tenants
    from tieredkv.keys import tenant_id
    from tieredkv.tenants import TenantQuotas

    cap, quota, rec = 8 * MiB, 1 * MiB, 30000 + HEADER_SIZE
    a, b, c = tenant_id("a"), tenant_id("b"), tenant_id("c")
    tier = LMDBTier(cfg(tmp_path, map_size_bytes=8 * cap, size_cap_bytes=cap, max_map_size_bytes=16 * cap))
    tier.set_quotas(TenantQuotas(default=quota))
    async with tier:
        mine = [(k(i), payload(30000, i)) for i in range(40)]
        await tier.put_many(mine[:20], tenants=[c] * 20)
        await tier.put_many(mine[20:])
    code = TENANT_WRITER.replace("sys.argv[1]", repr(str(tmp_path))).replace("FILE_BATCH", repr(file_batch))
    ws = [
        Child(code.replace("sys.argv[2]", str(cap)).replace("sys.argv[3]", str(quota)).replace("sys.argv[4]", base))
        for base in ("1000000", "2000000")
    ]
    children.extend(ws)
    for w in ws:
        w.expect("open")
    rounds = 60
    for r in range(rounds):  # lockstep: both are open and writing all along
        ws[0].send(f"put {r} a")
        ws[1].send(f"put {r} {'b' if r % 2 else 'a'}")
        for w in ws:
            w.expect("put")
    said = []
    for w in ws:
        w.send("quit")
        said.append({int(t, 16): int(n) for t, n in (x.split("=") for x in w.expect("done"))})
        w.finish()
    async with tier.__class__(tier.config) as again:
        again.set_quotas(TenantQuotas(default=quota))
        usage = await again.tenant_usage()
        got = await again.get_many([key for key, _ in mine])
        newest = await again.contains_many(
            [k(1_000_000 + (rounds - 1) * 4 + j) for j in range(4)]
            + [k(2_000_000 + (rounds - 1) * 4 + j) for j in range(4)]
        )
    env = lmdb.open(str(tmp_path), max_dbs=4, readonly=True, lock=True)
    try:
        acc, rec_db = env.open_db(b"access", create=False), env.open_db(b"records", create=False)
        with env.begin() as txn:
            counted = count_tenants(txn, acc, rec_db)
    finally:
        env.close()
    print(
        f"\n[drill 5] 2 writers x {rounds} rounds x 4 records of {rec} B, quota {quota} B: usage {usage}; counted from"
        f" the headers {counted}; what each writer said last {said}"
    )
    assert {t: n for t, n in usage.items() if t} == {t: cnt[0] for t, cnt in counted.items()}
    assert said[1] == usage  # the last writer's figures are the environment's
    assert quota - 4 * rec < usage[a] <= quota and quota - 4 * rec < usage[b] <= quota
    assert usage[c] == 20 * rec and usage[0] == 20 * rec
    assert got == [p.numpy().tobytes() for _, p in mine], "a record of c or of the default tenant was lost"
    assert newest == [True] * 8

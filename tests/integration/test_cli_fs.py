"""The admin CLI on the shared-filesystem tier (``kind: fs``), driven as a user would: real
`tieredkv` processes against a real fs tier directory whose records this process wrote through
the public API (``Tier.put_many``; ``tieredkv.open_store`` where the namespace catalog matters),
so the CLI is always another process on the same directory, as another node would be.

Each verb: ``status``, ``ls`` (pages, filters, summaries), ``inspect``, ``verify`` and
``--repair`` (damage written through the tier and damage done to a file on disk),
``evict`` (``--older-than`` on access times, ``--to-size``, ``--namespace``, ``--group``),
``flush``, and ``migrate`` fs → LMDB, LMDB → fs and fs → a real redis-server. After every
deletion the directory's shared usage ledger (what running engines on every node reserve
against) holds what the directory holds."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tieredkv
from tests.integration.test_cli_admin import (
    NS,
    NS_B,
    check_ls_views,
    corrupt,
    lmdb_tier,
    ls_pages,
    payload,
    present,
    read_back,
    redis_tier,
    run,
    run_json,
    seed,
    write_config,
)
from tieredkv.backends.fs.layout import Layout
from tieredkv.backends.fs.ledger import unpack
from tieredkv.backends.registry import build_tier
from tieredkv.catalog import catalog_key, is_catalog_key
from tieredkv.config import load_config
from tieredkv.format import HEADER_SIZE
from tieredkv.testing.servers import RedisServer, redis_command

KiB = 1024


def fs_tier(path: Path, name: str = "shared", cap: str = "32MiB") -> str:
    return f"""\
    - kind: fs
      name: {name}
      path: {path}
      size_cap_bytes: {cap}
    """


def record_files(root: Path) -> dict[str, int]:
    """Every record file under ``root`` (file name → size), read off the disk."""
    return {p.name: p.stat().st_size for p in (root / "ns").rglob("*.kv")}


def ledger(root: Path) -> tuple[int, int]:
    """(bytes, records) the shared usage ledger holds, read off the disk."""
    state = unpack((root / "ledger").read_bytes())
    assert state is not None, "the usage ledger is damaged"
    return state.used, state.records


def assert_ledger_holds_the_directory(root: Path) -> None:
    files = record_files(root)
    assert ledger(root) == (sum(files.values()), len(files))
    assert list((root / "tmp").iterdir()) == []  # no temporary file left behind


def age(root: Path, keys: list[bytes], seconds: float) -> None:
    """Make ``keys``' records look last used ``seconds`` ago (access and change time), as records
    no node has read since would."""
    lay = Layout(str(root))
    then = time.time() - seconds
    for k in keys:
        os.utime(lay.record_path(k), (then, then))


def atime_on_read(tmp: Path) -> bool:
    """Whether a read of a file here sets its access time (relatime / strictatime, not noatime)."""
    probe = tmp / "atime-probe"
    probe.write_bytes(b"x")
    then = time.time() - 7200
    os.utime(probe, (then, then))
    probe.read_bytes()
    moved = probe.stat().st_atime > then + 3600
    probe.unlink()
    return moved


# ---- status / ls -----------------------------------------------------------------------------


def test_status_and_ls_page_filter_and_summarize_an_fs_tier(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, "- kind: cpu\n  capacity_bytes: 16MiB\n  segment_bytes: 1MiB\n", fs_tier(root))
    keys = seed(cfg, "shared", 25)
    other = seed(cfg, "shared", 4, ns=NS_B, start=100)
    held = sum(HEADER_SIZE + 500 + i for i in range(25)) + sum(HEADER_SIZE + 500 + i for i in range(4))

    s = run_json("status", "-c", str(cfg))
    rows = {r["tier"]: r for r in s["tiers"]}
    assert rows["cpu"]["reachable"] is None  # in the engine: only the engine knows
    row = rows["shared"]
    assert (row["kind"], row["reachable"], row["records"]) == ("fs", True, 29)
    assert (row["capacity_bytes"], row["used_bytes"]) == (32 << 20, held)
    assert row["where"] == str(root) and row["extra"]["temp_files"] == 0 and row["extra"]["read_only"] is None
    human = run("status", "-c", str(cfg), "-t", "shared")
    assert human.returncode == 0, human.stderr
    assert "reachable" in human.stdout and "32.0 MiB" in human.stdout and str(root) in human.stdout

    atimes = {p: p.stat().st_atime for p in (root / "ns").rglob("*.kv")}
    seen, page = ls_pages(cfg, NS, 25)
    assert sorted(seen) == sorted(k.hex() for k in keys) and len(seen) == 25  # every record once
    rec = page["records"][0]
    assert rec["namespace"] == NS.fingerprint.hex() and rec["size"] >= 500 and 0 <= rec["age_s"] < 120
    assert rec["tenant"] is None  # the fs tier keeps no tenant books: the CLI says it cannot tell

    by_group = check_ls_views(cfg)
    assert sum(x["bytes"] for x in by_group) == sum(len(payload(k, 500 + i)) for i, k in enumerate(other))

    listed = run("ls", "-c", str(cfg), "--limit", "5")
    assert listed.returncode == 0 and "next page: --offset 5" in listed.stdout
    # listing is passive: no record file's access time moved, nothing was written
    assert {p: p.stat().st_atime for p in (root / "ns").rglob("*.kv")} == atimes
    assert_ledger_holds_the_directory(root)


def test_read_commands_never_create_an_fs_tier(tmp_path: Path) -> None:
    """A path with no fs tier is "unreachable" (exit 3) for every read command: neither a missing
    directory nor one that holds something else gets a tier's skeleton (marker, ledger, tmp/, ns/)."""
    other = tmp_path / "someone-elses"
    other.mkdir()
    (other / "notes.txt").write_text("not a tier")
    cfg = write_config(tmp_path, fs_tier(tmp_path / "nowhere", "gone"), fs_tier(other, "foreign"))
    for tier, root in (("gone", tmp_path / "nowhere"), ("foreign", other)):
        for args in (("ls",), ("verify",), ("evict", "--older-than", "1s"), ("inspect", NS.key(b"k", 0).hex())):
            r = run(*args, "-c", str(cfg), "-t", tier)
            assert r.returncode == 3, (tier, args, r.stdout, r.stderr)
            err = " ".join(r.stderr.split())
            assert "tier unavailable" in err and f"no fs tier at {root}" in err and "Traceback" not in r.stderr
        (row,) = run_json("status", "-c", str(cfg), "-t", tier, code=3)["tiers"]
        assert row["reachable"] is False and f"no fs tier at {root}" in row["error"]
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


# ---- inspect ---------------------------------------------------------------------------------


def test_inspect_shows_header_checksum_and_the_namespace_an_engine_catalogued(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    keys = seed(cfg, "shared", 4)
    good = run_json("inspect", keys[1].hex(), "-c", str(cfg))
    (entry,) = good["tiers"]
    assert good["group"] == 1 and good["namespace"] == NS.fingerprint.hex()
    assert entry["present"] and entry["verified"] is True and entry["record_bytes"] == HEADER_SIZE + 501
    assert entry["header"]["payload_bytes"] == 501 and entry["header"]["magic"] == "TKVR"

    corrupt(cfg, "shared", keys[2])
    bad = run_json("inspect", keys[2].hex(), "-c", str(cfg), code=1)
    assert bad["tiers"][0]["verified"] is False and "checksum" in bad["tiers"][0]["error"]
    human = run("inspect", keys[2].hex(), "-c", str(cfg))
    assert human.returncode == 1 and "CORRUPT" in human.stdout and "payload_bytes" in human.stdout
    absent = run_json("inspect", NS.key(b"nope", 0).hex(), "-c", str(cfg), code=1)
    assert absent["tiers"][0]["present"] is False

    # an engine's store (the public API) writes its namespace's catalog record in the fs tier
    key, ns = engine_store(cfg)
    got = run_json("inspect", key.hex(), "-c", str(cfg))
    assert got["tiers"][0]["verified"] is True
    info = got["namespace_info"]
    assert (info["model"], info["revision"], info["tier"]) == ("test/fs-cli", "r1", "shared")
    assert info["namespace"]["model"] == ns.model


def engine_store(cfg: Path) -> tuple[bytes, tieredkv.Namespace]:
    """One chunk stored through ``tieredkv.open_store`` (the pipeline; it writes the namespace's
    catalog record in the background, waited for here); returns its key and the namespace."""
    doc = load_config(cfg).model_dump(mode="json")
    doc["namespace"] = {"model": "test/fs-cli", "revision": "r1"}
    store = tieredkv.open_store(doc)
    try:
        blocks = torch.arange(8 * 4 * KiB, dtype=torch.int32).to(torch.uint8).reshape(8, 4 * KiB)
        store.register_group(0, [blocks], blocks_per_chunk=2)
        key = store.key(block_hash=b"\x07" * 32, group=0)
        assert all(r.ok for r in store.wait([store.store(0, [(key, (2, 3))])]).values())
        ns = store.namespace
        (tier,) = store.tiers
        deadline = time.monotonic() + 60
        while store.run(tier.contains_many([catalog_key(ns.fingerprint)])) != [True]:
            assert time.monotonic() < deadline, "the catalog record was never written"
            time.sleep(0.05)
    finally:
        store.close()
    return key, ns


def test_status_counts_the_engines_records_not_the_namespace_catalog(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, fs_tier(tmp_path / "fs"))
    seed(cfg, "shared", 3)
    engine_store(cfg)
    listed = run_json("ls", "-c", str(cfg), "--limit", "100")
    assert listed["total"] == 4 and not any(is_catalog_key(bytes.fromhex(r["key"])) for r in listed["records"])
    (row,) = run_json("status", "-c", str(cfg))["tiers"]
    assert row["records"] == 4


# ---- verify / repair -------------------------------------------------------------------------


def test_verify_finds_damage_written_or_on_disk_and_repair_deletes_only_it(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    keys = seed(cfg, "shared", 20)
    corrupt(cfg, "shared", keys[3])  # a payload bit flip, written through the tier
    corrupt(cfg, "shared", keys[11], where="header")  # bad magic
    lay = Layout(str(root))
    with open(lay.record_path(keys[5]), "r+b") as f:  # damage on the disk itself: a flipped byte
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    os.truncate(lay.record_path(keys[7]), 40)  # and a file cut short of its header
    damaged = {keys[i].hex() for i in (3, 5, 7, 11)}

    s = run_json("verify", "-c", str(cfg), code=1)
    assert {c["key"] for c in s["corrupt"]} == damaged
    (row,) = s["tiers"]
    assert (row["checked"], row["ok"], row["corrupt"], row["repaired"]) == (20, 16, 4, 0)
    assert present(cfg, "shared", [keys[i] for i in (3, 5, 7, 11)]) == [True] * 4  # nothing deleted
    human = run("verify", "-c", str(cfg))
    assert human.returncode == 1 and "--repair" in human.stdout and keys[3].hex() in human.stdout

    fixed = run_json("verify", "-c", str(cfg), "--repair", code=0)
    assert fixed["tiers"][0]["repaired"] == 4
    assert present(cfg, "shared", [keys[i] for i in (3, 5, 7, 11)]) == [False] * 4
    assert_ledger_holds_the_directory(root)  # the repair's deletions reached the shared ledger
    again = run_json("verify", "-c", str(cfg), code=0)
    assert again["tiers"][0]["checked"] == 16 and again["corrupt"] == []
    rest = [k for i, k in enumerate(keys) if i not in (3, 5, 7, 11)]
    assert read_back(cfg, "shared", rest) == [payload(k, 500 + keys.index(k)) for k in rest]


def test_verify_does_not_make_old_fs_records_look_recently_used(tmp_path: Path) -> None:
    if not atime_on_read(tmp_path):
        pytest.skip("this filesystem does not set access times on reads (noatime): nothing to show")
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    keys = seed(cfg, "shared", 6, groups=1)
    age(root, keys, 7200)
    assert run_json("evict", "-c", str(cfg), "--older-than", "1h", "--dry-run")["tiers"][0]["victims"] == 6
    run_json("verify", "-c", str(cfg))
    assert run_json("evict", "-c", str(cfg), "--older-than", "1h", "--dry-run")["tiers"][0]["victims"] == 6


def test_ls_never_shows_a_negative_size_for_a_file_cut_short(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    keys = seed(cfg, "shared", 2)
    os.truncate(Layout(str(root)).record_path(keys[0]), 40)
    sizes = {r["key"]: r["size"] for r in run_json("ls", "-c", str(cfg))["records"]}
    assert sizes[keys[1].hex()] == 501 and sizes[keys[0].hex()] >= 0


# ---- evict / flush ---------------------------------------------------------------------------


def test_evict_by_access_time_size_namespace_and_group(tmp_path: Path) -> None:
    """Ages are the record files' access times, which any node's read moves: records read through
    the tier (here, in this process) since they went old are kept by ``--older-than``."""
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    old = seed(cfg, "shared", 10, groups=1)
    age(root, old, 7200)
    new = seed(cfg, "shared", 10, groups=1, start=10)
    g1 = seed(cfg, "shared", 6, ns=NS_B, groups=2, start=50)
    assert read_back(cfg, "shared", old[:3]) == [payload(k, 500 + i) for i, k in enumerate(old[:3])]  # used again

    ages = {r["key"]: r["age_s"] for r in run_json("ls", "-c", str(cfg), "--limit", "100")["records"]}
    assert all(7100 < ages[k.hex()] < 7300 for k in old[3:])
    assert all(ages[k.hex()] < 120 for k in old[:3] + new + g1)

    dry = run_json("evict", "-c", str(cfg), "--older-than", "1h", "--dry-run")
    assert dry["dry_run"] is True and dry["tiers"][0]["victims"] == 7 and dry["tiers"][0]["evicted"] == 0
    assert all(present(cfg, "shared", old))
    aged = run_json("evict", "-c", str(cfg), "--older-than", "1h")
    assert aged["tiers"][0]["evicted"] == 7 and aged["tiers"][0]["no_age"] == 0
    assert present(cfg, "shared", old) == [True] * 3 + [False] * 7
    assert_ledger_holds_the_directory(root)

    grp = run_json("evict", "-c", str(cfg), "--namespace", NS_B.fingerprint.hex(), "--group", "1")
    assert grp["tiers"][0]["evicted"] == 3
    assert present(cfg, "shared", g1) == [i % 2 == 0 for i in range(6)]
    ns_only = run_json("evict", "-c", str(cfg), "--namespace", NS_B.fingerprint.hex())
    assert ns_only["tiers"][0]["evicted"] == 3 and not any(present(cfg, "shared", g1))

    # --to-size: the least recently used go first; `new` were written after `old[:3]` were read
    age(root, new[:5], 600)  # and half of them untouched for 10 minutes
    rec = HEADER_SIZE + 510  # the largest record left (payloads of 500..519 bytes)
    sized = run_json("evict", "-c", str(cfg), "--to-size", str(8 * rec))
    t = sized["tiers"][0]
    assert t["remaining_bytes"] <= 8 * rec and t["evicted"] == 5
    assert present(cfg, "shared", new) == [False] * 5 + [True] * 5
    assert all(present(cfg, "shared", old[:3]))
    assert_ledger_holds_the_directory(root)

    none = run("evict", "-c", str(cfg))
    assert none.returncode == 2 and "--older-than" in none.stderr


def test_flush_a_namespace_then_everything(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, fs_tier(root))
    a = seed(cfg, "shared", 6)
    b = seed(cfg, "shared", 3, ns=NS_B, start=10)
    refused = run("flush", "-c", str(cfg), "--namespace", NS.fingerprint.hex())
    assert refused.returncode == 2 and "--yes" in refused.stderr and all(present(cfg, "shared", a))
    s = run_json("flush", "-c", str(cfg), "--namespace", NS.fingerprint.hex(), "--yes")
    assert s["tiers"][0]["deleted"] == 6
    assert not any(present(cfg, "shared", a)) and all(present(cfg, "shared", b))
    human = run("flush", "-c", str(cfg), "--all", "--yes")
    assert human.returncode == 0 and "deleted 3 record(s)" in human.stdout
    assert record_files(root) == {} and ledger(root) == (0, 0)
    (row,) = run_json("status", "-c", str(cfg))["tiers"]
    assert (row["records"], row["used_bytes"]) == (0, 0)


# ---- migrate ---------------------------------------------------------------------------------


def test_migrate_fs_to_lmdb_and_back_to_a_new_fs_tier_verified_and_resumable(tmp_path: Path) -> None:
    root, again = tmp_path / "fs", tmp_path / "fs-new"
    cfg = write_config(
        tmp_path, fs_tier(root), lmdb_tier(tmp_path / "lmdb"), fs_tier(again, "fresh"),
    )  # fmt: skip
    keys = seed(cfg, "shared", 40, groups=3)
    first = run_json(
        "migrate", "--from", "shared", "--to", "nvme", "-c", str(cfg), "--limit", "15", "--batch-bytes", "4KiB"
    )
    assert (first["copied"], first["complete"], first["remaining"]) == (15, False, 25)
    second = run_json("migrate", "--from", "shared", "--to", "nvme", "-c", str(cfg))
    assert (second["copied"], second["skipped"], second["complete"]) == (25, 15, True)
    assert read_back(cfg, "nvme", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]

    # LMDB → an fs tier that does not exist yet: migrate creates it (the one command that may)
    assert not again.exists()
    back = run_json("migrate", "--from", "nvme", "--to", "fresh", "-c", str(cfg))
    assert (back["copied"], back["corrupt"], back["target_failed"], back["complete"]) == (40, 0, 0, True)
    assert read_back(cfg, "fresh", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]
    assert record_files(again) == record_files(root)  # the same records, byte for byte in size and name
    assert_ledger_holds_the_directory(again)
    v = run_json("verify", "-c", str(cfg), "-t", "fresh")
    assert (v["tiers"][0]["checked"], v["tiers"][0]["ok"]) == (40, 40)
    third = run_json("migrate", "--from", "nvme", "--to", "fresh", "-c", str(cfg))
    assert (third["copied"], third["skipped"]) == (0, 40)


def test_migrate_from_fs_skips_a_corrupt_record_and_exits_1(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, fs_tier(tmp_path / "fs"), lmdb_tier(tmp_path / "lmdb"))
    keys = seed(cfg, "shared", 10)
    corrupt(cfg, "shared", keys[4])
    s = run_json("migrate", "--from", "shared", "--to", "nvme", "-c", str(cfg), code=1)
    assert (s["copied"], s["corrupt"], s["complete"]) == (9, 1, True)
    assert s["problems"][0]["key"] == keys[4].hex()
    assert present(cfg, "nvme", keys) == [i != 4 for i in range(10)]


def test_migrate_fs_to_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = "fs" + uuid.uuid4().hex[:10]
    cfg = write_config(tmp_path, fs_tier(tmp_path / "fs"), redis_tier(redis_server.url, "remote", prefix=prefix))
    keys = seed(cfg, "shared", 30, groups=2)
    try:
        m = run_json("migrate", "--from", "shared", "--to", "remote", "-c", str(cfg), "--group", "1")
        assert (m["copied"], m["complete"]) == (15, True)
        assert present(cfg, "remote", keys) == [i % 2 == 1 for i in range(30)]
        rest = run_json("migrate", "--from", "shared", "--to", "remote", "-c", str(cfg))
        assert (rest["copied"], rest["skipped"]) == (15, 15)
        assert read_back(cfg, "remote", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]
        mine = int(redis_command(redis_server.port, "EVAL", f"return #redis.call('KEYS', '{prefix}:*')", "0")[1:])
        assert mine == 30
    finally:
        run_json("flush", "-c", str(cfg), "-t", "remote", "--all", "--yes")


@pytest.fixture
def read_only_view(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(a directory, a read-only bind mount of it): a node that mounts the shared tier read-only."""
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root and mount(8)")
    made = subprocess.run(["mount", "--bind", str(rw), str(ro)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {made.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")
        yield rw, ro
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_on_a_read_only_mount_reads_work_and_deletions_are_refused(read_only_view: tuple[Path, Path]) -> None:
    """A node that mounts the tier read-only: status says so, ls / inspect / verify / migrate from
    it work, evict and verify --repair are refused (exit 3) and change nothing."""
    rw, ro = read_only_view
    cfg = write_config(rw.parent, fs_tier(rw, "writer"), fs_tier(ro, "reader"), lmdb_tier(rw.parent / "lmdb"))
    keys = seed(cfg, "writer", 6)
    corrupt(cfg, "writer", keys[2])
    before = record_files(rw)

    (row,) = run_json("status", "-c", str(cfg), "-t", "reader")["tiers"]
    assert row["reachable"] is True and row["records"] == 6 and "Read-only file system" in row["extra"]["read_only"]
    assert len(run_json("ls", "-c", str(cfg), "-t", "reader")["records"]) == 6
    assert run_json("inspect", keys[1].hex(), "-c", str(cfg), "-t", "reader")["tiers"][0]["verified"] is True
    v = run_json("verify", "-c", str(cfg), "-t", "reader", code=1)
    assert [c["key"] for c in v["corrupt"]] == [keys[2].hex()]
    for args in (("verify", "--repair"), ("evict", "--older-than", "1s")):
        r = run(*args, "-c", str(cfg), "-t", "reader")
        err = " ".join(r.stderr.split())
        assert r.returncode == 3 and "refused" in err and "read-only" in err and "Traceback" not in err, (args, err)
    m = run_json("migrate", "--from", "reader", "--to", "nvme", "-c", str(cfg), code=1)
    assert (m["copied"], m["corrupt"]) == (5, 1)
    assert record_files(rw) == before and present(cfg, "writer", keys) == [True] * 6


def test_cli_deletions_reach_a_running_engines_view_of_the_cap(tmp_path: Path) -> None:
    """An engine holds its fs tier open (its usage ledger descriptor, its eviction index) while an
    operator runs `tieredkv evict` on another node: the engine's next store sees the room freed
    (the ledger), and its eviction index skips records the CLI deleted."""
    root = tmp_path / "fs"
    cap = 40 * (HEADER_SIZE + 4 * KiB)
    cfg = write_config(tmp_path, fs_tier(root, cap=str(cap)))
    tcfg = load_config(cfg).tier("shared")
    first = [NS.key(i.to_bytes(8, "big"), 0) for i in range(40)]
    later = [NS.key((100 + i).to_bytes(8, "big"), 0) for i in range(20)]

    async def engine() -> None:
        async with build_tier(tcfg) as tier:
            await tier.put_many([(k, bytes([i]) * 4 * KiB) for i, k in enumerate(first)])  # full to the cap
            r = await asyncio.to_thread(run_json, "evict", "-c", str(cfg), "--namespace", NS.fingerprint.hex())
            assert r["tiers"][0]["evicted"] == 40
            assert ledger(root) == (0, 0)  # the CLI's deletions are in the ledger at once
            recounts = tier.counters["recounts"]
            await tier.put_many([(k, bytes([i]) * 4 * KiB) for i, k in enumerate(later)])
            # the engine found the room in the ledger: nothing evicted for it, no recount needed
            assert tier.counters["evictions"] == 0 and tier.counters["recounts"] == recounts
            assert await tier.get_many(later) == [bytes([i]) * 4 * KiB for i in range(20)]

    asyncio.run(engine())
    assert_ledger_holds_the_directory(root)
    assert ledger(root) == (20 * (HEADER_SIZE + 4 * KiB), 20)


# ---- bench -----------------------------------------------------------------------------------


def test_bench_of_the_fs_tier_prints_each_raw_figure_its_baseline_and_its_floor(tmp_path: Path) -> None:
    """``tieredkv bench -t NAME`` benches that configured tier alone: the fs tier's row against
    ``pwrite`` / ``pread`` of one file per record and against its own calls without aiofiles (its
    floor), every raw figure printed with its GB/s, in a scratch directory beside the configured
    one (which it never creates)."""
    root = tmp_path / "fs"
    cfg = write_config(tmp_path, "- kind: cpu\n  capacity_bytes: 4MiB\n  segment_bytes: 1MiB\n", fs_tier(root))
    r = run(
        "bench", "-c", str(cfg), "-t", "shared", "--sizes", "64", "--total-mib", "1", "--reps", "1",
        "--layouts", "permuted", "--out", str(tmp_path / "out"), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "shared.store" in out and "cpu.store" not in out  # the cpu tier was not benched
    (written,) = (tmp_path / "out").glob("tiers-*.json")
    (row,) = json.loads(written.read_text())["results"]
    gbps = row["gbps"]
    store = max(("pwrite.store", "file_pagecache.store"), key=gbps.__getitem__)  # the strongest measured
    load = max(("pread.load", "file.load"), key=gbps.__getitem__)
    for line in (
        f"baselines: shared.store vs {store}, shared.load vs {load}",
        "floors: shared.store vs tier_calls_no_aiofiles.store, shared.load vs tier_calls_no_aiofiles.load",
    ):
        assert line in out
    for figure in (f"{store} (baseline)", f"{load} (baseline)", "pwrite_durable.store", "pwrite_rename.store",
                   "tier_calls_no_aiofiles.store (floor)", "tier_calls_no_aiofiles.load (floor)"):  # fmt: skip
        assert figure in out, figure
    assert row["baselines"] == {"shared.store": store, "shared.load": load}
    assert set(row["ratios"]) == set(row["floor_ratios"]) == {"shared.store", "shared.load"}
    assert all(v > 0 for v in gbps.values()) and len(gbps) == 2 + 8
    assert not root.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tieredkv-bench-")] == []

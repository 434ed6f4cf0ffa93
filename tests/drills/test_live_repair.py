"""Live repair: ``tieredkv verify`` and ``verify --repair`` on an LMDB directory an engine writes.

A writer process (``_lmdb_writer.py``, record files on: puts of 16 KiB or more go to a file beside
the index) stores, overwrites and deletes continuously over a 1 MiB cap, so its puts evict, record
files lose records (their blocks punched) and whole files (kept as spares, written over by later
batches). Meanwhile this process runs ``verify`` and ``verify --repair`` again and again (``ops.verify``,
what the CLI runs, and the real CLI in a subprocess now and then), and injects a truly corrupt
record now and then (``raw_put_many``, a key the writer never touches).

* No record of the writer is ever reported corrupt: a record read from a file that a writer changed
  under the read is read again where it is now, or is gone — never the bytes its old place holds.
  Between the verify runs every key of the writer is read directly with ``raw_get_many`` (the
  admin read ``verify`` uses, without its second look) and checked: none fails either.
* ``--repair`` deletes exactly the injected records it found (compare-and-delete), never a good one.
* After the run every record the writer committed and did not delete, overwrite or evict (it reports
  each) is there, with the bytes it wrote; and nothing else is.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.drills._lmdb_writer import INDEX
from tests.drills._util import Child, check_payload, payload, report, skey
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.cli import ops
from tieredkv.config import LMDBTierConfig, load_config
from tieredkv.errors import CorruptRecordError
from tieredkv.format import encode_record, verify_record

pytestmark = [pytest.mark.timeout(120)]

WRITER = Path(__file__).with_name("_lmdb_writer.py")
ROOT = Path(__file__).resolve().parents[2]
MODE = "fast-files"
SECONDS = 12.0  # the writer's run
INJECT_EVERY = 5  # verify runs between two injected corrupt records


def tier_config(path: Path) -> dict[str, Any]:
    """The writer's tier (``_lmdb_writer.config``, mode ``fast-files``), as a config file names it."""
    return {
        "kind": "lmdb",
        "name": "disk",
        "path": str(path),
        "sync_mode": "fast",
        "map_size_bytes": "2MiB",
        "size_cap_bytes": "1MiB",
        "max_map_size_bytes": "64MiB",
        "file_batch_bytes": "16KiB",
    }


class Writer(Child):
    def __init__(self, path: Path, seconds: float) -> None:
        super().__init__([sys.executable, str(WRITER), str(path), MODE, "41", "1", str(seconds)], cwd=ROOT)

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=60)
        finally:
            self.kill()
        err = self.stderr()
        assert self.proc.returncode == 0, f"writer exited {self.proc.returncode}: {self.lines[-3:]} {err[-2000:]}"

    def expected(self) -> dict[int, int]:
        """What the writer's committed operations leave: key index -> the version it holds."""
        want: dict[int, int] = {}
        for line in self.lines:
            op, _, rest = line.partition(" ")
            if op not in ("P", "D", "E"):
                continue
            seq, idx = rest.split()
            for i in map(int, idx.split(",")):
                if op == "P":
                    want[i] = int(seq)
                else:
                    want.pop(i, None)
        return want


def corrupt_record(n: int) -> tuple[bytes, bytes]:
    """A key the writer never touches, and a damaged record for it (one payload bit flipped)."""
    key = skey(100_000 + n)
    rec = encode_record(key, payload(100_000 + n, 1, 2000))
    rec[-1] ^= 0x10
    return key, bytes(rec)


def test_verify_and_repair_beside_a_live_writer_report_and_delete_only_damage(tmp_path: Path) -> None:
    path = tmp_path / "env"
    cfg = load_config({"tiers": [tier_config(path)]})
    cfg_file = tmp_path / "tieredkv.yaml"
    cfg_file.write_text(yaml.safe_dump({"tiers": [tier_config(path)]}))
    tier_cfg = LMDBTierConfig(**{k: v for k, v in tier_config(path).items() if k not in ("kind", "name")})
    writer = Writer(path, SECONDS)
    injected: dict[bytes, int] = {}  # injected key -> verify run it was injected before
    false_reports: list[str] = []
    wrongly_repaired = 0
    found = repaired_injected = runs = cli_runs = checked = vanished = raw_read = 0
    raw_failed: list[str] = []
    t0 = time.monotonic()
    keys = [skey(i) for i in sorted(INDEX.values())]

    async def read_raw() -> int:
        async with LMDBTier(tier_cfg) as tier:
            n = 0
            for key, rec in zip(keys, await tier.raw_get_many(keys)):
                if rec is None:
                    continue
                n += 1
                try:
                    verify_record(rec, key)
                except CorruptRecordError as e:
                    raw_failed.append(f"run {runs}: key {INDEX[key]}: {e}")
            return n

    try:
        writer.wait_ready(30)
        while writer.running():
            raw_read += asyncio.run(read_raw())
            runs += 1
            repair = runs % 2 == 0
            if runs % INJECT_EVERY == 1:
                key, rec = corrupt_record(runs)

                async def inject(key: bytes = key, rec: bytes = rec) -> None:
                    # with a cap of its own far above the writer's: the injection evicts nothing
                    # (an eviction here, which the writer cannot report, would take a committed record)
                    async with LMDBTier(tier_cfg.model_copy(update={"size_cap_bytes": 32 << 20})) as tier:
                        await tier.raw_put_many([(key, rec)])

                asyncio.run(inject())
                injected[key] = runs
            if runs % 10 == 0:  # the real CLI now and then
                cli_runs += 1
                argv = [sys.executable, "-m", "tieredkv.cli", "verify", "-c", str(cfg_file), "--json"]
                r = subprocess.run(
                    argv + (["--repair"] if repair else []),
                    check=False,
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    timeout=60,
                )
                assert r.returncode in (0, 1), r.stderr[-2000:]
                out = json.loads(r.stdout)
                rows, reported = out["tiers"], [(c["key"], c["error"]) for c in out["corrupt"]]
                row = rows[0]
                got = (row["checked"], row["vanished"], row["repaired"])
            else:
                res = asyncio.run(ops.verify(cfg, None, None, None, repair=repair))
                reported = [(c.key, c.error) for c in res.corrupt]
                row0 = res.tiers[0]
                got = (row0.checked, row0.vanished, row0.repaired)
            checked += got[0]
            vanished += got[1]
            bad_injected = [key for key, _ in reported if bytes.fromhex(key) in injected]
            false_reports += [f"run {runs}: {key[:16]}… {err}" for key, err in reported if bytes.fromhex(key) in INDEX]
            found += len(bad_injected)
            if repair:
                repaired_injected += got[2]
                wrongly_repaired += max(got[2] - len(bad_injected), 0)
    finally:
        writer.finish()
    # after the run: what the writer committed is there, right; the injected records found went
    done = next(line for line in writer.lines if line.startswith("DONE"))
    want = writer.expected()

    async def final() -> tuple[dict[int, int], list[bool]]:
        async with LMDBTier(tier_cfg) as tier:
            present = {info.key: info for info in [i async for i in tier.scan()]}
            keys = [skey(i) for i in sorted(want)]
            got = await tier.get_many(keys)
            seqs = {}
            for i, data in zip(sorted(want), got):
                assert data is not None, f"key {i}, committed at seq {want[i]} and never deleted or evicted, is gone"
                seqs[i] = check_payload(i, data)
            stray = [INDEX[k] for k in present if k in INDEX and INDEX[k] not in want]
            assert stray == [], f"records the writer deleted, overwrote or saw evicted are there: {stray[:5]}"
            assert tier.counters["corrupt"] == 0
            return seqs, await tier.contains_many(list(injected))

    seqs, injected_left = asyncio.run(final())
    assert seqs == want, {i: (seqs[i], want[i]) for i in want if seqs.get(i) != want[i]}
    assert raw_failed == [], f"{len(raw_failed)} admin reads of good records failed: {raw_failed[:5]}"
    assert false_reports == [], f"{len(false_reports)} good records reported corrupt: {false_reports[:5]}"
    assert wrongly_repaired == 0
    assert done == "DONE corrupt=0", done
    assert found >= 1, "no injected corrupt record was reported (each was evicted before a verify?)"
    assert repaired_injected >= 1, "--repair never deleted an injected corrupt record"
    assert sum(injected_left) <= len(injected) - repaired_injected
    report(
        "lmdb-live-repair",
        verify_runs=runs,
        cli_runs=cli_runs,
        records_checked=checked,
        vanished_meanwhile=vanished,
        raw_reads=raw_read,
        raw_reads_failed=len(raw_failed),
        false_corrupt_reports=len(false_reports),
        good_records_repaired=wrongly_repaired,
        injected=len(injected),
        injected_found=found,
        injected_repaired=repaired_injected,
        writer_commits=sum(1 for x in writer.lines if x[:1] in "PD"),
        writer_records_checked=len(want),
        seconds=round(time.monotonic() - t0, 1),
    )

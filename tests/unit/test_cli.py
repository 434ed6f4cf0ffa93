"""The `tieredkv` command, run as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TKV = [sys.executable, "-m", "tieredkv.cli"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    e.update(env or {}, COLUMNS="200")
    return subprocess.run([*TKV, *args], capture_output=True, text=True, timeout=120, env=e, cwd=ROOT, check=False)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "tieredkv"
    assert script.exists(), "pip install -e . must create the tieredkv console script"
    r = subprocess.run([str(script), "version"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "0.1.0"


def test_config_check_bad_file_exits_2_naming_field_value_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - kind: lmdb\n    sync_mode: sometimes\n")
    r = run("config", "check", str(bad))
    assert r.returncode == 2
    err = " ".join(r.stderr.split())
    assert "tiers.0.sync_mode: got 'sometimes'" in err and "'durable' or 'fast'" in err
    assert "Traceback" not in r.stderr


def test_config_check_good_file() -> None:
    r = run("config", "check", "config/tieredkv.yaml")
    assert r.returncode == 0 and "2 tier(s): cpu, nvme" in r.stdout


def test_config_show_masks_secrets_and_applies_env(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers:\n  - kind: redis\n    password: hunter2\n")
    r = run("config", "show", "--json", env={"TIEREDKV_CONFIG": str(cfg), "TIEREDKV_TIERS__0__TTL_S": "60"})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["tiers"][0]["password"] == "***" and data["tiers"][0]["ttl_s"] == 60
    assert "hunter2" not in r.stdout


def test_demo_replays_trace_verifies_bytes_and_second_run_hits_first_runs_lmdb(tmp_path: Path) -> None:
    args = ("demo", "--conversations", "4", "--turns", "2", "--data-dir", str(tmp_path), "--json")
    first = run(*args)
    assert first.returncode == 0, first.stderr
    s1 = json.loads(first.stdout)
    assert s1["requests"] == 8 and s1["mismatches"] == 0 and s1["verified_blocks"] > 0
    full, swa = s1["groups"]
    assert full["kind"] == "full" and swa["kind"] == "sliding_window"
    assert full["tokens_from_cache"] > 0, "turn 2 must hit turn 1's prefix"
    assert s1["tiers"]["lmdb"]["records"] > 0 and s1["tiers"]["lmdb"]["hits"] == 0
    assert s1["store"]["failed"] == 0 and s1["load"]["failed"] == 0
    second = run(*args)
    assert second.returncode == 0, second.stderr
    s2 = json.loads(second.stdout)
    assert s2["mismatches"] == 0
    assert s2["tiers"]["lmdb"]["hits"] > 0, "a second run on the same LMDB directory hits the first run's chunks"
    assert s2["groups"][0]["tokens_from_cache"] > full["tokens_from_cache"]


def test_demo_human_summary() -> None:
    r = run("demo", "--conversations", "3", "--turns", "2")
    assert r.returncode == 0, r.stderr
    assert "loaded blocks equal what was stored" in r.stdout
    assert "sliding_window" in r.stdout.replace("\n", "") or "slidin" in r.stdout
    assert "lmdb" in r.stdout and "cpu" in r.stdout and "p99 ms" in r.stdout


def test_config_show_masks_a_url_password_that_contains_at_signs(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers:\n  - kind: redis\n    url: redis://user:p@ss@host:6379/0\n")
    for args in (("config", "show"), ("config", "show", "--json"), ("config", "show", "--json", "--sources")):
        r = run(*args, env={"TIEREDKV_CONFIG": str(cfg)})
        assert r.returncode == 0, r.stderr
        assert "redis://user:***@host:6379/0" in r.stdout, r.stdout
        assert "p@ss" not in r.stdout and "ss@host" not in r.stdout


def test_config_check_of_a_fifo_or_device_exits_2_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):  # a regression blocks on the FIFO until run()'s timeout
        r = run("config", "check", path)
        err = " ".join(r.stderr.split())
        assert r.returncode == 2, r.stderr
        assert f"config file {path!r}: is a" in err and "not a regular file" in err, err
        assert "Traceback" not in r.stderr

"""The admin CLI from the built wheel in a fresh virtual environment WITHOUT torch
(``pip install 'tieredkv[admin]'``), against a real LMDB directory and a real redis-server that
this (engine) environment wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cli_admin import NS, lmdb_tier, redis_tier, seed, write_config
from tieredkv import __version__
from tieredkv.samples import sample_config_text
from tieredkv.testing.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def _sh(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIEREDKV_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [str(a) for a in args], check=False, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def admin_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel built from this tree, installed with the ``admin`` extra only."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    shutil.copytree(ROOT / "tieredkv", src / "tieredkv", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    r = _sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "dist", src)
    assert r.returncode == 0, r.stderr
    (wheel,) = (work / "dist").glob("tieredkv-*.whl")
    venv = work / "venv"
    r = _sh(sys.executable, "-m", "venv", venv)
    assert r.returncode == 0, r.stderr
    r = _sh(venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[admin]")
    assert r.returncode == 0, r.stderr
    return venv


def test_admin_cli_from_the_wheel_works_without_torch(
    admin_venv: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    py, tkv = admin_venv / "bin" / "python", admin_venv / "bin" / "tieredkv"
    no_torch = _sh(py, "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), redis_tier(redis_server.url, "shared"))
    keys = seed(cfg, "nvme", 6)  # written by this environment's engine-side library
    seed(cfg, "shared", 2, start=100)

    def run(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        r = _sh(tkv, *args, cwd=tmp_path)
        assert r.returncode == code, f"{args}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stderr
        return r

    def run_json(*args: str, code: int = 0) -> dict:
        return json.loads(run(*args, "--json", code=code).stdout)

    assert run("--version").stdout.strip() == __version__
    assert "migrate" in run("--help").stdout
    tiers = {t["tier"]: t for t in run_json("status", "-c", str(cfg))["tiers"]}
    assert tiers["nvme"]["records"] == 6 and tiers["shared"]["records"] == 2
    page = run_json("ls", "-c", str(cfg), "--tier", "nvme", "--limit", "3")
    assert [r["key"] for r in page["records"]] == sorted(k.hex() for k in keys)[:3]
    assert run_json("inspect", keys[0].hex(), "-c", str(cfg), "--tier", "nvme")["tiers"][0]["verified"] is True
    assert [t["ok"] for t in run_json("verify", "-c", str(cfg))["tiers"]] == [6, 2]
    dry = run_json("evict", "-c", str(cfg), "--namespace", NS.fingerprint.hex(), "--dry-run")
    assert [t["victims"] for t in dry["tiers"]] == [6, 2]
    moved = run_json("migrate", "--from", "nvme", "--to", "shared", "-c", str(cfg))
    assert moved["copied"] == 6 and moved["complete"] is True
    gone = run_json("flush", "-c", str(cfg), "--tier", "shared", "--namespace", NS.fingerprint.hex(), "--yes")
    assert gone["tiers"][0]["deleted"] == 8
    assert run_json("config", "show", "-c", str(cfg))["tiers"][0]["kind"] == "lmdb"
    run("config", "init", "new.yaml")
    assert (tmp_path / "new.yaml").read_text() == sample_config_text()

    demo = run("demo", code=2)  # engine side: says what to install
    assert "pip install 'tieredkv[engine]'" in demo.stderr
    api = _sh(py, "-c", "import tieredkv; print(tieredkv.__version__); tieredkv.open_store")
    assert api.stdout.strip() == __version__ and "pip install 'tieredkv[engine]'" in api.stderr

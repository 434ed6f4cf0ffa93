"""Block hashes that do not outlive the process are reported: with a non-cryptographic
``prefix_caching_hash_algo`` and no ``PYTHONHASHSEED`` vLLM draws a random seed per process, and a
persistent tier's records never hit again after a restart. tieredkv says so once in the log, in
its gauge (tieredkv's own ``/metrics`` and vLLM's), and in ``tieredkv status``.

Engine-loop runs (vLLM's real scheduler, tieredkv's spec over LMDB): with ``xxhash`` a restart
gets no hit and the warning is there; with ``sha256`` a restart hits and nothing is said."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import ReqSpec, run_engine
from tests.vllm.test_engine_loop import spec_extra
from tieredkv.integrations.vllm import hashseed

pytestmark = pytest.mark.vllm

PROMPT = tuple(range(9, 9 + 160))
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_seed_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(hashseed, "_warned", False)
    yield
    init_none_hash(sha256)  # as the rest of the suite expects


def _tiers(path: Path, metrics_port: int | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "namespace": {"model": "ignored"},
        "tiers": [{"kind": "lmdb", "name": "nvme", "path": str(path / "lmdb"), "size_cap_bytes": "32MiB"}],
    }
    if metrics_port is not None:
        cfg["metrics"] = {"port": metrics_port}
    f = path / "tiers.json"
    f.write_text(json.dumps(cfg))
    return f


def _hits(tiers: Path, algo: str) -> int:
    res = run_engine(
        spec_extra(1, tiers), workload=[[ReqSpec("R", 0, PROMPT, 2)]], settle=True, step_budget=400, hash_algo=algo
    )
    assert res.error is None and res.wrong_bytes == 0, res.error
    return res.external_hit_tokens


def _status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tieredkv.cli", "status", "-c", str(config), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


@pytest.mark.parametrize("algo", ["xxhash", "sha256"])
def test_a_restart_hits_only_with_reproducible_hashes_and_the_other_case_is_said(
    algo: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = _tiers(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.vllm.hashseed"):
        assert _hits(tiers, algo) == 0
        restarted = _hits(tiers, algo)
    said = [r.message for r in caplog.records if "block hashes differ in every process" in r.message]
    if algo == "xxhash":
        assert restarted == 0  # what the warning is about
        assert len(said) == 1 and "nvme" in said[0] and "PYTHONHASHSEED" in said[0]
    else:
        assert restarted > 0 and said == []


def test_the_gauge_on_both_endpoints_and_in_status(tmp_path: Path) -> None:
    from vllm.utils.hashing import sha256, xxhash
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from tieredkv.integrations.vllm.stats import HASHES_REPRODUCIBLE, StoreStatsReporter, values_by_metric
    from tieredkv.store import open_store
    from tieredkv.testing.servers import free_port

    port = free_port()
    cfg = json.loads(_tiers(tmp_path / "kv", port).read_text())
    with open_store(cfg) as store:
        reporter = StoreStatsReporter(lambda: [store])
        init_none_hash(xxhash)
        stats = reporter.take()
        assert stats is not None and store.block_hashes_reproducible is False
        assert values_by_metric(stats.data)[HASHES_REPRODUCIBLE] == {(): 0.0}
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "tieredkv_block_hashes_reproducible 0.0" in body
        config = tmp_path / "cli.json"
        config.write_text(json.dumps({k: v for k, v in cfg.items() if k != "metrics"}))
        url = f"http://127.0.0.1:{port}/metrics"
        r = _status(config, "--metrics-url", url)
        assert "block hashes not reproducible" in r.stderr, (r.returncode, r.stdout, r.stderr)
        assert json.loads(_status(config, "--json", "--metrics-url", url).stdout)["block_hashes_reproducible"] is False
    # a fresh store (a new process would be) under sha256: reproducible, and said as 1
    with open_store(json.loads(_tiers(tmp_path / "kv2").read_text())) as store:
        init_none_hash(sha256)
        stats = StoreStatsReporter(lambda: [store]).take()
        assert stats is not None and store.block_hashes_reproducible is True
        assert values_by_metric(stats.data)[HASHES_REPRODUCIBLE] == {(): 1.0}

"""Records bound to the weights, through vLLM's real scheduler on the engine loop.

A checkpoint directory (the tiny Llama config and safetensors weights) is served with
tieredkv's spec (and its secondary tier) over a persistent LMDB directory. A restarted engine on
the same weights is served the first run's records; a fine-tune deployed at the same path (every
file the same size) is not; the same weights copied to another directory (another model name for
vLLM) are; and the original weights again are. The fingerprint is found by tieredkv itself from
vLLM's model path, and the log says what it read.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_weights import model, save_sharded, write_safetensors
from tests.vllm.engine import TINY_MODEL, ReqSpec, run_engine
from tests.vllm.test_engine_loop import secondary_extra, spec_extra

pytestmark = pytest.mark.vllm

PROMPT = tuple(range(5, 5 + 200))


def _checkpoint(root: Path, seed: int) -> Path:
    d = save_sharded(root, model(seed), 2)
    shutil.copy(TINY_MODEL / "config.json", d / "config.json")
    return d


def _tiers(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lmdb = {"kind": "lmdb", "name": "nvme", "path": str(path / "lmdb"), "size_cap_bytes": "32MiB"}
    f = path / "tiers.json"
    f.write_text(json.dumps({"namespace": {"model": "ignored-in-vllm-modes"}, "tiers": [lmdb]}))
    return f


def _run(extra: dict[str, Any], where: Path) -> int:
    """External hit tokens of one request with PROMPT on a fresh engine serving ``where``."""
    secondary = extra["spec_name"] == "TieringOffloadingSpec"
    res = run_engine(
        extra,
        workload=[[ReqSpec("R", 0, PROMPT, 2)]],
        model=where,
        settle=True,
        step_budget=400,
        tiering_cpu_worker=secondary,
    )
    assert res.error is None, res.error
    assert res.wrong_bytes == 0 and not res.unfinished_requests
    return res.external_hit_tokens


@pytest.mark.parametrize("mode", ["spec", "secondary"])
def test_a_checkpoint_replaced_in_place_is_never_served_the_old_kv(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = _tiers(tmp_path / "kv")
    extra = spec_extra(1, tiers) if mode == "spec" else secondary_extra(1, tiers)
    served = _checkpoint(tmp_path / "models" / "llama", 0)
    original = tmp_path / "original"
    shutil.copytree(served, original)
    with caplog.at_level(logging.INFO, logger="tieredkv.weights"):
        assert _run(extra, served) == 0  # cold: stores
    assert any("namespace bound to weights" in r.message and str(served) in r.message for r in caplog.records)
    assert _run(extra, served) > 0  # a restart on the same weights: served from LMDB

    # a fine-tune deployed at the same path: same names, shapes and file sizes, other bytes
    sizes = sorted(f.stat().st_size for f in served.iterdir())
    tuned = {k: (v.float() * 1.5).to(v.dtype) for k, v in model(0).items()}
    for f in served.glob("*.safetensors"):
        f.unlink()
    names = list(tuned)
    for s in range(2):
        write_safetensors(served / f"model-{s + 1:05d}-of-00002.safetensors", {n: tuned[n] for n in names[s::2]})
    assert sorted(f.stat().st_size for f in served.iterdir()) == sizes
    assert _run(extra, served) == 0, "the old weights' KV was served to a new checkpoint under the same name"

    assert _run(extra, original) > 0  # the first weights under another path (another model name)
    shutil.rmtree(served)
    shutil.copytree(original, served)
    assert _run(extra, served) > 0  # the original weights back at the first path


def test_a_model_without_local_weights_falls_back_to_its_name_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers = _tiers(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger="tieredkv.weights"):
        _run(spec_extra(1, tiers), TINY_MODEL)  # a config-only directory: no *.safetensors
    assert any("cannot be fingerprinted" in r.message and "name and revision" in r.message for r in caplog.records)


def test_a_hub_id_is_found_in_the_local_cache_as_vllm_downloads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id resolves to its snapshot in the local Hugging Face cache (blobs behind symlinks, as
    vLLM's download leaves them), never downloaded: the same fingerprint as the files themselves."""
    from tieredkv.integrations.vllm.namespace import weights_location
    from tieredkv.weights import weights_fingerprint

    src = _checkpoint(tmp_path / "src", 3)
    repo = tmp_path / "hub" / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(blob)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # (HF_HUB_CACHE, read at import)
    found = weights_location("org/tiny")
    assert found is not None and Path(found).resolve() == snap.resolve()
    assert weights_fingerprint(found).digest == weights_fingerprint(src).digest
    assert weights_location("org/not-cached") is None

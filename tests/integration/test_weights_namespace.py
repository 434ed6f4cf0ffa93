"""Records bound to the weights: a store on persistent LMDB, restarted over the same model name
with other weights, misses; over the same weights copied elsewhere, hits."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import tieredkv
from tests.unit.test_weights import model, save_sharded
from tieredkv.errors import ConfigError
from tieredkv.pipeline import KeyState


def _cfg(data: Path, weights: Path | None, mode: str = "sampled", name: str = "org/same-name") -> dict:
    ns: dict = {"model": name, "revision": "main", "weights_fingerprint": mode}
    if weights is not None:
        ns["weights_path"] = str(weights)
    return {
        "namespace": ns,
        "tiers": [{"kind": "lmdb", "path": str(data), "map_size_bytes": "16MiB", "size_cap_bytes": "8MiB"}],
    }


def _kv() -> torch.Tensor:
    return torch.arange(16 * 1024, dtype=torch.int32).view(16, 1024).to(torch.uint8)


def _store_then_lookup(
    data: Path, weights: Path | None, store_it: bool, mode: str = "sampled", name: str = "org/same-name"
) -> KeyState:
    kv, out = _kv(), torch.zeros(16, 1024, dtype=torch.uint8)
    with tieredkv.open_store(_cfg(data, weights, mode, name)) as store:
        store.register_group(0, [kv], blocks_per_chunk=2)
        store.register_group(1, [out], blocks_per_chunk=2)
        key = store.key(b"\x07" * 32, 0)
        if store_it:
            job = store.store(0, [(key, (2, 3))])
            assert job is not None and store.wait([job])[job].ok
        ((state, _),) = store.lookup([key])
        if state is KeyState.HIT:  # and the bytes are the ones stored
            job = store.load(0, [(key, (4, 5))])
            assert job is not None and store.wait([job])[job].ok
            assert torch.equal(kv[4:6], _kv()[2:4])
        return state


def test_same_name_other_weights_miss_identical_weights_elsewhere_hit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = model()
    a = save_sharded(tmp_path / "models" / "a", w, 2)
    tuned = dict(w)
    tuned["embed.weight"] = (w["embed.weight"].float() + 0.5).to(torch.bfloat16)
    b = save_sharded(tmp_path / "models" / "b", tuned, 2)  # a fine-tune under the same model name
    copy = tmp_path / "node2" / "a"
    shutil.copytree(a, copy)
    data = tmp_path / "kv"
    with caplog.at_level(logging.INFO, logger="tieredkv.weights"):
        assert _store_then_lookup(data, a, store_it=True) is KeyState.HIT
    assert any("namespace bound to weights" in r.message and "5 tensors" in r.message for r in caplog.records)
    assert _store_then_lookup(data, b, store_it=False) is KeyState.MISS  # other weights: old KV not served
    assert _store_then_lookup(data, copy, store_it=False) is KeyState.HIT  # same weights, other path
    assert _store_then_lookup(data, a, store_it=False) is KeyState.HIT  # the original again
    # with a weights fingerprint the name is a label: another node names the checkpoint otherwise
    assert _store_then_lookup(data, copy, store_it=False, name="/mnt/models/a") is KeyState.HIT
    # without a fingerprint the name alone decides: the weights-bound record is not one of its own
    assert _store_then_lookup(data, None, store_it=False) is KeyState.MISS
    assert _store_then_lookup(data, a, store_it=False, mode="off") is KeyState.MISS


def test_an_explicit_weights_path_that_is_not_a_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="namespace.weights_path"):
        tieredkv.open_store(_cfg(tmp_path / "kv", tmp_path / "empty"))
    with pytest.raises(ConfigError, match="namespace.weights_path"):
        tieredkv.open_store(_cfg(tmp_path / "kv", tmp_path / "nowhere"))

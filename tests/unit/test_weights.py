"""The weights fingerprint: equal for identical weights wherever and however they are stored,
different when a tensor changes, and clear about files that are not a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tieredkv.errors import ConfigError
from tieredkv.weights import WHOLE_TENSOR_BYTES, WINDOW, weights_fingerprint

_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file as the format defines it (8-byte header length, JSON header, data)."""
    head: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    blobs, at = [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        head[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),  # 256 KiB: sampled
        "layers.0.attn.q.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(256, generator=g).to(torch.float32),  # small: read whole
        "layers.1.mlp.up.weight": torch.randn(1024, 256, generator=g).to(torch.float16),
        "lm_head.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
    }


def save_sharded(root: Path, tensors: dict[str, torch.Tensor], shards: int) -> Path:
    root.mkdir(parents=True)
    names = list(tensors)
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors", part)
    (root / "config.json").write_text("{}")
    return root


def test_identical_weights_elsewhere_match_a_changed_tensor_does_not(tmp_path: Path) -> None:
    w = model()
    a = weights_fingerprint(save_sharded(tmp_path / "a", w, 2))
    # another path, another split into files, other file times, a symlinked snapshot
    b_dir = save_sharded(tmp_path / "b", w, 3)
    for f in b_dir.iterdir():
        os.utime(f, (1, 1))
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for f in b_dir.iterdir():  # a hub snapshot: every file a symlink to a blob
        (snap / f.name).symlink_to(f)
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "config.json").write_text('{"_name_or_path": "/elsewhere"}')  # a label only
    single = tmp_path / "single" / "one.safetensors"
    write_safetensors(single, dict(reversed(list(w.items()))), metadata={"format": "pt", "note": "other"})
    assert weights_fingerprint(b_dir).digest == a.digest
    assert weights_fingerprint(snap).digest == a.digest
    assert weights_fingerprint(single).digest == a.digest
    assert a.tensors == 5 and a.files == 2 and a.weight_bytes == sum(t.numel() * t.element_size() for t in w.values())

    # one tensor changed (same dtype and shape, so the same file sizes): a fine-tune
    tuned = dict(w)
    tuned["layers.1.mlp.up.weight"] = (w["layers.1.mlp.up.weight"].float() * 1.01).to(torch.float16)
    c_dir = save_sharded(tmp_path / "c", tuned, 2)
    assert sorted(f.stat().st_size for f in c_dir.iterdir()) == sorted(
        f.stat().st_size for f in (tmp_path / "a").iterdir()
    )
    c = weights_fingerprint(c_dir)
    assert c.digest != a.digest
    # the original weights again (written anew): the first fingerprint again
    assert weights_fingerprint(save_sharded(tmp_path / "a2", w, 2)).digest == a.digest


def test_a_changed_name_dtype_or_shape_or_one_sampled_byte_changes_it(tmp_path: Path) -> None:
    w = model()
    base = weights_fingerprint(save_sharded(tmp_path / "base", w, 1)).digest
    renamed = {("model." + k if k == "lm_head.weight" else k): v for k, v in w.items()}
    retyped = {**w, "layers.0.norm.weight": w["layers.0.norm.weight"].to(torch.float16)}
    reshaped = {**w, "embed.weight": w["embed.weight"].reshape(256, 512)}
    small = {**w, "layers.0.norm.weight": w["layers.0.norm.weight"].clone()}
    small["layers.0.norm.weight"][100] += 1  # a small tensor is read whole: any byte counts
    first_window = {**w, "embed.weight": w["embed.weight"].clone()}
    first_window["embed.weight"][0, 0] += 1
    last_window = {**w, "embed.weight": w["embed.weight"].clone()}
    last_window["embed.weight"][-1, -1] += 1
    for i, variant in enumerate((renamed, retyped, reshaped, small, first_window, last_window)):
        assert weights_fingerprint(save_sharded(tmp_path / f"v{i}", variant, 1)).digest != base, i


def test_the_models_config_beside_the_weights_counts_its_labels_do_not(tmp_path: Path) -> None:
    w = model()
    d = save_sharded(tmp_path / "m", w, 1)
    (d / "config.json").write_text(
        json.dumps({"rope_theta": 10000.0, "_name_or_path": "a", "transformers_version": "1"})
    )
    base = weights_fingerprint(d).digest
    (d / "config.json").write_text(json.dumps({"_name_or_path": "b", "rope_theta": 10000.0}))
    assert weights_fingerprint(d).digest == base
    (d / "config.json").write_text(json.dumps({"rope_theta": 500000.0}))  # other RoPE: other KV
    assert weights_fingerprint(d).digest != base
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        weights_fingerprint(d)


def test_sampled_reads_are_bounded_and_full_reads_everything(tmp_path: Path) -> None:
    big = {f"layers.{i}.w": torch.zeros(1 << 20, dtype=torch.uint8) for i in range(6)}
    d = save_sharded(tmp_path / "big", big, 2)
    fp = weights_fingerprint(d)
    assert fp.bytes_read <= 6 * 8 * WINDOW < fp.weight_bytes // 16
    full = weights_fingerprint(d, full=True)
    assert full.bytes_read == full.weight_bytes == 6 << 20 and full.digest != fp.digest
    # a byte between two sampled windows: the sampled fingerprint may miss it, the full one never
    changed = {**big, "layers.3.w": big["layers.3.w"].clone()}
    changed["layers.3.w"][WHOLE_TENSOR_BYTES + 12345] = 7
    d2 = save_sharded(tmp_path / "big2", changed, 2)
    assert weights_fingerprint(d2, full=True).digest != full.digest


def test_files_that_are_not_a_checkpoint_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        weights_fingerprint(tmp_path)
    with pytest.raises(ConfigError, match="neither a file nor a directory"):
        weights_fingerprint(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ConfigError, match="x.safetensors: not a safetensors file"):
        weights_fingerprint(bad)
    (bad / "x.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(ConfigError, match="not JSON"):
        weights_fingerprint(bad)
    head = json.dumps({"w": {"dtype": "U8", "shape": [10], "data_offsets": [0, 4096]}}).encode()
    (bad / "x.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 10)
    with pytest.raises(ConfigError, match="outside the file"):
        weights_fingerprint(bad)
    write_safetensors(bad / "x.safetensors", {"w": torch.zeros(4, dtype=torch.uint8)})
    shutil.copy(bad / "x.safetensors", bad / "y.safetensors")
    with pytest.raises(ConfigError, match="also in"):
        weights_fingerprint(bad)

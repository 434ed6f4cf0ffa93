"""Config models, loading, env overrides and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from tieredkv.config import CPUTierConfig, LMDBTierConfig, RedisTierConfig, TieredKVConfig, load_config
from tieredkv.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_cpu_and_lmdb_tiers() -> None:
    cfg = load_config(env={})
    assert [t.kind for t in cfg.tiers] == ["cpu", "lmdb"]
    assert cfg.tier("lmdb").size_cap_bytes < cfg.tier("lmdb").map_size_bytes


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.yaml")))
def test_shipped_sample_configs_validate(path: Path) -> None:
    cfg = load_config(path, env={})
    assert cfg.tiers


def test_every_field_has_a_description() -> None:
    for model in (TieredKVConfig, CPUTierConfig, LMDBTierConfig, RedisTierConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_byte_sizes_parse_units() -> None:
    cfg = load_config({"tiers": [{"kind": "cpu", "capacity_bytes": "2GiB", "segment_bytes": "4MiB"}]}, env={})
    assert cfg.tiers[0].capacity_bytes == 2 << 30 and cfg.tiers[0].segment_bytes == 4 << 20


def test_unknown_field_names_path_value_and_suggestion() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "lmdb", "map_sze_bytes": 5}]}, env={})
    msg = str(ei.value)
    assert "tiers.0.map_sze_bytes" in msg and "got 5" in msg
    assert "did you mean 'map_size_bytes'" in msg and "allowed fields" in msg


def test_unknown_kind_lists_known_kinds() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.0.*'foo'.*'cpu', 'lmdb', 'redis'"):
        load_config({"tiers": [{"kind": "foo"}]}, env={})


def test_bad_value_names_field_value_and_expectation() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "redis", "url": "http://h", "ttl_s": -1}]}, env={})
    msg = str(ei.value)
    assert "tiers.0.url: got 'http://h'" in msg and "redis://" in msg
    assert "tiers.0.ttl_s: got -1" in msg and "greater than 0" in msg
    assert isinstance(ei.value, ValueError)


def test_cross_field_rule_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match="size_cap_bytes .* must be below map_size_bytes .* raise map_size_bytes"):
        load_config({"tiers": [{"kind": "lmdb", "map_size_bytes": "1GiB", "size_cap_bytes": "1GiB"}]}, env={})


def test_duplicate_tier_names_refused() -> None:
    with pytest.raises(ConfigError, match="duplicate tier name 'cpu'"):
        load_config({"tiers": [{"kind": "cpu"}, {"kind": "cpu"}]}, env={})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad, env={})


def test_env_overrides_by_name_index_and_nested(tmp_path: Path) -> None:
    env = {
        "TIEREDKV_NAMESPACE__MODEL": "org/model",
        "TIEREDKV_TIERS__nvme__PATH": str(tmp_path / "kv"),
        "TIEREDKV_TIERS__0__CAPACITY_BYTES": "64MiB",
        "TIEREDKV_TIERS__0__SEGMENT_BYTES": "8MiB",
        "TIEREDKV_CONFIG": "ignored.yaml",
        "OTHER": "x",
    }
    cfg = load_config(ROOT / "config" / "tieredkv.yaml", env=env)
    assert cfg.namespace.model == "org/model"
    assert cfg.tier("nvme").path == str(tmp_path / "kv")
    assert cfg.tiers[0].capacity_bytes == 64 << 20


def test_env_override_bad_value_and_unknown_tier() -> None:
    with pytest.raises(ConfigError, match="tiers.0.capacity_bytes: got 'lots'"):
        load_config(env={"TIEREDKV_TIERS__0__CAPACITY_BYTES": "lots"})
    with pytest.raises(ConfigError, match="no tier named 'nope'"):
        load_config(env={"TIEREDKV_TIERS__nope__PATH": "/x"})


def test_tier_lookup_error_lists_names() -> None:
    with pytest.raises(ConfigError, match=r"no tier named 'x'; configured: \['cpu', 'lmdb'\]"):
        load_config(env={}).tier("x")

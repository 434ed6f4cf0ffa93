"""Config models, loading, env overrides and error messages."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tieredkv.config import (
    CPUTierConfig,
    LMDBTierConfig,
    RedisTierConfig,
    TierConfigBase,
    TieredKVConfig,
    config_provenance,
    load_config,
    mask_secrets,
)
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
    with pytest.raises(ConfigError, match=r"tiers\.0.*'foo'.*'cpu', 'fs', 'lmdb', 'redis'"):
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


# ---- bounded reading: only regular files, at most 1 MiB, no alias bombs ---------------------

_LOAD_CHILD = """
import sys
from tieredkv.config import load_config
from tieredkv.errors import ConfigError
try:
    load_config(sys.argv[1], env={})
except ConfigError as e:
    print(e)
    sys.exit(2)
"""


def _load_in_child(path: Path | str) -> subprocess.CompletedProcess[str]:
    """``load_config(path)`` in a child process held to 1 GiB of address space: a regression that
    reads ``/dev/zero`` or expands an alias bomb dies of MemoryError there (or hits the timeout)
    instead of eating this machine's memory; a correct loader answers at once."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run(
        [sys.executable, "-c", _LOAD_CHILD, str(path)],
        capture_output=True, text=True, timeout=100, preexec_fn=limit, cwd=ROOT, check=False,
    )  # fmt: skip


def test_a_fifo_as_config_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []
    done = threading.Event()

    def load() -> None:
        try:
            load_config(fifo, env={})
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result.append(e)
        done.set()

    threading.Thread(target=load, daemon=True).start()
    if not done.wait(timeout=60):  # a regression blocks in open(): release it with a writer's EOF
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.wait(timeout=60)
        pytest.fail("load_config blocked on a FIFO (waiting for a writer)")
    assert isinstance(result[0], ConfigError), result
    msg = str(result[0])
    assert f"config file {str(fifo)!r}: is a FIFO (named pipe), not a regular file" in msg
    assert "give the path of a YAML config file" in msg


def test_a_device_or_directory_as_config_is_refused_without_reading_it(tmp_path: Path) -> None:
    r = _load_in_child("/dev/zero")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config file '/dev/zero': is a character device, not a regular file" in r.stdout
    with pytest.raises(ConfigError, match=r"is a directory, not a regular file; give the path of a YAML config"):
        load_config(tmp_path, env={})


def test_a_config_over_1_mib_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\nversion: 1\n")
    with pytest.raises(ConfigError, match=r"got 1,048,\d+ bytes — a config file may hold at most 1,048,576 bytes"):
        load_config(big, env={})
    ok = tmp_path / "ok.yaml"
    ok.write_text("# " + "x" * 100_000 + "\nversion: 1\n")
    assert load_config(ok, env={}).version == 1


def test_a_config_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"namespace: {model: caf\xe9}\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 22\); save the config as UTF-8"):
        load_config(bad, env={})


BILLION_LAUGHS = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['lol'] * 9)}]\n"
    for prev, name in zip(["", *"abcdefgh"], "abcdefghi")
)


def test_a_yaml_alias_bomb_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 600  # a few hundred bytes that expand to 9**9 strings
    r = _load_in_child(bomb)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"config file {str(bomb)!r}: the YAML expands to more than 100,000 values" in r.stdout
    assert "use fewer nested anchors/aliases" in r.stdout
    with pytest.raises(ConfigError, match="TIEREDKV_NAMESPACE__MODEL: the YAML expands to more than 100,000"):
        load_config(env={"TIEREDKV_NAMESPACE__MODEL": BILLION_LAUGHS})


def test_a_recursive_alias_or_deep_nesting_is_refused(tmp_path: Path) -> None:
    rec = tmp_path / "rec.yaml"
    rec.write_text("version: 1\nloop: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"the value at line 2 holds an alias to itself \(a recursive structure\)"):
        load_config(rec, env={})
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="nested too deeply to read"):
        load_config(deep, env={})


def test_plain_anchors_aliases_and_merge_keys_still_load(tmp_path: Path) -> None:
    cfg = tmp_path / "dry.yaml"
    cfg.write_text(
        "namespace: {model: &m org/model}\n"
        "tiers:\n"
        "  - &disk {kind: lmdb, name: a, path: /tmp/a, map_size_bytes: 64MiB, size_cap_bytes: 32MiB}\n"
        "  - <<: *disk\n    name: b\n    path: /tmp/b\n"
    )
    c = load_config(cfg, env={})
    assert [t.label for t in c.tiers] == ["a", "b"] and c.tiers[1].map_size_bytes == 64 << 20


# ---- secrets in URLs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://app:s3cret@127.0.0.1:6379/0", "redis://app:***@127.0.0.1:6379/0"),
        ("redis://user:p@ss@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:p@s/s?x#y@host:6380", "rediss://:***@host:6380"),
        ("unix:///run/redis.sock?db=0&password=p@ss", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_url_passwords_are_masked_whatever_they_contain(url: str, masked: str) -> None:
    assert mask_secrets({"tiers": [{"url": url}]}) == {"tiers": [{"url": masked}]}


def test_a_bad_url_field_error_masks_an_at_sign_password() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "redis", "url": "http://user:p@ss@host:6379/0"}]}, env={})
    assert "http://user:***@host:6379/0" in str(ei.value) and "ss@" not in str(ei.value)


# ---- tiers resolve their model through the registry ----------------------------------------


def test_tiers_items_are_the_registered_models_and_dump_all_their_fields(tmp_path: Path) -> None:
    lmdb = LMDBTierConfig(path=str(tmp_path / "kv"))
    cfg = TieredKVConfig(tiers=[CPUTierConfig(capacity_bytes="64MiB"), lmdb])
    assert cfg.tiers[1] is lmdb and isinstance(cfg.tiers[0], TierConfigBase)
    dumped = cfg.model_dump(mode="json")["tiers"]
    assert dumped[0]["capacity_bytes"] == 64 << 20 and dumped[1]["path"] == str(tmp_path / "kv")
    assert dumped[1]["eviction_policy"] == "lru"
    again = load_config(cfg.model_dump(mode="json"), env={})
    assert [type(t) for t in again.tiers] == [CPUTierConfig, LMDBTierConfig]
    assert [t.model_dump(exclude={"name"}) for t in again.tiers] == [t.model_dump(exclude={"name"}) for t in cfg.tiers]


def test_eviction_policy_override_by_tier_name_and_provenance() -> None:
    env = {"TIEREDKV_TIERS__lmdb__EVICTION_POLICY": "lru"}
    cfg, origin = config_provenance(env=env)
    assert cfg.tier("lmdb").eviction_policy == "lru"
    assert origin["tiers.1.eviction_policy"] == "env:TIEREDKV_TIERS__lmdb__EVICTION_POLICY"
    assert origin["tiers.0.eviction_policy"] == "default"
    with pytest.raises(ConfigError, match="tiers.1.eviction_policy: got 'mru' — unknown eviction policy 'mru'"):
        load_config(env={"TIEREDKV_TIERS__lmdb__EVICTION_POLICY": "mru"})


def test_a_tier_without_kind_or_of_a_bad_type_says_what_kinds_exist() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"capacity_bytes": 5}, {"kind": 7}, "cpu"]}, env={})
    lines = str(ei.value).splitlines()[1:]
    assert lines[0].strip().startswith("tiers.0: a tier needs a 'kind'; allowed kinds: 'cpu', 'fs', 'lmdb', 'redis'")
    assert lines[1].strip().startswith("tiers.1: unknown tier kind 7; allowed kinds:")
    assert lines[2].strip().startswith("tiers.2: got 'cpu' — Input should be a valid dictionary")


def test_with_local_dir_and_with_capacity_know_the_fields_so_callers_do_not(tmp_path: Path) -> None:
    cpu, lmdb, redis = CPUTierConfig(), LMDBTierConfig(name="nvme"), RedisTierConfig()
    assert cpu.with_local_dir(tmp_path) is cpu and redis.with_local_dir(tmp_path) is redis
    moved = lmdb.with_local_dir(tmp_path / "kv")
    assert moved.path == str(tmp_path / "kv") and moved.label == "nvme" and lmdb.path != moved.path
    assert redis.with_capacity(1 << 30) is redis  # the server holds the capacity
    big = cpu.with_capacity(100 << 20, largest_record_bytes=20 << 20)
    assert big.segment_bytes == 20 << 20 and big.capacity_bytes == 120 << 20
    sized = lmdb.with_capacity(1 << 30)
    assert sized.size_cap_bytes == 1 << 30 and sized.map_size_bytes == lmdb.map_size_bytes  # 4 GiB: room
    assert sized.max_map_size_bytes == lmdb.max_map_size_bytes  # 64 GiB
    huge = lmdb.with_capacity(40 << 30)
    assert huge.size_cap_bytes == 40 << 30 and huge.map_size_bytes == (80 << 30) + (32 << 20)
    assert huge.max_map_size_bytes == 2 * huge.map_size_bytes


def test_copy_threads_names_field_value_and_range() -> None:
    """``pipeline.copy_threads`` (host block copies split over threads) takes 1 to 8."""
    assert load_config({}, env={}).pipeline.copy_threads == 2
    assert load_config({"pipeline": {"copy_threads": 1}}, env={}).pipeline.copy_threads == 1
    for bad, says in ((0, "greater than or equal to 1"), (9, "less than or equal to 8")):
        with pytest.raises(ConfigError) as ei:
            load_config({"pipeline": {"copy_threads": bad}}, env={})
        assert f"pipeline.copy_threads: got {bad}" in str(ei.value) and says in str(ei.value)

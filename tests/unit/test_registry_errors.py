"""The tier registry and the error tree."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Literal

import pytest
from pydantic import Field

from tieredkv import errors
from tieredkv.backends import registry as reg
from tieredkv.backends.base import Tier, TierCapabilities
from tieredkv.backends.cpu import CPUTier
from tieredkv.config import CPUTierConfig, TierConfigBase, load_config
from tieredkv.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(reg._registry)
    yield
    reg._registry.clear()
    reg._registry.update(saved)


class MineConfig(TierConfigBase):
    kind: Literal["mine"] = Field("mine", description="Tier kind.")
    slots: int = Field(4, gt=0, description="How many slots.")


class MineTier(CPUTier):
    """A registered kind (a CPU slab under another name and config)."""

    kind = "mine"
    config_model = MineConfig
    capabilities = TierCapabilities(local_eviction=False)

    def __init__(self, config: MineConfig, **kwargs: object) -> None:
        super().__init__(CPUTierConfig(capacity_bytes=config.slots << 20, segment_bytes="1MiB"), **kwargs)
        self.mine = config


@pytest.mark.parametrize("kind", sorted(reg.known_tiers))
def test_every_builtin_tier_imports(kind: str) -> None:
    # If someone moves a tier module but forgets registry.py, this fails.
    cls = reg.get_tier_class(kind)
    assert issubclass(cls, Tier) and cls.kind == kind


@pytest.mark.parametrize("kind", sorted(reg.known_tiers))
def test_every_builtin_entry_is_consistent(kind: str) -> None:
    entry = reg.tier_entry(kind)
    assert entry.kind == kind and entry.source == "built in" and entry.install_hint.startswith("pip install")
    assert entry.config_model.model_fields["kind"].default == kind
    assert entry.capabilities is entry.tier_class.capabilities == reg.tier_capabilities(kind)
    assert entry.tier_class.evicts_locally is entry.capabilities.local_eviction
    declared = getattr(entry.tier_class, "config_model", None)
    assert declared in (None, entry.config_model), "the class and the registry disagree on the config model"
    policy = entry.eviction_policy(entry.config_model())
    assert (policy is not None) is entry.capabilities.local_eviction
    assert kind in reg.known_kinds()


def test_builtin_capabilities() -> None:
    caps = {k: reg.tier_capabilities(k) for k in reg.known_tiers}
    assert caps["cpu"] == TierCapabilities(
        in_process=True,
        slots=True,
        access_stamps=True,
        local_eviction=True,
        sync_probe=True,
        medium="host",
        tenants=True,
    )
    assert caps["lmdb"] == TierCapabilities(
        access_stamps=True,
        local_eviction=True,
        shared=True,
        sync_probe=True,
        writes_in_flight=2,
        medium="disk",
        tenants=True,
    )
    assert caps["cpu"].writes_in_flight == 1
    assert caps["redis"].writes_in_flight == 2  # ordered per key by the tier itself (RedisTier._put_many)
    assert not caps["redis"].local_eviction and caps["redis"].shared and not caps["redis"].in_process
    assert caps["redis"].medium == "remote" and caps["redis"].tenants  # quotas kept in Redis (_redis_tenants)


def test_importing_config_or_registry_or_validating_imports_no_backend() -> None:
    code = (
        "import sys\n"
        "from tieredkv.backends import registry\n"
        "from tieredkv.config import load_config\n"
        "load_config({'tiers': [{'kind': 'cpu'}, {'kind': 'lmdb'}, {'kind': 'redis'}]}, env={})\n"
        "registry.known_kinds()\n"
        "print(sorted(m for m in ('torch', 'lmdb', 'redis', 'numpy') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_a_registered_kind_is_one_entry_for_config_build_and_capabilities() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.0: unknown tier kind 'mine'"):
        load_config({"tiers": [{"kind": "mine"}]}, env={})
    reg.register_tier("mine", MineTier)
    assert "mine" in reg.known_kinds()
    entry = reg.tier_entry("mine")
    assert (entry.tier_class, entry.config_model, entry.source) == (MineTier, MineConfig, "register_tier")
    assert entry.eviction_policy(MineConfig()) is None and MineTier.evicts_locally is False
    cfg = load_config({"tiers": [{"kind": "mine", "slots": 2}, {"kind": "cpu"}]}, env={})
    assert isinstance(cfg.tiers[0], MineConfig) and cfg.tiers[0].label == "mine"
    assert cfg.model_dump()["tiers"][0] == {"kind": "mine", "name": "mine", "op_timeout_s": 5.0, "slots": 2}
    tier = reg.build_tier(cfg.tiers[0])
    assert isinstance(tier, MineTier) and tier.mine.slots == 2 and tier.name == "mine"
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "mine", "slot": 2}, {"kind": "nope"}]}, env={})
    msg = str(ei.value)
    assert "tiers.0.slot: got 2 — Extra inputs are not permitted; did you mean 'slots'?" in msg
    assert "tiers.1: unknown tier kind 'nope'; allowed kinds: 'cpu', 'fs', 'lmdb', 'mine', 'redis'" in msg
    with pytest.raises(ConfigError, match=r"tiers\.0\.slots: got 0 — .*greater than 0; expected: How many slots"):
        load_config({"tiers": [{"kind": "mine", "slots": 0}]}, env={})


def test_a_kind_whose_class_has_no_config_model_is_a_clear_config_error() -> None:
    class Bare(CPUTier):
        kind = "bare"
        config_model = None

    reg.register_tier("bare", Bare)
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "bare"}]}, env={})
    assert "tiers.0: tier kind 'bare'" in str(ei.value) and "subclass of tieredkv.config.TierConfigBase" in str(
        ei.value
    )
    reg.register_tier("ghost", "tieredkv_no_such_module:Ghost")
    with pytest.raises(ConfigError, match=r"tiers\.0: tier kind 'ghost' needs a package that is not installed"):
        load_config({"tiers": [{"kind": "ghost"}]}, env={})


def test_unknown_kind_lists_known_and_entry_point_group() -> None:
    with pytest.raises(
        errors.BackendNotFoundError,
        match=r"unknown tier kind 'nope'; known: \['cpu', 'fs', 'lmdb', 'redis'\].*tieredkv.backends",
    ):
        reg.get_tier_class("nope")


def test_register_duplicates_and_read_only_view() -> None:
    class MyTier(reg.get_tier_class("cpu")):  # type: ignore[misc]
        kind = "mine"

    reg.register_tier("mine", MyTier)
    assert reg.get_tier_class("mine") is MyTier
    with pytest.raises(ValueError, match="already registered"):
        reg.register_tier("cpu", MyTier)
    with pytest.raises(ValueError, match="already registered"):
        reg.register_tier("mine", "x.y:Z")
    reg.register_tier("mine", "x.y:Z", clobber=True)
    with pytest.raises(TypeError):
        reg.registry["x"] = 1  # type: ignore[index]


def test_missing_module_gives_install_hint() -> None:
    reg.register_tier("ghost", "tieredkv_no_such_module:Ghost")
    with pytest.raises(errors.BackendNotFoundError, match="not installed"):
        reg.get_tier_class("ghost")


def test_not_a_tier_is_refused() -> None:
    reg.register_tier("bad", "tieredkv.config:CPUTierConfig")
    with pytest.raises(errors.BackendNotFoundError, match="not a Tier subclass"):
        reg.get_tier_class("bad")


def test_build_tier_constructs_without_opening() -> None:
    tier = reg.build_tier(CPUTierConfig(capacity_bytes="16MiB"))
    assert tier.kind == "cpu" and not tier.closed and tier.name == "cpu"


def test_error_tree_roots_and_builtins() -> None:
    leaves = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.TieredKVError)]
    assert len(leaves) >= 8
    for cls in leaves:
        if cls is errors.TieredKVError:
            continue
        assert issubclass(cls, errors.TieredKVError)
        assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:-2]), cls
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.TierTimeoutError, TimeoutError)
    assert issubclass(errors.TierUnavailableError, ConnectionError)
    assert issubclass(errors.TierFullError, MemoryError)

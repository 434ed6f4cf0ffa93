"""The tier registry and the error tree."""

from __future__ import annotations

import inspect

import pytest

from tieredkv import errors
from tieredkv.backends import registry as reg
from tieredkv.backends.base import Tier
from tieredkv.config import CPUTierConfig


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(reg._registry)
    yield
    reg._registry.clear()
    reg._registry.update(saved)


@pytest.mark.parametrize("kind", sorted(reg.known_tiers))
def test_every_builtin_tier_imports(kind: str) -> None:
    # If someone moves a tier module but forgets registry.py, this fails.
    cls = reg.get_tier_class(kind)
    assert issubclass(cls, Tier) and cls.kind == kind


def test_unknown_kind_lists_known_and_entry_point_group() -> None:
    with pytest.raises(
        errors.BackendNotFoundError,
        match=r"unknown tier kind 'nope'; known: \['cpu', 'lmdb', 'redis'\].*tieredkv.backends",
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

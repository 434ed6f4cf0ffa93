"""Tier registry: ``kind`` → lazily imported ``"module:Class"``, with an install hint.

Built-in kinds are listed in :data:`known_tiers`; third-party tiers register through the
entry-point group ``tieredkv.backends`` (``kind = "package.module:Class"``) or by calling
:func:`register_tier`. Classes stay directly constructible: the registry only serves
config-driven lookup (``build_tier(config)``).
"""

from __future__ import annotations

import importlib
import types
from importlib.metadata import entry_points
from typing import Any

from tieredkv.errors import BackendNotFoundError

__all__ = ["build_tier", "get_tier_class", "known_tiers", "register_tier", "registry"]

ENTRY_POINT_GROUP = "tieredkv.backends"

#: Built-in tiers: kind → (target, install hint). Keep alphabetized.
known_tiers: dict[str, tuple[str, str]] = {
    "cpu": ("tieredkv.backends.cpu:CPUTier", "built in (needs torch: pip install tieredkv)"),
    "lmdb": ("tieredkv.backends.lmdb:LMDBTier", "pip install 'tieredkv[lmdb]'"),
    "redis": ("tieredkv.backends.redis:RedisTier", "pip install 'tieredkv[redis]'"),
}
assert list(known_tiers) == sorted(known_tiers), "keep known_tiers alphabetized"

_registry: dict[str, Any] = {}
#: Read-only view of the classes or targets registered beyond the built-ins.
registry = types.MappingProxyType(_registry)
_entry_points_loaded = False


def register_tier(kind: str, target: str | type, *, clobber: bool = False) -> None:
    """Register a tier class (or ``"module:Class"`` string) under ``kind``.

    Raises:
        ValueError: ``kind`` is taken (built-in or registered) and ``clobber`` is false.
    """
    if not clobber and (kind in known_tiers or (kind in _registry and _registry[kind] != target)):
        raise ValueError(f"tier kind {kind!r} is already registered; pass clobber=True to replace it")
    _registry[kind] = target


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in known_tiers and ep.name not in _registry:
            _registry[ep.name] = ep.value


def _import(target: str, kind: str, hint: str) -> type:
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendNotFoundError(
            f"tier kind {kind!r} needs a package that is not installed ({e.name}): {hint}"
        ) from e
    try:
        return getattr(module, cls_name)
    except AttributeError as e:
        raise BackendNotFoundError(f"tier kind {kind!r}: {module_name} has no class {cls_name!r}") from e


def get_tier_class(kind: str) -> type:
    """The tier class for ``kind``, importing it on first use.

    Raises:
        BackendNotFoundError: unknown kind (the message lists the known ones) or missing extra.
    """
    from tieredkv.backends.base import Tier

    _load_entry_points()
    if kind in _registry:
        target = _registry[kind]
        cls = target if isinstance(target, type) else _import(target, kind, f"install the package providing {target}")
    elif kind in known_tiers:
        cls = _import(*known_tiers[kind][:1], kind, known_tiers[kind][1])
    else:
        known = sorted({*known_tiers, *_registry})
        raise BackendNotFoundError(
            f"unknown tier kind {kind!r}; known: {known}. A third-party tier registers under the"
            f" entry-point group {ENTRY_POINT_GROUP!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise BackendNotFoundError(f"tier kind {kind!r} resolved to {cls!r}, which is not a Tier subclass")
    return cls


def build_tier(config: Any, **kwargs: Any) -> Any:
    """Construct (not open) the tier that ``config`` (a tier config model) describes."""
    return get_tier_class(config.kind)(config, **kwargs)

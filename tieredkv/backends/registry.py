"""Tier registry: one entry per ``kind`` — tier class, config model, capabilities, install hint.

A tier kind is one registry entry, whatever its origin:

* **built in** (:data:`known_tiers`): ``cpu``, ``fs``, ``lmdb``, ``redis``, imported on first use;
* **entry point**: a package that declares ``[project.entry-points."tieredkv.backends"]
  mykind = "pkg.mod:MyTier"``;
* **register_tier**: ``register_tier("mykind", MyTier)`` at run time.

A tier config with ``encryption`` set is built as its tier wrapped in a
:class:`~tieredkv.backends._sealed.SealedTier` (records sealed, :mod:`tieredkv.sealing`).

The tier class carries everything else as class variables: ``kind``, ``config_model`` (a
:class:`~tieredkv.tierconfig.TierConfigBase` subclass), ``capabilities``. So the config validates
``kind: mykind`` with ``MyTier.config_model``, ``build_tier`` constructs it, and callers
branch on :attr:`TierEntry.capabilities`, never on the kind.

Importing this module (or :mod:`tieredkv.config`) imports no backend: a built-in's config
model lives beside its tier (``tieredkv.backends.<kind>.config``) and imports no client
library, and a tier package imports its tier lazily, so a config naming ``redis`` validates
where the Redis client is not installed; only :func:`tier_entry`, :func:`get_tier_class`
and :func:`build_tier` import the tier's module (and its client library).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from tieredkv.errors import BackendNotFoundError

if TYPE_CHECKING:
    from tieredkv.backends.base import Tier, TierCapabilities
    from tieredkv.eviction import EvictionPolicy
    from tieredkv.tierconfig import TierConfigBase

__all__ = [
    "ENTRY_POINT_GROUP",
    "TierEntry",
    "build_tier",
    "config_model",
    "get_tier_class",
    "known_kinds",
    "known_tiers",
    "register_tier",
    "registry",
    "tier_capabilities",
    "tier_entry",
]

ENTRY_POINT_GROUP = "tieredkv.backends"


@dataclass(frozen=True)
class _Builtin:
    target: str  # "module:Class" of the tier
    config: str  # "module:Class" of its config model (beside the tier, importing no client library)
    hint: str  # how to install what the tier's module imports


_BUILTINS: dict[str, _Builtin] = {
    "cpu": _Builtin(
        "tieredkv.backends.cpu.tier:CPUTier",
        "tieredkv.backends.cpu.config:CPUTierConfig",
        "pip install 'tieredkv[engine]' (torch)",
    ),
    "fs": _Builtin(
        "tieredkv.backends.fs.tier:FSTier",
        "tieredkv.backends.fs.config:FSTierConfig",
        "pip install 'tieredkv[fs]' (aiofiles)",
    ),
    "lmdb": _Builtin(
        "tieredkv.backends.lmdb.tier:LMDBTier",
        "tieredkv.backends.lmdb.config:LMDBTierConfig",
        "pip install 'tieredkv[lmdb]'",
    ),
    "redis": _Builtin(
        "tieredkv.backends.redis.tier:RedisTier",
        "tieredkv.backends.redis.config:RedisTierConfig",
        "pip install 'tieredkv[redis]'",
    ),
}
assert list(_BUILTINS) == sorted(_BUILTINS), "keep the built-in tiers alphabetized"

#: Built-in tiers: kind → (tier target, install hint). Read-only; kept for callers of the old table.
known_tiers = types.MappingProxyType({k: (b.target, b.hint) for k, b in _BUILTINS.items()})

_registry: dict[str, Any] = {}
#: Read-only view of the classes or ``"module:Class"`` targets registered beyond the built-ins.
registry = types.MappingProxyType(_registry)
_entry_points_loaded = False
_from_entry_point: set[str] = set()  # kinds of _registry that came from an entry point


@dataclass(frozen=True)
class TierEntry:
    """Everything tieredkv knows about one tier kind (see :func:`tier_entry`)."""

    kind: str
    tier_class: type[Tier]
    config_model: type[TierConfigBase]
    install_hint: str
    #: ``"built in"``, ``"entry point"`` or ``"register_tier"``.
    source: str

    @property
    def capabilities(self) -> TierCapabilities:
        return self.tier_class.capabilities

    def eviction_policy(self, config: Any) -> EvictionPolicy | None:
        """A fresh policy for a tier of this kind configured by ``config`` (its
        ``eviction_policy`` field, default ``"lru"``); None when the medium evicts (Redis)."""
        from tieredkv.eviction import make_policy

        if not self.capabilities.local_eviction:
            return None
        return make_policy(getattr(config, "eviction_policy", "lru"))


def register_tier(kind: str, target: str | type, *, clobber: bool = False) -> None:
    """Register a tier class (or ``"module:Class"`` string) under ``kind``.

    Raises:
        ValueError: ``kind`` is taken (built-in or registered) and ``clobber`` is false.
    """
    if not clobber and (kind in _BUILTINS or (kind in _registry and _registry[kind] != target)):
        raise ValueError(f"tier kind {kind!r} is already registered; pass clobber=True to replace it")
    _registry[kind] = target
    _from_entry_point.discard(kind)


def known_kinds() -> list[str]:
    """Every kind a config may name: built in, installed through the entry point, or registered."""
    _load_entry_points()
    return sorted({*_BUILTINS, *_registry})


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _BUILTINS and ep.name not in _registry:
            _registry[ep.name] = ep.value
            _from_entry_point.add(ep.name)


def _import(target: str, kind: str, hint: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendNotFoundError(
            f"tier kind {kind!r} needs a package that is not installed ({e.name}): {hint}"
        ) from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise BackendNotFoundError(f"tier kind {kind!r}: {module_name} has no class {attr!r}") from e


def _unknown(kind: str) -> BackendNotFoundError:
    return BackendNotFoundError(
        f"unknown tier kind {kind!r}; known: {known_kinds()}. A third-party tier registers under the"
        f" entry-point group {ENTRY_POINT_GROUP!r}"
    )


def _hint(kind: str) -> str:
    if kind in _BUILTINS:
        return _BUILTINS[kind].hint
    target = _registry.get(kind)
    where = target if isinstance(target, str) else getattr(target, "__module__", "?")
    return f"install the package providing {where}"


def get_tier_class(kind: str) -> type[Tier]:
    """The tier class for ``kind``, importing it on first use.

    Raises:
        BackendNotFoundError: unknown kind (the message lists the known ones) or missing extra.
    """
    from tieredkv.backends.base import Tier

    _load_entry_points()
    if kind in _registry:
        target = _registry[kind]
        cls = target if isinstance(target, type) else _import(target, kind, _hint(kind))
    elif kind in _BUILTINS:
        cls = _import(_BUILTINS[kind].target, kind, _hint(kind))
    else:
        raise _unknown(kind)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise BackendNotFoundError(f"tier kind {kind!r} resolved to {cls!r}, which is not a Tier subclass")
    return cls


def config_model(kind: str) -> type[TierConfigBase]:
    """The config model that validates a tier of ``kind``. A built-in's comes from
    :mod:`tieredkv.backends.<kind>.config` without importing the backend; any other's is its tier class's
    ``config_model``.

    Raises:
        BackendNotFoundError: unknown kind, missing package, or a tier class without a usable
            ``config_model``.
    """
    from tieredkv.tierconfig import TierConfigBase

    _load_entry_points()
    if kind in _BUILTINS and kind not in _registry:
        model = _import(_BUILTINS[kind].config, kind, _hint(kind))
    else:
        cls = get_tier_class(kind)
        model = getattr(cls, "config_model", None)
        if not (isinstance(model, type) and issubclass(model, TierConfigBase)):
            raise BackendNotFoundError(
                f"tier kind {kind!r}: {cls.__module__}.{cls.__qualname__}.config_model is {model!r}; set it to"
                " the tier's config model, a subclass of tieredkv.config.TierConfigBase"
            )
    return model


def tier_capabilities(kind: str) -> TierCapabilities:
    """What a tier of ``kind`` can do (imports its class). Callers branch on these, never on kind."""
    return get_tier_class(kind).capabilities


def tier_entry(kind: str) -> TierEntry:
    """The whole registry entry of ``kind`` (imports the tier class and its config model)."""
    cls = get_tier_class(kind)
    if kind in _registry:
        source = "entry point" if kind in _from_entry_point else "register_tier"
    else:
        source = "built in"
    return TierEntry(kind, cls, config_model(kind), _hint(kind), source)


def build_tier(config: Any, **kwargs: Any) -> Tier:
    """Construct (not open) the tier that ``config`` (a tier config model) describes. A config
    with ``encryption`` (:class:`~tieredkv.config.EncryptionConfig`; LMDB and Redis have the field)
    gets that tier wrapped in a :class:`~tieredkv.backends._sealed.SealedTier`, its keys loaded
    now: a missing, unsafe or malformed key file raises here.

    Raises:
        BackendNotFoundError: as :func:`get_tier_class`, or encryption without the cryptography
            package.
        ConfigError: the encryption keys cannot be loaded (the message names the field and the fix).
    """
    cls = get_tier_class(config.kind)
    encryption = getattr(config, "encryption", None)
    if encryption is None:
        return cls(config, **kwargs)
    from tieredkv import sealing

    name = kwargs.get("name") or getattr(config, "name", "") or config.kind
    if sealing.AESGCM is None:
        raise BackendNotFoundError(
            f"tier {name!r}: encryption needs the cryptography package, which is not installed: {sealing.INSTALL_HINT}"
        )
    keyring = sealing.load_keyring(encryption, f"tier {name!r}: encryption")  # before the tier exists
    from tieredkv.backends._sealed import SealedTier

    return SealedTier(cls(config, **kwargs), keyring)

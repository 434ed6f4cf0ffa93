"""A package's names imported on first use (PEP 562): ``__getattr__ = lazy_names(__name__, homes)``,
``homes`` mapping each exported name to the submodule that defines it. The backend packages use it
so that importing a tier's config model imports no client library."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` from ``package.<homes[name]>``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return __getattr__

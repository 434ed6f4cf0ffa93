"""Sample configurations shipped inside the package (``tieredkv config init`` writes them out).

``config/tieredkv.yaml`` in the repository is the same file; a test keeps the two identical.
"""

from __future__ import annotations

from importlib.resources import files

__all__ = ["sample_config_text"]


def sample_config_text(name: str = "tieredkv.yaml") -> str:
    """The text of a shipped sample config."""
    return (files(__name__) / name).read_text(encoding="utf-8")

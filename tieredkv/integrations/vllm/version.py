"""The version gate of tieredkv's vLLM integration: vLLM 0.33.x, nothing else (no vLLM import here).

:mod:`tieredkv.integrations.vllm` checks the installed distribution's version when it is imported;
:mod:`~tieredkv.integrations.vllm.compat` checks the imported ``vllm.__version__`` before it takes
any vLLM name. Either way a vLLM other than 0.33.x fails with one line: what is supported, what
was found.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["SUPPORTED_VLLM", "installed_vllm", "require_supported_vllm", "unsupported_vllm"]

#: The vLLM release series this integration supports (``tieredkv[vllm]`` pins ``vllm>=0.33,<0.34``).
SUPPORTED_VLLM = ("0.33",)


def unsupported_vllm(found: str | None, detail: str = "") -> str:
    """The version gate's one line: what is supported, what was found."""
    what = f"vLLM {found}" if found else "no vLLM"
    series = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM)
    return f'tieredkv.integrations.vllm supports vLLM {series} (pip install "tieredkv[vllm]"); found {what}{detail}'


def require_supported_vllm(found: str | None) -> None:
    """Raise ImportError (:func:`unsupported_vllm`) unless ``found`` is a supported vLLM version."""
    if not found or not any(found == s or found.startswith(s + ".") for s in SUPPORTED_VLLM):
        raise ImportError(unsupported_vllm(found))


def installed_vllm() -> str | None:
    """The installed vLLM distribution's version (its metadata; vLLM is not imported), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None

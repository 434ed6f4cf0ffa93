"""Real-vLLM tests: collected only where vLLM 0.33 imports (``scripts/test-vllm``).

The default suite (``scripts/test`` in ``.venv``, no vLLM) ignores this directory entirely. Under
``scripts/test-vllm`` (``VLLM_SUITE_TIEREDKV=1``) a missing or wrong vLLM is an error, never a skip.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if not _HAVE_VLLM:
    if os.environ.get("VLLM_SUITE_TIEREDKV") == "1":
        raise RuntimeError("tests/vllm: vLLM is not importable in this venv; run ./scripts/test-vllm")
    collect_ignore_glob = ["*"]
else:
    import pytest

    @pytest.fixture(scope="session", autouse=True)
    def _vllm_version() -> None:
        import vllm

        assert vllm.__version__.startswith("0.33."), f"tests/vllm needs vLLM 0.33.x, found {vllm.__version__}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """The engine-loop and connector tables: hit tokens per group next to vLLM's own path, per row."""
    import sys

    for name, title in (
        ("tests.vllm.test_engine_loop", "engine loop: hit tokens per group (full/swa/mamba), steps"),
        ("tests.vllm.test_connector", "OffloadingConnector -> TieredKVConnector: hits per group, lost keys"),
    ):
        mod = sys.modules.get(name)
        lines = mod.report_table() if mod is not None else []
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)

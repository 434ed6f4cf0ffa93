"""The version gate of tieredkv's vLLM integration, and its one list of vLLM's private names.

Importing ``tieredkv.integrations.vllm`` where another vLLM than 0.33.x is installed fails with one
line saying what is supported and what was found (each case in a fresh interpreter, with another
vLLM installed ahead of the real one on its path: a distribution's metadata and package, or a
package alone); the names of vLLM's connector classes the connector builds on are all listed in
:mod:`tieredkv.integrations.vllm.compat`, and the real vLLM 0.33 has every one of them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
LINE = 'ImportError: tieredkv.integrations.vllm supports vLLM 0.33.x (pip install "tieredkv[vllm]"); found {}'


def _other_vllm(tmp_path: Path, version: str, *, metadata: bool) -> Path:
    """Another vLLM "installed" in ``tmp_path``: its package, and its distribution metadata if asked."""
    pkg = tmp_path / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if metadata:
        info = tmp_path / f"vllm-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return tmp_path


def _import(code: str, *path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )


def _last_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("version", ["0.34.0", "0.32.2", "1.0.0"])
def test_another_installed_vllm_fails_the_import_in_one_line(version: str, tmp_path: Path) -> None:
    """The installed distribution is another vLLM: importing the package (not yet vLLM itself,
    which the package never imports) fails, its last line the gate's."""
    r = _import("import tieredkv.integrations.vllm", _other_vllm(tmp_path, version, metadata=True))
    assert r.returncode != 0 and _last_line(r) == LINE.format(f"vLLM {version}"), r.stderr[-2000:]


def test_another_imported_vllm_fails_the_connector_in_one_line(tmp_path: Path) -> None:
    """A vLLM package without metadata ahead of the installed 0.33 (a source tree on the path):
    the package imports (the installed distribution is 0.33), the connector's module does not."""
    path = _other_vllm(tmp_path, "0.35.0rc1", metadata=False)
    assert _import("import tieredkv.integrations.vllm", path).returncode == 0
    r = _import("import tieredkv.integrations.vllm.connector", path)
    assert r.returncode != 0 and _last_line(r) == LINE.format("vLLM 0.35.0rc1"), r.stderr[-2000:]


def test_no_vllm_fails_the_connector_in_one_line() -> None:
    """vLLM not importable (an import hook refuses it here): the vLLM-free modules import, the
    connector's fails with the gate's line."""
    code = (
        "import sys, importlib.abc\n"
        "class NoVLLM(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoVLLM())\n"
        "import tieredkv.integrations.vllm.lookups\n"
        "import tieredkv.integrations.vllm.connector\n"
    )
    r = _import(code)
    assert r.returncode != 0 and _last_line(r) == LINE.format("no vLLM"), r.stderr[-2000:]


def test_vllm_033_passes_the_gate() -> None:
    import vllm

    from tieredkv.integrations.vllm import compat, require_supported_vllm

    assert compat.VLLM_VERSION == vllm.__version__ and vllm.__version__.startswith("0.33.")
    for ok in ("0.33", "0.33.0", "0.33.7.dev3+gabc", "0.33.1rc2"):
        require_supported_vllm(ok)
    for bad in ("0.3", "0.330.0", "0.34", "", None):
        with pytest.raises(ImportError, match="supports vLLM 0.33.x"):
            require_supported_vllm(bad)


def test_every_vllm_private_name_the_connector_uses_is_listed_in_compat(tmp_path: Path) -> None:
    """Every underscore name the connector's modules read, call or override that belongs to vLLM's
    connector classes (not defined by tieredkv alone) is one of compat's listed names, and the
    real vLLM 0.33 scheduler side has each of them."""
    from tests.vllm.engine import Engine, cpu_workers
    from tests.vllm.test_connector import TKC
    from tests.vllm.test_engine_loop import _tiers_file, spec_extra
    from tieredkv.integrations.vllm import compat, connector, connector_jobs
    from tieredkv.integrations.vllm.connector import TieredKVConnector, TieredKVConnectorScheduler

    used: set[str] = set()  # read, called, assigned or overridden
    for mod in (connector, connector_jobs):
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            name = (
                node.attr if isinstance(node, ast.Attribute) else node.name if isinstance(node, ast.FunctionDef) else ""
            )
            if name.startswith("_") and not name.startswith("__"):
                used.add(name)
    extra = spec_extra(1, _tiers_file(tmp_path, "lmdb"))
    with cpu_workers(extra, False):
        eng = Engine(extra, **TKC)
    try:
        sched = eng.connector_scheduler
        assert isinstance(sched, TieredKVConnectorScheduler) and isinstance(eng.connector, TieredKVConnector)
        base = compat.OffloadingConnectorScheduler
        # a name is vLLM's if vLLM's classes have it: on the class, or set by vLLM's __init__ (an
        # attribute of our scheduler that none of tieredkv's own code assigns)
        ours = _assigned_by(connector)
        vllms = {
            n
            for n in used
            if hasattr(base, n)
            or hasattr(compat.OffloadingConnector, n)
            or hasattr(compat.KVConnectorBase_V1, n)
            or (hasattr(sched, n) and n not in ours)
            or (hasattr(eng.connector, n) and n not in ours)
        }
        vllms -= {"_replace"}  # NamedTuple's public API (vLLM's config)
        listed = set(compat.SCHEDULER_METHODS) | set(compat.SCHEDULER_STATE) | set(compat.OTHER_PRIVATE)
        assert vllms <= listed, f"vLLM private names used but not listed in compat.py: {sorted(vllms - listed)}"
        for name in compat.SCHEDULER_STATE:
            assert hasattr(sched, name), name
        for name in compat.SCHEDULER_METHODS:
            assert hasattr(base, name), name
        # relied on, not named by the connector: vLLM's _release_step closes the region
        # _acquire_step opens; the other two are read in compat itself
        relied = {"_release_step", "_NONE_HASH_SEED", "_ConnectorMetricName"}
        # read by the in-step lookups (lookups.request_offload_keys, by name): every key vLLM
        # records on a request's ReqContext before it asks the first
        from tieredkv.integrations.vllm import lookups

        assert '"_offload_key_positions"' in inspect.getsource(lookups)
        assert "_offload_key_positions" in {f.name for f in dataclasses.fields(compat.ReqContext)}
        relied.add("_offload_key_positions")
        missing = [n for n in listed if n.startswith("_") and n not in used and n not in relied]
        assert not missing, f"listed in compat.py but no longer used by the connector: {missing}"
    finally:
        eng.shutdown()


def _assigned_by(module: object) -> set[str]:
    """Underscore names tieredkv's own code defines in ``module``: methods, attributes it assigns."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):  # type: ignore[arg-type]
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
            out.add(node.name)
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr.startswith("_"):
                out.add(t.attr)
            if isinstance(t, ast.Name) and t.id.startswith("_"):
                out.add(t.id)
    return out

"""A new tier kind is one module, one entry-point line and one contract-test class (shown by
the sample plug-in in tests/plugin_sample/).

The plug-in is installed with pip the way a user would (``pip install --target``, from a copy
of its source tree), and used from child processes that have the install on ``sys.path``: the
test venv is not changed. The children show the registry finds the kind through the entry
point, a YAML config names it like a built-in kind (and a bad field in it gets a good error),
``tieredkv.open_store`` stores and loads a chunk through it byte-exact, and the shipped
contract suite passes against it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tieredkv.testing.contract import TierContract

pytestmark = [pytest.mark.timeout(300)]

SAMPLE = Path(__file__).resolve().parents[1] / "plugin_sample"


def _child_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(source copy, install target)``: the plug-in built and installed by pip, offline."""
    assert importlib.util.find_spec("setuptools"), "the test venv needs setuptools to build the sample plug-in"
    base = tmp_path_factory.mktemp("plugin")
    src, site = base / "src", base / "site"
    shutil.copytree(SAMPLE, src)  # setuptools writes build files next to the source: not in the repo
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(src)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (site / "tieredkv_dirtier.py").is_file()
    return src, site


_USE_IT = r"""
import json, sys
from pathlib import Path

import torch

import tieredkv
from tieredkv.backends import registry
from tieredkv.catalog import catalog_key
from tieredkv.config import load_config
from tieredkv.errors import ConfigError

root = Path(sys.argv[1])
out = {}
entry = registry.tier_entry("dir")
out["kinds"] = registry.known_kinds()
out["entry"] = [f"{entry.tier_class.__module__}:{entry.tier_class.__name__}", entry.config_model.__name__,
                entry.source, entry.capabilities.local_eviction]

good = root / "tieredkv.yaml"
good.write_text(f'''
namespace: {{model: plugin-test}}
tiers:
  - kind: dir
    name: files
    root: {root / "records"}
    capacity_bytes: 8MiB
''')
cfg = load_config(good, env={})
t = cfg.tiers[0]
out["tier"] = [type(t).__name__, t.label, int(t.capacity_bytes), t.eviction_policy]

bad = root / "bad.yaml"
bad.write_text("tiers:\n  - kind: dir\n    root: /tmp/x\n    capacity_byte: 8MiB\n")
try:
    load_config(bad, env={})
except ConfigError as e:
    out["bad"] = str(e)

k = torch.randint(0, 256, (8, 16, 64), dtype=torch.uint8)
with tieredkv.open_store(cfg) as store:
    store.register_group(0, [k], blocks_per_chunk=2)
    key = store.key(bytes([7]) * 32, 0)
    job = store.store(0, [(key, (1, 2))])
    out["stored"] = job is not None and store.wait([job])[job].ok
    out["lookup"] = [[s.name, name] for s, name in store.lookup([key])]
    k0 = k.clone()
    k[5:7].zero_()
    job = store.load(0, [(key, (5, 6))])
    out["loaded"] = job is not None and store.wait([job])[job].ok
    out["exact"] = torch.equal(k[5:7], k0[1:3]) and torch.equal(k[:5], k0[:5])
    catalog = catalog_key(store.namespace.fingerprint).hex()  # (the namespace's catalog record, aside)
out["files"] = sorted(p.stat().st_size for p in (root / "records").iterdir() if p.name != catalog)
print(json.dumps(out))
"""


def test_the_plugin_is_found_configured_and_stores_through_open_store(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    _, site = installed
    r = subprocess.run(
        [sys.executable, "-c", _USE_IT, str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=_child_env(site), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kinds"] == ["cpu", "dir", "fs", "lmdb", "redis"]
    assert out["entry"] == ["tieredkv_dirtier:DirTier", "DirTierConfig", "entry point", True]
    assert out["tier"] == ["DirTierConfig", "files", 8 << 20, "lru"]
    bad = out["bad"]
    assert "tiers.0.capacity_byte: got '8MiB' — Extra inputs are not permitted" in bad
    assert "did you mean 'capacity_bytes'?" in bad and "allowed fields:" in bad and "root" in bad
    assert out["stored"] is True and out["lookup"] == [["HIT", "files"]]
    assert out["loaded"] is True and out["exact"] is True
    assert out["files"] == [64 + 2 * 16 * 64]  # one record file of the engine's: header + a 2-block chunk


def test_the_plugin_passes_the_shipped_contract_suite(installed: tuple[Path, Path]) -> None:
    src, site = installed
    contract = src / "contract_dirtier.py"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(src)]
        + ["-c", str(src / "pyproject.toml"), str(contract)],
        capture_output=True, text=True, timeout=240, env=_child_env(site), cwd=src, check=False,
    )  # fmt: skip
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m is not None and "failed" not in r.stdout and "error" not in r.stdout.lower(), tail
    methods = [n for n in dir(TierContract) if n.startswith("test_")]
    assert int(m.group(1)) >= len(methods) > 10, tail

"""The README's ten-line example runs as written from the wheel, in an empty directory.

What a newcomer does: build (here) or download the wheel, ``pip install "tieredkv[engine]"`` into a
fresh virtualenv, paste the README's example into a file in an empty directory and run it. No
config file, no repository checkout, no ``config/`` directory. The test builds the wheel from this
tree, installs it with CPU torch 2.13.0 (a local wheel on these machines; pip's cache makes
reruns fast) and compares the script's output with the block the README says it prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Ten lines: a chunk to the CPU tier and back"


def readme_example() -> tuple[str, str]:
    """The section's Python block and the ``text`` block that follows it (its expected output)."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text[text.index(SECTION) :]
    section = section[: section.find("\n## ", 1)]
    m = re.search(r"```python\n(.*?)```.*?```text\n(.*?)```", section, re.DOTALL)
    assert m, "the example section needs a ```python block followed by a ```text block with its output"
    return m.group(1), m.group(2)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without config overrides or this venv's paths."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TIEREDKV_", "PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE", "PYTEST"))
    }
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, check=False, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (
        f"{' '.join(cmd)} exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    )
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], ROOT, 600)
    (whl,) = out.glob("tieredkv-*.whl")
    return whl


def test_example_and_its_output_are_in_the_readme() -> None:
    code, expected = readme_example()
    compile(code, "README.md", "exec")
    assert "open_store()" in code and "config/" not in code  # nothing the wheel does not ship
    assert len(code.strip().splitlines()) <= 15
    assert expected.strip()


def test_wheel_ships_the_license_and_the_sample_config(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"tieredkv-[^/]+\.dist-info/licenses/LICENSE", n) for n in names), names
    assert "tieredkv/samples/tieredkv.yaml" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


@pytest.mark.timeout(1200)
def test_readme_example_runs_from_the_wheel_in_an_empty_directory(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 300)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "torch==2.13.0"], tmp_path, 900)  # the CPU wheel on these machines
    run([*pip, f"{wheel}[engine]"], tmp_path, 900)

    code, expected = readme_example()
    work = tmp_path / "empty"
    work.mkdir()
    (tmp_path / "example.py").write_text(code)  # outside the directory it runs in: that one starts empty
    r = run([str(py), str(tmp_path / "example.py")], work, 300)
    assert r.stdout.strip().splitlines() == expected.strip().splitlines(), r.stdout + r.stderr
    assert (work / "tieredkv-data" / "lmdb").is_dir()  # the default LMDB tier, where the README says
    imported = run([str(py), "-c", "import tieredkv; print(tieredkv.__file__)"], work, 120).stdout
    assert str(venv) in imported and str(ROOT) not in imported  # the wheel, not this checkout

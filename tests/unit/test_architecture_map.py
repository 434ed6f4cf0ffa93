"""docs/architecture.md is the module map: every module it names exists, and every module exists in it.

How the page names a module (the test reads it the same way):

- by its path under ``tieredkv/`` (``backends/base.py``, ``pipeline/transfer.py``; a leading
  ``tieredkv/`` is allowed), anywhere on the page;
- by its file name alone where a package is the context:
  - in a table row whose first cell is that package (``| `cli/` | `app.py` (...), ... |``);
  - in the picture (the first code block), on the lines below the package's own line and indented
    further (`` pipeline/ ──`` then ``│   jobs.py``; ``├── lmdb/`` then ``│     files.py``).
  A file name that is not in its context's package is looked up in ``tieredkv/`` itself.
- Paths of other parts of the repository (``tests/...``, ``benchmarks/...``, ``setup.py``) must
  exist too, from the repository root; a ``*`` in a name is a glob.

Every ``.py`` module under ``tieredkv/`` must be named, except ``__init__.py`` / ``__main__.py``
files of a few lines (a package's ``__init__`` that holds code is a module like any other).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tieredkv"
PAGE = ROOT / "docs" / "architecture.md"

#: An ``__init__.py`` / ``__main__.py`` longer than this holds code, and must be on the page.
INIT_LINES_EXEMPT = 80

# A file path (``a/b.py``, ``_native/fastrec.c``, ``tests/unit/test_x*.py``) or a package path (``cli/``).
_TOKEN = re.compile(r"(?<![\w./*-])((?:[\w*.-]+/)*[\w*-]+\.(?:py|c)|(?:[\w-]+/)+)(?![\w/])")


@dataclass(frozen=True)
class Mention:
    token: str
    line: int
    context: str  # a package under tieredkv/ ("" = tieredkv/ itself)


def _is_package(rel: str) -> bool:
    return bool(rel) and (PKG / rel).is_dir()


def _join(context: str, token: str) -> str:
    return str(PurePosixPath(context) / token) if context else token


def _strip_pkg(token: str) -> str:
    return token.removeprefix("tieredkv/")


def mentions(text: str) -> list[Mention]:
    """Every path-like token of the page, with the package it is read in."""
    out: list[Mention] = []
    lines = text.splitlines()
    in_code = False
    picture_done = False
    stack: list[tuple[int, str]] = []  # (column of the package's token, package) in the picture
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if in_code:
                picture_done = True
                stack = []
            in_code = not in_code
            continue
        found = list(_TOKEN.finditer(line))
        if in_code and not picture_done:
            if found:
                col, first = found[0].start(), _strip_pkg(found[0].group(1))
                while stack and stack[-1][0] >= col:
                    stack.pop()
                context = stack[-1][1] if stack else ""
                if first.endswith("/"):
                    pkg = _join(context, first.rstrip("/"))
                    if _is_package(pkg):
                        stack.append((col, pkg))
                    elif _is_package(first.rstrip("/")):
                        stack.append((col, first.rstrip("/")))
            context = stack[-1][1] if stack else ""
            out += [Mention(m.group(1), n, context) for m in found]
            continue
        context = ""
        if line.startswith("|"):
            first_cell = line.strip("|").split("|", 1)[0]
            cell_tokens = _TOKEN.findall(first_cell)
            if len(cell_tokens) == 1 and cell_tokens[0].endswith("/"):
                pkg = _strip_pkg(cell_tokens[0]).rstrip("/")
                context = pkg if _is_package(pkg) else ""
        out += [Mention(m.group(1), n, context) for m in found]
    return out


def resolve(m: Mention) -> tuple[list[Path], bool]:
    """The files a mention names, and whether it names anything at all (a package counts)."""
    token = _strip_pkg(m.token)
    candidates = [PKG / _join(m.context, token), PKG / token, ROOT / m.token]
    for c in candidates:
        rel = str(c.relative_to(ROOT))
        hits = sorted(ROOT.glob(rel)) if "*" in rel else ([c] if c.exists() else [])
        if hits:
            return [h for h in hits if h.is_file()], True
    return [], False


def modules() -> list[Path]:
    """Every module the page must name."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        small = len(p.read_text(encoding="utf-8").splitlines()) <= INIT_LINES_EXEMPT
        if p.name in ("__init__.py", "__main__.py") and p != PKG / "__init__.py" and small:
            continue
        out.append(p)
    return out


def test_page_conventions_are_understood() -> None:
    """The reader above on the page's own forms (a guard for the two tests below)."""
    text = """```
 pipeline/ ── loop
      │   jobs.py   read by metrics.py
 policy.py ── routes
 backends/ ── tiers
      ├── base.py
      ├── lmdb/    LMDB
      │     env.py
      ├── _sealed.py
 integrations/ ── engines
      ├── vllm/    vLLM
      │     spec.py
      └── after.py
```
| `cli/` | `app.py` (typer) |
| `demo.py`, `bench.py` | `backends/_rawbench.py` |
See `tests/unit/test_scheduler*.py` and `tieredkv/__init__.py`.
"""
    got = {m.token: resolve(m) for m in mentions(text)}
    rel = {t: sorted(str(p.relative_to(ROOT)) for p in files) for t, (files, ok) in got.items() if ok}
    assert rel["jobs.py"] == ["tieredkv/pipeline/jobs.py"]
    assert rel["metrics.py"] == ["tieredkv/metrics.py"]  # not in pipeline/: tieredkv/ itself
    assert rel["base.py"] == ["tieredkv/backends/base.py"]
    assert rel["env.py"] == ["tieredkv/backends/lmdb/env.py"]  # a tier package under backends/
    assert rel["_sealed.py"] == ["tieredkv/backends/_sealed.py"]  # back out of lmdb/
    assert rel["spec.py"] == ["tieredkv/integrations/vllm/spec.py"]  # a package in a package
    assert "after.py" not in rel  # back out of vllm/: integrations/after.py, which does not exist
    assert rel["app.py"] == ["tieredkv/cli/app.py"]
    assert rel["backends/_rawbench.py"] == ["tieredkv/backends/_rawbench.py"]
    assert "tests/unit/test_scheduler.py" in rel["tests/unit/test_scheduler*.py"]
    assert rel["tieredkv/__init__.py"] == ["tieredkv/__init__.py"]
    assert not resolve(Mention("nosuch.py", 1, "pipeline"))[1]


def test_every_module_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    missing = []
    for m in mentions(text):
        if m.token.endswith("/"):
            continue  # a package or a directory on disk (files/, spare/): context only
        if not resolve(m)[1]:
            where = f"in {m.context}/ or tieredkv/" if m.context else "in tieredkv/ or the repository root"
            missing.append(f"  line {m.line}: {m.token} (looked {where})")
    assert not missing, (
        "docs/architecture.md names modules or files that do not exist (moved or renamed? "
        "update the page):\n" + "\n".join(missing)
    )


def test_every_module_is_on_the_page() -> None:
    text = PAGE.read_text(encoding="utf-8")
    named: set[Path] = set()
    for m in mentions(text):
        named.update(resolve(m)[0])
    absent = [str(p.relative_to(ROOT)) for p in modules() if p not in named]
    assert not absent, (
        "modules missing from docs/architecture.md (name each by its path under tieredkv/, or by its "
        "file name in its package's table row or under its package in the picture):\n  " + "\n  ".join(absent)
    )

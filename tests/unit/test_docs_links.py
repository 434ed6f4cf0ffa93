"""The README and docs/ hold together: every relative link reaches a file (and its heading, where
the link names one), every results file they cite is kept or in the history table, the README's
vLLM command is one that docs/vllm.md (which the vLLM tests run) holds, and the README's two
set-up commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "HISTORY.md"]

#: Link targets written on another branch of the same issue; while one is missing its links are
#: left to ``test_pending_link_targets_exist`` (an expected failure). Remove an entry once it lands.
#: Pages linked before they are written (target -> why): none now.
PENDING: dict[str, str] = {}

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_RESULT_FILE = re.compile(r"\b([a-z][a-z-]*-(?:\d{8}(?:T\d{4,6}Z)?[a-z-]*|10min))\.(json|md|png)\b")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the page's headings (lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``, a repeated one suffixed ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def links() -> list[tuple[Path, int, str, Path, str]]:
    """(page, line, link as written, target file, anchor) for every relative link."""
    out = []
    for page in PAGES:
        for n, line in prose_lines(page):
            for target in _LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                out.append((page, n, target, dest, anchor))
    return out


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _pending(dest: Path) -> bool:
    return _rel(dest) in PENDING and not dest.exists()


def test_the_link_reader_sees_links_and_headings(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A title: `x`\n## Again\n## Again\n```\n# not a heading [no](link)\n```\n[a](p.md#again-1)\n")
    assert anchors(page) == {"a-title-x", "again", "again-1"}
    assert _LINK.findall("see [b](c.md) and ![img](d.png), [e](https://x)") == ["c.md", "https://x"]


def test_every_relative_link_resolves() -> None:
    broken = []
    for page, n, target, dest, anchor in links():
        if _pending(dest):
            continue
        if not dest.exists():
            broken.append(f"  {_rel(page)}:{n}: {target} (no such file: {_rel(dest)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"  {_rel(page)}:{n}: {target} (no heading #{anchor} in {_rel(dest)})")
    assert not broken, "links in README.md / docs/ that lead nowhere:\n" + "\n".join(broken)


def test_pending_link_targets_exist() -> None:
    missing = sorted({_rel(dest) for _, _, _, dest, _ in links() if _pending(dest)})
    assert not missing, f"linked, not there yet: {missing} ({[PENDING[m] for m in missing]})"


def test_every_cited_results_file_is_kept_or_in_the_history() -> None:
    history = (RESULTS / "HISTORY.md").read_text(encoding="utf-8")
    lost = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for stem, ext in _RESULT_FILE.findall(line):
                name = f"{stem}.{ext}"
                if not (RESULTS / name).exists() and f"`{name}`" not in history:
                    lost.append(f"  {_rel(page)}:{n}: {name}")
    assert not lost, (
        "results files cited that are neither in benchmarks/results/ nor a row of its HISTORY.md:\n" + "\n".join(lost)
    )


def test_history_names_every_kept_results_file() -> None:
    history = (RESULTS / "HISTORY.md").read_text(encoding="utf-8")
    kept = [p.name for p in sorted(RESULTS.iterdir()) if p.name != "HISTORY.md" and not p.name.endswith(".tmp")]
    assert kept
    absent = [name for name in kept if f"`{name}`" not in history]
    assert not absent, f"benchmarks/results/HISTORY.md has no row for {absent}"


_RUN = re.compile(r"(?P<bench>[a-z][a-z-]*?)-(?P<stamp>\d{8}(?:T\d{4,6}Z)?|10min)(?:-[a-z]+)?\.(?:json|md|png)")


def test_results_keep_the_latest_run_of_each_bench_only() -> None:
    """One run per bench in benchmarks/results/ (its files share one date), its HISTORY.md row
    marked kept; every other row of that bench removed."""
    history = (RESULTS / "HISTORY.md").read_text(encoding="utf-8").splitlines()
    runs: dict[str, set[str]] = {}
    for p in RESULTS.iterdir():
        m = _RUN.fullmatch(p.name)
        if p.name == "HISTORY.md" or p.name.endswith(".tmp"):
            continue
        assert m is not None, f"{p.name}: not a <bench>-<date>.<ext> results file"
        runs.setdefault(m["bench"], set()).add(m["stamp"])
    assert {"tiers", "peers"} <= set(runs)
    several = {bench: sorted(stamps) for bench, stamps in runs.items() if len(stamps) > 1}
    assert not several, f"more than one run kept per bench: {several}"
    for p in RESULTS.iterdir():
        rows = [line for line in history if line.startswith("|") and f"`{p.name}`" in line]
        if p.name != "HISTORY.md":
            assert rows and all("**kept**" in row for row in rows), f"{p.name}: its HISTORY.md row is not marked kept"
    kept_rows = [line for line in history if line.startswith("|") and "**kept**" in line]
    for row in kept_rows:
        named = re.findall(r"`([^`]+\.(?:json|md|png))`", row)
        assert named and all((RESULTS / n).exists() for n in named), (
            f"a row marked kept names a removed file: {row[:120]}"
        )


def test_readme_vllm_commands_are_the_tested_ones() -> None:
    """The vLLM tests run docs/vllm.md's ``--kv-transfer-config`` JSONs; the README shows one of them."""
    pattern = re.compile(r"--kv-transfer-config '([^']+)'")
    readme = pattern.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    documented = pattern.findall((ROOT / "docs" / "vllm.md").read_text(encoding="utf-8"))
    assert len(documented) == 3 and readme
    assert all(cfg in documented for cfg in readme), "a README --kv-transfer-config differs from docs/vllm.md's"


def test_readme_two_commands_are_what_ci_runs() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Set-up from the repository: two commands") :]
    block = section[section.index("```bash\n") + 8 : section.index("```", section.index("```bash\n") + 8)]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./scripts/demo", "./scripts/test"]
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "./scripts/test" in ci

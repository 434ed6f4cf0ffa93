"""Nothing outside ``tieredkv/backends/`` reaches past the Tier contract (issue 43).

Callers use what ``Tier`` declares (``capabilities``, ``counters_snapshot()``,
``set_evict_listener()``, ``quotas``, ...): no ``getattr`` probing a tier for a method only some
tiers have, no read of a tier's private attribute. ``tieredkv/testing/`` holds wrapper tiers
(``FaultyTier``) that are tiers themselves and may call their inner tier's hooks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "tieredkv"
ALLOWED = ("backends", "testing")


def _tierish(node: ast.AST) -> bool:
    """An expression that names a tier: ``tier``, ``self.tier``, ``tiers[i]``, ``first_tier``..."""
    if isinstance(node, ast.Subscript):
        return _tierish(node.value)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in ("t", "inner") or name.rstrip("s").endswith("tier")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def seam_reads(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if node.args and _tierish(node.args[0]):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and _tierish(node.value):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_checker_sees_seam_reads() -> None:
    src = "getattr(tier, 'set_evict_listener', None)\nx = self.tiers[0]._counter_lock\ny = tier.stats()\n"
    assert [line for line, _ in seam_reads(src)] == [1, 2]


def test_nothing_outside_backends_reads_past_the_tier_contract() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ALLOWED:
            continue
        found += [f"  tieredkv/{rel}:{line}: {text}" for line, text in seam_reads(path.read_text(encoding="utf-8"))]
    assert not found, "reads past the Tier contract (declare a hook or capability on Tier):\n" + "\n".join(found)

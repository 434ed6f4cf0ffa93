"""The sample config shipped in the wheel, the repository's copy of it and the docs agree.

``tieredkv config init`` writes ``tieredkv/samples/tieredkv.yaml``; the docs and the tests point
people at ``config/tieredkv.yaml``. Both must be the same file, valid, and the override examples
of README.md and docs/*.md must name tiers that exist where the docs say they do.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tieredkv.config import LMDBTierConfig, load_config
from tieredkv.errors import ConfigError
from tieredkv.samples import sample_config_text

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tieredkv" / "samples" / "tieredkv.yaml"
REPO_COPY = ROOT / "config" / "tieredkv.yaml"
README = ROOT / "README.md"
OPERATING = ROOT / "docs" / "operating.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# `TIEREDKV_TIERS__<tier>__<FIELD>=<value>` as the docs write override examples.
_TIER_OVERRIDE = re.compile(r"\b(TIEREDKV_TIERS__(\w+?)__(\w+))=([^\s`]+)")


def _section(title: str) -> str:
    text = OPERATING.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_repository_copy_is_the_shipped_sample() -> None:
    assert REPO_COPY.read_bytes() == SAMPLE.read_bytes(), (
        "config/tieredkv.yaml and tieredkv/samples/tieredkv.yaml differ: edit one, copy it over the other"
    )
    assert sample_config_text() == SAMPLE.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", [SAMPLE, REPO_COPY], ids=["shipped", "repository"])
def test_sample_validates(path: Path) -> None:
    cfg = load_config(path, env={})
    assert [t.label for t in cfg.tiers] == ["cpu", "nvme"]
    assert int(cfg.tier("cpu").capacity_bytes) <= 1 << 30  # laptop-sized: the slab is allocated at open


def test_configuration_section_override_names_a_tier_of_the_sample() -> None:
    examples = _TIER_OVERRIDE.findall(_section("Configuration"))
    assert examples, "docs/operating.md's Configuration section has no TIEREDKV_TIERS__<tier>__<FIELD> example"
    var, tier, field, value = examples[0]
    cfg = load_config(SAMPLE, env={var: value})
    assert tier in {t.label for t in cfg.tiers}, (
        f"docs/operating.md example {var} names tier {tier!r}, not in the sample"
    )
    assert str(getattr(cfg.tier(tier), field.lower())) == value


def test_every_readme_tier_override_applies_to_a_shipped_config() -> None:
    """Each ``TIEREDKV_TIERS__<tier>__...`` in the README and docs/ works against the sample, the Redis Cluster
    sample, or the built-in defaults (tiers named ``cpu`` and ``lmdb``)."""
    sources = {"sample": SAMPLE, "cluster sample": ROOT / "config" / "tieredkv-redis-cluster.yaml", "defaults": None}
    found = [hit for page in DOCS for hit in _TIER_OVERRIDE.findall(page.read_text(encoding="utf-8"))]
    assert len(found) >= 3
    for var, tier, _field, value in found:
        fits = []
        for label, src in sources.items():
            try:
                cfg = load_config(src, env={var: value})
            except ConfigError:  # this source has no such tier
                continue
            fits.append(label)
            assert tier in {t.label for t in cfg.tiers}
        assert fits, f"documented override {var}={value} names tier {tier!r}, which no shipped config has"


def test_defaults_need_no_file_and_name_tiers_after_their_kind() -> None:
    """``open_store()`` with no argument (the README's ten lines) reads no file."""
    cfg = load_config(None, env={})
    assert [t.label for t in cfg.tiers] == ["cpu", "lmdb"]
    assert isinstance(cfg.tier("lmdb"), LMDBTierConfig) and not Path(cfg.tier("lmdb").path).is_absolute()
    assert int(cfg.tier("cpu").capacity_bytes) <= 1 << 30

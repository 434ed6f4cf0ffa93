"""KV group geometry: GroupSpec / GroupLayout validation and derived sizes."""

from __future__ import annotations

import pytest

from tieredkv.errors import ConfigError
from tieredkv.groups import GroupKind, GroupLayout, GroupSpec


def test_derived_sizes_full_group() -> None:
    g = GroupSpec(0, GroupKind.FULL, tokens_per_block=16, blocks_per_chunk=4, bytes_per_block=1024)
    assert g.tokens_per_chunk == 64
    assert g.bytes_per_chunk == 4096
    assert g.window_chunks is None
    assert g.reach_tokens is None


def test_sliding_window_chunks_round_up() -> None:
    g = GroupSpec(1, "sliding_window", tokens_per_block=16, blocks_per_chunk=2, window_tokens=100)
    assert g.kind is GroupKind.SLIDING_WINDOW  # strings are coerced
    assert g.window_chunks == 4  # cdiv(100 - 1, 32)
    assert g.reach_tokens == 99  # token t is attended to by queries t .. t + 99


@pytest.mark.parametrize(
    ("window", "chunks"),
    [(1, 0), (2, 1), (16, 1), (17, 1), (18, 2), (32, 2), (33, 2), (34, 3), (48, 3), (49, 3)],
)
def test_sliding_window_needs_window_minus_one_tokens_before_the_boundary(window: int, chunks: int) -> None:
    # The token at the boundary is recomputed: it needs the window - 1 tokens before it,
    # vLLM's cdiv(sliding_window - 1, block_size).
    g = GroupSpec(1, "sliding_window", tokens_per_block=16, blocks_per_chunk=1, window_tokens=window)
    assert g.window_chunks == chunks == -(-(window - 1) // 16)
    assert g.reach_tokens == window - 1


def test_mamba_needs_one_chunk() -> None:
    g = GroupSpec(2, "mamba", tokens_per_block=64, blocks_per_chunk=3)
    assert g.window_chunks == 1
    assert g.reach_tokens == 192


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ({"bytes_per_block": -1}, "bytes_per_block"),
        ({"tokens_per_block": True}, "tokens_per_block"),
    ],
)
def test_bad_numbers_name_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"index": 0, "kind": "full", "tokens_per_block": 16}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=rf"groups\[0\]\.{field}="):
        GroupSpec(**args)  # type: ignore[arg-type]


def test_unknown_kind_lists_allowed() -> None:
    with pytest.raises(ConfigError, match=r"kind='cross'.*allowed: \['full', 'sliding_window', 'mamba'\]"):
        GroupSpec(0, "cross", 16)  # type: ignore[arg-type]


def test_window_required_only_on_sliding_window() -> None:
    with pytest.raises(ConfigError, match="window_tokens=None"):
        GroupSpec(0, "sliding_window", 16)
    with pytest.raises(ConfigError, match="only allowed on sliding_window"):
        GroupSpec(0, "full", 16, window_tokens=64)


def test_index_must_fit_four_bytes() -> None:
    with pytest.raises(ConfigError, match="4 bytes"):
        GroupSpec(2**32, "full", 16)
    assert GroupSpec(2**32 - 1, "full", 16).index == 2**32 - 1


def test_chunk_not_whole_hash_blocks_is_a_clear_error() -> None:
    g = GroupSpec(3, "full", tokens_per_block=4, blocks_per_chunk=3)
    with pytest.raises(ConfigError) as info:
        GroupLayout((g,), tokens_per_hash=16)
    msg = str(info.value)
    assert "groups[0].blocks_per_chunk=3" in msg  # field and value
    assert "tokens_per_hash=16" in msg
    assert "multiple of 4" in msg  # the fix: 4 blocks of 4 tokens = 16
    assert isinstance(info.value, ValueError)


def test_block_smaller_than_hash_is_fine_when_chunk_is_whole() -> None:
    # vLLM 0.33 asserts tokens_per_block % tokens_per_hash == 0; we only need whole chunks.
    layout = GroupLayout((GroupSpec(0, "full", tokens_per_block=4, blocks_per_chunk=4),), tokens_per_hash=16)
    assert layout.hashes_per_chunk(0) == 1


def test_layout_checks_and_alignment() -> None:
    a = GroupSpec(0, "full", 16, 4)
    b = GroupSpec(1, "sliding_window", 16, 1, window_tokens=64)
    c = GroupSpec(5, "mamba", 48, 1)
    layout = GroupLayout((a, b, c), tokens_per_hash=16)
    assert len(layout) == 3
    assert [layout.hashes_per_chunk(i) for i in range(3)] == [4, 1, 3]
    assert layout.alignment_tokens == 192  # lcm(64, 16, 48)
    with pytest.raises(ConfigError, match="used twice"):
        GroupLayout((a, a), tokens_per_hash=16)
    with pytest.raises(ConfigError, match="empty"):
        GroupLayout((), tokens_per_hash=16)
    with pytest.raises(ConfigError, match="tokens_per_hash=0"):
        GroupLayout((a,), tokens_per_hash=0)


def test_specs_are_frozen() -> None:
    g = GroupSpec(0, "full", 16)
    with pytest.raises(AttributeError):
        g.tokens_per_block = 32  # type: ignore[misc]

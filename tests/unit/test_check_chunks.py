"""The engine thread's check of a store or load call in C (``_fastrec.check_chunks``) against the
Python check it shortcuts (``TieredStore._checked`` with the helper off): for every call, the same
chunks back (keys, ids, their types) or the same error, and the C side refusing, never guessing,
on any form it does not take. Hostile input: generated calls mixing every accepted form with every
way a chunk can be wrong, and direct calls of the C function with bad arguments."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredkv.store as store_mod
from tieredkv.backends.cpu import CPUTier
from tieredkv.config import CPUTierConfig, TieredKVConfig
from tieredkv.keys import MIN_STORED_KEY_BYTES, group_suffix
from tieredkv.pipeline.jobs import ChunkRef
from tieredkv.store import MAX_KEY_BYTES, TieredStore

pytestmark = pytest.mark.skipif(store_mod._check_chunks is None, reason="needs the C helper (tieredkv._fastrec)")
C_CHECK = store_mod._check_chunks
N_BLOCKS, BPC = 10, 2


@pytest.fixture(scope="module")
def store() -> Iterator[TieredStore]:
    cfg = TieredKVConfig(namespace={"model": "check-chunks"})
    s = TieredStore(cfg, tiers=[CPUTier(CPUTierConfig(capacity_bytes="4MiB", segment_bytes="1MiB"))]).start()
    s.register_group(0, [torch.zeros(N_BLOCKS, 8, dtype=torch.uint8)], blocks_per_chunk=BPC)
    s.register_group(1, [torch.zeros(N_BLOCKS, 8, dtype=torch.uint8)], blocks_per_chunk=BPC)
    yield s
    s.close()


def _outcome(s: TieredStore, native: bool, group: int, chunks: Any, op: str) -> Any:
    """What ``_checked`` answers, with the helper on or off: the refs as plain values (with their
    types), or the error's type and message."""
    old = store_mod._check_chunks
    store_mod._check_chunks = C_CHECK if native else None
    try:
        refs = s._checked(group, chunks() if callable(chunks) else chunks, op)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    finally:
        store_mod._check_chunks = old
    assert type(refs) is tuple
    return [(type(r), type(r.key), r.key, type(r.block_ids), r.block_ids, [type(b) for b in r.block_ids]) for r in refs]


def _agree(s: TieredStore, group: int, chunks: Any) -> Any:
    got = {native: _outcome(s, native, group, chunks, "store") for native in (True, False)}
    assert got[True] == got[False], chunks
    return got[True]


class _Bytes(bytes):
    pass


class _Tuple(tuple):  # a tuple subclass that is not ChunkRef: the C side leaves it to Python
    pass


def _keys(s: TieredStore) -> list[Any]:
    good = s.key(b"h" * 32, 0)
    return [
        good,
        bytearray(good),
        memoryview(good),
        _Bytes(good),
        good[:10],  # short
        b"x" * (MAX_KEY_BYTES + 1),  # long
        s.key(b"h" * 32, 1),  # another group
        b"\0" * 16 + good[16:],  # another namespace
        good[: MIN_STORED_KEY_BYTES - 1],
        s.namespace.fingerprint + group_suffix(0),  # the right ends, too short between them
        s.namespace.fingerprint + b"x" * MAX_KEY_BYTES + group_suffix(0),  # ... too long
        "not bytes",
        None,
    ]


#: ids at and past every edge, and every other form an id can take
_IDS = st.sampled_from(
    [-1, 0, N_BLOCKS - 1, N_BLOCKS, N_BLOCKS + 1, True, False, 2**63, 2**70, -(2**70)]
    + [3.0, "1", None, np.int64(3), torch.tensor(4)]
)


@st.composite
def _chunk(draw: st.DrawFn, keys: list[Any]) -> Any:
    """A chunk as an engine passes it (most draws), one with a single thing wrong or odd (its key
    or one id swapped for another form), or anything at all."""
    kind = draw(st.sampled_from(["good", "good", "one-off", "one-off", "any"]))
    key = keys[0] if kind != "any" else draw(st.sampled_from(keys))
    ids: list[Any] = [draw(st.integers(0, N_BLOCKS - 1)) for _ in range(BPC)]
    if kind == "one-off":
        if draw(st.booleans()):
            key = draw(st.sampled_from(keys))
        else:
            ids[draw(st.integers(0, BPC - 1))] = draw(_IDS)
    elif kind == "any":
        ids = draw(st.lists(_IDS, min_size=0, max_size=BPC + 1))
    form = draw(st.sampled_from(["tuple", "tuple", "list", "range", "ndarray"]))
    if form == "list":
        ids_obj: Any = list(ids)
    elif form == "range" and len(ids) == BPC and all(type(b) is int for b in ids) and ids[1] == ids[0] + 1:
        ids_obj = range(ids[0], ids[0] + BPC)
    elif form == "ndarray" and all(type(b) is int and abs(b) < 2**31 for b in ids):
        ids_obj = np.asarray(ids, dtype=np.int64)
    else:
        ids_obj = tuple(ids)
    shapes = ["tuple", "list", "ref"] + (["subclass", "three", "one", "str"] if kind == "any" else [])
    shape = draw(st.sampled_from(shapes))
    if shape == "list":
        return [key, ids_obj]
    if shape == "ref":
        return ChunkRef(key, ids_obj)
    if shape == "subclass":
        return _Tuple((key, ids_obj))
    if shape == "three":
        return (key, ids_obj, 0)
    if shape == "one":
        return (key,)
    if shape == "str":
        return "ab"
    return (key, ids_obj)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_c_and_python_checks_agree_on_generated_calls(store: TieredStore, data: st.DataObject) -> None:
    """Any call (any mix of good and bad chunks, in any container): the C check and the Python
    check give the same chunks back, of the same types, or raise the same error."""
    chunks = data.draw(st.lists(_chunk(_keys(store)), min_size=0, max_size=6))
    container = data.draw(st.sampled_from(["list", "tuple", "gen"]))
    group = data.draw(st.sampled_from([0] * 8 + [1, 7]))
    if container == "gen":  # a one-shot iterator: each side gets its own
        _agree(store, group, lambda: (c for c in chunks))
    else:
        _agree(store, group, list(chunks) if container == "list" else tuple(chunks))


def test_every_documented_bad_chunk_raises_the_same_error_either_way(store: TieredStore) -> None:
    """The errors a caller reads (test_namespace_from_engine's list and the edges of each rule)
    are the Python check's, word for word, with the helper on."""
    key = store.key(b"h" * 32, 0)
    cases: list[tuple[Any, type[Exception], str]] = [
        ([(key[:10], (1, 2))], ValueError, "key is 10 bytes"),
        ([(key, (1,))], ValueError, "has 1 block ids; group 0 chunks are 2 blocks"),
        ([(key, (1, 2, 3))], ValueError, "has 3 block ids"),
        ([(key, (-1, 2))], ValueError, r"block ids \[-1\] are out of range"),
        ([(key, (1, N_BLOCKS))], ValueError, rf"block ids \[{N_BLOCKS}\] are out of range 0..{N_BLOCKS - 1}"),
        ([(key, (1, 2**70))], ValueError, "out of range"),
        ([(key, (1, 2)), (key, ("a", 2))], TypeError, "chunk 1 block ids .* are not integers"),
        ([(key, (1, 2)), "nope"], TypeError, "chunk 1 is 'nope'"),
        ([(store.key(b"h" * 32, 1), (1, 2))], ValueError, "key is of group 1, not of group 0"),
        ([(b"\0" * 16 + key[16:], (1, 2))], ValueError, "another namespace"),
    ]
    for chunks, exc, msg in cases:
        got = _agree(store, 0, chunks)
        assert got[0] is exc
        with pytest.raises(exc, match=msg):
            store._checked(0, chunks, "store")


def test_the_common_forms_take_one_c_call_and_give_chunk_refs(store: TieredStore) -> None:
    """What engines pass (a list of (bytes, tuple or list of ints), or ChunkRefs) is answered by
    the C call alone: a tuple of ChunkRef whose ids are tuples of the same ints; the first chunk
    it does not take is named by index, and nothing is half-built."""
    key = store.key(b"h" * 32, 0)
    fp, suffix = store.namespace.fingerprint, group_suffix(0)
    args = (ChunkRef, fp, suffix, BPC, N_BLOCKS, MIN_STORED_KEY_BYTES, MAX_KEY_BYTES)
    ids = (3, 4)
    got = C_CHECK([(key, ids), [key, [5, 6]], ChunkRef(key, (0, 9))], *args)
    assert type(got) is tuple and all(type(r) is ChunkRef for r in got)
    assert got == ((key, (3, 4)), (key, (5, 6)), (key, (0, 9))) and got[0].block_ids is ids
    assert got[1].key is key and type(got[1].block_ids) is tuple
    assert C_CHECK((), *args) == ()
    for i, bad in enumerate([(key, (3, True)), (key, (3, 10)), (bytearray(key), (3, 4)), (key, range(3, 5))]):
        assert C_CHECK([(key, ids)] * (i + 1) + [bad], *args) == i + 1
    # the refs keep what they hold alive on their own (and the ids of a list are a new tuple)
    before = sys.getrefcount(ids)
    refs = C_CHECK([(key, ids)] * 50, *args)
    assert sys.getrefcount(ids) == before + 50
    del refs
    assert sys.getrefcount(ids) == before


def test_the_c_check_refuses_bad_arguments_with_a_clear_error() -> None:
    """Called wrongly (by a future caller), it raises TypeError / ValueError naming its form; it
    never builds refs of a type that is not a plain two-field tuple."""

    class WithDict(tuple):  # a __dict__ of its own: not a plain tuple layout
        pass

    ok = ([], ChunkRef, b"", b"\0\0\0\0", BPC, N_BLOCKS, 1, 10)
    assert C_CHECK(*ok) == ()
    bad_calls: list[tuple[Any, ...]] = [
        ok[:7],
        ([x for x in "ab"].__iter__(), *ok[1:]),
        (ok[0], list, *ok[2:]),
        (ok[0], int, *ok[2:]),
        (ok[0], WithDict, *ok[2:]),
        (*ok[:2], "fp", *ok[3:]),
        (*ok[:4], 0, *ok[5:]),
        (*ok[:5], -1, *ok[6:]),
    ]
    for call in bad_calls:
        with pytest.raises((TypeError, ValueError), match="check_chunks"):
            C_CHECK(*call)
    with pytest.raises(TypeError):
        C_CHECK(*ok[:4], "2", *ok[5:])

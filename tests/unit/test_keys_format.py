"""Chunk keys (vLLM OffloadKey layout), namespaces and the record format."""

from __future__ import annotations

import os
import shutil
import struct
import sysconfig

import pytest
import torch

from tieredkv import format as fmt
from tieredkv.errors import CorruptRecordError
from tieredkv.format import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    as_readable,
    as_writable,
    decode_header,
    encode_record,
    make_header,
    verify_record,
)
from tieredkv.keys import (
    GroupGeometry,
    Namespace,
    ParallelLayout,
    key_group,
    key_hash,
    make_chunk_key,
    split_stored_key,
    tenant_id,
)

H = bytes(range(32))


def test_chunk_key_is_vllm_offload_key_layout() -> None:
    # vLLM: make_offload_key(block_hash, group_idx) == block_hash + group_idx.to_bytes(4, "big")
    key = make_chunk_key(H, 258)
    assert key == H + b"\x00\x00\x01\x02"
    assert key_hash(key) == H and key_group(key) == 258
    with pytest.raises(ValueError):
        make_chunk_key(H, -1)
    with pytest.raises(ValueError):
        make_chunk_key(H, 2**32)


def test_stored_key_round_trip() -> None:
    ns = Namespace(model="m")
    k = ns.key(H, 3)
    assert split_stored_key(k) == (ns.fingerprint, H, 3)
    assert ns.keys([H, H[::-1]], 3) == [k, ns.key(H[::-1], 3)]
    with pytest.raises(ValueError):
        split_stored_key(b"short")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "abc"},
        {"dtype": "float16"},
        {"groups": (GroupGeometry(tokens_per_block=32),)},
        {"groups": (GroupGeometry(bytes_per_block=1),)},
        {"parallel": ParallelLayout(tp_size=2)},
        {"parallel": ParallelLayout(rank=1)},
        {"format_version": 2},
        {"tenant_salt": "tenant-a"},
        {"generation": "0123456789abcdef"},
    ],
)
def test_every_namespace_field_changes_the_fingerprint(change: dict) -> None:
    base = Namespace(model="m", groups=(GroupGeometry(),))
    other = Namespace(**{"model": "m", "groups": (GroupGeometry(),), **change})
    assert len(base.fingerprint) == 16
    assert base.fingerprint != other.fingerprint
    assert base.fingerprint == Namespace(model="m", groups=(GroupGeometry(),)).fingerprint


def test_record_layout_and_verify() -> None:
    ns = Namespace(model="m")
    key = ns.key(H, 7)
    rec = encode_record(key, b"payload")
    assert len(rec) == HEADER_SIZE + 7 == 71
    magic, version, hsize, fp, group, flags, n, _csum = HEADER.unpack_from(rec)
    assert (magic, version, hsize, fp, group, flags, n) == (MAGIC, 1, 64, ns.fingerprint, 7, 0, 7)
    assert bytes(verify_record(rec, key)) == b"payload"
    assert decode_header(rec).payload_len == 7


def test_every_byte_of_header_and_payload_is_covered() -> None:
    ns = Namespace(model="m")
    key = ns.key(H, 1)
    rec = encode_record(key, bytes(range(200)))
    covered = list(range(len(rec)))  # the reserved bytes 48..63 must stay zero
    for i in covered:
        bad = bytearray(rec)
        bad[i] ^= 0x01
        with pytest.raises(CorruptRecordError):
            verify_record(bad, key)


def test_record_bound_to_its_key() -> None:
    ns = Namespace(model="m")
    rec = encode_record(ns.key(H, 1), b"x" * 10)
    with pytest.raises(CorruptRecordError, match="checksum"):
        verify_record(rec, ns.key(H[::-1], 1))  # same namespace and group, other hash
    with pytest.raises(CorruptRecordError, match="group"):
        verify_record(rec, ns.key(H, 2))
    with pytest.raises(CorruptRecordError, match="namespace"):
        verify_record(rec, Namespace(model="n").key(H, 1))


def test_decoding_never_trusts_the_length_field() -> None:
    key = Namespace(model="m").key(H, 0)
    rec = bytearray(encode_record(key, b"abc"))
    struct.pack_into("<Q", rec, 32, 2**62)
    with pytest.raises(CorruptRecordError, match="disagrees"):
        verify_record(rec, key)
    with pytest.raises(CorruptRecordError, match="shorter"):
        verify_record(rec[:20], key)


def test_buffer_views() -> None:
    t = torch.arange(8, dtype=torch.int32)
    mv = as_readable(t)
    assert mv.format == "B" and len(mv) == 32
    assert bytes(as_readable(torch.tensor([7], dtype=torch.uint8))) == b"\x07"
    w = as_writable(torch.zeros(4, dtype=torch.float16))
    w[:] = b"\x01" * 8
    with pytest.raises(ValueError, match="read-only"):
        as_writable(b"abc")
    with pytest.raises(ValueError, match="contiguous"):
        as_readable(torch.zeros(4, 4)[:, 0])


def test_generation_unset_keeps_the_fingerprint() -> None:
    """A namespace that was never reset keeps the fingerprint it had before generations existed."""
    import dataclasses

    from tieredkv.keys import _canonical

    ns = Namespace(model="m")
    assert "generation" not in _canonical(ns)
    assert dataclasses.replace(ns, generation="").fingerprint == ns.fingerprint


def test_partial_chunk_keys() -> None:
    from tieredkv.keys import partial_chunk_key, partial_valid_from

    k = make_chunk_key(H, 1)
    assert partial_chunk_key(k, 0) == k and partial_valid_from(k, len(k)) == 0
    keys = {partial_chunk_key(k, v) for v in range(1, 4)}
    assert len(keys) == 3 and k not in keys
    for v in range(1, 4):
        p = partial_chunk_key(k, v)
        assert p[-4:] == k[-4:], "the group suffix stays last: routing and the record header use it"
        assert partial_valid_from(p, len(k)) == v
        assert partial_valid_from(p, len(p)) == 0  # the length says it is a whole key
        ns = Namespace(model="m")
        assert partial_valid_from(ns.fingerprint + p, len(ns.fingerprint + k)) == v
    with pytest.raises(ValueError):
        partial_chunk_key(k, 256)


def test_record_header_bytes_are_pinned() -> None:
    """The on-disk / on-wire header of one record, byte for byte: a change to the layout or the
    checksum (even a faster way to compute it) that alters these bytes makes every record
    already stored in LMDB or Redis a miss, so it must come with a FORMAT_VERSION bump."""
    key = bytes(range(16)) + b"\x07" * 32 + (3).to_bytes(4, "big")
    payload = memoryview(bytes(range(256)) * 4)
    header = make_header(key, payload)
    assert header.hex() == (
        "544b565201004000"  # magic TKVR, version 1, header size 64
        "000102030405060708090a0b0c0d0e0f"  # namespace fingerprint
        "0300000000000000"  # group 3, flags 0
        "0004000000000000"  # payload length 1024
        "c26d280a458f004b"  # xxh3-64 of key + header[:32] + payload
        "00000000000000000000000000000000"  # reserved
    )
    assert bytes(verify_record(header + bytes(payload), key)) == bytes(payload)


#: Whether this machine can build the C helper (a C compiler and Python's headers: xxHash is
#: vendored, no system library is needed; every machine of this project's kind): then the install
#: must have built it, and both paths are tested.
CAN_BUILD = bool(
    (shutil.which("cc") or shutil.which("gcc"))
    and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
)


@pytest.fixture(params=["native", "python"])
def record_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a record test on the C helper (``tieredkv._fastrec``) and on the pure-Python path."""
    if request.param == "python":
        monkeypatch.setattr(fmt, "_fastrec", None)
    elif fmt._fastrec is None and CAN_BUILD:
        pytest.fail("the C helper is not built here although it can be (reinstall: pip install -e .)")
    elif fmt._fastrec is None:
        pytest.skip("no C compiler or Python headers on this machine: the pure-Python path is the one in use")
    return str(request.param)


def test_the_c_helper_is_built_on_a_machine_that_can_build_it() -> None:
    """Where a C compiler and Python's headers are (every machine of this kind), the install built
    ``tieredkv._fastrec`` and records go through it; elsewhere the pure-Python path serves."""
    assert fmt.NATIVE == (fmt._fastrec is not None)
    if CAN_BUILD:
        assert fmt.NATIVE


SIZES = [0, 7, 16 * 1024 - 1, 16 * 1024, 64 * 1024 + 3, 256 * 1024, 1024 * 1024]


@pytest.mark.parametrize("n", SIZES)
def test_both_paths_write_the_same_records_and_accept_each_others(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if _NATIVE is None and not CAN_BUILD:
        pytest.skip("no C compiler or Python headers on this machine: only the pure-Python path exists")
    key = Namespace(model="m").key(H, 5)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8)
    native = encode_record(key, payload, flags=9)
    monkeypatch.setattr(fmt, "_fastrec", None)
    python = encode_record(key, payload, flags=9)
    assert native == python
    for record in (native, python):
        for helper in (None, _NATIVE):
            monkeypatch.setattr(fmt, "_fastrec", helper)
            for shift in (0, 3):  # a destination off the 16-byte grid as well
                dst = bytearray(n + 6)
                assert fmt.verify_into(memoryview(record), key, memoryview(dst)[shift:]) == n
                assert dst[shift : shift + n] == as_readable(payload)
                assert not any(dst[:shift]) and not any(dst[shift + n :])


@pytest.mark.parametrize("n", [0, 100, 64 * 1024 + 3])
def test_a_tenant_makes_a_version_2_record_both_paths_agree_and_a_flipped_tenant_fails(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record with a tenant is version 2, its tenant (bytes 48..55) covered by the checksum; the
    default tenant keeps version 1, byte for byte as before. Both paths write and accept both."""
    key = Namespace(model="m").key(H, 5)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8)
    tenant = tenant_id("acme")
    made = []
    for helper in (_NATIVE, None):
        if helper is None and _NATIVE is None:
            continue
        monkeypatch.setattr(fmt, "_fastrec", helper)
        rec = encode_record(key, payload, tenant=tenant)
        heads = bytearray(HEADER_SIZE)
        fmt.encode_heads_into(memoryview(heads), [(key, as_readable(payload), tenant)])
        assert bytes(heads) == bytes(rec[:HEADER_SIZE])
        made.append(rec)
        assert struct.unpack_from("<H", rec, 4)[0] == 2 and decode_header(rec).tenant == tenant
        assert struct.unpack_from("<H", encode_record(key, payload), 4)[0] == 1  # default tenant: version 1
        assert decode_header(encode_record(key, payload)).tenant == 0
    assert all(r == made[0] for r in made)
    record = made[0]
    for helper in (None, _NATIVE):
        monkeypatch.setattr(fmt, "_fastrec", helper)
        dst = bytearray(n)
        assert fmt.verify_into(memoryview(record), key, memoryview(dst)) == n and dst == as_readable(payload)
        for at in (48, 55, 56, 63):  # the tenant, and the bytes after it
            bad = bytearray(record)
            bad[at] ^= 0x10
            with pytest.raises(CorruptRecordError):
                fmt.verify_into(memoryview(bad), key, memoryview(bytearray(n)))
        sealed = bytearray(record)
        sealed[28] |= fmt.FLAG_SEALED
        with pytest.raises(CorruptRecordError, match="sealed|length|verify"):
            fmt.verify_record(sealed, key)


_NATIVE = fmt._fastrec


@pytest.mark.parametrize("n", [200, 64 * 1024, 256 * 1024])
def test_verify_into_refuses_every_damaged_byte_and_keeps_none_in_the_destination(n: int, record_path: str) -> None:
    """Every byte of header and payload is covered on both paths, and a damaged payload never
    stays where it landed: the destination is either untouched or zeroed."""
    key = Namespace(model="m").key(H, 1)
    rec = encode_record(key, bytes(range(256)) * (n // 256) + bytes(n % 256))
    positions = range(len(rec)) if n <= 200 else [*range(HEADER_SIZE), HEADER_SIZE, len(rec) // 2, len(rec) - 1]
    for i in positions:
        bad = bytearray(rec)
        bad[i] ^= 0x01
        dst = bytearray(b"\xaa" * n)
        with pytest.raises(CorruptRecordError):
            fmt.verify_into(memoryview(bad), key, memoryview(dst))
        assert dst in (bytearray(b"\xaa" * n), bytearray(n)), i
    other = Namespace(model="m").key(H[::-1], 1)
    with pytest.raises(CorruptRecordError, match="checksum"):
        fmt.verify_into(rec, other, memoryview(bytearray(n)))  # a record copied under another key
    with pytest.raises(CorruptRecordError, match="group"):
        fmt.verify_into(rec, Namespace(model="m").key(H, 2), memoryview(bytearray(n)))


def test_verify_into_a_destination_too_small_copies_nothing(record_path: str) -> None:
    key = Namespace(model="m").key(H, 1)
    rec = encode_record(key, b"x" * 40_000)
    dst = bytearray(b"\xaa" * 39_999)
    assert fmt.verify_into(rec, key, memoryview(dst)) == -1 and dst == b"\xaa" * 39_999
    bad = bytearray(rec)
    bad[-1] ^= 1
    with pytest.raises(CorruptRecordError):  # damaged and too large: corrupt, not merely too large
        fmt.verify_into(bad, key, memoryview(dst))
    assert dst == b"\xaa" * 39_999


def test_the_pinned_header_on_both_paths(record_path: str) -> None:
    key = bytes(range(16)) + b"\x07" * 32 + (3).to_bytes(4, "big")
    payload = bytes(range(256)) * 4
    assert bytes(encode_record(key, payload)[:HEADER_SIZE]) == make_header(key, memoryview(payload))
    assert make_header(key, memoryview(payload)).hex().startswith("544b565201004000")


def test_a_batch_encoded_in_one_call_is_each_record_as_encode_record_writes_it(record_path: str) -> None:
    """``encode_records_into`` writes the records one after another, each byte for byte what ``encode_record`` writes for its item, and
    says where each ends; a destination too small for all of them gets nothing."""
    ns = Namespace(model="m")
    items = [(ns.key(H, g), bytes((g * 7 + i) % 251 for i in range(n))) for g, n in enumerate(SIZES)]
    items.append((ns.key(H[::-1], 2), b""))
    total = sum(HEADER_SIZE + len(p) for _, p in items)
    dst = bytearray(b"\xaa" * (total + 5))
    ends = fmt.encode_records_into(memoryview(dst), [(k, memoryview(p)) for k, p in items])
    assert ends[-1] == total and len(ends) == len(items)
    for (key, payload), start, end in zip(items, [0, *ends], ends):
        assert dst[start:end] == encode_record(key, payload)
        assert bytes(verify_record(memoryview(dst)[start:end], key)) == payload
    assert dst[total:] == b"\xaa" * 5
    short = bytearray(b"\xaa" * (total - 1))
    with pytest.raises(ValueError, match="smaller"):
        fmt.encode_records_into(memoryview(short), [(k, memoryview(p)) for k, p in items])
    assert short == b"\xaa" * (total - 1)
    assert fmt.encode_records_into(memoryview(short), []) == []


def test_a_batch_checked_in_one_call_answers_as_verify_into_does_for_each(record_path: str) -> None:
    """``verify_many_into`` (one C call for a whole read, the GIL let go once): each good record
    lands whole; a damaged one (payload or header), one copied under another key and a short
    one are each a CorruptRecordError naming what is wrong, with nothing of it left where it
    landed; one too large for its buffer is -1 and its buffer untouched."""
    ns = Namespace(model="m")
    keys = [ns.key(H, g) for g in range(8)]
    payloads = [
        bytes((g * 13 + i) % 251 for i in range(n))
        for g, n in enumerate([0, 100, 70_000, 300_000, 300_000, 100, 70_000, 100])
    ]
    records = [bytearray(encode_record(k, p)) for k, p in zip(keys, payloads)]
    records[4][-1] ^= 1  # a payload byte (300 KB: found after its copy)
    records[5][9] ^= 1  # the header's fingerprint
    records[6] = bytearray(encode_record(keys[0], payloads[6]))  # another key's record
    records[7] = records[7][:40]  # shorter than a header
    dsts = [bytearray(b"\xaa" * max(len(p), 1)) for p in payloads]
    dsts[2] = bytearray(b"\xaa" * 69_999)  # one byte short
    got = fmt.verify_many_into([memoryview(r) for r in records], keys, [memoryview(d) for d in dsts])
    assert got[:4] == [0, 100, -1, 300_000]
    assert dsts[1] == payloads[1] and dsts[3] == payloads[3] and dsts[2] == b"\xaa" * 69_999
    for i, why in ((4, "checksum"), (5, "namespace"), (6, "group"), (7, "shorter")):
        assert isinstance(got[i], CorruptRecordError) and why in str(got[i]), (i, got[i])
        assert dsts[i] in (bytearray(b"\xaa" * len(dsts[i])), bytearray(len(dsts[i]))), i
    assert fmt.verify_many_into([], [], []) == []


def test_the_c_batch_check_refuses_bad_arguments_before_it_copies_anything() -> None:
    if _NATIVE is None:
        pytest.skip("no C helper on this machine")
    key = Namespace(model="m").key(H, 1)
    rec = encode_record(key, b"x" * 100)
    dst = bytearray(b"\xaa" * 100)
    for args, message in [
        (([rec], [key], []), "of one length"),
        (([rec, rec], [key, "k"], [dst, dst]), "key must be bytes"),
        (([rec, rec], [key, key], [dst, b"read-only"]), "writable"),
        (((rec,), (key,), (dst,)), "list"),
    ]:
        with pytest.raises((TypeError, BufferError, ValueError), match=message):
            _NATIVE.verify_many(*args)
        assert dst == b"\xaa" * 100


def test_headers_written_apart_are_each_records_header_and_leave_the_payloads_alone(record_path: str) -> None:
    """``encode_heads_into`` (the LMDB tier's layout: header and payload stored apart) writes,
    for each item, byte for byte the header ``encode_record`` puts before that payload, one after
    another, and touches nothing else; a destination too small for all of them gets nothing."""
    ns = Namespace(model="m")
    items = [(ns.key(H, g), bytes((g * 5 + i) % 251 for i in range(n))) for g, n in enumerate(SIZES)]
    views = [(k, memoryview(p)) for k, p in items]
    heads = bytearray(b"\xaa" * (HEADER_SIZE * len(items) + 3))
    fmt.encode_heads_into(memoryview(heads), views)
    for i, (key, payload) in enumerate(items):
        assert heads[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] == encode_record(key, payload)[:HEADER_SIZE]
    assert heads[-3:] == b"\xaa" * 3
    short = bytearray(b"\xaa" * (HEADER_SIZE * len(items) - 1))
    with pytest.raises(ValueError, match="smaller"):
        fmt.encode_heads_into(memoryview(short), views)
    assert short == b"\xaa" * len(short)


def test_a_record_kept_apart_is_checked_as_a_whole_one_is(record_path: str) -> None:
    """``verify_many_parts_into`` answers for a (header, payload) pair what ``verify_many_into``
    answers for the whole record: good ones land whole; a damaged payload byte or header byte,
    a header of another key, a header that is not 64 bytes and a payload of another length are
    each a CorruptRecordError with nothing left where it landed; one too large is -1, its
    buffer untouched."""
    ns = Namespace(model="m")
    keys = [ns.key(H, g) for g in range(8)]
    payloads = [
        bytearray((g * 11 + i) % 251 for i in range(n))
        for g, n in enumerate([0, 100, 70_000, 300_000, 300_000, 100, 70_000, 100])
    ]
    heads = [bytearray(encode_record(k, p)[:HEADER_SIZE]) for k, p in zip(keys, payloads)]
    payloads[4][-1] ^= 1  # a payload byte (300 KB: found after its copy)
    heads[5][40] ^= 1  # the header's checksum
    heads[6] = bytearray(encode_record(keys[0], payloads[6])[:HEADER_SIZE])  # another key's header
    heads[7] = heads[7][:63]  # not a header
    dsts = [bytearray(b"\xaa" * max(len(p), 1)) for p in payloads]
    dsts[2] = bytearray(b"\xaa" * 69_999)  # one byte short
    got = fmt.verify_many_parts_into(
        [memoryview(h) for h in heads], [memoryview(p) for p in payloads], keys, [memoryview(d) for d in dsts]
    )
    assert got[:4] == [0, 100, -1, 300_000]
    assert dsts[1] == payloads[1] and dsts[3] == payloads[3] and dsts[2] == b"\xaa" * 69_999
    for i, why in ((4, "checksum"), (5, "checksum"), (6, "group"), (7, "")):
        assert isinstance(got[i], CorruptRecordError) and why in str(got[i]), (i, got[i])
        assert dsts[i] in (bytearray(b"\xaa" * len(dsts[i])), bytearray(len(dsts[i]))), i
    longer = fmt.verify_many_parts_into([memoryview(heads[1])], [memoryview(payloads[1] + b"!")], [keys[1]], [dsts[1]])
    assert isinstance(longer[0], CorruptRecordError)
    assert fmt.verify_many_parts_into([], [], [], []) == []


def test_the_c_parts_check_refuses_bad_arguments_before_it_copies_anything() -> None:
    if _NATIVE is None:
        pytest.skip("no C helper on this machine")
    key = Namespace(model="m").key(H, 1)
    rec = encode_record(key, b"x" * 100)
    head, body = rec[:HEADER_SIZE], rec[HEADER_SIZE:]
    dst = bytearray(b"\xaa" * 100)
    for args, message in [
        (([head], [body], [key], []), "of one length"),
        (([head, head], [body, body], [key, "k"], [dst, dst]), "key must be bytes"),
        (([head, head], [body, body], [key, key], [dst, b"read-only"]), "writable"),
        (((head,), (body,), (key,), (dst,)), "list"),
    ]:
        with pytest.raises((TypeError, BufferError, ValueError), match=message):
            _NATIVE.verify_parts_many(*args)
        assert dst == b"\xaa" * 100


def test_a_header_kept_at_the_end_of_a_stored_entry_is_read_in_place(record_path: str) -> None:
    """``head_at``: the header is the last 64 bytes of an entry that starts with other bytes
    (the LMDB tier's access entry: stamp and size, then the header), read where it is. An entry
    of any other length is not a header; a good one still catches every damaged payload."""
    ns = Namespace(model="m")
    keys = [ns.key(H, g) for g in range(3)]
    payloads = [bytes((g * 3 + i) % 251 for i in range(70_000)) for g in range(3)]
    entries = [b"s" * 16 + bytes(encode_record(k, p)[:HEADER_SIZE]) for k, p in zip(keys, payloads)]
    entries[2] = entries[2] + b"!"  # one byte too long: not a header
    dsts = [bytearray(70_000) for _ in range(3)]
    got = fmt.verify_many_parts_into(entries, payloads, keys, [memoryview(d) for d in dsts], head_at=16)
    assert got[:2] == [70_000, 70_000] and dsts[0] == payloads[0] and dsts[1] == payloads[1]
    assert isinstance(got[2], CorruptRecordError) and not any(dsts[2])
    damaged = bytearray(payloads[1])
    damaged[12_345] ^= 4
    (bad,) = fmt.verify_many_parts_into([entries[1]], [damaged], [keys[1]], [memoryview(dsts[1])], head_at=16)
    assert isinstance(bad, CorruptRecordError) and "checksum" in str(bad)
    if _NATIVE is not None:
        with pytest.raises(ValueError, match="negative"):
            _NATIVE.verify_parts_many([entries[0]], [payloads[0]], [keys[0]], [dsts[0]], -1)

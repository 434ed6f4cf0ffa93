"""Sealed records (tieredkv.sealing): what opens, what does not, and how keys are loaded."""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path

import pytest

from tieredkv.backends.registry import build_tier
from tieredkv.config import EncryptionConfig, LMDBTierConfig, RedisTierConfig, load_config
from tieredkv.errors import ConfigError, CorruptRecordError
from tieredkv.format import (
    FLAG_SEALED,
    HEADER_SIZE,
    SEAL_KEY_ID_AT,
    SEAL_TAG,
    TENANT_AT,
    TENANT_VERSION,
    decode_header,
    encode_record,
    verify_record,
)
from tieredkv.keys import Namespace, tenant_id
from tieredkv.sealing import Keyring, claimed_size, key_id, load_keyring, sealed_size

K1, K2, K3 = (bytes([i]) * 16 + os.urandom(16) for i in (1, 2, 3))
NS = Namespace(model="sealing/unit")
OTHER = Namespace(model="sealing/other")
KEY = NS.key(b"\x07" * 32, 3)
PAYLOAD = b"the prompt's keys and values " * 40


def flip(rec: bytes | bytearray, at: int, bit: int = 1) -> bytes:
    b = bytearray(rec)
    b[at] ^= bit
    return bytes(b)


def opens(ring: Keyring, rec: bytes | bytearray, key: bytes = KEY) -> bytes:
    dst = bytearray(len(PAYLOAD) + 10)
    n = ring.open_into(rec, key, memoryview(dst))
    assert n >= 0
    return bytes(dst[:n])


def test_round_trip_and_layout() -> None:
    ring = Keyring([K1])
    rec = ring.seal(KEY, PAYLOAD, tenant=tenant_id("acme"))
    assert len(rec) == sealed_size(len(PAYLOAD)) == HEADER_SIZE + len(PAYLOAD) + SEAL_TAG
    h = decode_header(rec)  # the header is a well-formed version 2 header of the plaintext's length
    assert (h.version, h.flags, h.payload_len, h.tenant) == (
        TENANT_VERSION,
        FLAG_SEALED,
        len(PAYLOAD),
        tenant_id("acme"),
    )
    assert h.fingerprint == NS.fingerprint and h.group == 3
    assert struct.unpack_from("<I", rec, SEAL_KEY_ID_AT)[0] == key_id(K1) == ring.newest_id
    assert PAYLOAD[:16] not in rec and PAYLOAD[200:216] not in rec
    assert opens(ring, rec) == PAYLOAD
    assert ring.open(rec, KEY) == PAYLOAD and ring.check(rec, KEY) is None
    assert claimed_size(rec, KEY) == len(rec) and claimed_size(rec, OTHER.key(b"\x07" * 32, 3)) is None
    # two seals of the same payload differ (a fresh nonce each)
    assert ring.seal(KEY, PAYLOAD) != ring.seal(KEY, PAYLOAD)


def test_the_checksum_paths_refuse_a_sealed_record() -> None:
    rec = Keyring([K1]).seal(KEY, PAYLOAD)
    with pytest.raises(CorruptRecordError, match="sealed"):
        verify_record(rec, KEY)


@pytest.mark.parametrize(
    "where",
    ["ciphertext", "tag", "nonce-first", "nonce-last", "length", "group", "namespace", "tenant", "key-id", "flags"],
)
def test_any_changed_bit_does_not_open_and_leaves_nothing(where: str) -> None:
    ring = Keyring([K1, K2])
    rec = ring.seal(KEY, PAYLOAD, tenant=5)
    at = {
        "ciphertext": HEADER_SIZE + 100,
        "tag": len(rec) - 3,
        "nonce-first": 41,
        "nonce-last": 57,
        "length": 33,
        "group": 24,
        "namespace": 8,
        "tenant": TENANT_AT,
        "key-id": SEAL_KEY_ID_AT,
        "flags": 29,
    }[where]
    dst = bytearray(b"\xee" * (len(PAYLOAD) + 10))
    with pytest.raises(CorruptRecordError):
        ring.open_into(flip(rec, at), KEY, memoryview(dst))
    assert dst == b"\xee" * len(dst) or not any(dst[: len(PAYLOAD)])  # never a byte of plaintext
    assert ring.check(flip(rec, at), KEY) is not None


def test_a_forged_plain_record_another_key_another_key_id_or_place_does_not_open() -> None:
    ring = Keyring([K1])
    cases = {
        "plain record (the format, no key)": bytes(encode_record(KEY, PAYLOAD)),
        "plain version 2 record": bytes(encode_record(KEY, PAYLOAD, tenant=9)),
        "sealed under another ring": bytes(Keyring([K3]).seal(KEY, PAYLOAD)),
        "another block's record": bytes(ring.seal(NS.key(b"\x08" * 32, 3), PAYLOAD)),
        "another namespace's record": bytes(ring.seal(OTHER.key(b"\x07" * 32, 3), PAYLOAD)),
        "short": bytes(ring.seal(KEY, PAYLOAD))[:70],
        "empty": b"",
    }
    for what, rec in cases.items():
        dst = bytearray(len(PAYLOAD))
        with pytest.raises(CorruptRecordError) as ei:
            ring.open_into(rec, KEY, memoryview(dst))
        assert not any(dst), what
        if what == "sealed under another ring":
            assert f"{key_id(K3):08x}" in str(ei.value) and "not in the keyring" in str(ei.value)
    # a forged header that claims the ring's key id, over another key's ciphertext
    other = bytearray(Keyring([K3]).seal(KEY, PAYLOAD))
    other[SEAL_KEY_ID_AT : SEAL_KEY_ID_AT + 4] = key_id(K1).to_bytes(4, "little")
    with pytest.raises(CorruptRecordError, match="does not authenticate"):
        ring.open(bytes(other), KEY)


def test_another_tenant_in_the_header_does_not_open() -> None:
    ring = Keyring([K1])
    rec = bytearray(ring.seal(KEY, PAYLOAD, tenant=tenant_id("a")))
    assert opens(ring, rec) == PAYLOAD
    rec[TENANT_AT : TENANT_AT + 8] = tenant_id("b").to_bytes(8, "little")
    with pytest.raises(CorruptRecordError, match="does not authenticate"):
        ring.open(bytes(rec), KEY)


def test_rotation_newest_seals_any_opens() -> None:
    old = Keyring([K1]).seal(KEY, PAYLOAD)
    rotated = Keyring([K2, K1])
    assert opens(rotated, old) == PAYLOAD
    new = rotated.seal(KEY, PAYLOAD)
    assert struct.unpack_from("<I", new, SEAL_KEY_ID_AT)[0] == key_id(K2)
    dropped = Keyring([K2])
    assert opens(dropped, new) == PAYLOAD
    with pytest.raises(CorruptRecordError, match="not in the keyring"):
        dropped.open(old, KEY)


def test_a_record_too_large_for_its_destination_authenticates_first() -> None:
    ring = Keyring([K1])
    rec = ring.seal(KEY, PAYLOAD)
    small = bytearray(10)
    assert ring.open_into(rec, KEY, memoryview(small)) == -1 and not any(small)
    with pytest.raises(CorruptRecordError):  # damaged and too large: corrupt, not oversize
        ring.open_into(flip(rec, HEADER_SIZE + 5), KEY, memoryview(small))


def test_keyring_refuses_bad_rings() -> None:
    with pytest.raises(ConfigError, match="no key"):
        Keyring([])
    with pytest.raises(ConfigError, match="key 2 has 31 bytes"):
        Keyring([K1, K2[:31]])
    with pytest.raises(ConfigError, match="twice"):
        Keyring([K1, K2, K1])
    assert K1.hex() not in repr(Keyring([K1])) and f"{key_id(K1):08x}" in repr(Keyring([K1]))


# ---- loading keys ------------------------------------------------------------------------------


def key_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_key_file_hex_base64_comments_newest_first(tmp_path: Path) -> None:
    text = f"# tieredkv keys, newest first\n\n{K2.hex()}   # since March\n{base64.b64encode(K1).decode()}\n"
    ring = load_keyring(EncryptionConfig(keys_file=key_file(tmp_path / "keys", text)), "tier 'redis': encryption")
    assert ring.ids == (key_id(K2), key_id(K1)) and ring.newest_id == key_id(K2)


def test_keys_from_the_environment() -> None:
    cfg = EncryptionConfig(keys_env="TKV_TEST_KEYS")
    ring = load_keyring(cfg, "tier 'redis': encryption", env={"TKV_TEST_KEYS": f"{K2.hex()}, {K1.hex()}"})
    assert ring.ids == (key_id(K2), key_id(K1))


@pytest.mark.parametrize(
    "case", ["missing", "short-key", "long-key", "group-readable", "other-readable", "empty", "directory"]
)
def test_key_file_errors_name_the_field_and_the_fix_never_the_key(tmp_path: Path, case: str) -> None:
    secret = K1.hex()
    path = {
        "missing": str(tmp_path / "nope"),
        "short-key": lambda: key_file(tmp_path / "k", secret[:62] + "\n"),
        "long-key": lambda: key_file(tmp_path / "k", f"{K2.hex()}\n{secret}ab\n"),
        "group-readable": lambda: key_file(tmp_path / "k", secret + "\n", 0o640),
        "other-readable": lambda: key_file(tmp_path / "k", secret + "\n", 0o604),
        "empty": lambda: key_file(tmp_path / "k", "# no key yet\n"),
        "directory": str(tmp_path),
    }[case]
    path = path() if callable(path) else path
    cfg = {"tiers": [{"kind": "redis", "name": "remote", "encryption": {"keys_file": path}}]}
    with pytest.raises(ConfigError) as ei:
        build_tier(load_config(cfg, env={}).tiers[0])
    msg = str(ei.value)
    assert "tier 'remote': encryption.keys_file" in msg and path in msg, msg
    assert secret[:20] not in msg
    want = {
        "missing": "check the path",
        "short-key": "line 1: not a 256-bit key",
        "long-key": "line 2: not a 256-bit key",
        "group-readable": "chmod 600",
        "other-readable": "chmod 600",
        "empty": "holds no key",
        "directory": "not a regular file",
    }[case]
    assert want in msg, msg
    if case.endswith("-key"):
        assert "openssl rand -hex 32" in msg


@pytest.mark.parametrize("value", [None, "", "  \n", "# only a comment"])
def test_an_empty_or_unset_key_variable_names_it_and_the_fix(value: str | None) -> None:
    env = {} if value is None else {"TKV_TEST_KEYS": value}
    with pytest.raises(ConfigError) as ei:
        load_keyring(EncryptionConfig(keys_env="TKV_TEST_KEYS"), "tier 'remote': encryption", env=env)
    msg = str(ei.value)
    assert "tier 'remote': encryption.keys_env" in msg and "TKV_TEST_KEYS" in msg
    assert ("not set" if value is None else ("empty" if not value.strip() else "no key")) in msg


def test_a_bad_key_in_the_variable_is_not_echoed() -> None:
    bad = "ab" * 31
    with pytest.raises(ConfigError) as ei:
        load_keyring(EncryptionConfig(keys_env="V"), "tier 'r': encryption", env={"V": f"{K1.hex()} {bad}"})
    assert "key 2" in str(ei.value) and bad not in str(ei.value) and K1.hex() not in str(ei.value)


@pytest.mark.parametrize(
    ("encryption", "says"),
    [
        ({}, "set exactly one of keys_file"),
        ({"keys_file": "/k", "keys_env": "K"}, "set exactly one of keys_file"),
        ({"keys_env": "NOT A NAME"}, "name of an environment variable"),
        ({"keys_file": " "}, "must name the key file"),
        ({"key_file": "/k"}, "keys_file"),
    ],
)
def test_config_errors_name_the_field(encryption: dict[str, str], says: str) -> None:
    for kind in ("redis", "lmdb"):
        with pytest.raises(ConfigError) as ei:
            load_config({"tiers": [{"kind": kind, "encryption": encryption}]}, env={})
        assert "tiers.0.encryption" in str(ei.value) and says in str(ei.value), str(ei.value)


def test_encryption_fields_are_described_and_default_off() -> None:
    for name, field in EncryptionConfig.model_fields.items():
        assert field.description, name
    assert RedisTierConfig().encryption is None and LMDBTierConfig().encryption is None
    assert RedisTierConfig.model_fields["encryption"].description
    assert LMDBTierConfig.model_fields["encryption"].description


def test_encryption_set_from_the_environment_like_any_field(tmp_path: Path) -> None:
    path = key_file(tmp_path / "keys", K1.hex() + "\n")
    env = {"TIEREDKV_TIERS__redis__ENCRYPTION__KEYS_FILE": path}
    cfg = load_config({"tiers": [{"kind": "redis"}]}, env=env)
    assert cfg.tiers[0].encryption == EncryptionConfig(keys_file=path)  # type: ignore[attr-defined]
    tier = build_tier(cfg.tiers[0])
    assert tier.keyring.ids == (key_id(K1),)  # type: ignore[attr-defined]

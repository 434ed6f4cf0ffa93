"""Sealed records: AES-256-GCM with a key per namespace and tenant, for tiers that leave the host.

A tier configured with ``encryption`` (:class:`~tieredkv.config.EncryptionConfig`) stores every
payload sealed (:class:`~tieredkv.backends._sealed.SealedTier`): only a holder of one of its
master keys can read it, and a record not sealed by one (written by anyone who can write the
keyspace, with the format in hand), or changed by a single bit since, is a miss, never bytes.

Primitives:

* :class:`Keyring` — the master keys (newest first: the newest seals, any opens), loaded by
  :func:`load_keyring` from a key file or an environment variable. ``seal`` / ``seal_into`` make
  a record, ``open_into`` / ``open`` / ``check`` take one apart.
* :func:`key_id` — the 32-bit id a record names its master key by.

The sealed record (layout in :mod:`tieredkv.format`): the 64-byte header, version 2 with flag bit
0 (:data:`~tieredkv.format.FLAG_SEALED`), its payload length the plaintext's, its nonce in bytes
40..47 and 56..59, the sealing key's id in 60..63, the tenant in 48..55; then the ciphertext and
the 16-byte GCM tag. The associated data is the stored key and the whole header, so the tag
vouches for every header field (namespace, group, length, tenant, key id) and for the key the
record is stored under: a record copied under another key, or with any header byte changed, does
not open.

Keys: a record is sealed with AES-256-GCM under a key derived from the master key with
HKDF-SHA256 (salt: the record's 16-byte namespace fingerprint; info: ``b"tieredkv record v2"``
and the tenant id, 8 bytes little-endian): one key per (master key, namespace, tenant), derived
once and kept (at most :data:`_CACHE_MAX` at a time). A key id is the first 4 bytes of
SHA-256(``b"tieredkv key id\\0"`` + master key): it says which key to try, never anything about
the key (32 bits of a hash of 256 secret bits).

Nonces are 96 random bits per record (``os.urandom``). With random nonces, NIST SP 800-38D
bounds the use of one key to 2**32 seals (a nonce repeats with probability under 2**-32): here
per derived key, i.e. per master key, namespace and tenant, at most 2**32 records (4.3 billion:
1 PiB of 256 KiB chunks) before the master key is rotated. Nothing counts them across processes.

What a seal does not hide (by design: the tiers and the admin CLI need them): the stored key (the
namespace fingerprint, the block hash, the group), the record's size, the header's namespace
fingerprint, group, length, tenant id and key id, and when records are read and written. It does
not stop a replay: anyone who can write the keyspace can put back an older record that was sealed
for the same key (the same block of the same namespace and tenant), and it opens.

Key material never appears in a message, a log line, a ``repr`` or an exception: errors name the
file or variable and the line, never its text.
"""

from __future__ import annotations

import binascii
import hashlib
import os
import re
import stat
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tieredkv.errors import ConfigError, CorruptRecordError
from tieredkv.format import (
    FLAG_SEALED,
    HEADER_SIZE,
    MAGIC,
    SEAL_KEY_ID_AT,
    SEAL_NONCE,
    SEAL_NONCE_AT,
    SEAL_TAG,
    TENANT_AT,
    TENANT_VERSION,
    as_readable,
)
from tieredkv.keys import key_header_ids

if TYPE_CHECKING:
    from tieredkv.config import EncryptionConfig

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
except ImportError:  # the base install: a tier with encryption says what to install
    AESGCM = None  # type: ignore[assignment,misc]

__all__ = ["KEY_BYTES", "Keyring", "claimed_size", "key_id", "load_keyring", "parse_keys", "sealed_size"]

#: Bytes of a master key (AES-256).
KEY_BYTES = 32
#: HKDF info prefix of a record key (the tenant id follows, 8 bytes little-endian).
INFO = b"tieredkv record v2"
#: Largest key file read (a key is one line of 64 characters; a ring of hundreds fits).
MAX_KEY_FILE_BYTES = 64 << 10
#: Derived keys kept (per master key, namespace and tenant); past it the cache starts over.
_CACHE_MAX = 4096
#: The install that brings AES-GCM and HKDF.
INSTALL_HINT = "pip install 'tieredkv[redis]' (or any extra but lmdb; it brings the cryptography package)"

# The header as the sealing code reads it: magic, version, header size, the 20 bytes of namespace
# fingerprint and group, flags, payload length, nonce (first 8), tenant, nonce (last 4), key id.
_HEAD = struct.Struct("<4sHH20sIQ8sQ4sI")
_LEAD = struct.pack("<4sHH", MAGIC, TENANT_VERSION, HEADER_SIZE)
assert _HEAD.size == HEADER_SIZE
assert SEAL_NONCE_AT == ((40, 48), (56, 60)) and TENANT_AT == 48 and SEAL_KEY_ID_AT == 60 and SEAL_NONCE == 12
_UNAUTHENTIC = (
    "sealed record does not authenticate (changed since it was sealed, forged, or sealed for another key,"
    " tenant or namespace)"
)
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def key_id(master: bytes) -> int:
    """The 32-bit id records name master key ``master`` by (header bytes 60..63)."""
    return int.from_bytes(hashlib.sha256(b"tieredkv key id\0" + master).digest()[:4], "little")


def sealed_size(payload_len: int) -> int:
    """Bytes of the sealed record of a payload of ``payload_len`` bytes."""
    return HEADER_SIZE + payload_len + SEAL_TAG


def claimed_size(head: bytes | memoryview, key: bytes) -> int | None:
    """The sealed record size (header, ciphertext, tag) the header at the start of ``head``
    states, if it is a sealed header for stored key ``key``; else None. Nothing authenticated:
    for telling a record too large for its destination from a foreign value, not for serving."""
    head = bytes(head[:HEADER_SIZE])
    if len(head) < HEADER_SIZE or not head.startswith(_LEAD):
        return None
    _, _, _, ids, flags, n, *_ = _HEAD.unpack(head)
    if flags != FLAG_SEALED or ids != key_header_ids(key):
        return None
    return sealed_size(n)


class Keyring:
    """Master keys, newest first: the newest seals, every one opens what it sealed.

    ``Keyring([k2, k1])`` (each 32 bytes). Rotation: put a new key first, restart the engines (its
    records are sealed with it from then on, the older ones still open), and drop an old key once
    its records have aged out (``tieredkv verify --repair`` deletes what no key opens).

    Raises:
        ConfigError: no key, a key not of 32 bytes, or the same key (id) twice.
    """

    def __init__(self, keys: Sequence[bytes], *, source: str = "keys") -> None:
        if AESGCM is None:
            raise ConfigError(f"{source}: encryption needs the cryptography package: {INSTALL_HINT}")
        if not keys:
            raise ConfigError(f"{source}: no key; give at least one 32-byte key (64 hex digits)")
        self._masters: dict[int, bytes] = {}
        for i, k in enumerate(keys):
            if len(k) != KEY_BYTES:
                raise ConfigError(f"{source}: key {i + 1} has {len(k)} bytes; a key is {KEY_BYTES} bytes")
            kid = key_id(bytes(k))
            if kid in self._masters:
                raise ConfigError(f"{source}: key {i + 1} is there twice (key id {kid:08x}); keep one")
            self._masters[kid] = bytes(k)
        self.source = source
        self._newest = next(iter(self._masters))
        self._derived: dict[tuple[int, bytes, int], Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Keyring({self.source}, key ids {', '.join(f'{k:08x}' for k in self.ids)})"

    @property
    def ids(self) -> tuple[int, ...]:
        """The key ids, newest first."""
        return tuple(self._masters)

    @property
    def newest_id(self) -> int:
        """The id of the key that seals."""
        return self._newest

    def _aead(self, kid: int, fingerprint: bytes, tenant: int) -> Any:
        """The AES-GCM of (master key ``kid``, namespace, tenant), derived on first use."""
        ck = (kid, fingerprint, tenant)
        aead = self._derived.get(ck)
        if aead is None:
            hkdf = HKDF(
                algorithm=hashes.SHA256(),
                length=KEY_BYTES,
                salt=fingerprint,
                info=INFO + tenant.to_bytes(8, "little"),
            )
            aead = AESGCM(hkdf.derive(self._masters[kid]))
            with self._lock:
                if len(self._derived) >= _CACHE_MAX:
                    self._derived.clear()
                self._derived[ck] = aead
        return aead

    # ---- sealing ---------------------------------------------------------------------

    def seal_into(self, dst: memoryview, key: bytes, payload: Any, tenant: int = 0) -> int:
        """Write the sealed record of ``payload`` for stored key ``key`` and ``tenant`` at the start
        of ``dst`` (at least :func:`sealed_size` bytes); return its length."""
        pv = as_readable(payload)
        n = len(pv)
        total = HEADER_SIZE + n + SEAL_TAG
        if len(dst) < total:
            raise ValueError(f"destination of {len(dst)} bytes is smaller than the sealed record ({total})")
        nonce = os.urandom(SEAL_NONCE)
        kid = self._newest
        ids = key_header_ids(key)
        head = _HEAD.pack(MAGIC, TENANT_VERSION, HEADER_SIZE, ids, FLAG_SEALED, n, nonce[:8], tenant, nonce[8:], kid)
        dst[:HEADER_SIZE] = head
        self._aead(kid, ids[:16], tenant).encrypt_into(nonce, pv, key + head, dst[HEADER_SIZE:total])
        return total

    def seal(self, key: bytes, payload: Any, tenant: int = 0) -> bytearray:
        """A new sealed record of ``payload`` for stored key ``key`` and ``tenant``."""
        pv = as_readable(payload)
        out = bytearray(sealed_size(len(pv)))
        self.seal_into(memoryview(out), key, pv, tenant)
        return out

    # ---- opening ---------------------------------------------------------------------

    def _parse(self, head: bytes, body: memoryview, key: bytes) -> tuple[Any, bytes, bytes, int]:
        """The AEAD, nonce, associated data and plaintext length of the sealed record of header
        ``head`` and sealed body ``body`` (ciphertext and tag), once ``head`` is a sealed header
        for ``key`` under a key of this ring.

        Raises:
            CorruptRecordError: anything else, named.
        """
        if len(head) < HEADER_SIZE or len(body) < SEAL_TAG:
            raise CorruptRecordError(
                f"record of {len(head) + len(body)} bytes is shorter than a sealed record"
                f" ({HEADER_SIZE + SEAL_TAG} at least)"
            )
        if not head.startswith(_LEAD) or head[28] & FLAG_SEALED == 0:
            # a plain record (anyone who knows the format can write one), or no record at all
            raise CorruptRecordError(
                "not a sealed record: a tier with encryption serves only records sealed with its keys"
            )
        _, _, _, ids, flags, n, nonce_a, tenant, nonce_b, kid = _HEAD.unpack(head)
        if flags != FLAG_SEALED:
            raise CorruptRecordError(f"sealed record with unknown flags {flags:#x}")
        if ids != key_header_ids(key):
            raise CorruptRecordError("sealed record belongs to another namespace or group")
        if n != len(body) - SEAL_TAG:
            raise CorruptRecordError(f"payload length field {n} disagrees with the {len(body)} bytes sealed")
        if kid not in self._masters:
            raise CorruptRecordError(f"sealed under key id {kid:08x}, which is not in the keyring ({self.source})")
        return self._aead(kid, ids[:16], tenant), nonce_a + nonce_b, key + head, n

    def open_into(self, record: Any, key: bytes, dst: memoryview) -> int:
        """Deliver the payload of sealed ``record`` for stored key ``key`` into the start of
        ``dst``; return its length, or -1 when it does not fit (the record authenticated first:
        a forged one is corrupt, not merely too large; nothing written to ``dst``).

        Raises:
            CorruptRecordError: not a sealed record for ``key``, sealed under a key not in the ring
                (a removed key, another deployment's), or it fails authentication (any bit of the
                key, header, ciphertext or tag changed; another tenant or namespace). Nothing of it
                stays in ``dst``.
        """
        mv = as_readable(record)
        return self.open_parts_into(bytes(mv[:HEADER_SIZE]), mv[HEADER_SIZE:], key, dst)

    def open_parts_into(self, head: bytes, body: memoryview, key: bytes, dst: memoryview) -> int:
        """:meth:`open_into` of a record held as its 64-byte header ``head`` and, apart, its sealed
        body ``body`` (ciphertext then tag: a read received in place)."""
        aead, nonce, aad, n = self._parse(head, body, key)
        if n > len(dst):
            self._authenticate(aead, nonce, aad, body)
            return -1
        landed = dst[:n]
        try:
            aead.decrypt_into(nonce, body, aad, landed)
        except InvalidTag:
            landed[:] = bytes(n)
            raise CorruptRecordError(_UNAUTHENTIC) from None
        except BaseException:
            landed[:] = bytes(n)
            raise
        return n

    def open(self, record: Any, key: bytes) -> bytes:
        """The payload of sealed ``record`` for stored key ``key`` (raises as :meth:`open_into`)."""
        mv = as_readable(record)
        aead, nonce, aad, _ = self._parse(bytes(mv[:HEADER_SIZE]), mv[HEADER_SIZE:], key)
        return self._authenticate(aead, nonce, aad, mv[HEADER_SIZE:])

    def check(self, record: Any, key: bytes) -> str | None:
        """Why ``record`` does not open for ``key`` (None: it opens)."""
        try:
            self.open(record, key)
        except CorruptRecordError as e:
            return str(e)
        return None

    @staticmethod
    def _authenticate(aead: Any, nonce: bytes, aad: bytes, body: memoryview) -> bytes:
        try:
            return bytes(aead.decrypt(nonce, body, aad))
        except InvalidTag:
            raise CorruptRecordError(_UNAUTHENTIC) from None


# ---- loading keys ------------------------------------------------------------------------


def parse_keys(text: str, where: str) -> list[bytes]:
    """The keys in ``text`` (a key file's, or an environment variable's value): 64 hex digits or
    the base64 of 32 bytes each, newest first, separated by line breaks, whitespace or commas;
    ``#`` starts a comment. Errors name ``where``, the line and the key's place on it, never its
    text."""
    keys: list[bytes] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for i, word in enumerate(line.split("#", 1)[0].replace(",", " ").split(), 1):
            keys.append(_one_key(word, f"{where}, line {lineno}" + (f", key {i}" if i > 1 else "")))
    return keys


def _one_key(word: str, where: str) -> bytes:
    if _HEX_KEY.fullmatch(word):
        return bytes.fromhex(word)
    try:
        raw = binascii.a2b_base64(word, strict_mode=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ConfigError(
            f"{where}: not a 256-bit key (64 hex digits, or the base64 of 32 bytes); make one with"
            " `openssl rand -hex 32`"
        )
    return raw


def read_key_file(path: str, where: str) -> str:
    """The text of key file ``path``: a regular file of at most :data:`MAX_KEY_FILE_BYTES`,
    accessible by its owner only (no permission bit for group or others).

    Raises:
        ConfigError: naming ``where``, the path and the fix.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.expanduser(path), flags)
    except OSError as e:
        raise ConfigError(f"{where} {path!r}: cannot read it ({e.strerror}); check the path") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} {path!r}: not a regular file; name the file that holds the keys")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{where} {path!r}: group or others may access it (mode {stat.S_IMODE(st.st_mode):04o}); a key file"
                f" must be its owner's alone: chmod 600 {path}"
            )
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"{where} {path!r}: {st.st_size} bytes; a key file holds at most {MAX_KEY_FILE_BYTES}")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{where} {path!r}: not ASCII text; one key per line, 64 hex digits or base64") from None


def load_keyring(cfg: EncryptionConfig, where: str, env: Mapping[str, str] | None = None) -> Keyring:
    """The keyring of an ``encryption`` config (its ``keys_file``, else its ``keys_env``);
    ``where`` names the config in errors (``"tier 'redis': encryption"``).

    Raises:
        ConfigError: the file or variable is missing, empty, unsafe or malformed (the message
            names the field, the value and the fix; never a key).
    """
    env = os.environ if env is None else env
    if cfg.keys_file is not None:
        field = f"{where}.keys_file"
        keys = parse_keys(read_key_file(cfg.keys_file, field), f"{field} {cfg.keys_file!r}")
        if not keys:
            raise ConfigError(f"{field} {cfg.keys_file!r}: holds no key; add one (`openssl rand -hex 32 >> file`)")
        return Keyring(keys, source=f"keys_file {cfg.keys_file}")
    var = cfg.keys_env
    field = f"{where}.keys_env"
    if var is None or not _ENV_NAME.fullmatch(var):
        raise ConfigError(f"{field}: {var!r} is not an environment variable name; set keys_file or keys_env")
    value = env.get(var, "")
    if not value.strip():
        raise ConfigError(
            f"{field}: environment variable {var} is {'empty' if var in env else 'not set'}; set it to the keys"
            " (64 hex digits each, newest first, separated by spaces or commas), e.g. from `openssl rand -hex 32`"
        )
    keys = parse_keys(value, f"{field}: environment variable {var}")
    if not keys:
        raise ConfigError(f"{field}: environment variable {var} holds no key (only comments)")
    return Keyring(keys, source=f"keys_env {var}")

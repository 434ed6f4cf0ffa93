"""Parsing of user input (option values, keys): each bad value is a :class:`CLIError` with exit
code 2 that names the option, the value given and the fix."""

from __future__ import annotations

import re

from tieredkv.cli.exits import EXIT_BAD_INPUT, CLIError
from tieredkv.keys import FINGERPRINT_BYTES, MIN_STORED_KEY_BYTES, tenant_id

__all__ = ["parse_duration", "parse_key", "parse_metrics_url", "parse_namespace", "parse_size", "parse_tenant"]


def parse_namespace(text: str | None) -> bytes | None:
    """A namespace fingerprint given as 32 hex digits (as ``ls`` prints it)."""
    if text is None:
        return None
    try:
        fp = bytes.fromhex(text.strip())
    except ValueError:
        fp = b""
    if len(fp) != FINGERPRINT_BYTES:
        raise CLIError(EXIT_BAD_INPUT, f"--namespace: got {text!r} — expected {2 * FINGERPRINT_BYTES} hex digits")
    return fp


def parse_tenant(name: str | None, hex_id: str | None) -> int | None:
    """The tenant id of ``--tenant NAME`` (:func:`tieredkv.keys.tenant_id` of the name) or
    ``--tenant-id HEX`` (16 hex digits); None when neither is given."""
    if name is not None and hex_id is not None:
        raise CLIError(EXIT_BAD_INPUT, "give --tenant NAME or --tenant-id HEX, not both")
    if name is not None:
        if not name:
            raise CLIError(
                EXIT_BAD_INPUT,
                "--tenant: got '' — records without a tenant are the default tenant;"
                " select them another way (e.g. --namespace)",
            )
        return tenant_id(name)
    if hex_id is None:
        return None
    text = hex_id.strip().lower().removeprefix("0x")
    if not re.fullmatch(r"[0-9a-f]{16}", text) or int(text, 16) == 0:
        raise CLIError(
            EXIT_BAD_INPUT, f"--tenant-id: got {hex_id!r} — expected 16 hex digits (not all zero), as `status` shows it"
        )
    return int(text, 16)


def parse_key(text: str) -> bytes:
    """A stored key given as hex (fingerprint + block hash + 4-byte group)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise CLIError(EXIT_BAD_INPUT, f"KEY: got {text!r} — not hex; copy a key from `tieredkv ls`") from None
    if len(key) < MIN_STORED_KEY_BYTES:
        raise CLIError(
            EXIT_BAD_INPUT,
            f"KEY: {len(key)} bytes is too short for a stored key (16-byte namespace + hash + 4-byte group)",
        )
    return key


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)?\s*$")
_UNITS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | None) -> float | None:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1d"`` → seconds."""
    if text is None:
        return None
    m = _DURATION.match(text)
    if not m:
        raise CLIError(EXIT_BAD_INPUT, f"--older-than: got {text!r} — use seconds or 90s / 15m / 2h / 1d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_size(text: str | None, option: str) -> int | None:
    """``"512MiB"``, ``"2GB"``, ``"1000"`` → bytes (pydantic ByteSize syntax).

    At least 1 byte; a fraction of a byte (``0.5``, ``2.7B``) is refused rather than truncated
    (pydantic turns ``"0.5"`` into 0, which for ``evict --to-size`` meant "evict everything").
    A fraction with a larger unit (``1.5GiB``) is rounded down to whole bytes.
    """
    if text is None:
        return None
    from decimal import Decimal

    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        n = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise CLIError(EXIT_BAD_INPUT, f"{option}: got {text!r} — use a size such as 512MiB or 2GB") from None
    m = ByteSize.byte_string_re.match(text)
    unit = (m.group(2) or "b").lower() if m else ""
    if m and unit in ByteSize.byte_sizes:
        exact = Decimal(m.group(1)) * Decimal(str(ByteSize.byte_sizes[unit]))
    else:  # a plain int pydantic read another way ('1_000')
        exact = Decimal(n)
    if exact < 1:
        hint = (
            "; to delete every selected record leave out --to-size (e.g. `tieredkv evict --namespace HEX`)"
            " or use `tieredkv flush`"
            if option == "--to-size"
            else ""
        )
        raise CLIError(
            EXIT_BAD_INPUT,
            f"{option}: got {text!r} — that is {exact.normalize():f} bytes, below 1 byte;"
            f" give a size of at least 1 byte such as 512MiB or 2GB{hint}",
        )
    if exact != exact.to_integral_value() and unit in ("b", "bit"):
        raise CLIError(
            EXIT_BAD_INPUT,
            f"{option}: got {text!r} — not a whole number of bytes; give whole bytes ({int(exact)})"
            " or a unit such as 512MiB or 2GB",
        )
    return n


def parse_metrics_url(text: str | None) -> str | None:
    """``--metrics-url``: an http(s) URL with a host."""
    if text is None:
        return None
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # a bad port raises ValueError
    except ValueError:
        ok = False
    if not ok:
        raise CLIError(
            EXIT_BAD_INPUT,
            f"--metrics-url: got {text!r} — expected the http:// URL of a running engine's metrics,"
            " such as http://127.0.0.1:9400/metrics",
        )
    return text.strip()

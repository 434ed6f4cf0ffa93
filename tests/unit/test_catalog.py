"""The namespace catalog's record: its key, and a payload read back with bounds (never unpickled,
never trusted: JSON of a bounded size, checked field by field)."""

from __future__ import annotations

import json

import pytest

from tieredkv.catalog import MAX_BYTES, catalog_key, catalog_payload, is_catalog_key, parse_catalog
from tieredkv.keys import Namespace

NS = Namespace(model="org/model", revision="r1", weights="ab" * 16)


def test_a_catalog_record_round_trips_and_its_key_is_reserved() -> None:
    key = catalog_key(NS.fingerprint)
    assert is_catalog_key(key) and key.startswith(NS.fingerprint)
    assert not is_catalog_key(NS.key(b"\x00tieredkv:namespace-catalog\x00", 0))  # another group
    got = parse_catalog(catalog_payload(NS), NS.fingerprint)
    assert (got["model"], got["revision"], got["weights"]) == ("org/model", "r1", "ab" * 16)
    assert got["namespace"] == NS.describe()


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b" " * (MAX_BYTES + 1), "larger than"),
        (b"\x80\x04K\x01.", "not JSON"),  # a pickle is never read as one
        (b"[1, 2]", "not a tieredkv catalog"),
        (json.dumps({"tieredkv_catalog": 1, "fingerprint": "00" * 16}).encode(), "not this one"),
        (
            json.dumps(
                {"tieredkv_catalog": 1, "fingerprint": NS.fingerprint.hex(), "namespace": {"model": 5}}
            ).encode(),
            "no namespace description",
        ),
    ],
)
def test_a_bad_catalog_payload_is_refused_with_its_reason(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_catalog(payload, NS.fingerprint)

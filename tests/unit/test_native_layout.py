"""The C helper holds no record layout of its own: it takes tieredkv.format's at import, and
what it holds is what format says. Also: it is built from the vendored xxHash header (no system
library), and an install where it cannot build says so instead of going on silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_keys_format import CAN_BUILD
from tieredkv import format as fmt
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import Namespace

ROOT = Path(__file__).resolve().parents[2]
NATIVE = fmt._fastrec


@pytest.fixture
def native() -> Iterator[object]:
    """The helper (failing where it should have been built); its layout put back after the test."""
    if NATIVE is None:
        if CAN_BUILD:
            pytest.fail("the C helper is not built here although it can be (reinstall: pip install -e .)")
        pytest.skip("no C compiler on this machine: the pure-Python path is the one in use")
    try:
        yield NATIVE
    finally:
        NATIVE.set_layout(**fmt.native_layout())


def test_the_helper_holds_the_layout_format_wrote_down(native: object) -> None:
    """What the C checks read (set at import from ``format.native_layout()``) is format's layout,
    field by field: a layout changed in format.py and not in the build (or the other way) fails here."""
    assert NATIVE.layout() == fmt.native_layout()
    lay = fmt.native_layout()
    assert lay["header"] == fmt.HEADER_SIZE and lay["magic"] == fmt.MAGIC
    assert {v for v, *_ in lay["versions"]} == {fmt.FORMAT_VERSION, fmt.TENANT_VERSION}
    # the struct format the pure-Python path packs with puts each field where the layout says
    raw = fmt._HEADER2.pack(fmt.MAGIC, 0x0201, 0x0403, bytes(range(16)), 0x05060708, 0x090A0B0C, 11, 12, 13)
    for name, value in (("version", 0x0201), ("header_size", 0x0403), ("flags", 0x090A0B0C), ("length", 11)):
        at, width = lay[name]
        assert int.from_bytes(raw[at : at + width], "little") == value, name
    at, width = lay["checksum"]
    assert int.from_bytes(raw[at : at + width], "little") == 12
    assert raw[slice(*lay["fingerprint"])] == bytes(range(16))
    assert raw[slice(*lay["group"])] == (0x05060708).to_bytes(4, "little")


def test_the_c_checks_follow_the_layout_they_are_given(native: object) -> None:
    """Records written by the pure-Python path pass the C check under format's layout and fail it
    once the helper is handed another (another magic, a version dropped, the checksum elsewhere):
    the C code reads the layout it was given, not offsets of its own."""
    key = Namespace(model="m").key(bytes(range(32)), 3)
    payload = bytes(range(256)) * 300
    v1 = bytes(fmt.encode_record(key, payload))
    v2 = bytes(fmt.encode_record(key, payload, tenant=7))
    dst = bytearray(len(payload))

    def check() -> list[int]:
        return NATIVE.verify_many([v1, v2], [key, key], [dst, dst])

    assert check() == [len(payload)] * 2
    good = fmt.native_layout()
    for change in (
        {"magic": b"TKVX"},
        {"versions": good["versions"][:1]},  # version 2 unknown
        {"checksum": (32, 8)},  # the checksum read from the length field
        {"group": (20, 24)},  # the group read from the fingerprint's last bytes
    ):
        NATIVE.set_layout(**{**good, **change})
        assert -1 in check(), change
        NATIVE.set_layout(**good)
    assert check() == [len(payload)] * 2 and dst == payload


def test_a_layout_the_checks_cannot_read_is_refused(native: object) -> None:
    good = fmt.native_layout()
    for change, message in (
        ({"header": 0}, "header"),
        ({"length": (60, 8)}, "field length"),
        ({"flags": (28, 3)}, "field flags"),
        ({"fingerprint": (8, 80)}, "fingerprint"),
        ({"versions": ()}, "versions"),
        ({"versions": ((1, ((0, 32),) * 5, (48, 64), 0),)}, "hashed ranges"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            NATIVE.set_layout(**{**good, **change})
        assert NATIVE.layout() is None  # a refused layout leaves none: every check raises
        NATIVE.set_layout(**good)


def test_without_a_layout_the_helper_checks_nothing(native: object) -> None:
    """Imported on its own (format never ran), the helper has no layout and every record check
    raises instead of guessing; the host copy needs none."""
    code = textwrap.dedent(
        """
        import importlib.util, sys
        import tieredkv
        spec = importlib.util.find_spec("tieredkv._fastrec")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert "tieredkv.format" not in sys.modules and mod.layout() is None
        try:
            mod.verify_many([b"x" * 64], [b"k" * 52], [bytearray(1)])
        except RuntimeError as e:
            assert "layout" in str(e)
        else:
            raise SystemExit("a check ran without a layout")
        assert mod.stream_into(bytearray(3), b"abc") == 3
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_the_helper_links_no_system_xxhash(native: object) -> None:
    """XXH3 is compiled in from the vendored header: the built module names no libxxhash."""
    built = Path(NATIVE.__file__).read_bytes()
    assert b"libxxhash" not in built
    vendored = ROOT / "tieredkv" / "_native" / "xxhash"
    assert (vendored / "xxhash.h").exists() and "BSD 2-Clause" in (vendored / "LICENSE").read_text()


def test_an_install_that_cannot_build_the_helper_says_what_is_lost(tmp_path: Path) -> None:
    """setup.py with a compiler that fails: the install goes on (exit 0) and says, on stderr,
    that the helper did not build and what is lost without it."""
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    r = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "tmp"),
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "did not build" in r.stderr and "tieredkv._fastrec" in r.stderr, r.stderr[-3000:]
    assert "LMDB tier's reads" in r.stderr and "docs/native.md" in r.stderr
    assert not list((tmp_path / "lib").rglob("_fastrec*"))


def test_batch_headers_summed_by_the_helper_match_the_python_path(
    native: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LMDB put's headers (encode_heads_into on a batch): packed in Python, summed by the
    helper with the GIL let go; byte for byte what the pure-Python path writes, both versions,
    payload sizes around the xxhash package's 64 KiB GIL threshold, and each one verifies."""
    import random

    rng = random.Random(7)
    ns = Namespace(model="m")
    sizes = [0, 1, 63, 4096, 65535, 65536, 65537, 1 << 20]
    items = [
        (ns.key(bytes([i]) * 32, i % 3), memoryview(rng.randbytes(n)), (0, 5, 1 << 63)[i % 3])
        for i, n in enumerate(sizes * 2)
    ]
    # with tenants (packed in Python, summed by the helper), without (written whole by the helper)
    for batch in (items, [(k, p) for k, p, _ in items], [(k, p, 0) for k, p, _ in items]):
        made = []
        for helper in (NATIVE, None):
            monkeypatch.setattr(fmt, "_fastrec", helper)
            heads = bytearray(HEADER_SIZE * len(batch))
            fmt.encode_heads_into(memoryview(heads), batch)
            made.append(bytes(heads))
        assert made[0] == made[1]
        for i, (key, payload, *_) in enumerate(batch):
            fmt.verify_parts(memoryview(made[0])[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], payload, key)


def test_the_header_helpers_refuse_what_is_not_a_batch_of_headers(native: object) -> None:
    key = Namespace(model="m").key(b"h" * 32, 1)
    heads = bytearray(HEADER_SIZE * 2)
    fmt.encode_heads_into(memoryview(heads), [(key, memoryview(b"ab")), (key, memoryview(b"cd"))])
    with pytest.raises(TypeError):
        NATIVE.sum_heads(heads, [key], [b"ab", b"cd"])  # lists of two lengths
    with pytest.raises(ValueError, match="smaller"):
        NATIVE.sum_heads(bytearray(HEADER_SIZE), [key, key], [b"ab", b"cd"])
    with pytest.raises(ValueError, match="shorter"):
        NATIVE.sum_heads(heads, [b"k", key], [b"ab", b"cd"])
    foreign = bytearray(heads)
    foreign[4] = 0x7F  # a version the layout does not have
    with pytest.raises(ValueError, match="version"):
        NATIVE.sum_heads(foreign, [key, key], [b"ab", b"cd"])
    with pytest.raises(ValueError, match="version"):
        NATIVE.heads_many(heads, [key, key], [b"ab", b"cd"], 0x7F)  # a version the layout does not have
    with pytest.raises(TypeError):
        NATIVE.heads_many(heads, [key, key], [b"ab", b"cd"])  # no version
    with pytest.raises(BufferError):
        NATIVE.sum_heads(bytes(heads), [key, key], [b"ab", b"cd"])  # read-only headers

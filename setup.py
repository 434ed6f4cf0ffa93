"""Build step for the optional native helper (all other metadata is in pyproject.toml).

``tieredkv._fastrec`` does the checked copy of records (and the LMDB tier's reads of record
files, and a non-temporal host copy) in C, the GIL released; docs/native.md says what each part
buys, measured. It needs a C compiler and Python's headers, nothing else: XXH3 comes from the
xxHash header vendored in tieredkv/_native/xxhash/ (BSD-2-Clause), compiled in, never a system
library. Where it does not build, the install goes on without it, says so on stderr, and
tieredkv.format keeps its pure-Python path (the same bytes, slower reads).
"""

import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

NATIVE = "tieredkv._fastrec"
HERE = "tieredkv/_native"
X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}

#: What an install without the helper loses (docs/native.md has the figures).
LOST = """\
tieredkv: the optional C helper {name} did not build ({why}).
tieredkv works without it (tieredkv.format's pure-Python path writes and accepts the same
records), but without it:
  - the LMDB tier's reads cost about 1.2-1.8x the CPU per byte and run about 1.2-1.4x slower
    through the pipeline (checked copies, record files), with more of it under the GIL;
  - host block moves (the CPU tier, staging) copy a chunk's blocks one NumPy call at a time:
    scattered 64 KiB chunks of 4 blocks stored and loaded about 2.2-2.4x slower;
  - the LMDB tier's puts of 64 KiB chunks run up to about 1.25x slower (headers hashed with
    the GIL held);
  - each store or load call costs the engine thread about 0.75 us per chunk to check instead
    of 0.06.
To build it: a C compiler (gcc or clang) and Python's headers (Debian: build-essential and
python3-dev), then reinstall (pip install -e .). See docs/native.md.
"""


class BuildNative(build_ext):
    """``build_ext`` that never fails the install over the helper, and says loudly when it did
    not build (setuptools' own note for an optional extension is one easily missed line)."""

    def run(self) -> None:
        try:
            super().run()
        except (BaseError, CCompilerError, OSError) as e:  # no compiler at all: fails before compiling
            self._lost(e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (BaseError, CCompilerError, OSError) as e:  # a compile or link error
            self._lost(e, ext.name)

    @staticmethod
    def _lost(e: BaseException, name: str = NATIVE) -> None:
        bar = "*" * 78
        why = f"{type(e).__name__}: {e}".strip()
        print(f"\n{bar}\nWARNING: {LOST.format(name=name, why=why)}{bar}\n", file=sys.stderr, flush=True)


sources = [f"{HERE}/fastrec.c"]
if X86:  # xxHash's run-time dispatch (AVX2 / AVX-512 where the CPU has them), baseline flags
    sources.append(f"{HERE}/xxhash/xxh_x86dispatch.c")

setup(
    ext_modules=[
        Extension(
            NATIVE,
            sources=sources,
            depends=[f"{HERE}/xxhash/xxhash.h", f"{HERE}/xxhash/xxh_x86dispatch.h"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,  # BuildNative says what is lost
        )
    ],
    cmdclass={"build_ext": BuildNative},
)

"""Build step for the optional native helper (all other metadata is in pyproject.toml).

``tieredkv._fastrec`` encodes and checks records in C, the GIL released for the copy and the
checksum. It links the system's libxxhash (Debian's libxxhash0); where it does not build, the
install goes on without it and tieredkv.format keeps its pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tieredkv._fastrec",
            sources=["tieredkv/_native/fastrec.c"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-l:libxxhash.so.0"],
            optional=True,
        )
    ]
)

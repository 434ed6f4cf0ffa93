"""What the C helper (``tieredkv._fastrec``) buys over the pure-Python record path, per function.

    .venv/bin/python benchmarks/bench_native.py [--sizes 64,256,1024] [--total-mib 64] [--reps 7]

Per chunk size, each repetition moves the same ``--total-mib`` of payloads through each record
function twice, once with the helper and once on the pure-Python path (``tieredkv.format`` and
``tieredkv.staging`` with the helper switched off, as on a machine where it did not build), the
two interleaved and their order swapped every other rep; rep 0 warms up and is not kept. The
functions that are Python only (docs/native.md: the encodes, ``verify_into``, ``write_records``)
run the same code in both columns, a check on the noise:

* ``encode_records_into``: whole records (header, payload copied, checksummed) into one buffer;
* ``encode_heads_into``: the headers alone (checksums), payloads left in place (the LMDB put);
* ``verify_into``: one record's checked copy per call (the Redis tier's read);
* ``verify_many_into`` / ``verify_many_parts_into``: a batch's checked copies (the LMDB read);
* ``write_records`` / ``read_records_into`` / ``read_placed_into``: the LMDB tier's record files
  (16 MiB files in the temp dir: page cache, no sync);
* ``host_copy``: ``staging``'s host block move (the CPU tier's gathers and scatters): a gather of
  chunks of 4 blocks at permuted ids into staging, ``move_pieces`` on two threads against NumPy's
  copy per run of blocks.

``--without-helper SCRIPT [ARGS]`` instead runs another bench script with the helper blocked
(e.g. ``benchmarks/bench_tiers.py --tiers cpu,lmdb``), to set its figures beside a run with it.

Prints GB/s of payload (median of the reps) per path and the ratio C / Python. The clock is the
calling thread's CPU time by default (``--clock wall`` for wall time). Not part of the test suite;
no file is written unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tieredkv import format as fmt
from tieredkv import staging
from tieredkv.bench import sizes_option
from tieredkv.config import PipelineConfig
from tieredkv.keys import Namespace
from tieredkv.layouts import BLOCKS_PER_CHUNK

KiB, MiB = 1024, 1024 * 1024
#: The clock of a timed call: the calling thread's CPU time (``--clock cpu``, the default: the time
#: other processes take the core away is not counted, which on a shared 2-core box is most of the
#: noise) or wall time (``--clock wall``).
CLOCK: Callable[[], float] = time.thread_time
FILE_BYTES = 16 * MiB  # the LMDB tier's default file_batch_bytes
#: host_copy: blocks per chunk (as the other benches) and move_pieces threads (the pipeline's default)
HOST_BPC, HOST_THREADS = BLOCKS_PER_CHUNK, PipelineConfig().copy_threads
_PLACE = struct.Struct("<dQ16sQ")  # the LMDB tier's filed access entry: stamp, size, token, offset
_LAYOUT = (_PLACE.size, 8, 16, 32)


def aligned(n: int) -> np.ndarray:
    """``n`` bytes at a 4 KiB boundary (as torch's and the staging slab's buffers are aligned enough
    to dodge the kernel copy's misalignment trap)."""
    raw = np.empty(n + 4096, np.uint8)
    at = -raw.ctypes.data % 4096
    return raw[at : at + n]


class Case:
    """The buffers of one chunk size: ``count`` payloads, their keys, destinations, records."""

    def __init__(self, size: int, total: int, work: str) -> None:
        self.size = size
        self.count = n = max(4, total // size)
        rng = np.random.default_rng(size)
        self.src = aligned(n * size).reshape(n, size)
        self.src[:] = rng.integers(0, 256, (n, size), dtype=np.uint8)
        self.dst = aligned(n * size).reshape(n, size)
        self.dst[:] = 1  # faulted in
        ns = Namespace(model="bench-native")
        self.keys = [ns.key(i.to_bytes(32, "big"), 0) for i in range(n)]
        self.views = [memoryview(self.src[i]) for i in range(n)]
        self.dsts = [memoryview(self.dst[i]) for i in range(n)]
        self.out = aligned(n * (size + fmt.HEADER_SIZE))
        self.heads = bytearray(fmt.HEADER_SIZE * n)
        fmt.encode_heads_into(memoryview(self.heads), list(zip(self.keys, self.views)))
        self.records = [bytes(self.heads[i * 64 : (i + 1) * 64]) + self.views[i].tobytes() for i in range(n)]
        self.head_list = [memoryview(self.heads)[i * 64 : (i + 1) * 64] for i in range(n)]
        self.dir = tempfile.mkdtemp(dir=work)
        self.per_file = max(1, FILE_BYTES // size)
        self.paths, self.offsets, self.entries = [], [], []
        for f, b in enumerate(range(0, n, self.per_file)):
            token = f.to_bytes(16, "big")
            path = os.path.join(self.dir, token.hex())
            items = range(b, min(n, b + self.per_file))
            hv = memoryview(self.heads)[b * 64 : (b + len(items)) * 64]
            fmt.write_records(path, hv, [self.views[i] for i in items], sync=False)
            for j, _i in enumerate(items):
                at = j * (size + 64)
                self.paths.append(path)
                self.offsets.append(at)
                self.entries.append(memoryview(_PLACE.pack(1.0, size + 64, token, at)))
        self.wdir = tempfile.mkdtemp(dir=work)
        self.written = 0
        self.kv: staging.KVGroupTensors | None = None  # host_copy's group, made at its first call
        self.ids: Any = None

    def check(self) -> None:
        if not np.array_equal(self.dst, self.src):
            raise RuntimeError(f"{self.size}: the destinations do not hold the payloads")
        self.dst[:] = 1

    # ---- the operations, each over every payload of the case ----

    def encode_records_into(self) -> None:
        per = max(1, FILE_BYTES // self.size)
        mv = memoryview(self.out)
        for b in range(0, self.count, per):
            items = list(zip(self.keys[b : b + per], self.views[b : b + per]))
            fmt.encode_records_into(mv, items)

    def encode_heads_into(self) -> None:
        per = max(1, FILE_BYTES // self.size)
        for b in range(0, self.count, per):
            items = list(zip(self.keys[b : b + per], self.views[b : b + per]))
            fmt.encode_heads_into(memoryview(self.heads)[b * 64 :], items)

    def verify_into(self) -> None:
        for rec, key, dst in zip(self.records, self.keys, self.dsts):
            fmt.verify_into(rec, key, dst)

    def verify_many_into(self) -> None:
        per = self.per_file
        for b in range(0, self.count, per):
            got = fmt.verify_many_into(self.records[b : b + per], self.keys[b : b + per], self.dsts[b : b + per])
            assert got == [self.size] * len(got), got[:3]

    def verify_many_parts_into(self) -> None:
        per = self.per_file
        for b in range(0, self.count, per):
            s = slice(b, b + per)
            got = fmt.verify_many_parts_into(self.head_list[s], self.views[s], self.keys[s], self.dsts[s])
            assert got == [self.size] * len(got), got[:3]

    def write_records(self) -> None:
        for b in range(0, self.count, self.per_file):
            path = os.path.join(self.wdir, str(self.written))
            self.written += 1
            items = self.views[b : b + self.per_file]
            fmt.write_records(path, memoryview(self.heads)[b * 64 :], items, sync=False)
        for name in os.listdir(self.wdir):  # untimed in spirit: small next to the writes
            os.unlink(os.path.join(self.wdir, name))

    def read_records_into(self) -> None:
        per = self.per_file
        for b in range(0, self.count, per):
            s = slice(b, b + per)
            got = fmt.read_records_into(
                self.paths[s], self.offsets[s], [self.size + 64] * len(self.paths[s]), self.keys[s], self.dsts[s]
            )
            assert got == [self.size] * len(got), got[:3]

    def read_placed_into(self) -> None:
        per = self.per_file
        for b in range(0, self.count, per):
            s = slice(b, b + per)
            got = fmt.read_placed_into(self.dir, self.entries[s], self.keys[s], self.dsts[s], _LAYOUT)
            assert got == [self.size] * len(got), got[:3]

    def host_copy(self) -> None:
        if self.kv is None:  # the payloads as a KV group's blocks, 4 to a chunk, at permuted ids
            nb, bb = self.count * HOST_BPC, self.size // HOST_BPC
            self.ids = np.random.default_rng(self.size).permutation(nb)
            blocks = aligned(nb * bb).reshape(nb, bb)
            blocks[self.ids] = self.src.reshape(nb, bb)
            self.kv = staging.KVGroupTensors([torch.from_numpy(blocks)])
        places = staging._Places(None, self.ids.tolist())
        staging._move_host(self.kv, places, HOST_BPC, self.dst.reshape(-1), True, HOST_THREADS)


OPS = [
    "encode_records_into",
    "encode_heads_into",
    "verify_into",
    "verify_many_into",
    "verify_many_parts_into",
    "write_records",
    "read_records_into",
    "read_placed_into",
    "host_copy",
]
_CHECKED = {"verify_into", "verify_many_into", "verify_many_parts_into", "read_records_into", "read_placed_into"}
_CHECKED |= {"host_copy"}


def use_native(on: bool, helper: Any, mover: Any) -> None:
    """Switch the helper on or off for ``format`` and ``staging`` (as the tests do)."""
    fmt._fastrec = helper if on else None
    staging._move_pieces = mover if on else None


def timed(fn: Callable[[], None]) -> float:
    """Seconds of ``fn()`` on :data:`CLOCK`."""
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def measure(sizes: list[int], total: int, reps: int, ops: list[str]) -> list[dict[str, Any]]:
    helper, mover = fmt._fastrec, staging._move_pieces
    if helper is None:
        raise SystemExit("the C helper is not built here: nothing to compare (pip install -e .)")
    work = tempfile.mkdtemp(prefix="tieredkv-native-")
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            case = Case(size, total, work)
            for op in ops:
                fn = getattr(case, op)
                got: dict[str, list[float]] = {"native": [], "python": []}
                for rep in range(reps + 1):
                    for path in ("native", "python") if rep % 2 == 0 else ("python", "native"):
                        use_native(path == "native", helper, mover)
                        seconds = timed(fn)
                        if op in _CHECKED:
                            case.check()
                        if rep:
                            got[path].append(case.count * size / seconds / 1e9)
                use_native(True, helper, mover)
                med = {p: statistics.median(v) for p, v in got.items()}
                row = {"size": size, "op": op, "gbps": med, "reps": got}
                line = f"{size // KiB:>5} KiB {op:<24} {med['native']:6.2f} {med['python']:6.2f} "
                line += f"{med['native'] / med['python']:5.2f}x"
                print(line, flush=True)
                rows.append(row)
            shutil.rmtree(case.dir, ignore_errors=True)
            shutil.rmtree(case.wdir, ignore_errors=True)
            del case
    finally:
        use_native(True, helper, mover)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def run_without_helper(argv: list[str]) -> int:
    """Run the bench script ``argv[0]`` (with its arguments) in this process with the helper's
    import blocked, as on a machine where it did not build: the other benches' figures without it."""
    for mod in [m for m in sys.modules if m.startswith("tieredkv")]:
        del sys.modules[mod]  # imported again without the helper
    sys.modules["tieredkv._fastrec"] = None  # type: ignore[assignment]
    import runpy

    from tieredkv import format as fresh

    assert not fresh.NATIVE
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--without-helper"]:
        return run_without_helper(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=sizes_option, default="64,256,1024", help="chunk sizes in KiB")
    ap.add_argument("--total-mib", type=int, default=64, help="payload bytes per op, path and rep")
    ap.add_argument("--reps", type=int, default=7, help="kept repetitions per op and path (the median is printed)")
    ap.add_argument("--ops", default=",".join(OPS), help="which functions")
    ap.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu", help="the calling thread's CPU time, or wall time"
    )
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    a = ap.parse_args(argv)
    sizes = a.sizes
    global CLOCK
    CLOCK = time.thread_time if a.clock == "cpu" else time.perf_counter
    head = f"{'chunk':>9} {'function':<24} {'C':>6} {'Python':>6} {'ratio':>6}"
    print(head)
    rows = measure(sizes, a.total_mib * MiB, a.reps, a.ops.split(","))
    print(f"GB/s of payload, median of {a.reps} interleaved reps; ratio = C / Python")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"total_bytes": a.total_mib * MiB, "reps": a.reps, "results": rows}, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the weights fingerprint costs at start-up, per GB of weights.

Writes a synthetic checkpoint (``--gib`` GiB of random bytes in ``--files`` safetensors files of
tensors of ``--tensor-mib`` MiB, the shapes a 7-70B model's matrices have), then times
:func:`tieredkv.weights.weights_fingerprint` cold (every file evicted from the page cache with
``POSIX_FADV_DONTNEED`` first: the first start on a node) and warm, sampled and ``full=True``,
and prints seconds, bytes read and seconds per GB. Not part of the test suite.

    .venv/bin/python benchmarks/bench_weights.py --gib 4 --dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from tieredkv.weights import weights_fingerprint


def write_checkpoint(root: Path, gib: float, files: int, tensor_mib: int) -> int:
    rng = np.random.default_rng(0)
    per_tensor = tensor_mib << 20
    tensors = max(files, int(gib * 1024 // tensor_mib))
    names = [f"model.layers.{i // 7}.w{i % 7}.weight" for i in range(tensors)]
    for f in range(files):
        mine = names[f::files]
        head: dict[str, object] = {"__metadata__": {"format": "pt"}}
        for j, n in enumerate(mine):
            head[n] = {
                "dtype": "BF16",
                "shape": [per_tensor // 2 // 4096, 4096],
                "data_offsets": [j * per_tensor, (j + 1) * per_tensor],
            }
        text = json.dumps(head).encode()
        text += b" " * (-len(text) % 8)
        with open(root / f"model-{f + 1:05d}-of-{files:05d}.safetensors", "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.writelines(rng.integers(0, 256, per_tensor, dtype=np.uint8).tobytes() for _ in mine)
            out.flush()
            os.fsync(out.fileno())
    return tensors * per_tensor


def evict(root: Path) -> None:
    for f in root.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--tensor-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        root = Path(d)
        t0 = time.perf_counter()
        total = write_checkpoint(root, a.gib, a.files, a.tensor_mib)
        print(f"checkpoint: {total / 2**30:.2f} GiB in {a.files} files, written in {time.perf_counter() - t0:.1f} s")
        gb = total / 1e9
        for full in (False, True):
            for cold in (True, False):
                times, fp = [], None
                for _ in range(a.reps if not full else max(1, a.reps // 2)):
                    if cold:
                        evict(root)
                    fp = weights_fingerprint(root, full=full)
                    times.append(fp.seconds)
                assert fp is not None
                med = statistics.median(times)
                print(
                    f"{'full' if full else 'sampled':7s} {'cold' if cold else 'warm'}: median {med * 1000:8.1f} ms"
                    f" ({med / gb * 1000:7.2f} ms per GB), read {fp.bytes_read / 2**20:8.1f} MiB of"
                    f" {fp.tensors} tensors; reps {[round(t * 1000, 1) for t in times]}"
                )


if __name__ == "__main__":
    main()

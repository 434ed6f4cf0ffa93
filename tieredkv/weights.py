"""A content fingerprint of a model's weights, so KV computed by other weights is never served.

The namespace names a model by what a person typed (model name, revision); a fine-tune deployed
under the same name, or a checkpoint replaced in place, would otherwise be served the old
weights' KV from every persistent tier. :func:`weights_fingerprint` reads a checkpoint of
``*.safetensors`` files and returns a digest that is:

* **equal for identical weights wherever they sit**: it depends on tensor names, dtypes, shapes
  and bytes only — not on the directory, the file names or how the tensors are split into files,
  not on file times — so every node serving the same weights shares records;
* **different when the model's ``config.json`` beside them changes** (RoPE scaling, heads,
  windows: what shapes the KV besides the weights; labels such as ``_name_or_path`` left out);
* **different when any tensor changes** in name, dtype or shape, or in any byte it samples; a
  tensor of at most :data:`WHOLE_TENSOR_BYTES` is read whole (norms, biases, small heads), a
  larger one in :data:`SAMPLES` windows of :data:`WINDOW` bytes: the first and the last, and the
  rest spread over the tensor with offsets drawn from its name (deterministic, so every node reads
  the same bytes). ``full=True`` reads every byte instead.

What a change has to look like to escape the sampled fingerprint: same tensor names, dtypes and
shapes, and not one byte changed inside any sampled window (8 windows of 4 KiB per large tensor).
A fine-tune or a merged LoRA changes every element of the matrices it touches; to escape, a
change must stay inside the gaps between windows of every tensor it touches — e.g. a handful of
embedding rows retrained in place — and only ``full=True`` guarantees to see that.

Cost: the headers, plus about 32 KiB per large tensor, read with readahead off
(``POSIX_FADV_RANDOM``): a few MiB for a model of a few hundred tensors, whatever its size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path

import xxhash

from tieredkv.errors import ConfigError

__all__ = ["SAMPLES", "WHOLE_TENSOR_BYTES", "WINDOW", "WeightsFingerprint", "weights_fingerprint"]

log = logging.getLogger(__name__)

#: Windows sampled per tensor larger than :data:`WHOLE_TENSOR_BYTES`.
SAMPLES = 8
#: Bytes per sampled window (one page).
WINDOW = 4096
#: A tensor of at most this many bytes is read whole.
WHOLE_TENSOR_BYTES = 64 << 10
#: The largest safetensors header accepted (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
_VERSION = b"tieredkv-weights-v1"
_FULL_READ = 8 << 20


@dataclasses.dataclass(frozen=True)
class WeightsFingerprint:
    """What :func:`weights_fingerprint` found: the digest (hex) and what it read."""

    digest: str
    path: str
    files: int
    tensors: int
    weight_bytes: int
    bytes_read: int
    seconds: float
    full: bool

    def describe(self) -> str:
        how = "every byte" if self.full else f"headers and {self.bytes_read / (1 << 20):.1f} MiB of samples"
        return (
            f"weights {self.digest[:16]}… = {self.tensors} tensors, {self.weight_bytes / (1 << 30):.2f} GiB in"
            f" {self.files} safetensors files under {self.path} ({how}, {self.seconds:.2f} s)"
        )


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint: ``path`` itself, or those in directory
    ``path`` (not recursive; symlinks followed, as in a Hugging Face hub snapshot)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ConfigError(f"namespace.weights_path: {str(p)!r} is neither a file nor a directory")
    files = sorted(f for f in p.iterdir() if f.name.endswith(".safetensors") and f.is_file())
    if not files:
        raise ConfigError(
            f"namespace.weights_path: no *.safetensors file in {str(p)!r}; point it at the checkpoint's"
            " directory (or one .safetensors file)"
        )
    return files


def _header(fd: int, name: str, size: int) -> tuple[dict[str, dict[str, object]], int]:
    """A safetensors file's header (tensors by name; ``__metadata__`` left out) and where its data begin."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise ConfigError(f"{name}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw)
    if not 2 <= n <= MAX_HEADER_BYTES or 8 + n > size:
        raise ConfigError(f"{name}: not a safetensors file (header length {n} for a file of {size} bytes)")
    try:
        head = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{name}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(head, dict):
        raise ConfigError(f"{name}: not a safetensors file (its header is not a JSON object)")
    head.pop("__metadata__", None)
    return head, 8 + n


#: Keys of a Hugging Face ``config.json`` that say nothing about the computation.
_CONFIG_LABELS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def _model_config(path: str | os.PathLike[str]) -> bytes:
    """The canonical form of the checkpoint's ``config.json`` (beside the weights), labels left
    out: what shapes the KV besides the weights (RoPE scaling, head layout, window sizes);
    ``b""`` when there is none."""
    p = Path(path).expanduser()
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    try:
        raw = json.loads(cfg.read_bytes())
    except FileNotFoundError:
        return b""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg}: the model's config.json cannot be read as JSON ({e})") from None
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k not in _CONFIG_LABELS}
    return b"config:" + json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


def _windows(name: str, length: int) -> list[tuple[int, int]]:
    """``(offset, size)`` windows sampled from a tensor of ``length`` bytes (all of it when small)."""
    if length <= WHOLE_TENSOR_BYTES:
        return [(0, length)]
    seed = hashlib.blake2b(name.encode(), digest_size=8 * SAMPLES).digest()
    span = length - WINDOW
    starts = {0, span}
    stride = span // (SAMPLES - 1)
    for i in range(SAMPLES - 2):  # one window in each stretch between the first and the last
        jitter = int.from_bytes(seed[8 * i : 8 * i + 8], "little") % max(stride, 1)
        starts.add(min(span, i * stride + stride // 2 + jitter))
    return [(s, WINDOW) for s in sorted(starts)]


def weights_fingerprint(path: str | os.PathLike[str], *, full: bool = False) -> WeightsFingerprint:
    """The content fingerprint of the weights under ``path`` (see the module docstring).

    Raises :class:`~tieredkv.errors.ConfigError` naming the file when ``path`` holds no
    safetensors checkpoint or a file is not one, and ``OSError`` when a file cannot be read."""
    t0 = time.perf_counter()
    files = safetensors_files(path)
    entries: dict[str, tuple[str, list[int], int, Path, int, int]] = {}
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            head, data_at = _header(fd, str(f), size)
        finally:
            os.close(fd)
        for tname, meta in head.items():
            try:
                dtype = str(meta["dtype"])  # type: ignore[index]
                shape = [int(x) for x in meta["shape"]]  # type: ignore[index, attr-defined]
                begin, end = (int(x) for x in meta["data_offsets"])  # type: ignore[index, attr-defined]
            except (KeyError, TypeError, ValueError):
                raise ConfigError(f"{f}: tensor {tname!r} has a malformed header entry: {meta!r}") from None
            if not 0 <= begin <= end or data_at + end > size:
                raise ConfigError(f"{f}: tensor {tname!r} lies outside the file ({begin}..{end} of {size - data_at})")
            if tname in entries:
                raise ConfigError(f"{f}: tensor {tname!r} is also in {entries[tname][3]}: not one checkpoint")
            entries[tname] = (dtype, shape, end - begin, f, data_at + begin, end - begin)
    h = hashlib.blake2b(_VERSION, digest_size=16)
    h.update(_model_config(path))
    read = total = 0
    fds: dict[Path, int] = {}
    try:
        for tname in sorted(entries):
            dtype, shape, nbytes, f, at, length = entries[tname]
            total += nbytes
            h.update(json.dumps([tname, dtype, shape, nbytes], separators=(",", ":")).encode())
            if f not in fds:
                fd = fds[f] = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
                if not full and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # samples: no readahead
            fd = fds[f]
            spans = [(0, length)] if full else _windows(tname, length)
            th = xxhash.xxh3_128()  # the bytes (GB/s), then the digest into the BLAKE2b of the whole
            for off, n in spans:
                pos = 0
                while pos < n:
                    piece = os.pread(fd, min(n - pos, _FULL_READ), at + off + pos)
                    if not piece:
                        raise ConfigError(f"{f}: tensor {tname!r} is cut short (the file shrank while read)")
                    th.update(piece)
                    pos += len(piece)
                    read += len(piece)
            h.update(th.digest())
    finally:
        for fd in fds.values():
            os.close(fd)
    return WeightsFingerprint(
        digest=h.hexdigest(),
        path=str(Path(path).expanduser()),
        files=len(files),
        tensors=len(entries),
        weight_bytes=total,
        bytes_read=read,
        seconds=time.perf_counter() - t0,
        full=full,
    )


def namespace_weights(
    weights_path: str | None,
    mode: str = "sampled",
    *,
    found: str | None = None,
    looked_for: str | None = None,
    what: str = "tieredkv",
) -> str:
    """The weights fingerprint to put in a namespace (``""``: none), logged as it is decided.

    ``weights_path`` (the config's ``namespace.weights_path``) wins; else ``found`` (where an
    integration found the engine's weights, e.g. vLLM's resolved model path). An explicit path
    that is not a checkpoint is a :class:`~tieredkv.errors.ConfigError`; weights that were looked
    for and not found, or cannot be read, fall back to the model name and revision with a warning.
    ``mode``: ``sampled``, ``full`` or ``off`` (``namespace.weights_fingerprint``).
    ``looked_for``: what an integration looked for when it found nothing (then a warning)."""
    if mode == "off":
        log.info(
            "%s: weights fingerprint off (namespace.weights_fingerprint): records are bound to the model name and revision only",
            what,
        )
        return ""
    path = weights_path or found
    if path is None:
        if looked_for is not None:
            log.warning(
                "%s: no local weights found for %s: records are bound to the model name and revision only, so a"
                " changed checkpoint under the same name would be served the old weights' KV; set"
                " namespace.weights_path to the checkpoint's directory",
                what,
                looked_for,
            )
        return ""
    try:
        fp = weights_fingerprint(path, full=mode == "full")
    except (ConfigError, OSError) as e:
        if weights_path is not None:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"namespace.weights_path: {weights_path!r} cannot be read ({e}); fix the path or its permissions"
            ) from e
        log.warning(
            "%s: the weights at %s cannot be fingerprinted (%s): records are bound to the model name and"
            " revision only, so a changed checkpoint under the same name would be served the old weights' KV;"
            " set namespace.weights_path",
            what,
            path,
            e,
        )
        return ""
    log.info("%s: namespace bound to %s", what, fp.describe())
    return fp.digest

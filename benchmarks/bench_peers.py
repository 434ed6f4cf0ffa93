"""tieredkv against LMCache 0.5.6 on the same machine, in the same run, with the same chunk sizes.

    ./scripts/bench peers          # or: .venv/bin/python benchmarks/bench_peers.py [--quick] [--help]

Pairs compared (store GB/s and load GB/s per chunk size; every byte read back is verified on
both sides):

    tieredkv tier      LMCache 0.5.6 backend
    cpu            vs  cpu    local CPU  (LocalCPUBackend, ``local_cpu: true``)
    lmdb           vs  disk   local disk (LocalDiskBackend, ``local_disk: <dir>``, ``local_cpu: false``)
    redis          vs  redis  Redis      (RemoteBackend, ``remote_url: redis://127.0.0.1:PORT``, ``local_cpu: false``;
                                          LMCache's RedisConnector, redis-py)
    redis          vs  resp   Redis      (RemoteBackend, ``remote_url: resp://127.0.0.1:PORT``: LMCache's native
                                          RESP client on the same server; ``--lmcache-redis redis`` skips it)

What it does:

1. Creates (or reuses) ``<repo>/.venv-lmcache`` and installs, in this order, ``torch==2.13.0+cpu``
   (the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build) and
   ``lmcache==0.5.6`` under a pip constraint file that pins ``torch==2.13.0+cpu``, so nothing can
   upgrade torch. ``LMCACHE_TRACK_USAGE=false`` everywhere. Reused when it already imports
   lmcache 0.5.6 beside torch 2.13.0+cpu.
2. Starts one private ``redis-server`` on a free loopback port (stopped at the end, also on error).
3. For each pair, round by round, interleaved: tieredkv's round
   (``tieredkv.bench.pipeline_store_load``: the real asyncio pipeline with one tier, the KV
   group a CPU "device" block tensor of four blocks per chunk (``bench_blocks``), store jobs of
   16 MiB, ``drain()``, load jobs into other blocks, bytes compared) and LMCache's round of the
   same size in ``.venv-lmcache`` (``benchmarks/_lmcache_child.py``: ``LMCacheEngine.store`` /
   ``retrieve`` in calls of the same 16 MiB, with ``kvcaches`` a paged KV cache in vLLM's layout,
   four blocks per chunk too, and ``slot_mapping``, as vLLM's adapter calls them; see its
   docstring for the API used, what LMCache offers on CPU and why its connector is a stand-in),
   which runs a step at a time on this process's word (``--turns``; LMCache first on even
   rounds, second on odd), never beside tieredkv's. Disk figures of both sides use the same
   directory.

   Block layouts (``--layouts``, ``tieredkv.bench.LAYOUTS``; default ``permuted,consecutive``):
   every round stores and loads each size once per layout, on both sides, from and into the
   same block ids (``tieredkv.layouts.round_ids``; round ``r``, the warm-up being 0, draws them
   from seed ``r``; each side reports a digest of the ids it used, and a difference is an
   error). ``permuted``, a churned engine pool (vLLM's free queue hands blocks out in the order
   they were freed), is the default figure; ``consecutive``, a fresh pool, the named best case;
   ``fragmented`` (short runs) on request.
4. Beside each tieredkv round (in turn before and after it), measures the medium's raw limits
   with the tier class's own ``raw_limits``, as ``tieredkv bench`` does: plain file
   writes/reads and py-lmdb put/get for ``lmdb``; pipelined redis-py SET/GET and
   ``redis-benchmark`` on the same server for ``redis``; one gather of scattered blocks, one
   ``copy_`` and a two-thread non-temporal copy for ``cpu``. The medium's limit for an op is
   the strongest (highest median) of the figures the tier class names for it
   (``RawLimits.limit``) as measured in this run, named with the figures it was picked from.
5. Prints the medians (of ``--reps``) and the ratio tieredkv / LMCache per size and layout
   (targets, ``TARGETS``: >= 1x on the CPU pair, >= 2x on the disk and Redis pairs), then the
   medium's limit over LMCache, and which figure was the limit at each size. A cell below its
   target whose target throughput is above the medium's limit is listed as above the medium:
   no raw client on it was seen that fast in the run. Writes
   ``benchmarks/results/peers-<UTC time>.json``: machine description, versions, install time,
   ``config`` (``layouts``, ``lmcache_copy``, ...), and per size (``results``, see
   ``build_results``): both sides' per-rep figures per layout, the raw figures per rep and the
   limit candidates, medians (``median_gbps``: ``tieredkv.<tier>[@<layout>].<op>``,
   ``lmcache.<backend>[@<layout>].<op>``, no ``@`` for the first layout), ratios
   (``<tier>/<backend>[@<layout>].<op>``) and the medium's limit (``medium``: ``<tier>.<op>`` ->
   ``limit``, ``limit_gbps``, ``candidates``).

Both sides run torch with one intra-op thread (``--threads``), get one untimed warm-up round per
tier and size, and start every store of a round and layout without the chunks stored before it
(tieredkv: a fresh tier; LMCache: the keys cleared, untimed). ``--quick`` is a smoke run (64 KiB
and 1 MiB, 8 MiB, one rep; writes ``peers-<time>-quick.json``). Loopback only; every loop is
bounded.
An LMCache child that hangs past its per-round deadline is ended (stacks kept in the JSON under
``lmcache_incidents``) and its unfinished sizes run again in a fresh process, at most 4 attempts
(LMCache 0.5.6's ``resp://`` client can hang in ``retrieve``: see ``_lmcache_child.py``).
Exit status 1 when a figure is missing (a side failed) or the sides used different block ids,
else 0 (ratios below target included).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from _lmcache_child import side_figures  # benchmarks/ is on sys.path: both run as scripts from there

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD = HERE / "_lmcache_child.py"

KiB, MiB = 1 << 10, 1 << 20
LMCACHE_VERSION = "0.5.6"
TORCH_PIN = "2.13.0+cpu"
#: tieredkv / LMCache target per tieredkv tier (issue 15): at least even on the CPU cells, at
#: least twice as fast on the disk and Redis cells.
TARGETS = {"cpu": 1.0, "lmdb": 2.0, "redis": 2.0}
#: tieredkv tier -> the LMCache backends (``_lmcache_child.py --backend``) it is compared with.
PAIRS = {"cpu": ("cpu",), "lmdb": ("disk",), "redis": ("redis", "resp")}
#: LMCache backend -> what it is in LMCache.
LMCACHE_BACKENDS = {
    "cpu": "LocalCPUBackend (local_cpu)",
    "disk": "LocalDiskBackend (local_disk)",
    "redis": "RemoteBackend redis:// (RedisConnector, redis-py)",
    "resp": "RemoteBackend resp:// (RESPConnector, native client)",
}
#: Block-id layouts both sides run by default (``--layouts``; ``tieredkv.bench.LAYOUTS``): the first,
#: a churned engine pool, is the default figure; ``consecutive`` (a fresh pool) the named best case.
DEFAULT_LAYOUTS = ("permuted", "consecutive")
CHILD_ATTEMPTS = 4  # a hung or failed LMCache child is run again for the sizes it did not finish
ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_LOG_LEVEL": "WARNING",
    "PYTHONHASHSEED": "0",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the LMCache virtualenv ------------------------------------------------------------------


def _venv_versions(py: Path) -> tuple[str, str] | None:
    """(lmcache, torch) versions importable by ``py``, or None."""
    if not py.exists():
        return None
    code = (
        "import importlib.metadata as m, torch, lmcache; "
        "print(m.version('lmcache'), torch.__version__, torch.version.cuda)"
    )
    r = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **ENV}, check=False
    )
    if r.returncode != 0:
        return None
    parts = r.stdout.split()
    if len(parts) < 3 or parts[2] != "None":  # a CUDA build of torch is not what this compares
        return None
    return parts[0], parts[1]


def _pip(py: Path, args: list[str], logf: Path) -> None:
    cmd = [str(py), "-m", "pip", "install", *args]
    log("==> " + " ".join(cmd[1:]))
    with open(logf, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, timeout=1800, check=False
        )
    if r.returncode != 0:
        tail = "".join(logf.read_text().splitlines(keepends=True)[-25:])
        hint = ""
        if "torch" in args[-1]:
            hint = (
                f"\n(torch=={TORCH_PIN} is the CPU wheel; pip must find it through --find-links /"
                " PIP_FIND_LINKS, e.g. /opt/wheels on these machines. Set TIEREDKV_TORCH_FIND_LINKS"
                " to a directory holding torch-2.13.0+cpu-*.whl.)"
            )
        raise RuntimeError(f"pip install {' '.join(args)} failed (rc {r.returncode}); log {logf}:\n{tail}{hint}")


def ensure_lmcache_venv(venv: Path) -> tuple[Path, dict[str, Any]]:
    """Create or reuse ``venv`` with torch 2.13.0+cpu then lmcache 0.5.6; returns (python, install info)."""
    py = venv / "bin" / "python"
    found = _venv_versions(py)
    if found and found[0] == LMCACHE_VERSION and found[1] == TORCH_PIN:
        log(f"==> reusing {venv} (lmcache {found[0]}, torch {found[1]})")
        return py, {"reused": True, "seconds": 0.0, "lmcache": found[0], "torch": found[1]}
    t0 = time.perf_counter()
    if not py.exists():
        log(f"==> creating virtualenv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    logf = venv / "install.log"
    constraints = venv / "peers-constraints.txt"
    constraints.write_text(f"torch=={TORCH_PIN}\n")
    links: list[str] = []
    for d in (os.environ.get("TIEREDKV_TORCH_FIND_LINKS"), "/opt/wheels"):
        if d and Path(d).is_dir() and any(Path(d).glob("torch-2.13.0+cpu-*.whl")):
            links = ["--find-links", d]
            break
    steps = {}
    t = time.perf_counter()
    _pip(py, [*links, "-c", str(constraints), f"torch=={TORCH_PIN}"], logf)  # torch first, the CPU wheel
    steps["torch"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    _pip(py, [*links, "-c", str(constraints), f"lmcache=={LMCACHE_VERSION}"], logf)
    steps["lmcache"] = round(time.perf_counter() - t, 1)
    found = _venv_versions(py)
    if not found or found[0] != LMCACHE_VERSION or found[1] != TORCH_PIN:
        raise RuntimeError(
            f"{venv}: after install, lmcache/torch are {found}, want {LMCACHE_VERSION}/{TORCH_PIN}"
            f" (CPU build); see {logf}"
        )
    secs = round(time.perf_counter() - t0, 1)
    log(f"==> installed lmcache {found[0]} beside torch {found[1]} in {secs:.0f} s")
    return py, {"reused": False, "seconds": secs, "steps_s": steps, "lmcache": found[0], "torch": found[1]}


# ---- the two sides -----------------------------------------------------------------------------


def run_tieredkv(
    kind: str,
    sizes: list[int],
    total: int,
    reps: int,
    workdir: str,
    redis_url: str,
    lmcache: Sequence[LMCacheSide] = (),
    layouts: Sequence[str] = DEFAULT_LAYOUTS[:1],
) -> dict[int, Any]:
    """Per size: store/load seconds of each rep through tieredkv's pipeline (one warm-up first)
    for each of ``layouts`` (``layouts``: layout -> :func:`side_figures`; round ``r`` draws its
    block ids from seed ``r``, as LMCache's child does; ``block_ids``: their digests), and the
    medium's raw limits measured beside each rep (``raw_gbps``: figure -> GB/s per rep;
    ``raw_limit_candidates``: op -> the figures its limit is the strongest of, the tier class's
    ``RawLimits.limit``; :func:`medium_figures`). Each round of the ``lmcache`` sides runs between
    tieredkv's, in turn before and after them (LMCache, raw, tieredkv on even rounds; tieredkv,
    raw, LMCache on odd)."""
    import torch

    from tieredkv.backends.registry import get_tier_class
    from tieredkv.bench import (
        BLOCKS_PER_CHUNK,
        bench_blocks,
        bench_config,
        frozen_heap,
        make_tier,
        pipeline_store_load,
    )
    from tieredkv.config import CPUTierConfig, FSTierConfig, LMDBTierConfig, RedisTierConfig
    from tieredkv.keys import Namespace
    from tieredkv.layouts import ids_digest

    # The user-facing defaults of each kind; make_tier gives the bench copy its own directory
    # under ``workdir`` and room for the run (tieredkv.bench.bench_config).
    cfg = {
        "cpu": lambda: CPUTierConfig(),
        "lmdb": lambda: LMDBTierConfig(path=workdir),
        "fs": lambda: FSTierConfig(path=workdir),
        "redis": lambda: RedisTierConfig(url=redis_url),
    }[kind]()
    tier_class = get_tier_class(cfg.kind)

    ns = Namespace(model="tieredkv-peers", tenant_salt=uuid.uuid4().hex)
    out = {}
    for i, size in enumerate(sizes):
        n = max(4, total // size)
        g = torch.Generator().manual_seed(i)
        src = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)
        dst = torch.zeros_like(src)
        blocks = bench_blocks(src)  # one engine block tensor for every round of this size
        raw_cfg = bench_config(cfg, size, n, workdir)
        samples: dict[str, list[tuple[float, float]]] = {lay: [] for lay in layouts}
        raw: dict[str, list[float]] = {}
        candidates: dict[str, list[str]] = {}
        with frozen_heap():  # as in vLLM's engine (and in LMCache's child, for its side)
            for r in range(reps + 1):  # round 0 is the warm-up; each run on a fresh, empty tier
                if r % 2 == 0:  # the others first on even rounds, second on odd (as tieredkv bench)
                    for side in lmcache:
                        side.turn()
                    _medium_round(tier_class, raw_cfg, src, dst, workdir, raw if r else {}, candidates)
                for lay in layouts:
                    tier = make_tier(cfg, size, n, workdir)
                    try:  # raises if a byte differs
                        ts, tl = pipeline_store_load(tier, src, dst, ns, blocks, layout=lay, seed=r)
                    finally:
                        if tier.config.local_dir is not None:  # the bench copy's own directory
                            shutil.rmtree(tier.config.local_dir, ignore_errors=True)
                    if r:
                        samples[lay].append((ts, tl))
                if r % 2 == 1:
                    _medium_round(tier_class, raw_cfg, src, dst, workdir, raw, candidates)
                    for side in lmcache:
                        side.turn()
        for side in lmcache:
            side.finish(size)
        nbytes = n * size
        nb = n * BLOCKS_PER_CHUNK
        figures = {lay: side_figures(n, nbytes, samples[lay]) for lay in layouts}
        out[size] = {
            "layouts": figures,
            "block_ids": {lay: ids_digest(lay, nb, reps + 1) for lay in layouts},
            "raw_gbps": raw,
            "raw_limit_candidates": candidates,
        }
        for lay, fig in figures.items():
            log(
                f"tieredkv {kind:5} {_label(size):>7} {lay}: store {fig['store_gbps']} GB/s, load {fig['load_gbps']} GB/s"
            )
        del src, dst, blocks
    return out


def _medium_round(
    tier_class: Any,
    raw_cfg: Any,
    src: Any,
    dst: Any,
    workdir: str,
    raw: dict[str, list[float]],
    candidates: dict[str, list[str]],
) -> None:
    """One measurement of the medium's raw limits (the tier class's ``raw_limits``), each figure
    appended to ``raw`` and, per op, the figures its limit is the strongest of
    (``RawLimits.limit``) put in ``candidates``; ``dst`` is left zeroed."""
    limits = tier_class.raw_limits(raw_cfg, src, dst, workdir=workdir)
    dst.zero_()
    if limits is not None:
        for op in ("store", "load"):
            if limits.limit(op):
                candidates[op] = list(limits.limit(op))
        for name, value in limits.gbps.items():
            raw.setdefault(name, []).append(round(value, 4))


def medium_figures(t: dict[str, Any], op: str) -> dict[str, Any] | None:
    """The medium's limit for ``op`` ("store" / "load") beside one tieredkv size, as ``tieredkv
    bench`` settles it: the strongest (highest median of the reps) of the raw figures the tier
    class names for it (``RawLimits.limit``: ``raw_limit_candidates``) measured in the run.
    ``{"limit": name, "limit_gbps": GB/s, "candidates": {name: median GB/s, None where not
    measured}}``; None when no candidate was measured.

    Measured by the tier class's own ``raw_limits`` (host memory: a gather, a copy, a two-thread
    non-temporal copy; disk: page-cache file I/O and py-lmdb; Redis: pipelined redis-py and
    ``redis-benchmark``), interleaved with tieredkv's rounds."""
    raw = {k: statistics.median(v) for k, v in t.get("raw_gbps", {}).items() if v}
    names = t.get("raw_limit_candidates", {}).get(op, [])
    got = {k: raw[k] for k in names if k in raw}
    if not got:
        return None
    limit = max(got, key=got.__getitem__)
    return {
        "limit": limit,
        "limit_gbps": round(got[limit], 4),
        "candidates": {k: round(raw[k], 4) if k in raw else None for k in names},
    }


class _Child(NamedTuple):
    """One running ``_lmcache_child.py``: its process, this side's ends of the two turn pipes,
    its result file and log, and the sizes it was given."""

    proc: subprocess.Popen[bytes]
    go_w: int
    done_r: int
    out: str
    logf: Path
    sizes: list[int]


class LMCacheSide:
    """One LMCache backend, run a step at a time in ``_lmcache_child.py`` processes (``--turns``):
    :meth:`turn` lets the child run its next step (an engine's set-up and warm-up round, or one
    timed round) and waits until it is over, so tieredkv's rounds run between LMCache's and never
    beside them. A child that fails or hangs (its watchdog ends it; this side ends it past the
    step's deadline too) is recorded as an incident, and the next turn starts a fresh child for
    the sizes not yet measured, up to ``CHILD_ATTEMPTS`` children; :meth:`finish` gives a size
    the turns it still needs after such a restart. :meth:`close` returns the results."""

    def __init__(
        self,
        py: Path,
        backend: str,
        sizes: list[int],
        total: int,
        reps: int,
        workdir: str,
        redis_url: str,
        threads: int,
        batch_bytes: int,
        round_timeout: int = 0,
        layouts: Sequence[str] = DEFAULT_LAYOUTS[:1],
        copy: str = "blocks",
    ) -> None:
        self.py, self.backend, self.sizes, self.total, self.reps = py, backend, sizes, total, reps
        self.workdir, self.redis_url, self.threads, self.batch_bytes = workdir, redis_url, threads, batch_bytes
        self.layouts, self.copy = list(layouts), copy
        self.round_timeout = round_timeout or max(60, total // MiB // 2 * len(self.layouts))
        self.done: dict[int, Any] = {}
        self.agg: dict[str, Any] = {"backend": backend, "notes": [], "incidents": []}
        self.attempt = 0
        self.t0 = time.perf_counter()
        self._child: _Child | None = None

    def _start(self) -> bool:
        todo = [s for s in self.sizes if s not in self.done]
        if not todo or self.attempt >= CHILD_ATTEMPTS:
            return False
        self.attempt += 1
        fd, out = tempfile.mkstemp(prefix=f"lmcache-{self.backend}-", suffix=".json", dir=self.workdir)
        os.close(fd)
        logf = Path(self.workdir) / f"lmcache-{self.backend}-{self.attempt}.log"
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        # fmt: off
        cmd = [
            str(self.py), str(CHILD), "--backend", self.backend, "--sizes", ",".join(map(str, todo)),
            "--total-bytes", str(self.total), "--reps", str(self.reps), "--batch-bytes", str(self.batch_bytes),
            "--threads", str(self.threads), "--workdir", self.workdir, "--redis-url", self.redis_url,
            "--out", out, "--round-timeout", str(self.round_timeout), "--turns", f"{go_r},{done_w}",
            "--layouts", ",".join(self.layouts), "--copy", self.copy,
        ]
        # fmt: on
        with open(logf, "w") as lf:
            proc = subprocess.Popen(
                cmd,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ENV},
                cwd=str(ROOT),
                pass_fds=(go_r, done_w),
            )
        os.close(go_r)
        os.close(done_w)
        self._child = _Child(proc, go_w, done_r, out, logf, todo)
        return True

    def turn(self) -> bool:
        """One step of the child (a fresh child first when none runs); False when there is none
        left to run (every size measured, or the attempts spent)."""
        if self._child is None and not self._start():
            return False
        child = self._child
        assert child is not None
        try:
            os.write(child.go_w, b"g")
        except BrokenPipeError:
            self._end()
            return True
        # the child's own watchdog ends a step at round_timeout; this deadline is the backstop
        ready, _, _ = select.select([child.done_r], [], [], self.round_timeout + 60)
        if not ready or os.read(child.done_r, 1) != b"d":
            self._end()
            return True
        self._collect(child.out)
        return True

    def finish(self, size: int) -> None:
        """Turns until ``size`` is measured (or no child is left to measure it)."""
        while size not in self.done and self.turn():
            pass

    def _collect(self, out: str) -> dict[str, Any]:
        try:
            res = json.loads(Path(out).read_text())
        except (OSError, json.JSONDecodeError):
            res = {"backend": self.backend, "results": []}
        for r in res.get("results", []):
            self.done[r["size"]] = r
        return res

    def _end(self) -> None:
        """The child is over (its sizes done, failed or hung): reap it, keep what it measured."""
        child = self._child
        assert child is not None
        self._child = None
        os.close(child.go_w)  # a child still waiting for a turn reads EOF and leaves
        os.close(child.done_r)
        try:
            rc = child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=30)
            rc = -9
        text = child.logf.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("lmcache "):
                log(line)
        res = self._collect(child.out)
        if rc != 0 and "error" not in res:
            res["error"] = f"child exited with {rc}" + (" (deadline)" if rc == -9 else "")
        for k in ("lmcache", "torch", "python"):
            if k in res:
                self.agg[k] = res[k]
        self.agg["notes"] += [n for n in res.get("notes", []) if n not in self.agg["notes"]]
        if "error" in res:
            lines = [x for x in text.splitlines(keepends=True) if "LMCache WARNING" not in x]
            log(
                f"LMCache {self.backend} attempt {self.attempt} FAILED: {res['error']}\n{res.get('traceback', '')}"
                + "".join(lines[-40:])
            )
            self.agg["incidents"].append(
                {
                    "attempt": self.attempt,
                    "sizes": child.sizes,
                    "error": res["error"],
                    "traceback": res.get("traceback", ""),
                    "log_tail": "".join(lines[-150:]),
                }
            )

    def close(self) -> dict[str, Any]:
        """Every size's figures, as one child of the old kind reported them; ``error`` is set
        only when some size was never measured."""
        for size in self.sizes:
            self.finish(size)
        if self._child is not None:
            self._end()
        agg = self.agg
        agg["results"] = [self.done[s] for s in self.sizes if s in self.done]
        missing = [s for s in self.sizes if s not in self.done]
        if missing:
            last = agg["incidents"][-1]["error"] if agg["incidents"] else "no child ran"
            agg["error"] = (
                f"sizes {[_label(s) for s in missing]} not measured after {self.attempt} attempts; last: {last}"
            )
        agg["attempts"] = self.attempt
        agg["wall_s"] = round(time.perf_counter() - self.t0, 1)
        return agg


# ---- report ------------------------------------------------------------------------------------


def _label(size: int) -> str:
    return f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def _figure(label: str, layout: str, op: str, default: str) -> str:
    """``<label>.<op>`` for the run's default (first) layout, else ``<label>@<layout>.<op>``
    (``tieredkv.bench.figure``)."""
    return f"{label}.{op}" if layout == default else f"{label}@{layout}.{op}"


def _layouts(row: dict[str, Any]) -> list[str]:
    return list(row.get("layouts") or DEFAULT_LAYOUTS[:1])


def _row_label(row: dict[str, Any], layout: str) -> str:
    """``64 KiB permuted`` (``64 KiB`` when the run has one layout)."""
    return row["label"] if len(_layouts(row)) == 1 else f"{row['label']} {layout}"


def build_results(
    sizes: list[int],
    pairs: list[tuple[str, str]],
    tkv: dict[str, dict[int, Any]],
    lmc: dict[str, dict[str, Any]],
    layouts: Sequence[str] = DEFAULT_LAYOUTS[:1],
) -> list[dict[str, Any]]:
    """Per size: both sides' per-rep figures (``tieredkv`` / ``lmcache``: tier / backend -> its
    result, figures per layout under ``layouts``), the medians (``median_gbps``:
    ``tieredkv.<tier>[@<layout>].<op>``, ``lmcache.<backend>[@<layout>].<op>``), the ratios
    tieredkv / LMCache (``ratios``: ``<tier>/<backend>[@<layout>].<op>``; no ``@`` for the run's
    first layout) and the medium's limit (``medium``: ``<tier>.<op>`` -> :func:`medium_figures`)."""
    rows = []
    for size in sizes:
        row: dict[str, Any] = {
            "size": size,
            "label": _label(size),
            "layouts": list(layouts),
            "tieredkv": {},
            "lmcache": {},
            "median_gbps": {},
            "ratios": {},
            "medium": {},
        }
        for kind, backend in pairs:
            t = tkv.get(kind, {}).get(size)
            lres = next((r for r in lmc.get(backend, {}).get("results", []) if r["size"] == size), None)
            if t:
                row["tieredkv"][kind] = t
            if lres:
                row["lmcache"][backend] = lres
            for op in ("store", "load"):
                m = medium_figures(t, op) if t else None
                if m is not None:
                    row["medium"][f"{kind}.{op}"] = m
                for lay in layouts:
                    tf = (t or {}).get("layouts", {}).get(lay)
                    lf = (lres or {}).get("layouts", {}).get(lay)
                    if tf:
                        row["median_gbps"]["tieredkv." + _figure(kind, lay, op, layouts[0])] = _med(tf[f"{op}_gbps"])
                    if lf:
                        row["median_gbps"]["lmcache." + _figure(backend, lay, op, layouts[0])] = _med(lf[f"{op}_gbps"])
                    if tf and lf:
                        row["ratios"][_figure(f"{kind}/{backend}", lay, op, layouts[0])] = round(
                            _med(tf[f"{op}_gbps"]) / _med(lf[f"{op}_gbps"]), 2
                        )
        rows.append(row)
    return rows


def block_id_mismatches(
    pairs: list[tuple[str, str]], tkv: dict[str, dict[int, Any]], lmc: dict[str, dict[str, Any]]
) -> list[str]:
    """The cells whose two sides did not use the same block ids (digests of ``block_ids``)."""
    bad = []
    for kind, backend in pairs:
        for res in lmc.get(backend, {}).get("results", []):
            mine = tkv.get(kind, {}).get(res["size"], {}).get("block_ids")
            if mine is not None and res.get("block_ids") != mine:
                bad.append(f"{_label(res['size'])} {kind}/{backend}")
    return bad


def print_table(rows: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """One table per operation: tieredkv GB/s / LMCache GB/s and the ratio per size and layout,
    then the medium's limit (the strongest raw figure of its candidates measured,
    :func:`medium_figures`) over LMCache's. Returns the cells below target, and those of them
    whose target is above the medium's limit in this run."""
    below, above_medium = [], []
    width = max([7, *(len(_row_label(r, lay)) for r in rows for lay in _layouts(r))])
    for op in ("store", "load"):
        print(
            f"\n{op}: tieredkv GB/s / LMCache {LMCACHE_VERSION} GB/s  ratio  (median of reps; targets: "
            + ", ".join(f"{k} >= {v:g}x" for k, v in TARGETS.items())
            + ")"
        )
        head = f"{'size':>{width}} | " + " | ".join(f"{k + ' vs ' + b:>19}" for k, b in pairs)
        print(head)
        print("-" * len(head))
        for r in rows:
            lays = _layouts(r)
            for lay in lays:
                cells = []
                for k, b in pairs:
                    target = TARGETS[k]
                    x = r["median_gbps"].get("tieredkv." + _figure(k, lay, op, lays[0]))
                    y = r["median_gbps"].get("lmcache." + _figure(b, lay, op, lays[0]))
                    name = _figure(f"{k}/{b}", lay, op, lays[0])
                    ratio = r["ratios"].get(name)
                    if x is None or y is None or ratio is None:
                        cells.append(f"{'n/a':>19}")
                        continue
                    m = r.get("medium", {}).get(f"{k}.{op}")
                    if ratio < target:
                        cell = f"{r['label']} {name} {ratio:.2f}x"
                        below.append(cell)
                        if m is not None and m["limit_gbps"] < target * y:
                            above_medium.append(
                                f"{cell}: {target:g}x LMCache is {target * y:.2f} GB/s, the medium's limit"
                                f" {m['limit_gbps']:.2f} ({m['limit']})"
                            )
                    cells.append(f"{x:.2f}/{y:.2f} {ratio:5.2f}x{' ' if ratio >= target else '!'}".rjust(19))
                print(f"{_row_label(r, lay):>{width}} | " + " | ".join(cells))
        print(
            "the medium's limit in the same run (the strongest of its raw figures): GB/s / LMCache GB/s  ratio"
            "  ('^': below the pair's target)"
        )
        for r in rows:
            lays = _layouts(r)
            for lay in lays:
                cells = []
                for k, b in pairs:
                    target = TARGETS[k]
                    m = r.get("medium", {}).get(f"{k}.{op}")
                    y = r["median_gbps"].get("lmcache." + _figure(b, lay, op, lays[0]))
                    if m is None or not y:
                        cells.append(f"{'n/a':>19}")
                        continue
                    q = m["limit_gbps"] / y
                    cells.append(f"{m['limit_gbps']:.2f}/{y:.2f} {q:5.2f}x{' ' if q >= target else '^'}".rjust(19))
                print(f"{_row_label(r, lay):>{width}} | " + " | ".join(cells))
        kinds = list(dict.fromkeys(k for k, _ in pairs))
        for k in kinds:
            got = [(r["label"], r["medium"][f"{k}.{op}"]) for r in rows if f"{k}.{op}" in r.get("medium", {})]
            if got:
                names = ", ".join(got[0][1]["candidates"])
                print(
                    f"  {k}.{op} limit, the strongest of ({names}): "
                    + ", ".join(f"{lab} {m['limit']}" for lab, m in got)
                )
    print(
        "\nLMCache backends: "
        + "; ".join(f"{b} = {LMCACHE_BACKENDS[b]}" for b in dict.fromkeys(b for _, b in pairs))
        + ". '!' marks a ratio below the pair's target. Both sides move the chunks from and into the"
        " same block ids of a paged KV cache (per layout; LMCache through engine.store/retrieve's"
        " kvcaches and slot_mapping). The medium's raw figures (the tier's own raw_limits, as tieredkv"
        " bench measures them) were measured beside each tieredkv round."
    )
    if above_medium:
        print("below target, with the target above the medium's limit in the run:")
        for line in above_medium:
            print(f"  {line}")
    return below, above_medium


def _fs_of(path: str) -> dict[str, str]:
    """Mount point, device and filesystem type holding ``path`` (from /proc/mounts)."""
    best = ("", "", "")
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def machine(workdir: str) -> dict[str, Any]:
    from tieredkv.bench import machine_info

    m = machine_info()
    m["workdir_fs"] = _fs_of(workdir)
    m["loadavg_start"] = m.pop("loadavg", None)
    return m


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from tieredkv.bench import add_run_args, run_plan  # (imports torch: not at module level here)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, total_mib=128, per="tier and rep", reps=3, quick_sizes=[64 * KiB, 1 * MiB], quick_mib=8)
    ap.add_argument("--tiers", default="cpu,lmdb,redis", help="tieredkv tiers to compare (cpu, lmdb, redis)")
    ap.add_argument(
        "--lmcache-redis",
        default="redis,resp",
        help="LMCache Redis clients to compare tieredkv's redis tier with: redis (redis://), resp (resp://)",
    )
    ap.add_argument(
        "--batch-mib",
        type=int,
        default=16,
        help="bytes per tieredkv job / LMCache store()/retrieve() call (tieredkv.bench uses 16)",
    )
    ap.add_argument(
        "--layouts",
        default=",".join(DEFAULT_LAYOUTS),
        help="block-id layouts of the paged KV cache, both sides, the first the default figure: permuted"
        " (a churned pool), fragmented (short runs), consecutive (a fresh pool, the best case)",
    )
    ap.add_argument(
        "--lmcache-copy",
        default="blocks",
        choices=("blocks", "lmcache"),
        help="how LMCache's stand-in connector moves a chunk: blocks (index_select / numpy, in LMCache's"
        " favour) or lmcache (LMCache's own CPU fallback, device_ops.multi_layer_kv_transfer)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on both sides")
    ap.add_argument("--workdir", help="directory for the LMDB and LMCache disk files (default: a temp dir)")
    ap.add_argument("--venv", default=str(ROOT / ".venv-lmcache"), help="the LMCache virtualenv")
    ap.add_argument("--out", default=str(HERE / "results"), help="directory for the JSON result")
    ap.add_argument(
        "--lmcache-round-timeout",
        type=int,
        default=0,
        help="seconds one LMCache round (store + retrieve of --total-mib per layout) may take before its"
        " child is ended and its unfinished sizes run again (default: max(60, total MiB / 2 per layout))",
    )
    a = ap.parse_args(argv)
    sizes, total, reps = run_plan(a)
    kinds = [k.strip() for k in a.tiers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in PAIRS]
    if bad:
        ap.error(f"unknown tiers {bad}; choose from {list(PAIRS)}")
    rclients = [c.strip() for c in a.lmcache_redis.split(",") if c.strip()]
    if not rclients or any(c not in PAIRS["redis"] for c in rclients):
        ap.error(f"--lmcache-redis: choose from {list(PAIRS['redis'])}")
    pairs = [(k, b) for k in kinds for b in (rclients if k == "redis" else PAIRS[k])]
    from tieredkv.bench import BLOCKS_PER_CHUNK, LAYOUTS

    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts) or len(set(layouts)) < len(layouts):
        ap.error(f"--layouts: distinct names from {list(LAYOUTS)}")
    batch_bytes = a.batch_mib * MiB
    if batch_bytes != 16 * MiB:
        import tieredkv.bench as tb

        tb.BATCH_BYTES = batch_bytes  # the pipeline side reads it per call
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from tieredkv.bench import STEADY_MALLOC, steady_malloc

    # The same heap settings on both sides: this process (tieredkv.bench.steady_malloc) and
    # LMCache's child, through glibc's environment variables for them.
    steady_malloc()
    for name, value in STEADY_MALLOC.items():
        os.environ[f"MALLOC_{name.removeprefix('M_')}_"] = str(value)

    py, install = ensure_lmcache_venv(Path(a.venv))

    import torch

    from tieredkv.testing.servers import RedisServer

    torch.set_num_threads(a.threads)
    work = a.workdir or tempfile.mkdtemp(prefix="tieredkv-peers-")
    os.makedirs(work, exist_ok=True)
    info = machine(work)
    info["malloc_lmcache_child"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    t_start = time.perf_counter()
    tkv: dict[str, dict[int, Any]] = {}
    lmc: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    try:
        with RedisServer() as srv:
            log(f"==> redis-server on {srv.url}; disk files under {work} ({info['workdir_fs']['fstype']})")
            for kind in kinds:  # tieredkv's rounds interleaved with LMCache's, pair by pair
                sides = [
                    LMCacheSide(
                        py,
                        b,
                        sizes,
                        total,
                        reps,
                        work,
                        srv.url,
                        a.threads,
                        batch_bytes,
                        a.lmcache_round_timeout,
                        layouts=layouts,
                        copy=a.lmcache_copy,
                    )
                    for k, b in pairs
                    if k == kind
                ]
                try:
                    tkv[kind] = run_tieredkv(kind, sizes, total, reps, work, srv.url, lmcache=sides, layouts=layouts)
                except Exception as e:  # noqa: BLE001 - report it, keep measuring the other pairs
                    errors[f"tieredkv.{kind}"] = f"{type(e).__name__}: {e}"
                    log(f"tieredkv {kind} FAILED: {errors[f'tieredkv.{kind}']}")
                for side in sides:
                    lmc[side.backend] = side.close()  # (the turns tieredkv did not give, if it failed)
                    if "error" in lmc[side.backend]:
                        errors[f"lmcache.{side.backend}"] = lmc[side.backend]["error"]
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    wall = round(time.perf_counter() - t_start, 1)

    rows = build_results(sizes, pairs, tkv, lmc, layouts)
    mismatched = block_id_mismatches(pairs, tkv, lmc)
    if mismatched:  # (the child's NumPy drew others from the same tieredkv.layouts code)
        errors["block_ids"] = "LMCache's child used other block ids than tieredkv in: " + ", ".join(mismatched)
    below, above_medium = print_table(rows, pairs)
    for b, r in lmc.items():
        for inc in r.get("incidents", []):
            print(
                f"LMCache {b} incident (attempt {inc['attempt']}, sizes {[_label(x) for x in inc['sizes']]}): "
                f"{inc['error']}"
                + ("; its unfinished sizes ran again in a fresh process" if inc["attempt"] < CHILD_ATTEMPTS else "")
            )
    if errors:
        print("errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    notes = sorted({n for r in lmc.values() for n in r.get("notes", [])})
    info["lmcache"] = next((r.get("lmcache") for r in lmc.values() if r.get("lmcache")), install.get("lmcache"))
    info["lmcache_torch"] = install.get("torch")
    info["loadavg_end"] = os.getloadavg()
    doc = {
        "what": "tieredkv tiers vs LMCache backends: store/load GB/s per chunk size, ratio tieredkv / LMCache",
        "command": "./scripts/bench peers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": info,
        "lmcache_install": install,
        "config": {
            "sizes": sizes,
            "total_bytes_per_rep": total,
            "reps": reps,
            "batch_bytes": batch_bytes,
            "torch_threads": a.threads,
            "layouts": layouts,
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            "lmcache_copy": a.lmcache_copy,
            "quick": a.quick,
            "warmup_rounds": 1,
            "pairs": [{"tieredkv": k, "lmcache": b, "lmcache_backend": LMCACHE_BACKENDS[b]} for k, b in pairs],
            "target_ratio": TARGETS,
        },
        "wall_s": wall,
        "results": rows,
        "below_target": below,
        "below_target_above_medium": above_medium,
        "errors": errors,
        "lmcache_notes": notes,
        "lmcache_child_wall_s": {b: r.get("wall_s") for b, r in lmc.items()},
        "lmcache_incidents": {b: r["incidents"] for b, r in lmc.items() if r.get("incidents")},
    }
    os.makedirs(a.out, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(a.out, f"peers-{stamp}{'-quick' if a.quick else ''}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path} (measured in {wall:.0f} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

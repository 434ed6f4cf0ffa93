"""``tieredkv demo``: a synthetic hybrid-model serving trace through adapter, pipeline and tiers.

The trace: a few long system prompts shared by many multi-turn conversations; each turn's
prompt is the previous prompt, the model's answer and a new user message, so later turns
and other conversations hit cached prefixes. The "model" has a full-attention group and a
sliding-window group (optionally a mamba group) with different block sizes per chunk.

A small engine loop stands in for vLLM: it admits requests, asks the planner
(:class:`~tieredkv.planner.OffloadScheduler`, over the planner core the vLLM connector
``TieredKVConnector`` plans with too) for the longest hit that is whole chunks in
every group, loads it through the pipeline into "GPU" blocks (CPU tensors here; CUDA tensors
when present), computes the rest in prefill steps, and stores whole chunks after every step.
A block's bytes are a function of the token prefix it ends (as real KV is), so every loaded
block is checked against what computing it would have produced.

The summary reports what a user cares about: prompt tokens served from cache instead of
recomputed, the time that saved at a stated prefill rate, and store/load throughput over busy
time (bytes over the time at least one job of that kind was in flight, not over wall time).
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from tieredkv.backends.registry import tier_capabilities
from tieredkv.config import TieredKVConfig
from tieredkv.groups import GroupKind, GroupLayout, GroupSpec
from tieredkv.pipeline import JobResult, KeyState
from tieredkv.planner import DEFAULT_MAX_CHUNKS_PER_PLAN, LoadPlan, StoreOutcome, StorePlan
from tieredkv.store import TieredStore

__all__ = ["DEFAULT_PREFILL_TOKENS_PER_S", "SAVED_S_FORMULA", "DemoOptions", "busy_seconds", "run_demo"]

TOKENS_PER_HASH = 16

#: Prefill rate the time saved is priced at unless the caller says otherwise: about an 8B model's
#: prefill on one A100-class GPU (2 x 8e9 FLOPs per token at ~50% of 312 dense bf16 TFLOP/s gives
#: ~10k tokens/s; an H100 does roughly 2-3x that). An assumption to state, not a measurement.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0

SAVED_S_FORMULA = "max(0, tokens_from_cache / prefill_tokens_per_s - load.busy_s)"


@dataclass
class DemoOptions:
    system_prompts: int = 6
    conversations: int = 24
    turns: int = 4
    system_tokens: tuple[int, int] = (512, 1536)
    user_tokens: tuple[int, int] = (48, 256)
    output_tokens: tuple[int, int] = (32, 160)
    concurrency: int = 8
    prefill_tokens: int = 512
    mamba: bool = False
    seed: int = 0
    max_chunks_per_plan: int | None = DEFAULT_MAX_CHUNKS_PER_PLAN  # the adapter's bound on one store plan
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S  # prices tokens from cache as time saved
    admit_after: int | None = None  # every policy rule's admit_after (None: the config's)
    admission_baseline: bool = True  # with admission on: replay the trace without it first (bytes saved)


def demo_layout(mamba: bool = False) -> GroupLayout:
    """Full attention (16-token blocks, 4 per chunk, 32 KiB/block) and sliding window
    (16-token blocks, 2 per chunk, window 256 tokens, 16 KiB/block); optionally mamba."""
    groups = [
        GroupSpec(0, GroupKind.FULL, tokens_per_block=16, blocks_per_chunk=4, bytes_per_block=32 << 10),
        GroupSpec(
            1,
            GroupKind.SLIDING_WINDOW,
            tokens_per_block=16,
            blocks_per_chunk=2,
            bytes_per_block=16 << 10,
            window_tokens=256,
        ),
    ]
    if mamba:
        groups.append(GroupSpec(2, GroupKind.MAMBA, tokens_per_block=64, blocks_per_chunk=1, bytes_per_block=64 << 10))
    return GroupLayout(tuple(groups), TOKENS_PER_HASH)


# ---- the synthetic model ----------------------------------------------------------------


def chain_hashes(tokens: list[int], parent: bytes = b"\0" * 16) -> list[bytes]:
    """vLLM-style chained block hashes, one per TOKENS_PER_HASH full tokens."""
    out = []
    h = parent
    for i in range(len(tokens) // TOKENS_PER_HASH):
        blk = tokens[i * TOKENS_PER_HASH : (i + 1) * TOKENS_PER_HASH]
        h = xxhash.xxh3_128_digest(h + b"".join(t.to_bytes(4, "little") for t in blk))
        out.append(h)
    return out


def block_content(prefix_hash: bytes, group: int, pos: int, nbytes: int) -> torch.Tensor:
    """The KV bytes of block ``pos`` of ``group`` ending at ``prefix_hash``."""
    pattern = prefix_hash + group.to_bytes(4, "little") + pos.to_bytes(4, "little") + b"\xa5" * 8
    return torch.frombuffer(bytearray(pattern), dtype=torch.uint8).repeat(nbytes // 32)


class FakeGPU:
    """Per group: a pool of KV blocks (block 0 is the null block) and a free list."""

    def __init__(self, layout: GroupLayout, blocks: int, device: str) -> None:
        self.kv = [torch.zeros(blocks, g.bytes_per_block, dtype=torch.uint8, device=device) for g in layout.groups]
        self.free = [deque(range(1, blocks)) for _ in layout.groups]

    def alloc(self, pos: int, n: int) -> list[int]:
        if len(self.free[pos]) < n:
            raise RuntimeError("demo GPU out of blocks; lower --concurrency")
        return [self.free[pos].popleft() for _ in range(n)]

    def release(self, pos: int, ids: list[int]) -> None:
        self.free[pos].extend(i for i in ids if i)


# ---- the trace ---------------------------------------------------------------------------


@dataclass
class _Req:
    rid: str
    conv: int
    turn: int
    tokens: list[int]
    output: list[int]
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    computed: int = 0
    hit: int = 0
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    seen: set[bytes] = field(default_factory=set)  # its keys admission counted a sighting for


class _Trace:
    def __init__(self, o: DemoOptions) -> None:
        self.o = o
        self.rng = random.Random(o.seed)
        self.systems = [self._toks(*o.system_tokens) for _ in range(o.system_prompts)]
        self.history: dict[int, list[int]] = {}
        self.conv_sys = [self.rng.randrange(o.system_prompts) for _ in range(o.conversations)]

    def _toks(self, lo: int, hi: int, rng: random.Random | None = None) -> list[int]:
        rng = rng or self.rng
        return [rng.randrange(32000) for _ in range(rng.randint(lo, hi))]

    def turn(self, conv: int, turn: int) -> _Req:
        # a turn's tokens depend on the seed, the conversation and the turn only (not on the order
        # turns come up in, which the timing of stores decides): same seed, same trace
        rng = random.Random(f"{self.o.seed}:{conv}:{turn}")
        prompt = self.history.get(conv, self.systems[self.conv_sys[conv]]) + self._toks(*self.o.user_tokens, rng)
        out = self._toks(*self.o.output_tokens, rng)
        self.history[conv] = prompt + out
        return _Req(f"c{conv}t{turn}", conv, turn, prompt, out)


# ---- the engine loop -------------------------------------------------------------------------


class _Engine:
    def __init__(self, store: TieredStore, layout: GroupLayout, o: DemoOptions, device: str) -> None:
        self.store, self.layout, self.o = store, layout, o
        self.gpu = FakeGPU(layout, blocks=o.concurrency * 400 + 64, device=device)
        for pos, g in enumerate(layout.groups):  # the store builds the namespace and the planner from these
            store.register_group(g, [self.gpu.kv[pos]], null_block=0)  # as vLLM's
        self.sched = store.planner(layout.tokens_per_hash, max_chunks_per_plan=o.max_chunks_per_plan)
        self.served = [0] * len(layout.groups)
        self.recomputed = [0] * len(layout.groups)
        self.from_cache = 0  # prompt tokens whose prefill a fully loaded hit skipped
        self.verified = 0
        self.mismatches = 0
        self.deferred = 0
        self.results: list[JobResult] = []
        # admission: chunk bytes of every chunk it declined, and the chunks stored (admitted)
        self.declined: dict[bytes, int] = {}
        self.written: set[bytes] = set()

    # keys: the adapter speaks chunk keys (hash + group); tiers store fingerprint + chunk key
    def skey(self, chunk_key: bytes) -> bytes:
        return self.store.stored_key(chunk_key)

    def admit(self, r: _Req) -> bool:
        if r.rid not in self.sched:
            r.hashes = chain_hashes(r.tokens)
            self.sched.add_request(r.rid, len(r.tokens), block_hashes=r.hashes)
        keys = [k for pos in range(len(self.layout.groups)) for k in self.sched.offload_keys(r.rid, pos)]
        states = self.store.lookup([self.skey(k) for k in keys])
        hit = {k for k, (s, _) in zip(keys, states) if s is KeyState.HIT}
        pend = {k for k, (s, _) in zip(keys, states) if s is KeyState.PENDING}
        plan = self.sched.plan_lookup(r.rid, num_computed_tokens=0, is_stored=hit)
        if (
            pend
            and self.sched.plan_lookup(r.rid, num_computed_tokens=0, is_stored=hit | pend).num_hit_tokens
            > plan.num_hit_tokens
        ):
            self.deferred += 1
            return False  # a longer hit is being written: wait for it (vLLM's HIT_PENDING)
        r.hit = plan.num_hit_tokens
        r.blocks = [self._allocate(g, pos, len(r.tokens), r.hit) for pos, g in enumerate(self.layout.groups)]
        self.sched.update_request(r.rid, block_ids=r.blocks)
        if r.hit:
            self._load(r, self.sched.plan_load(r.rid, num_computed_tokens=0, num_external_tokens=r.hit))
        r.computed = r.hit
        return True

    def _allocate(self, g: GroupSpec, pos: int, n_tokens: int, hit: int) -> list[int]:
        """Block ids for a new request, as a KV cache manager hands them out: a sliding-window
        group gets the null block for positions already out of the window at the hit boundary
        (the token at the boundary reads the window - 1 tokens before it)."""
        n = -(-n_tokens // g.tokens_per_block)
        skip = 0
        if g.kind is GroupKind.SLIDING_WINDOW and g.window_tokens is not None:
            skip = max(0, hit - g.window_tokens + 1) // g.tokens_per_block
        return [0] * skip + self.gpu.alloc(pos, n - skip)

    def _load(self, r: _Req, plan: LoadPlan) -> None:
        keys = [self.skey(k) for k in plan.keys]
        self.store.pin(keys)
        jobs = {}
        for pos, (g, gl) in enumerate(zip(self.layout.groups, plan.groups)):
            if not gl.keys:
                continue
            bpc = g.blocks_per_chunk
            ids = {k: [0] * bpc for k in gl.chunk_indices}
            for b, p in zip(gl.dst_block_ids, gl.block_positions):
                ids[p // bpc][p % bpc] = b
            chunks = [(self.skey(key), ids[k]) for key, k in zip(gl.keys, gl.chunk_indices)]
            job = self.store.load(g.index, chunks)
            if job is None:
                raise RuntimeError("demo: staging pool too small for one request's hit")
            jobs[job] = (pos, gl)
        results = self.store.wait(jobs)
        self.store.unpin(keys)
        if all(res.ok for res in results.values()):
            self.from_cache += r.hit
        for job_id, res in results.items():
            self.results.append(res)
            pos, gl = jobs[job_id]
            g = self.layout.groups[pos]
            if not res.ok:
                self.failed_load(r, pos, gl, res)
                continue
            for b, p in zip(gl.dst_block_ids, gl.block_positions):
                self._check(r, pos, p, b)
            self.served[pos] += len(gl.block_positions) * g.tokens_per_block

    def failed_load(self, r: _Req, pos: int, gl: Any, res: JobResult) -> None:
        """A load of an accepted hit failed (a tier died between lookup and load). The demo stops;
        an engine would recompute those blocks (see ``benchmarks/soak.py``)."""
        raise RuntimeError(f"demo: load of an accepted hit failed: {res.error}")

    def fill_block(self, r: _Req, pos: int, p: int, block_id: int) -> None:
        """Compute block ``p`` of group ``pos``: its bytes are a function of the prefix it ends."""
        g = self.layout.groups[pos]
        h = r.hashes[(p + 1) * g.tokens_per_block // TOKENS_PER_HASH - 1]
        self.gpu.kv[pos][block_id].copy_(block_content(h, g.index, p, g.bytes_per_block))

    def extra_summary(self) -> dict[str, Any]:
        """More summary fields (subclasses)."""
        return {}

    def _check(self, r: _Req, pos: int, p: int, block_id: int) -> None:
        g = self.layout.groups[pos]
        h = r.hashes[(p + 1) * g.tokens_per_block // TOKENS_PER_HASH - 1]
        want = block_content(h, g.index, p, g.bytes_per_block)
        if torch.equal(self.gpu.kv[pos][block_id].cpu(), want):
            self.verified += 1
        else:
            self.mismatches += 1

    def prefill(self, r: _Req) -> None:
        n = min(self.o.prefill_tokens, len(r.tokens) - r.computed)
        start, end = r.computed, r.computed + n
        for pos, g in enumerate(self.layout.groups):
            tpb = g.tokens_per_block
            first = start // tpb if start % tpb == 0 else start // tpb + 1
            for p in range(first, end // tpb):  # blocks completed in this step
                self.fill_block(r, pos, p, r.blocks[pos][p])
            self.recomputed[pos] += n
        plan = self.sched.plan_store(r.rid, num_computed_tokens=start, num_scheduled_tokens=n)
        self._store(r, plan)
        r.computed = end
        self._slide_window(r)
        if r.computed >= len(r.tokens):
            self._store(r, self.sched.finish_request(r.rid, num_computed_tokens=r.computed))
            r.finished = True

    def store_rest(self, r: _Req) -> None:
        """A finished request whose final store plan was bounded: offer its next chunks."""
        if r.rid in self.sched:
            self._store(r, self.sched.plan_finished(r.rid))

    def _slide_window(self, r: _Req) -> None:
        for pos, g in enumerate(self.layout.groups):
            if g.kind is not GroupKind.SLIDING_WINDOW or g.window_tokens is None:
                continue
            reach = max(0, r.computed - g.window_tokens + 1)  # the next query reads from here on
            gone = [p for p in range(reach // g.tokens_per_block) if r.blocks[pos][p]]
            if gone:
                self.sched.release_blocks(r.rid, pos, gone)
                # the engine would free them once in-flight stores finish; keep them until the request ends

    def _store(self, r: _Req, plan: StorePlan) -> None:
        if not plan:
            return
        accepted: set[bytes] = set()
        refused: set[bytes] = set()
        declined: set[bytes] = set()
        for gp in plan.groups:
            chunks = list(gp.chunks)
            if chunks and self.store.admission_active:  # admission: stored on the Nth sighting
                ok = self.store.admit([self.skey(c.key) for c in chunks], r.seen)
                no = [c.key for c, y in zip(chunks, ok) if not y]
                declined.update(no)
                cb = self.store.groups[gp.group].bytes_per_chunk
                self.declined.update((self.skey(k), cb) for k in no)
                chunks = [c for c, y in zip(chunks, ok) if y]
            if not chunks:
                continue
            job = self.store.store(gp.group, [(self.skey(c.key), c.block_ids) for c in chunks])
            if job is None:  # back-pressure: the adapter offers these chunks again later
                refused.update(c.key for c in chunks)
                continue
            r.store_jobs.add(job)
            accepted.update(c.key for c in chunks)
            if self.store.admission_active:
                self.written.update(self.skey(c.key) for c in chunks)
        outcome = StoreOutcome(accepted=frozenset(accepted), refused=frozenset(refused), declined=frozenset(declined))
        self.sched.complete_store(r.rid, outcome)

    def collect(self, running: dict[str, _Req]) -> None:
        for res in self.store.poll():
            self.results.append(res)
            for r in running.values():
                r.store_jobs.discard(res.job_id)


def run_demo(
    cfg: TieredKVConfig,
    o: DemoOptions | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    engine_cls: type[_Engine] = _Engine,
    device: str | None = None,
) -> dict[str, Any]:
    """Replay the trace against the tiers of ``cfg``; return the summary dict.

    With admission on (a policy rule's ``admit_after`` above 1, or ``o.admit_after``), the same
    trace is replayed first with every chunk admitted, in scratch copies of the tiers (a temporary
    directory), and ``admission.baseline`` says what that wrote and hit: the bytes admission saved
    are measured, not estimated. Skipped (``baseline`` None) when a tier keeps its records outside
    this process and its own directory (a Redis server), which a scratch run would write to."""
    o = o or DemoOptions()
    if o.admit_after is not None:
        cfg = _admitting(cfg, o.admit_after)
    baseline = None
    if any(rule.admit_after > 1 for rule in cfg.policy) and o.admission_baseline and _scratchable(cfg):
        with tempfile.TemporaryDirectory(prefix="tieredkv-demo-baseline-") as d:
            scratch = cfg.model_copy(
                update={"tiers": [t if t.local_dir is None else t.with_local_dir(Path(d) / t.label) for t in cfg.tiers]}
            )
            base = _replay(_admitting(scratch, 1), o, None, engine_cls, device)
        baseline = {"bytes_written": base["store"]["bytes"], "tokens_from_cache": base["tokens_from_cache"]}
    summary = _replay(cfg, o, progress, engine_cls, device)
    adm = summary["admission"]
    adm["baseline"] = baseline
    adm["bytes_saved"] = None if baseline is None else baseline["bytes_written"] - adm["bytes_written"]
    return summary


def _admitting(cfg: TieredKVConfig, n: int) -> TieredKVConfig:
    """``cfg`` with every policy rule's ``admit_after`` set to ``n``."""
    return cfg.model_copy(update={"policy": [r.model_copy(update={"admit_after": n}) for r in cfg.policy]})


def _scratchable(cfg: TieredKVConfig) -> bool:
    """Whether every tier of ``cfg`` keeps its records in this process or in its own directory."""
    return all(t.local_dir is not None or tier_capabilities(t.kind).in_process for t in cfg.tiers)


def _replay(
    cfg: TieredKVConfig,
    o: DemoOptions,
    progress: Callable[[int, int], None] | None,
    engine_cls: type[_Engine],
    device: str | None,
) -> dict[str, Any]:
    layout = demo_layout(o.mamba)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t_start = time.perf_counter()
    store = TieredStore(cfg).start()  # namespace: the config's, completed by the registered groups
    try:
        eng = engine_cls(store, layout, o, device)
        trace = _Trace(o)
        total = o.conversations * o.turns
        waiting: deque[_Req] = deque(trace.turn(c, 0) for c in range(o.conversations))
        running: dict[str, _Req] = {}
        done = 0
        tokens = 0
        while waiting or running:
            for _ in range(len(waiting)):
                if len(running) >= o.concurrency:
                    break
                r = waiting.popleft()
                if eng.admit(r):
                    running[r.rid] = r
                else:
                    waiting.append(r)
            for r in list(running.values()):
                if not r.finished:
                    eng.prefill(r)
                else:
                    eng.store_rest(r)  # its blocks stay allocated until every chunk was offered
            eng.collect(running)
            if not running and waiting:
                time.sleep(0.001)  # everything waits on pending stores
            for rid, r in list(running.items()):
                if r.finished and not r.store_jobs and rid not in eng.sched:
                    del running[rid]
                    for pos, ids in enumerate(r.blocks):
                        eng.gpu.release(pos, ids)
                    tokens += len(r.tokens)
                    done += 1
                    if progress:
                        progress(done, total)
                    if r.turn + 1 < o.turns:
                        waiting.append(trace.turn(r.conv, r.turn + 1))
        store.drain(30)
        eng.collect(running)
        wall = time.perf_counter() - t_start
        summary = _summary(eng, store, layout, done, tokens, wall)
    finally:
        store.close()
    return summary


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def busy_seconds(results: list[JobResult]) -> float:
    """Seconds during which at least one of ``results`` was in flight: the length of the union
    of their intervals from submit to completion (``finished_at - seconds`` to ``finished_at``)."""
    total = 0.0
    start = end = None
    for s, e in sorted((r.finished_at - r.seconds, r.finished_at) for r in results):
        if end is None or s > end:
            if start is not None and end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if start is not None and end is not None:
        total += end - start
    return total


def _jobs(rs: list[JobResult]) -> dict[str, Any]:
    """A job kind's figures: throughput over busy time (not wall time) and latency percentiles."""
    nbytes = sum(r.nbytes for r in rs)
    busy = round(busy_seconds(rs), 4)
    ms = [1e3 * r.seconds for r in rs if r.ok]
    return {
        "jobs": len(rs),
        "failed": sum(not r.ok for r in rs),
        "bytes": nbytes,
        "busy_s": busy,
        "busy_gbps": round(nbytes / busy / 1e9, 3) if busy > 0 else 0.0,
        "p50_ms": round(_pct(ms, 0.5), 3),
        "p99_ms": round(_pct(ms, 0.99), 3),
    }


def _summary(
    eng: _Engine, store: TieredStore, layout: GroupLayout, requests: int, tokens: int, wall: float
) -> dict[str, Any]:
    st = store.stats()
    tiers = {}
    held = store.tier_stats()  # None: unreachable now (report what the pipeline saw)
    for tier in store.tiers:
        ts = held[tier.name]
        lane = st.lanes[tier.name]
        tiers[tier.name] = {
            "kind": tier.kind,
            "records": None if ts is None else ts.records,
            "used_bytes": 0 if ts is None else ts.used_bytes,
            "hits": tier.counters.get("hits", 0),
            "put_bytes": tier.counters.get("put_bytes", 0),
            "dropped_stores": lane.dropped,
            "breaker": lane.breaker,
        }
    groups = []
    for pos, g in enumerate(layout.groups):
        served, recomputed = eng.served[pos], eng.recomputed[pos]
        groups.append(
            {
                "group": g.index,
                "kind": g.kind.value,
                "tokens_per_chunk": g.tokens_per_chunk,
                "tokens_from_cache": served,
                "tokens_recomputed": recomputed,
                "stored_chunks": st.groups[g.index].stores,
                "loaded_chunks": st.groups[g.index].loads,
            }
        )
    store_jobs = _jobs([r for r in eng.results if r.kind == "store"])
    # Admission: the chunks it declined and never stored (bytes_not_written: what writing every
    # distinct chunk once would have cost more; the measured saving, bytes_saved, also counts the
    # duplicate writes of chunks several requests computed at once, and is set by run_demo from a
    # baseline replay); declined_bytes counts every declined offer (a chunk offered again after a
    # miss counts again).
    never = sum(b for k, b in eng.declined.items() if k not in eng.written)
    admission = {
        "admit_after": {g.index: store.policy.get(g.index).admit_after for g in layout.groups},
        "declined_offers": {g.index: st.groups[g.index].admission_declined for g in layout.groups},
        "declined_bytes": sum(st.groups[g.index].admission_declined_bytes for g in layout.groups),
        "chunks_never_written": sum(k not in eng.written for k in eng.declined),
        "bytes_not_written": never,
        "bytes_written": store_jobs["bytes"],
        "saved_share": round(never / (never + store_jobs["bytes"]), 4) if never else 0.0,
    }
    load_jobs = _jobs([r for r in eng.results if r.kind == "load"])
    rate = eng.o.prefill_tokens_per_s
    recompute_s = round(eng.from_cache / rate, 4)
    return {
        "requests": requests,
        "prompt_tokens": tokens,
        "wall_s": round(wall, 4),
        # what a user cares about: prefill skipped, and the time that saved at a stated rate
        "tokens_from_cache": eng.from_cache,
        "tokens_recomputed": tokens - eng.from_cache,
        "prefill_tokens_per_s": rate,
        "recompute_s": recompute_s,
        "saved_s": round(max(0.0, recompute_s - load_jobs["busy_s"]), 4),
        "saved_s_formula": SAVED_S_FORMULA,
        "deferred_for_pending": eng.deferred,
        "groups": groups,
        "tiers": tiers,
        "store": store_jobs,
        "load": load_jobs,
        "admission": admission,
        "drops": {"staging_backpressure": st.counters.get("store_backpressure", 0), **st.dropped},
        "verified_blocks": eng.verified,
        "mismatches": eng.mismatches,
        "breaker_opens": {n: lane.breaker_opens for n, lane in st.lanes.items()},
        **eng.extra_summary(),
    }

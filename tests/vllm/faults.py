"""Store faults for the engine loop: they wrap the real manager's ``prepare_store``.

``run_engine(..., store_fault=StoreFault(mode))``: before each ``prepare_store`` call reaches the
real manager, ``decide`` answers how many leading keys go through (the rest are refused for now:
a *partial accept*) or ``None`` (the whole call is refused, as a full store answers). A refused key
that no later call gets accepted, and that the manager does not hold at the end of the run, is
*lost* (``RunResult.lost_keys``). Nothing else is faked: the manager, the worker and the bytes are
real.

Modes (each refuses a key at most once, so a planner that offers it again gets it stored):

* ``last_pass`` — every call offering the request's last full-attention prompt chunk until the
  request finished, and the first one after (the request's last store pass);
* ``swa_once`` / ``mamba_once`` — every call offering a sliding-window / Mamba key not refused yet;
* ``partial`` — the first offer of a key: only the first half of the call's keys go through;
* ``every_other`` — every other call, once per key;
* ``always`` — every call (a store that is full for good; for benchmarks of the backlog).

"""

from __future__ import annotations

from typing import Any

from tieredkv.keys import key_group

MODES = ("last_pass", "swa_once", "mamba_once", "partial", "every_other", "always")


def _last_prompt_key(req: Any, bpc: int) -> Any:
    """The key of the request's last whole full-attention (group 0) prompt chunk."""
    from vllm.v1.kv_offload.base import make_offload_key

    n = req.num_prompt_tokens // (16 * bpc)  # full-attention block 16, hash block 16
    if n == 0 or len(req.block_hashes) < n * bpc:
        return None
    return make_offload_key(req.block_hashes[n * bpc - 1], 0)


class StoreFault:
    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: one of {MODES}")
        self.mode = mode
        self.refused: set[bytes] = set()
        self._finished_refused: set[str] = set()
        self._calls = 0

    def decide(self, keys: list[Any], ctx: Any, engine: Any) -> int | None:
        self._calls += 1
        fresh = [k for k in keys if k not in self.refused]
        if self.mode == "last_pass":
            req = engine.reqs.get(ctx.req_id)
            last = _last_prompt_key(req, engine.bpc) if req is not None else None
            if last is None or last not in keys:
                return len(keys)
            if not req.is_finished():
                return self._refuse(keys)
            if ctx.req_id not in self._finished_refused:
                self._finished_refused.add(ctx.req_id)
                return self._refuse(keys)
            return len(keys)
        if self.mode in ("swa_once", "mamba_once"):
            name = "swa" if self.mode == "swa_once" else "mamba"
            if name not in engine.groups:
                return len(keys)
            g = engine.groups.index(name)
            if any(key_group(k) == g for k in fresh):
                return self._refuse(fresh)
            return len(keys)
        if self.mode == "partial":
            if len(keys) < 2 or not fresh:
                return len(keys)
            n = (len(keys) + 1) // 2
            self.refused.update(keys[n:])
            return n
        if self.mode == "always":
            return self._refuse(keys)
        if self._calls % 2 == 0 and fresh:  # every_other
            return self._refuse(fresh)
        return len(keys)

    def _refuse(self, fresh: list[Any]) -> None:
        self.refused.update(fresh)

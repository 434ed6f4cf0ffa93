"""Whether vLLM's block hashes are the same in the next process: persistent records need it.

vLLM derives every block hash from a seed (``NONE_HASH``). With its default ``sha256`` the seed is
fixed, so the hashes of a prefix are the same in every process and records on LMDB or Redis hit
again after a restart and on other nodes. With a non-cryptographic ``prefix_caching_hash_algo``
(``xxhash``, ``xxhash_cbor``) and no ``PYTHONHASHSEED``, vLLM draws a random seed per process: every
record a persistent tier holds becomes dead weight at the next start. tieredkv says so once, in
the log, and in its metrics (``block_hashes_reproducible``), which ``tieredkv status`` reads.

vLLM sets the seed after it builds the scheduler (and with it tieredkv's manager), so the check
runs when tieredkv's stats are first taken, each step until vLLM has set it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["block_hashes_reproducible", "check_block_hashes"]

log = logging.getLogger(__name__)

_warned = False


def block_hashes_reproducible() -> tuple[bool, str] | None:
    """``(reproducible, why)`` for vLLM's block hashes in this process; None until vLLM has set
    its hash seed (or without vLLM)."""
    try:
        from tieredkv.integrations.vllm.compat import none_hash_seed
    except ImportError:
        return None
    seed, default = none_hash_seed()
    if seed is None:
        return None
    if os.environ.get("PYTHONHASHSEED") is not None:
        return True, "PYTHONHASHSEED is set"
    if seed == default:
        return True, "vLLM's fixed seed (a cryptographic prefix_caching_hash_algo)"
    return False, (
        "vLLM drew a random block-hash seed for this process (a non-cryptographic prefix_caching_hash_algo"
        " such as xxhash, and no PYTHONHASHSEED)"
    )


def check_block_hashes(stores: Iterable[Any]) -> bool:
    """Record the answer on each store (``store.block_hashes_reproducible``) once vLLM has set its
    seed, warning once per process when records outlive it; True once decided."""
    global _warned
    answer = block_hashes_reproducible()
    if answer is None:
        return False
    ok, why = answer
    for store in stores:
        store.block_hashes_reproducible = ok
        lasting = [t.name for t in store.tiers if not t.capabilities.in_process]
        if not ok and lasting and not _warned:
            _warned = True
            log.warning(
                "tieredkv: %s: block hashes differ in every process, so the records of tiers %s will never"
                " hit after a restart or on another node. Set PYTHONHASHSEED to one value on every node"
                " (or use --prefix-caching-hash-algo sha256)",
                why,
                lasting,
            )
    return True

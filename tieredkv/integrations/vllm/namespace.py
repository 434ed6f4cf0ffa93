"""The tieredkv namespace of a vLLM deployment, derived from vLLM's ``OffloadingConfig``.

No vLLM import: the function reads attributes only, so it is testable without vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from tieredkv.config import TieredKVConfig
from tieredkv.errors import ConfigError
from tieredkv.groups import GroupKind, GroupSpec
from tieredkv.keys import GroupGeometry, Namespace, ParallelLayout
from tieredkv.weights import namespace_weights

__all__ = [
    "group_kind",
    "group_kinds",
    "group_specs",
    "namespace_from_offloading_config",
    "new_generation",
    "weights_location",
]

log = logging.getLogger(__name__)


def _is_attention_layer(name: str) -> bool:
    return name.endswith((".attn", "attention")) or ".self_attn" in name or ".cross_attn" in name


def group_kind(group: Any, override: str | None = None) -> str:
    """tieredkv's kind of an ``OffloadingGroupConfig``: ``full``, ``sliding_window`` or ``mamba``.

    vLLM 0.33's ``OffloadingGroupConfig`` does not carry the KV spec: an unbounded group is full
    attention; a bounded one is a sliding window, except a one-chunk "window" over layers that are
    not attention layers, which is a Mamba/SSM state group (vLLM gives Mamba a window of one chunk).
    ``override`` (from the ``group_kinds`` option) wins when the layer names do not tell.
    """
    if override:
        if override not in ("full", "sliding_window", "mamba"):
            raise ConfigError(
                f"group_kinds: got {override!r} for group {getattr(group, 'group_id', '?')}; allowed: 'full',"
                " 'sliding_window', 'mamba'"
            )
        return override
    window = getattr(group, "sliding_window_size_in_chunks", None)
    if window is None:
        return "full"
    names = tuple(getattr(group, "layer_names", ()) or ())
    if window == 1 and names and not any(_is_attention_layer(n) for n in names):
        return "mamba"
    return "sliding_window"


def group_kinds(config: Any, overrides: Any = None) -> list[str]:
    """The kind of every group of a vLLM ``OffloadingConfig`` (``overrides``: optional list of kinds)."""
    groups = list(config.groups)
    if overrides is not None and len(list(overrides)) != len(groups):
        raise ConfigError(
            f"group_kinds: got {list(overrides)!r} for {len(groups)} KV groups; give one of 'full',"
            " 'sliding_window', 'mamba' per group, in vLLM's group order"
        )
    return [group_kind(g, overrides[i] if overrides is not None else None) for i, g in enumerate(groups)]


def namespace_from_offloading_config(
    config: Any,
    tkv: TieredKVConfig | None = None,
    *,
    bytes_per_block: int | None = None,
    rank: int | None = None,
    kinds: list[str] | None = None,
) -> Namespace:
    """Namespace for the bytes vLLM offloads under ``config`` (a vLLM ``OffloadingConfig``).

    Model name and KV dtype come from ``config.model``; every group's tokens per block, window
    and the global blocks per chunk from ``config.groups`` / ``config.cache``; the parallel layout
    (TP / PP / PCP / DCP sizes and, for per-rank bytes, the rank) from ``config.parallel``.
    Revision and tenant salt come from the tieredkv config. ``bytes_per_block`` defaults to
    ``config.worker_kv_bytes_per_block``; ``rank`` to ``config.parallel.rank`` (pass 0 for bytes
    that hold every rank's pages, such as vLLM's primary rows).
    """
    per_block = int(config.worker_kv_bytes_per_block if bytes_per_block is None else bytes_per_block)
    groups = tuple(
        _geometry(spec) for spec in group_specs(config, kinds if kinds is not None else group_kinds(config), per_block)
    )
    par = config.parallel
    agnostic = bool(getattr(par, "is_parallelism_agnostic", False))
    parallel = ParallelLayout(
        tp_size=1 if agnostic else int(par.tp_size),
        pp_size=1 if agnostic else int(par.pp_size),
        pcp_size=1 if agnostic else int(par.pcp_size),
        dcp_size=1 if agnostic else int(par.dcp_size),
        rank=int(par.rank if rank is None else rank),
    )
    ns = tkv.namespace if tkv is not None else None
    name = str(config.model.name)
    mode = ns.weights_fingerprint if ns is not None else "sampled"
    explicit = ns.weights_path if ns is not None else None
    found = None if explicit or mode == "off" else weights_location(name)
    return Namespace(
        model=name,
        revision=ns.revision if ns is not None else "",
        dtype=str(config.model.dtype),
        groups=groups,
        parallel=parallel,
        tenant_salt=ns.tenant_salt if ns is not None else "",
        weights=namespace_weights(explicit, mode, found=found, looked_for=name, what="tieredkv (vLLM)"),
    )


def weights_location(model: str) -> str | None:
    """Where vLLM's model ``model`` (``model_config.model``: a local path or a hub id) keeps its
    weights on this node: the path itself, or the hub id's snapshot in the local Hugging Face cache
    (vLLM's ``download_dir`` and ``revision`` when vLLM's current config names this model, else
    the default cache and ``main``). None when not found; nothing is downloaded."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path)
    revision, cache_dir = None, None
    try:
        from vllm.config import get_current_vllm_config_or_none

        vc = get_current_vllm_config_or_none()
    except Exception:  # noqa: BLE001 - no vLLM, or another version: the defaults
        vc = None
    if vc is not None and getattr(vc.model_config, "model", None) == model:
        revision = getattr(vc.model_config, "revision", None)
        cache_dir = getattr(vc.load_config, "download_dir", None)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return str(
            snapshot_download(
                model,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=True,
                allow_patterns=["*.safetensors", "config.json"],
            )
        )
    except Exception as e:  # noqa: BLE001 - not cached here (or not a hub id): not found
        log.debug("tieredkv: no local snapshot of %s (%s; HF_HOME=%s)", model, e, os.environ.get("HF_HOME"))
        return None


def group_specs(config: Any, kinds: list[str], bytes_per_block: int) -> list[GroupSpec]:
    """One :class:`~tieredkv.groups.GroupSpec` per group of a vLLM ``OffloadingConfig`` (the group
    model tieredkv keys, routes and plans by). A sliding-window group whose window vLLM does not
    give (a ``group_kinds`` override) gets a placeholder window of one chunk."""
    bpc = int(config.cache.blocks_per_chunk)
    out = []
    for i, (g, kind) in enumerate(zip(config.groups, kinds)):
        tpb = int(g.tokens_per_block)
        window_chunks = getattr(g, "sliding_window_size_in_chunks", None)
        window = None
        if kind == "sliding_window":
            window = int(window_chunks) * tpb * bpc if window_chunks else _NO_WINDOW
        out.append(GroupSpec(i, GroupKind(kind), tpb, bpc, bytes_per_block, window))
    return out


#: Marks a sliding-window spec whose window size vLLM did not give (recorded as 0 in the namespace).
_NO_WINDOW = 1


def _geometry(spec: GroupSpec) -> GroupGeometry:
    geo = GroupGeometry.from_spec(spec)
    if spec.kind is GroupKind.SLIDING_WINDOW and spec.window_tokens == _NO_WINDOW:
        geo = dataclasses.replace(geo, window_tokens=0)
    return geo


def new_generation(ns: Namespace) -> Namespace:
    """``ns`` with a fresh random cache generation: a fingerprint no earlier record carries.

    Random rather than a counter: two engines that each reset once would otherwise share
    "generation 1" on a shared tier even if their weights differ.
    """
    return dataclasses.replace(ns, generation=secrets.token_hex(8))

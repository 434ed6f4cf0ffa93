"""Typed configuration (pydantic v2).

Primitives:

* :class:`TierConfigBase` — base of every tier's model. A ``tiers`` item is validated with
  the model the tier registry gives for its ``kind`` (built in, or a third-party tier
  installed under the ``tieredkv.backends`` entry point): no kind is special here.
* :class:`CPUTierConfig`, :class:`LMDBTierConfig`, :class:`FSTierConfig`, :class:`RedisTierConfig` — the built-in
  tiers' models, ``extra="forbid"``, every field documented; :class:`EncryptionConfig` — the
  ``encryption`` of an LMDB or Redis tier (sealed records, :mod:`tieredkv.sealing`).
* :class:`NamespaceConfig` — what the namespace fingerprint is built from.
* :class:`TieredKVConfig` — the whole file.
* :func:`load_config` — from a YAML/JSON path, a dict or nothing (defaults), with
  ``TIEREDKV_*`` environment overrides applied on top.

A bad value raises :class:`~tieredkv.errors.ConfigError` whose message names each bad
field by its path (``tiers.1.map_size_bytes``), the value given and what is allowed.

How a config file is read (bounded, safe YAML) and how ``TIEREDKV_*`` overrides are written:
:mod:`tieredkv.configfile`.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tieredkv.backends import registry
from tieredkv.backends.cpu.config import CPUTierConfig
from tieredkv.backends.fs.config import FSTierConfig
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.redis.config import RedisTierConfig
from tieredkv.configfile import (
    ENV_PREFIX,
    MAX_CONFIG_BYTES,
    MAX_YAML_VALUES,
    apply_env_overrides,
    default_tiers,
    env_override_paths,
    env_sets,
    has_path,
    leaf_paths,
    read_source,
    safe_yaml,
)
from tieredkv.errors import BackendNotFoundError, ConfigError
from tieredkv.tierconfig import ConfigModel as _Model
from tieredkv.tierconfig import EncryptionConfig, EvictionPolicyName, Size, TierConfigBase

__all__ = [
    "AdmissionConfig",
    "CPUTierConfig",
    "EncryptionConfig",
    "EvictionPolicyName",
    "FSTierConfig",
    "HintsConfig",
    "LMDBTierConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "PipelineConfig",
    "PolicyRule",
    "RedisTierConfig",
    "Size",
    "TenantsConfig",
    "TierConfig",
    "TierConfigBase",
    "TieredKVConfig",
    "format_validation_error",
    "load_config",
]
# What moved to tieredkv.configfile, still importable from here.
__all__ += ["ENV_PREFIX", "MAX_CONFIG_BYTES", "MAX_YAML_VALUES", "apply_env_overrides", "safe_yaml"]

#: The old private name of :class:`TierConfigBase`.
_TierBase = TierConfigBase


def _tier_model(data: Mapping[str, Any]) -> type[TierConfigBase]:
    """The registered config model for ``data['kind']``, or a one-line validation error."""
    kind = data.get("kind")
    if kind is None or kind == "":
        raise PydanticCustomError("tier_kind_missing", "a tier needs a 'kind'")
    if not isinstance(kind, str) or kind not in registry.known_kinds():
        raise PydanticCustomError("tier_kind_unknown", "{detail}", {"detail": f"unknown tier kind {kind!r}"})
    try:
        return registry.config_model(kind)
    except BackendNotFoundError as e:  # registered, but its package is broken or incomplete
        raise PydanticCustomError("tier_kind_unavailable", "{detail}", {"detail": str(e)}) from None


def _by_kind(data: Any, handler: Any) -> Any:
    """A ``tiers`` item: validated with the model its ``kind`` registers (a model instance as is)."""
    if isinstance(data, TierConfigBase) or not isinstance(data, Mapping):
        return handler(data)
    return _tier_model(data).model_validate(data)


#: Type of a ``tiers`` item: a :class:`TierConfigBase` subclass chosen by ``kind`` through the
#: tier registry, so a tier installed through the ``tieredkv.backends`` entry point is written in
#: YAML exactly like a built-in one.
TierConfig = Annotated[SerializeAsAny[TierConfigBase], WrapValidator(_by_kind)]


class NamespaceConfig(_Model):
    """Identity of the bytes stored (see :class:`tieredkv.keys.Namespace`)."""

    model: str = Field("tieredkv/demo-hybrid", min_length=1, description="Model name.")
    revision: str = Field("", description="Model revision (commit or tag).")
    dtype: str = Field("bfloat16", description="KV cache dtype.")
    tenant_salt: str = Field("", description="Optional salt that isolates tenants sharing a tier.")
    weights_path: str | None = Field(
        None,
        description="The model's weights (a directory of *.safetensors, or one file): their content"
        " fingerprint joins the namespace, so a changed checkpoint under the same name is never served"
        " the old weights' KV. vLLM modes find the weights themselves; this overrides what they find.",
    )
    weights_fingerprint: Literal["sampled", "full", "off"] = Field(
        "sampled",
        description="'sampled': safetensors headers and a deterministic sample of every tensor's bytes"
        " (milliseconds); 'full': every byte (about 0.2-0.5 s per GB); 'off': name and revision only.",
    )


class PolicyRule(_Model):
    """Which tiers a KV group's chunks go to, chosen by the group's chunk size (and kind)."""

    max_chunk_bytes: Size | None = Field(
        None, description="The rule matches groups whose chunk is at most this many bytes (None: any size)."
    )
    kinds: list[Literal["full", "sliding_window", "mamba"]] | None = Field(
        None, description="Group kinds the rule matches (None: every kind)."
    )
    tiers: list[str] = Field(
        default_factory=list, description="Tier names, fastest first; empty means every configured tier."
    )
    write: Literal["through", "back"] = Field(
        "through",
        description="'through': a store writes every listed tier; 'back': only the first, and the next"
        " tier receives a chunk when the first evicts it.",
    )
    promote: bool = Field(True, description="Copy a chunk loaded from a lower tier into the first tier.")
    admit_after: int = Field(
        1,
        ge=1,
        le=64,
        description="Admission: store a chunk of the group on its Nth sighting (a request offering it for"
        " storing, counted once per request); 1 (the default) stores on the first, i.e. always. Sightings"
        " are counted in a bounded LRU (admission.tracked_keys).",
    )


class AdmissionConfig(_Model):
    """How sightings of chunks are counted for the policy rules' ``admit_after``."""

    tracked_keys: int = Field(
        65536,
        ge=16,
        le=1 << 24,
        description="Chunks whose sightings are remembered (an LRU of key -> count, about 200 bytes each);"
        " a chunk pushed out starts again at 0, so under pressure admission errs on not storing.",
    )


class HintsConfig(_Model):
    """What tieredkv does with a request's KV hints (vLLM's ``kv_hints``; see docs/vllm.md)."""

    enabled: bool = Field(
        True, description="Execute tieredkv's hint actions (false: every action is ignored, counted)."
    )
    max_retained_chunks: int = Field(
        16384, ge=0, description="Chunks pinned by retention hints at once, in all (0: no retention)."
    )
    max_retained_bytes: Size = Field(
        ByteSize(256 << 20),
        ge=0,
        description="Bytes pinned by retention hints at once, in all; also at most a quarter of the smallest"
        " tier capacity the config states, so a flood of hints cannot pin a whole tier.",
    )
    max_retain_s: float = Field(
        3600.0,
        gt=0,
        description="Longest retention a hint may ask for (longer ones are cut to this); a pin (no 'seconds')"
        " is held until a higher-priority retention needs its room, a cache reset or the engine stops.",
    )


class PipelineConfig(_Model):
    """The asyncio store/load pipeline."""

    staging_bytes: Size = Field(
        ByteSize(256 << 20), gt=0, description="Host staging pool (pinned with CUDA); full means back-pressure."
    )
    max_batch_bytes: Size = Field(
        ByteSize(16 << 20), gt=0, description="A tier writer batches queued chunks up to this many bytes per call."
    )
    max_batch_items: int = Field(64, gt=0, description="A tier writer batches at most this many chunks per call.")
    job_timeout_s: float = Field(30.0, gt=0, description="A store or load job not finished by then fails.")
    breaker_failures: int = Field(3, gt=0, description="Consecutive failures of a tier that open its circuit breaker.")
    breaker_reset_s: float = Field(
        1.0, gt=0, description="Seconds an open breaker waits before letting one probe through (half-open)."
    )
    uvloop: bool = Field(True, description="Run the pipeline loop on uvloop when it is installed.")
    copy_threads: int = Field(
        2,
        ge=1,
        le=8,
        description="Threads a job's host-memory block copies (KV tensors in CPU memory) are split over, each"
        " taking 1 MiB or more; 1 keeps them on the pipeline thread. CUDA copies are the GPU's.",
    )


class MetricsConfig(_Model):
    """Prometheus metrics."""

    port: int | None = Field(
        None, ge=0, le=65535, description="Serve /metrics over HTTP on this port (None: no endpoint; 0: any free port)."
    )
    addr: str = Field("127.0.0.1", description="Address the metrics endpoint binds to ('0.0.0.0' in a container).")


def _quota(v: Any) -> Any:
    """A tenant quota: a byte size (an int, '512MiB') or a share of each tier's capacity ('25%')."""
    if isinstance(v, str) and v.strip().endswith("%"):
        try:
            pct = float(v.strip()[:-1])
        except ValueError:
            raise ValueError(f"{v!r} is not a percentage; write e.g. '25%'") from None
        if not 0 < pct <= 100:
            raise ValueError(f"{v!r} is out of range; a share of a tier's capacity is 0% < q <= 100%")
        return v.strip()
    return _SIZE.validate_python(v)


_SIZE: TypeAdapter[ByteSize] = TypeAdapter(Size)
#: A tenant quota: bytes (in every tier), or a share of each tier's capacity ('25%').
Quota = Annotated[str | ByteSize, Field(union_mode="left_to_right"), BeforeValidator(_quota)]


class TenantsConfig(_Model):
    """Per-tenant quotas (a tenant is vLLM's ``cache_salt`` of a request, or a library call's
    ``tenant=``). A tenant over its quota in a tier has its own oldest records evicted there
    first; no other tenant loses a record to it. Records without a tenant are the default tenant,
    which no quota bounds."""

    default_quota: Quota | None = Field(
        None,
        description="Quota of every tenant not named in 'quotas': bytes ('8GiB', the same in every tier) or a"
        " share of each tier's capacity ('25%'); None: no quota.",
    )
    quotas: dict[str, Quota] = Field(
        default_factory=dict, description="Per-tenant quotas by tenant name (vLLM's cache_salt), as default_quota."
    )
    report_top: int = Field(
        20, ge=0, description="Tenants reported by usage in metrics besides those named in 'quotas' (the largest)."
    )


class TieredKVConfig(_Model):
    """The whole tieredkv configuration file."""

    version: Literal[1] = Field(1, description="Config file format version.")
    namespace: NamespaceConfig = Field(default_factory=NamespaceConfig, description="Namespace identity.")
    tiers: list[TierConfig] = Field(
        default_factory=default_tiers,
        min_length=1,
        description="Tiers, fastest first; each item's 'kind' selects its model in the tier registry.",
    )
    policy: list[PolicyRule] = Field(
        default_factory=lambda: [PolicyRule()],
        min_length=1,
        description="Routing rules; a group takes the first rule that matches it.",
    )
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Store/load pipeline settings.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics settings.")
    tenants: TenantsConfig = Field(default_factory=TenantsConfig, description="Per-tenant quotas.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Sighting counts for the policy rules' admit_after."
    )
    hints: HintsConfig = Field(default_factory=HintsConfig, description="Request KV hints (vLLM's kv_hints).")

    @model_validator(mode="after")
    def _names(self) -> TieredKVConfig:
        seen: set[str] = set()
        for i, t in enumerate(self.tiers):
            n = t.label
            if n in seen:
                raise ValueError(f"tiers.{i}: duplicate tier name {n!r}; give each tier a distinct 'name'")
            seen.add(n)
        for i, rule in enumerate(self.policy):
            for j, name in enumerate(rule.tiers):
                if name not in seen:
                    raise ValueError(f"policy.{i}.tiers.{j}: no tier named {name!r}; configured: {sorted(seen)}")
            if rule.write == "back" and len(rule.tiers or seen) < 2:
                raise ValueError(f"policy.{i}.write: 'back' needs at least two tiers to write back to")
        return self

    def tier(self, name: str) -> TierConfigBase:
        """The tier config called ``name`` (its ``name`` or, when unnamed, its ``kind``)."""
        for t in self.tiers:
            if t.label == name:
                return t
        raise ConfigError(f"no tier named {name!r}; configured: {[t.label for t in self.tiers]}")


# ---------------------------------------------------------------------------------------
# loading


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> TieredKVConfig:
    """Load and validate a config from a path, a mapping or defaults, then apply env overrides.

    Raises:
        ConfigError: unreadable file, bad YAML, or any invalid field.
    """
    raw = read_source(source)
    raw = apply_env_overrides(raw, os.environ if env is None else env)
    try:
        return TieredKVConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, source)) from e


# ---------------------------------------------------------------------------------------
# error messages


def format_validation_error(err: ValidationError, raw: Any = None, source: Any = None) -> str:
    """Turn a pydantic error into lines of ``field.path: got VALUE — problem (allowed/fix)``."""
    where = f"config file {str(source)!r}" if isinstance(source, (str, os.PathLike)) else "config"
    lines = [f"invalid {where}: {err.error_count()} problem(s)"]
    for e in err.errors(include_url=False):
        loc = _loc_path(e["loc"])
        value = e.get("input")
        problem = e["msg"]
        hint = _hint(e, raw)
        if e["loc"] and str(e["loc"][-1]) in SECRET_FIELDS:
            value = "***"
        else:
            value = mask_secrets(value)
        if e["type"] == "missing":
            got = "missing — "
        elif isinstance(value, dict):  # a rule across fields: the message names them
            got = ""
        elif value == "***":
            got = "got *** — "
        else:
            got = f"got {_short(value)} — "
        where_ = f"{loc}: " if e["loc"] else ""
        lines.append(f"  {where_}{got}{problem.removeprefix('Value error, ')}{'; ' + hint if hint else ''}")
    return "\n".join(lines)


def _loc_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _hint(e: Any, raw: Any) -> str:
    if not e["loc"]:
        return ""
    if e["type"] == "extra_forbidden":
        model = _model_at(e["loc"][:-1], raw)
        if model is not None:
            allowed = sorted(model.model_fields)
            close = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            return f"{guess}allowed fields: {', '.join(allowed)}"
    if e["type"] in ("tier_kind_missing", "tier_kind_unknown"):
        from tieredkv.backends.registry import ENTRY_POINT_GROUP, known_kinds

        kinds = ", ".join(repr(k) for k in known_kinds())
        return f"allowed kinds: {kinds} (a third-party kind installs under the entry point {ENTRY_POINT_GROUP!r})"
    model = _model_at(e["loc"][:-1], raw)
    if model is not None:
        field = model.model_fields.get(str(e["loc"][-1]))
        if field is not None and field.description:
            return f"expected: {field.description}"
    return ""


_SECTIONS: dict[str, type[BaseModel]] = {
    "namespace": NamespaceConfig,
    "pipeline": PipelineConfig,
    "metrics": MetricsConfig,
}


def _model_at(loc: tuple[Any, ...], raw: Any) -> type[BaseModel] | None:
    """The pydantic model that owns the fields at location ``loc`` (best effort; a tier's model
    comes from the registry by the raw item's ``kind``)."""
    if not loc:
        return TieredKVConfig
    head = loc[0]
    if len(loc) == 1:
        return _SECTIONS.get(str(head))
    if len(loc) == 2 and head == "policy":
        return PolicyRule
    if len(loc) > 2 and head == "tiers":  # a section of a tier's model (its encryption)
        model = _model_at(loc[:2], raw)
        for part in loc[2:]:
            field = model.model_fields.get(str(part)) if model is not None else None
            model = _section_model(field.annotation) if field is not None else None
        return model
    if len(loc) == 2 and head == "tiers":
        items = raw.get("tiers") if isinstance(raw, dict) else None
        idx = loc[1]
        item = items[idx] if isinstance(items, list) and isinstance(idx, int) and idx < len(items) else None
        kind = item.get("kind") if isinstance(item, dict) else None
        if isinstance(kind, str):
            from tieredkv.backends.registry import config_model
            from tieredkv.errors import BackendNotFoundError

            try:
                return config_model(kind)
            except BackendNotFoundError:
                return None
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``EncryptionConfig | None``: EncryptionConfig), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_section_model, typing.get_args(annotation)) if m is not None), None)


# ---------------------------------------------------------------------------------------
# provenance (for `tieredkv config show`)

#: Fields whose values are masked wherever a config is shown.
SECRET_FIELDS = frozenset({"password"})
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>.*)", re.DOTALL)
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&;]password=)[^&#]*", re.IGNORECASE)


def _mask_url(m: re.Match[str]) -> str:
    """``scheme://user:PASSWORD@host...`` with the password masked, whatever it contains.

    The user info ends at the *last* ``@`` (a password may hold ``@``, ``/``, ``?`` or ``#``;
    an ``@`` in a query string is masked with it, which errs on the side of hiding); the user
    name ends at the first ``:``. A ``password=`` query parameter (``unix://`` URLs) is masked too.
    """
    userinfo, at, rest = m["rest"].rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.partition(':')[0]}:***@{rest}"
    else:
        rest = m["rest"]
    return m["scheme"] + _QUERY_PASSWORD.sub(lambda q: f"{q['key']}***", rest)


def mask_secrets(data: Any) -> Any:
    """Replace secret fields and passwords inside URLs with ``***``."""
    if isinstance(data, dict):
        return {k: ("***" if k in SECRET_FIELDS and v else mask_secrets(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [mask_secrets(v) for v in data]
    if isinstance(data, str):
        return _URL.sub(_mask_url, data)
    return data


def config_provenance(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> tuple[TieredKVConfig, dict[str, str]]:
    """Load a config like :func:`load_config` and say where each leaf value came from.

    Returns the config and ``{dotted.path: origin}`` for every leaf of
    ``config.model_dump(mode="json")`` (list items by index: ``tiers.1.path``), where origin is
    ``"default"``, ``"file"`` (or ``"mapping"`` for a dict source) or ``"env:TIEREDKV_..."``
    (the variable that set it, or an enclosing mapping).

    Raises:
        ConfigError: as :func:`load_config`.
    """
    environ = os.environ if env is None else env
    cfg = load_config(source, env=environ)
    raw_file = read_source(source)
    env_paths = env_override_paths(raw_file, environ)
    file_origin = "mapping" if isinstance(source, Mapping) else "file"
    out: dict[str, str] = {}
    for path in leaf_paths(cfg.model_dump(mode="json")):
        origin = "default"
        for var, parts in env_paths:  # later variables win, as in apply_env_overrides
            if path[: len(parts)] == parts and env_sets(environ[var], path[len(parts) :]):
                origin = f"env:{var}"
        if origin == "default" and has_path(raw_file, path):
            origin = file_origin
        out[".".join(str(p) for p in path)] = origin
    return cfg, out


__all__ += ["SECRET_FIELDS", "config_provenance", "mask_secrets"]

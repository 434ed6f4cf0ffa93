"""Typed configuration (pydantic v2).

Primitives:

* :class:`TierConfigBase` — base of every tier's model. A ``tiers`` item is validated with
  the model the tier registry gives for its ``kind`` (built in, or a third-party tier
  installed under the ``tieredkv.backends`` entry point): no kind is special here.
* :class:`CPUTierConfig`, :class:`LMDBTierConfig`, :class:`RedisTierConfig` — the built-in
  tiers' models, ``extra="forbid"``, every field documented; :class:`EncryptionConfig` — the
  ``encryption`` of an LMDB or Redis tier (sealed records, :mod:`tieredkv.sealing`).
* :class:`NamespaceConfig` — what the namespace fingerprint is built from.
* :class:`TieredKVConfig` — the whole file.
* :func:`load_config` — from a YAML/JSON path, a dict or nothing (defaults), with
  ``TIEREDKV_*`` environment overrides applied on top.

A bad value raises :class:`~tieredkv.errors.ConfigError` whose message names each bad
field by its path (``tiers.1.map_size_bytes``), the value given and what is allowed.

Environment overrides: ``TIEREDKV_<PATH>`` where path parts are joined by ``__``; a list
item is addressed by index or, for ``tiers``, by the tier's name. Values are parsed as YAML
scalars. Examples::

    TIEREDKV_NAMESPACE__MODEL=meta-llama/Llama-3.1-8B
    TIEREDKV_TIERS__lmdb__PATH=/nvme/tieredkv
    TIEREDKV_TIERS__0__CAPACITY_BYTES=8GiB

``TIEREDKV_CONFIG`` names the config file (read by the CLI) and is not an override.

Reading is bounded: the file must be a regular file (a FIFO, a device or a directory is
refused without reading it) of at most 1 MiB of UTF-8, and a YAML document (file or override)
may hold at most 100,000 values once its aliases (``*name``) are expanded.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
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
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.redis.config import RedisTierConfig
from tieredkv.errors import BackendNotFoundError, ConfigError
from tieredkv.tierconfig import ConfigModel as _Model
from tieredkv.tierconfig import EncryptionConfig, EvictionPolicyName, Size, TierConfigBase

__all__ = [
    "CPUTierConfig",
    "EncryptionConfig",
    "EvictionPolicyName",
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

ENV_PREFIX = "TIEREDKV_"
_NOT_OVERRIDES = {"TIEREDKV_CONFIG", "TIEREDKV_VENV"}


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


class MetricsConfig(_Model):
    """Prometheus metrics."""

    port: int | None = Field(
        None, ge=0, le=65535, description="Serve /metrics over HTTP on this port (None: no endpoint; 0: any free port)."
    )
    addr: str = Field("127.0.0.1", description="Address the metrics endpoint binds to ('0.0.0.0' in a container).")


def _default_tiers() -> list[Any]:
    return [CPUTierConfig(), LMDBTierConfig()]


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
        default_factory=_default_tiers,
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
    raw = _read_source(source)
    raw = apply_env_overrides(raw, os.environ if env is None else env)
    try:
        return TieredKVConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw, source)) from e


def _read_source(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _plain(source)
    path = Path(source)
    where = f"config file {str(path)!r}"
    text = _read_config_file(path, where)
    try:
        data = safe_yaml(text, where)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r}: top level must be a mapping of fields, got {type(data).__name__}"
        )
    return data


#: The largest config file read, in bytes (a config is a few KiB).
MAX_CONFIG_BYTES = 1 << 20
#: The most values a YAML document may hold once every alias (``*name``) is expanded.
MAX_YAML_VALUES = 100_000


def _read_config_file(path: Path, where: str) -> str:
    """The text of a regular file of at most :data:`MAX_CONFIG_BYTES` (UTF-8).

    Opened non-blocking and checked with ``fstat`` on the open descriptor, so a FIFO, a device
    (``/dev/zero``) or a directory is refused without blocking or reading it.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}); check the path") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{where}: is {_file_kind(st.st_mode)}, not a regular file; give the path of a YAML config file"
            )
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(_too_big(where, st.st_size))
        chunks: list[bytes] = []
        got = 0
        while got <= MAX_CONFIG_BYTES:  # the file may grow after fstat
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > MAX_CONFIG_BYTES:
            raise ConfigError(_too_big(where, got))
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}); check the path") from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); save the config as UTF-8 YAML"
        ) from None


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def _too_big(where: str, size: int) -> str:
    got = f"{size:,} bytes"
    if size == MAX_CONFIG_BYTES + 1:  # read until the limit: the true size is unknown
        got = f"more than {MAX_CONFIG_BYTES:,} bytes"
    return (
        f"{where}: got {got} — a config file may hold at most {MAX_CONFIG_BYTES:,} bytes (1 MiB);"
        " a tieredkv config is a few KiB, check that this is the right file"
    )


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing documents that expand too far through aliases.

    An alias (``*name``) stands for a copy of its anchor's value, so a few hundred bytes of
    nested aliases ("billion laughs") expand to billions of values when walked. The composed
    node graph is measured first (linear in its size) and refused above :data:`MAX_YAML_VALUES`
    values; a recursive alias (a value containing itself) is refused too.

    Raises:
        ConfigError: too many values, recursion, or nesting too deep, naming ``where``.
        yaml.YAMLError: not valid YAML (the caller words it).
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(
            f"{where}: the YAML is nested too deeply to read; a tieredkv config is a few levels deep"
        ) from None
    finally:
        loader.dispose()


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: yaml.Node, where: str) -> None:
    """Raise if ``root`` expands past :data:`MAX_YAML_VALUES` values or contains itself."""
    size: dict[int, int] = {}
    on_path: set[int] = set()  # the nodes whose subtree is being measured (the current path)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            total = 1 + sum(size[id(c)] for c in _yaml_children(node))
            if total > MAX_YAML_VALUES:
                raise ConfigError(
                    f"{where}: the YAML expands to more than {MAX_YAML_VALUES:,} values (each alias *name"
                    " counts as a copy of its anchor's value) — a tieredkv config has a few hundred;"
                    " use fewer nested anchors/aliases"
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(
                f"{where}: the value at line {node.start_mark.line + 1} holds an alias to itself (a recursive"
                " structure); a config cannot be recursive — write the values out instead of the alias"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in size)


def _plain(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every ``TIEREDKV_*`` variable applied."""
    out = _plain(raw)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in _NOT_OVERRIDES:
            continue
        parts = [p for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = safe_yaml(env[name], name)
        except yaml.YAMLError:
            value = env[name]
        _set_path(out, parts, value, name)
    return out


def _set_path(root: dict[str, Any], parts: list[str], value: Any, var: str) -> None:
    node: Any = root
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, dict):
            key = part.lower()
            if key == "tiers" and "tiers" not in node and not last:
                node["tiers"] = [_plain(t) for t in _default_tiers()]
            if last:
                node[key] = value
                return
            node = node.setdefault(key, {})
        elif isinstance(node, list):
            idx = _list_index(node, part, var)
            if last:
                node[idx] = value
                return
            node = node[idx]
        else:
            raise ConfigError(f"{var}: cannot set {'.'.join(parts)}: {'.'.join(parts[:i])} is not a mapping")


def _list_index(items: list[Any], part: str, var: str) -> int:
    if part.isdigit():
        idx = int(part)
        if idx >= len(items):
            raise ConfigError(f"{var}: index {idx} out of range; there are {len(items)} items")
        return idx
    for i, item in enumerate(items):
        if isinstance(item, dict) and part.lower() in (
            str(item.get("name") or "").lower(),
            str(item.get("kind") or "").lower() if not item.get("name") else "",
        ):
            return i
    names = [str(t.get("name") or t.get("kind")) for t in items if isinstance(t, dict)]
    raise ConfigError(f"{var}: no tier named {part.lower()!r}; use an index or one of {names}")


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
    raw_file = _read_source(source)
    env_paths = _env_override_paths(raw_file, environ)
    file_origin = "mapping" if isinstance(source, Mapping) else "file"
    out: dict[str, str] = {}
    for path in _leaf_paths(cfg.model_dump(mode="json")):
        origin = "default"
        for var, parts in env_paths:  # later variables win, as in apply_env_overrides
            if path[: len(parts)] == parts and _env_sets(environ[var], path[len(parts) :]):
                origin = f"env:{var}"
        if origin == "default" and _has_path(raw_file, path):
            origin = file_origin
        out[".".join(str(p) for p in path)] = origin
    return cfg, out


def _env_override_paths(raw: dict[str, Any], env: Mapping[str, str]) -> list[tuple[str, tuple[Any, ...]]]:
    """``(variable, resolved path)`` of each override, applied in order to a copy of ``raw``."""
    work = _plain(raw)
    out: list[tuple[str, tuple[Any, ...]]] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in _NOT_OVERRIDES:
            continue
        parts = [p for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        resolved: list[Any] = []
        node: Any = work
        for part in parts:
            if isinstance(node, list):
                idx = _list_index(node, part, name)
                resolved.append(idx)
                node = node[idx]
            elif isinstance(node, dict):
                key = part.lower()
                if key == "tiers" and "tiers" not in node:
                    node["tiers"] = [_plain(t) for t in _default_tiers()]
                resolved.append(key)
                node = node.get(key, {})
            else:
                break
        out.append((name, tuple(resolved)))
        work = apply_env_overrides(work, {name: env[name]})
    return out


def _env_sets(text: str, rest: tuple[Any, ...]) -> bool:
    """Whether an override's value (YAML) sets the sub-path ``rest`` of where it points."""
    if not rest:
        return True
    try:
        value = safe_yaml(text, "")
    except (yaml.YAMLError, ConfigError):
        return False
    return _has_path(value, rest)


def _leaf_paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(data, dict) and data:
        return [p for k, v in data.items() for p in _leaf_paths(v, (*prefix, k))]
    if isinstance(data, list) and data:
        return [p for i, v in enumerate(data) for p in _leaf_paths(v, (*prefix, i))]
    return [prefix]


def _has_path(raw: Any, path: tuple[Any, ...]) -> bool:
    node = raw
    for part in path:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if not (in_dict or in_list):
            return False
        node = node[part]
    return True


__all__ += ["SECRET_FIELDS", "config_provenance", "mask_secrets"]

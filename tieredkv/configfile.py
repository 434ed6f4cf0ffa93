"""Where a config's values come from: its file, read bounded as safe YAML, and the ``TIEREDKV_*``
environment overrides applied on top (:mod:`tieredkv.config` validates the result).

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

Provenance (``tieredkv config show``): :func:`env_override_paths` resolves where each override
lands; :func:`leaf_paths` and :func:`has_path` walk the plain data.

Nothing here imports :mod:`tieredkv.config` (which imports this module) or the tier registry.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tieredkv.backends.cpu.config import CPUTierConfig
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "MAX_CONFIG_BYTES",
    "MAX_YAML_VALUES",
    "apply_env_overrides",
    "default_tiers",
    "env_override_paths",
    "env_sets",
    "has_path",
    "leaf_paths",
    "read_source",
    "safe_yaml",
]

ENV_PREFIX = "TIEREDKV_"
_NOT_OVERRIDES = {"TIEREDKV_CONFIG", "TIEREDKV_VENV"}


def default_tiers() -> list[Any]:
    """The tiers of a config that names none (and that a ``TIEREDKV_TIERS__...`` override edits)."""
    return [CPUTierConfig(), LMDBTierConfig()]


# ---------------------------------------------------------------------------------------
# reading a file


def read_source(source: Any) -> dict[str, Any]:
    """The plain data of a config source: ``{}`` for None, a plain copy of a mapping, else the
    mapping a YAML file holds (read by :func:`safe_yaml`, at most :data:`MAX_CONFIG_BYTES`)."""
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


# ---------------------------------------------------------------------------------------
# environment overrides


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
                node["tiers"] = [_plain(t) for t in default_tiers()]
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
# provenance


def env_override_paths(raw: dict[str, Any], env: Mapping[str, str]) -> list[tuple[str, tuple[Any, ...]]]:
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
                    node["tiers"] = [_plain(t) for t in default_tiers()]
                resolved.append(key)
                node = node.get(key, {})
            else:
                break
        out.append((name, tuple(resolved)))
        work = apply_env_overrides(work, {name: env[name]})
    return out


def env_sets(text: str, rest: tuple[Any, ...]) -> bool:
    """Whether an override's value (YAML) sets the sub-path ``rest`` of where it points."""
    if not rest:
        return True
    try:
        value = safe_yaml(text, "")
    except (yaml.YAMLError, ConfigError):
        return False
    return has_path(value, rest)


def leaf_paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(data, dict) and data:
        return [p for k, v in data.items() for p in leaf_paths(v, (*prefix, k))]
    if isinstance(data, list) and data:
        return [p for i, v in enumerate(data) for p in leaf_paths(v, (*prefix, i))]
    return [prefix]


def has_path(raw: Any, path: tuple[Any, ...]) -> bool:
    node = raw
    for part in path:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if not (in_dict or in_list):
            return False
        node = node[part]
    return True

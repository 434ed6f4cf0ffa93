"""What every tier's config model shares, apart from the loader (:mod:`tieredkv.config`).

* :class:`TierConfigBase` — the base of every tier's model, built in or third party: ``kind``,
  ``name``, ``op_timeout_s`` and the hooks callers use without knowing the kind
  (:meth:`~TierConfigBase.with_local_dir`, :meth:`~TierConfigBase.with_capacity`).
* :data:`Size`, :data:`EvictionPolicyName` and :class:`EncryptionConfig` — field types the
  built-in tiers' models (``tieredkv.backends.<kind>.config``) share.

Nothing here imports a backend or the tier registry: a tier's config module imports this one,
the registry imports those, and :mod:`tieredkv.config` (the loader) imports the registry.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

__all__ = [
    "ConfigModel",
    "EncryptionConfig",
    "EvictionPolicyName",
    "Size",
    "TierConfigBase",
]


def _positive_size(v: Any) -> Any:
    negative = (isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0) or (
        isinstance(v, str) and v.strip().startswith(("-", "0 ")) or v == "0"
    )
    if negative:
        raise ValueError("must be greater than 0: a size in bytes such as 1048576, '512MiB' or '8GiB'")
    return v


#: A byte size: an int or a string with a unit ('512MiB', '8GiB'), greater than 0.
Size = Annotated[ByteSize, BeforeValidator(_positive_size)]


class ConfigModel(BaseModel):
    """Base of every config model: unknown fields are errors, defaults validated, frozen."""

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class TierConfigBase(ConfigModel):
    """Base of every tier's config model, built in or third party.

    ``TieredKVConfig.tiers`` holds these: each item's ``kind`` is looked up in the tier registry
    (:func:`tieredkv.backends.registry.config_model`, by :mod:`tieredkv.config`) and the item
    validated with that kind's model, so a tier installed through the ``tieredkv.backends`` entry point is written in YAML
    exactly like a built-in one. A third-party model subclasses this one and narrows ``kind``::

        class DirTierConfig(TierConfigBase):
            kind: Literal["dir"] = Field("dir", description="Tier kind (selects the backend).")
            root: str = Field(..., description="Directory holding one file per record.")
    """

    kind: str = Field(description="Tier kind (selects the backend through the tier registry).")
    name: str = Field("", description="Unique tier name used in logs, metrics and the CLI; defaults to the kind.")
    op_timeout_s: float = Field(5.0, gt=0, description="Deadline for one tier operation (a whole batch), in seconds.")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("name") and data.get("kind"):
            data = {**data, "name": data["kind"]}
        return data

    #: The field naming the directory on local disk that the tier keeps its data in (LMDB:
    #: ``path``), or None (in memory, on a server). Lets callers relocate a tier's data
    #: (``tieredkv demo --data-dir``) without knowing its kind: :meth:`with_local_dir`.
    local_dir_field: ClassVar[str | None] = None

    @property
    def local_dir(self) -> str | None:
        """The directory on local disk the tier keeps its data in (its ``local_dir_field``), else None."""
        path = getattr(self, self.local_dir_field, None) if self.local_dir_field else None
        return path if isinstance(path, str) else None

    @property
    def configured_capacity(self) -> int | None:
        """The capacity this config gives the tier in bytes, where it says one without opening the
        tier (the CPU tier's slab), else None."""
        return None

    @property
    def label(self) -> str:
        """The tier's name, or its kind when unnamed."""
        return self.name or str(self.kind)

    def _updated(self, **fields: Any) -> Self:
        """A validated copy with ``fields`` changed (``model_copy`` would skip the checks)."""
        return type(self).model_validate({**self.model_dump(), **fields})

    def with_local_dir(self, path: str | os.PathLike[str]) -> Self:
        """A copy keeping its data under ``path`` when the tier has a local directory, else itself."""
        if self.local_dir_field is None:
            return self
        return self._updated(**{self.local_dir_field: str(path)})

    def with_capacity(self, capacity_bytes: int, *, largest_record_bytes: int = 0) -> Self:
        """A copy that holds about ``capacity_bytes`` of records (headers included) before it
        evicts, records of up to ``largest_record_bytes`` fitting, adjusting whatever else that
        needs; itself when a server holds the capacity (Redis ``maxmemory``). For callers that
        size tiers for a workload (``tieredkv bench``, tests) without knowing the kind."""
        return self


def _known_policy(name: str) -> str:
    from tieredkv.eviction import policies

    if name not in policies:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {sorted(policies)} (a new policy registers in"
            " tieredkv.eviction.policies)"
        )
    return name


#: The name of an eviction policy in :data:`tieredkv.eviction.policies`, checked at validation.
EvictionPolicyName = Annotated[str, AfterValidator(_known_policy)]

EVICTION_POLICY_DOC = (
    "Which records go first when the tier is full: a policy named in tieredkv.eviction.policies ('lru')."
)


class EncryptionConfig(ConfigModel):
    """Sealed records (:mod:`tieredkv.sealing`): every payload the tier stores is encrypted and
    authenticated with AES-256-GCM under a key derived per namespace and tenant from a master key;
    a record no master key opens is a miss. The master keys come from a file or an environment
    variable (exactly one of the two), newest first: the newest seals, every one opens."""

    keys_file: str | None = Field(
        None,
        description="File of master keys, newest first: one per line, 64 hex digits (`openssl rand -hex 32`) or"
        " the base64 of 32 bytes; '#' starts a comment. It must be its owner's alone (chmod 600).",
    )
    keys_env: str | None = Field(
        None,
        description="Name of an environment variable holding the master keys instead, newest first, separated"
        " by spaces, commas or line breaks (e.g. TIEREDKV_KEYS).",
    )

    @field_validator("keys_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("must be the name of an environment variable (letters, digits, '_'), e.g. TIEREDKV_KEYS")
        return v

    @field_validator("keys_file")
    @classmethod
    def _file_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must name the key file, e.g. /etc/tieredkv/keys")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> EncryptionConfig:
        if (self.keys_file is None) == (self.keys_env is None):
            raise ValueError(
                "set exactly one of keys_file (a file of master keys) or keys_env (the name of an environment"
                " variable holding them)"
            )
        return self


ENCRYPTION_DOC = (
    "Seal every record (AES-256-GCM, keys from a key file or an environment variable): only a holder"
    " of a key reads it, a forged or altered record is a miss. None: records are stored in clear,"
    " with a checksum."
)

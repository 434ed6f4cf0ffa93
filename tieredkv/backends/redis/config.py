"""The Redis tier's config model (``kind: redis``); imports nothing of the tier itself (redis-py)."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field, field_validator

from tieredkv.tierconfig import ENCRYPTION_DOC, EncryptionConfig, Size, TierConfigBase

__all__ = ["RedisTierConfig"]


class RedisTierConfig(TierConfigBase):
    """A Redis server or Redis Cluster."""

    kind: Literal["redis"] = Field("redis", description="Tier kind (selects the backend).")
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis:// or rediss:// (TLS) URL of a node; for a cluster, any node.",
    )
    cluster: bool = Field(False, description="Use the Redis Cluster client (slot routing, hash-tagged keys).")
    username: str | None = Field(None, description="ACL user name (AUTH user pass).")
    password: str | None = Field(None, description="Password (AUTH); masked in `config show`.")
    ssl_ca_certs: str | None = Field(None, description="CA bundle for TLS (rediss://).")
    ssl_certfile: str | None = Field(None, description="Client certificate for mutual TLS.")
    ssl_keyfile: str | None = Field(None, description="Client key for mutual TLS.")
    socket_timeout_s: float = Field(2.0, gt=0, description="Socket read/write timeout; a dead server fails fast.")
    connect_timeout_s: float = Field(0.5, gt=0, description="TCP connect timeout.")
    ttl_s: int | None = Field(None, gt=0, description="Expire records after this many seconds (None: no TTL).")
    key_prefix: str = Field("tkv", min_length=1, description="Prefix of every key this tier writes.")
    hash_tag_buckets: int = Field(
        16,
        ge=1,
        le=4096,
        description="Hash-tag buckets per namespace: a batch of one namespace touches at most this many cluster slots.",
    )
    max_batch_bytes: Size = Field(
        ByteSize(8 << 20), gt=0, description="Split pipelines so one round trip carries at most this many bytes."
    )
    native_io: bool = Field(
        True,
        description="On a single node over redis:// or unix://, move records with tieredkv's own pipelined"
        " RESP connections (payloads sent and received in place, no copies); false: redis-py for everything."
        " Clusters and TLS always use redis-py.",
    )
    connections: int = Field(
        2, ge=1, le=64, description="Data-path connections of native_io: a batch's reads are split over them."
    )
    lookup_budget_ms: float = Field(
        1.0,
        ge=0,
        le=1000,
        description="The most a scheduler's lookup batch (a request's whole prefix, one pipelined EXISTS)"
        " may wait for the server so it is answered in the step it is asked; past it, or when the server"
        " fails, the lookup is answered asynchronously (a step later). 0: always asynchronously.",
    )
    removal_watch: Literal["auto", "scan", "off"] = Field(
        "auto",
        description="How the records the server removes by itself (maxmemory evictions, ttl_s expiries) are"
        " observed, for KV events (only while an engine asks for them): 'auto' turns on keyspace"
        " notifications for evicted and expired keys (CONFIG SET notify-keyspace-events, adding flags"
        " E, e, x, never removing any) and subscribes on every primary, or, where CONFIG is refused and"
        " the flags are not already on, checks the keys this process stored with EXISTS in bounded"
        " rounds; 'scan' always does the latter (never touches the server's config); 'off' observes nothing.",
    )
    removal_scan_interval_s: float = Field(
        1.0, gt=0, description="Removal scan ('scan' mode): seconds between two rounds of EXISTS."
    )
    removal_scan_keys: int = Field(
        1024, ge=1, description="Removal scan: keys checked per round (one pipelined EXISTS each)."
    )
    removal_scan_max_keys: int = Field(
        1 << 18,
        ge=1,
        description="Removal scan: keys this process stored that it keeps checking, at most; past it the"
        " oldest are forgotten (their removal is then not reported).",
    )
    encryption: EncryptionConfig | None = Field(None, description=ENCRYPTION_DOC)

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if "{" in v or "}" in v:
            raise ValueError("must not contain '{' or '}' (they would become the Redis Cluster hash tag)")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

"""Reading a running engine's ``/metrics`` (Prometheus text) for ``tieredkv status``: breaker
states, the in-process tiers' usage, and whether the engine's block hashes outlive it, which
the CLI cannot see otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineMetrics", "NotMetrics", "read_engine_metrics"]

#: The gauge, on tieredkv's own endpoint and on vLLM's (``vllm:kv_offload_tieredkv_*``).
_HASHES = ("tieredkv_block_hashes_reproducible", "vllm:kv_offload_tieredkv_block_hashes_reproducible")


@dataclass
class EngineMetrics:
    """What ``tieredkv status`` reads from an engine: breaker state and usage by tier, whether its
    block hashes are reproducible across processes (None: not reported), or why nothing was read."""

    breakers: dict[str, str] = field(default_factory=dict)
    usage: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None
    block_hashes_reproducible: bool | None = None


#: The most bytes read from a metrics endpoint (tieredkv's /metrics is a few KiB).
_MAX_METRICS_BYTES = 16 << 20


class NotMetrics(Exception):
    """The URL answered, but not with Prometheus text."""


def read_engine_metrics(url: str) -> EngineMetrics:
    """Breaker states, usage gauges and the block-hash gauge from a running engine's ``/metrics``.

    An unreachable URL is reported in ``error`` (breaker state unknown). A body that is
    not Prometheus text (an HTML page, garbage, over 16 MiB) raises :class:`NotMetrics`.
    """
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            body = resp.read(_MAX_METRICS_BYTES + 1)
    except OSError as e:
        return EngineMetrics(error=f"cannot read engine metrics at {url}: {e}")
    if len(body) > _MAX_METRICS_BYTES:
        raise NotMetrics(f"the response is over {_MAX_METRICS_BYTES >> 20} MiB")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotMetrics(f"the response is not UTF-8 text (byte {body[e.start]:#04x} at offset {e.start})") from None
    try:
        families = _parse_metrics(text)
    except Exception as e:  # noqa: BLE001 - the parser's errors on garbage are ValueError, IndexError, ...
        first = text.lstrip()[:40].splitlines()[0] if text.strip() else ""
        detail = f"{e}" if str(e) else type(e).__name__
        raise NotMetrics(f"the response is not Prometheus text format ({_clip(detail)}; it starts {first!r})") from None
    out = EngineMetrics()
    breakers, engine = out.breakers, out.usage
    for fam in families:
        for s in fam.samples:
            if s.name in _HASHES:
                out.block_hashes_reproducible = bool(s.value)
            tier = s.labels.get("tier")
            if tier is None:
                continue
            if s.name == "tieredkv_breaker_state" and s.value == 1:
                breakers[tier] = s.labels.get("state", "?")
            elif s.name == "tieredkv_tier_used_bytes":
                engine.setdefault(tier, {})["used"] = s.value
            elif s.name == "tieredkv_tier_records":
                engine.setdefault(tier, {})["records"] = s.value
    return out


def _parse_metrics(text: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."

"""Old home of the admin operations; they live in :mod:`tieredkv.cli` now (operations in
:mod:`tieredkv.cli.ops`, input parsing in :mod:`tieredkv.cli.parse`). Re-exported so existing
imports keep working."""

from __future__ import annotations

from tieredkv.cli.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE
from tieredkv.cli.exits import CLIError as AdminError
from tieredkv.cli.ops import evict, flush, inspect_key, list_records, migrate, show_config, status, summarize, verify
from tieredkv.cli.parse import parse_duration, parse_key, parse_metrics_url, parse_namespace, parse_size
from tieredkv.cli.render import human_age, human_bytes
from tieredkv.cli.tiers import open_tier, select_tiers

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_UNAVAILABLE",
    "AdminError",
    "evict",
    "flush",
    "human_age",
    "human_bytes",
    "inspect_key",
    "list_records",
    "migrate",
    "open_tier",
    "parse_duration",
    "parse_key",
    "parse_metrics_url",
    "parse_namespace",
    "parse_size",
    "select_tiers",
    "show_config",
    "status",
    "summarize",
    "verify",
]

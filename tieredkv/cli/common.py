"""What every command module shares: :func:`run` (a command body's errors to one ``error:`` line
and an exit code, through :func:`tieredkv.cli.exits.exit_code`), :func:`fail`, and the
``--config`` option. The app (:mod:`tieredkv.cli.app`) and the engine-side commands
(:mod:`tieredkv.cli.engine`) both import it; neither imports the other's commands back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NoReturn

import typer

from tieredkv.cli import render
from tieredkv.cli.exits import CLIError, exit_code, message_for
from tieredkv.errors import TieredKVError

__all__ = ["ConfigOpt", "fail", "run"]

ConfigOpt = typer.Option(None, "--config", "-c", envvar="TIEREDKV_CONFIG", help="tieredkv YAML config file.")


def fail(code: int, message: str) -> NoReturn:
    render.error(message)
    raise typer.Exit(code)


def run(fn: Callable[[], Any]) -> Any:
    """Run one command body (sync, or returning a coroutine), mapping errors to exit codes."""
    try:
        result = fn()
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
        return result
    except (CLIError, TieredKVError, KeyboardInterrupt) as e:
        fail(exit_code(e), message_for(e))

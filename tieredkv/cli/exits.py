"""Exit codes and the one map from errors to them (every command goes through :func:`exit_code`).

0 success; 1 the job ran and found a problem (corrupt records not repaired, key not found, a
failed copy, refused confirmation); 2 bad input (config file, option values); 3 a tier could not
be reached; 130 interrupted.
"""

from __future__ import annotations

from tieredkv.errors import ConfigError, TieredKVError, TierUnavailableError

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_UNAVAILABLE",
    "CLIError",
    "exit_code",
    "message_for",
]

EXIT_OK, EXIT_PROBLEM, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A command cannot go on; ``code`` is the process exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def exit_code(exc: BaseException) -> int:
    """The exit code for an error a command raised (the only such map in the CLI)."""
    if isinstance(exc, CLIError):
        return exc.code
    if isinstance(exc, TierUnavailableError):
        return EXIT_UNAVAILABLE
    if isinstance(exc, ConfigError):
        return EXIT_BAD_INPUT
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, TieredKVError):
        return EXIT_PROBLEM
    raise TypeError(f"no exit code for {type(exc).__name__}") from exc


def message_for(exc: BaseException) -> str:
    """The one-line-per-error text shown for ``exc`` (without the ``error:`` prefix)."""
    if isinstance(exc, TierUnavailableError):
        return f"tier unavailable: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (a migrate resumes where it stopped when run again)"
    return str(exc)

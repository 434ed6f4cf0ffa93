"""The ``tieredkv`` command (console script ``tieredkv = "tieredkv.cli:main"``).

Module map (where to make a change):

* :mod:`tieredkv.cli.app` — the typer app: one function per command, options → operation →
  printer / ``--json``, errors through :func:`~tieredkv.cli.common.run`. Add a command here.
* :mod:`tieredkv.cli.common` — what the app and the engine commands share: ``run`` / ``fail``
  and the ``--config`` option (neither imports the other back).
* :mod:`tieredkv.cli.exits` — exit codes and the one error → exit-code map.
* :mod:`tieredkv.cli.ops` — the admin operations (status, ls, inspect, verify, evict, flush,
  migrate, config show / init); typed results, no printing.
* :mod:`tieredkv.cli.results` — the result dataclasses (``to_json()`` is the ``--json`` output).
* :mod:`tieredkv.cli.render` — tables on a terminal, plain rows in a pipe, one-line errors,
  progress on stderr. Change how something looks here.
* :mod:`tieredkv.cli.tiers` — which tiers the CLI reaches (by capabilities), opening them for
  admin work (passive scans), batching helpers.
* :mod:`tieredkv.cli.parse` — option values → typed values, with errors that name the fix.
* :mod:`tieredkv.cli.enginemetrics` — a running engine's ``/metrics`` (breaker states).
* :mod:`tieredkv.cli.engine` — ``demo`` and ``bench``: the only commands that need torch.
* :mod:`tieredkv.localcluster` — the ``cluster up`` / ``down`` local Redis Cluster.

The admin verbs import nothing that needs torch: ``pip install 'tieredkv[admin]'`` is enough.
"""

from __future__ import annotations

from tieredkv.cli.app import app, main
from tieredkv.cli.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE, CLIError

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_PROBLEM", "EXIT_UNAVAILABLE", "CLIError", "app", "main"]

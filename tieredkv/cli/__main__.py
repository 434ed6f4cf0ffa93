"""``python -m tieredkv.cli``: the ``tieredkv`` command."""

from tieredkv.cli.app import main

main()

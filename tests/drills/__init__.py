"""Reliability drills: crash, kill, corrupt, full and bad input (issue 8).

Each drill prints one ``DRILL <name>: key=value ...`` line with its counts (run pytest with
``-s`` to see them); with ``TIEREDKV_DRILL_REPORT=<file>`` set, the lines are appended there too.
"""

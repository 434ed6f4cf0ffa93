"""pytest plugin: vLLM 0.33.0's own offloading-connector suite run against ``TieredKVConnector``.

Loaded by :mod:`run_suite` as ``-p tieredkv_peer`` in a pytest run rooted in the suite's files as
vLLM ships them (``tests/v1/kv_connector/unit/offloading_connector/`` of the vLLM 0.33.0 source
package, unmodified on disk). With ``--peer-connector=tieredkv`` (the default) it swaps tieredkv's
classes in for vLLM's before any of the suite's modules is imported:

* ``offloading_connector.OffloadingConnector`` -> ``TieredKVConnector``: the scheduler role (which
  vLLM's ``KVConnectorFactory`` builds by that name, the suite's ``kv_connector="OffloadingConnector"``)
  and the worker role (which the suite's ``RequestRunner`` constructs by that name) both run
  tieredkv's connector;
* ``offloading.scheduler.OffloadingConnectorScheduler`` -> ``TieredKVConnectorScheduler``: the
  tests that build the scheduler side on its own build tieredkv's.

``--peer-connector=vllm`` runs the same suite against vLLM's own classes (the control). Either
way it writes a per-test report, ``report.json`` and ``report.md``, into ``--peer-report``.
Tests listed in :data:`INTENDED` (an intended difference, with its reason and the tieredkv test
that shows the loss vLLM's behaviour causes) are marked ``xfail(strict=True)``: they must fail
for the stated reason, and a pass makes the run fail until the list is updated.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pytest

#: nodeid (relative to the suite's root) -> why TieredKVConnector behaves differently on purpose
#: (docs/vllm.md, "vLLM's own suite") and the test of ours showing what vLLM's behaviour loses.
INTENDED: dict[str, str] = {
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py::test_scheduler_reports_allocation_failure": (
        "a store that refuses every call: vLLM expects 2 allocation failures (one while running, one at the "
        "finished pass, after which vLLM gives the chunks up); TieredKVConnector holds the finished request's "
        "blocks and offers them again (at most hold_finished_steps times), each refused retry one more "
        "allocation failure (3 here). What vLLM's giving up loses: tests/vllm/test_connector.py::"
        "test_case_refusal_on_the_last_pass; the count: tests/vllm/test_vllm_suite_cases.py::"
        "test_refused_finished_request_is_retried_each_retry_an_allocation_failure"
    ),
}

_SWAPPED: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tieredkv peer suite")
    group.addoption(
        "--peer-connector",
        choices=("tieredkv", "vllm"),
        default="tieredkv",
        help="whose connector runs the suite: tieredkv's TieredKVConnector (default) or vLLM's own",
    )
    group.addoption("--peer-report", default=None, help="directory for report.json and report.md")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    # Before the suite's conftest imports its utils (which bind OffloadingConnector by name).
    if early_config.known_args_namespace.peer_connector == "tieredkv":
        _swap_in_tieredkv()


def _swap_in_tieredkv() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    from tieredkv.integrations.vllm.connector import TieredKVConnector, TieredKVConnectorScheduler

    offloading_connector.OffloadingConnector = TieredKVConnector  # type: ignore[misc]
    scheduler.OffloadingConnectorScheduler = TieredKVConnectorScheduler  # type: ignore[misc]
    _SWAPPED[:] = [
        "vllm...v1.offloading_connector.OffloadingConnector -> tieredkv.integrations.vllm.TieredKVConnector",
        (
            "vllm...v1.offloading.scheduler.OffloadingConnectorScheduler -> "
            "tieredkv.integrations.vllm.connector.TieredKVConnectorScheduler"
        ),
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("peer_connector") != "tieredkv":
        return
    for item in items:
        reason = INTENDED.get(item.nodeid)
        if reason is not None:
            mark = pytest.mark.xfail(reason=f"intended difference: {reason}", strict=True, raises=AssertionError)
            item.add_marker(mark)


class _Recorder:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            entry["detail"] = report.wasxfail
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["detail"] = _last_line(report)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["detail"] = _skip_reason(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.results[report.nodeid or "<collection>"] = {
                "outcome": "error (collect)",
                "duration_s": 0.0,
                "detail": _last_line(report),
            }

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        out = self.config.getoption("peer_report")
        if not out:
            return
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        counts: dict[str, int] = {}
        for entry in self.results.values():
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        meta = _meta(self.config, time.monotonic() - self.started, exitstatus)
        doc = {**meta, "counts": counts, "tests": dict(sorted(self.results.items()))}
        (path / "report.json").write_text(json.dumps(doc, indent=1) + "\n")
        (path / "report.md").write_text(_markdown(doc))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        out = self.config.getoption("peer_report")
        terminalreporter.section("vLLM 0.33.0 offloading-connector suite")
        terminalreporter.write_line(f"connector: {self.config.getoption('peer_connector')}")
        for line in _SWAPPED:
            terminalreporter.write_line(f"swapped: {line}")
        if out:
            terminalreporter.write_line(f"per-test report: {Path(out) / 'report.md'} (and report.json)")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Recorder(config), "tieredkv_peer_recorder")


def _last_line(report: Any) -> str:
    text = str(report.longrepr or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])[:300]
    return str(longrepr or "")[:300]


def _meta(config: pytest.Config, elapsed: float, exitstatus: int) -> dict[str, Any]:
    import vllm

    import tieredkv

    return {
        "suite": "vllm 0.33.0 tests/v1/kv_connector/unit/offloading_connector",
        "connector": config.getoption("peer_connector"),
        "swapped": list(_SWAPPED),
        "vllm": vllm.__version__,
        "tieredkv": os.path.dirname(tieredkv.__file__),
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "elapsed_s": round(elapsed, 1),
        "exit_status": int(exitstatus),
        "intended_differences": INTENDED,
    }


def _markdown(doc: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(doc["counts"].items()))
    lines = [
        f"# {doc['suite']}",
        "",
        (
            f"connector: **{doc['connector']}**; vLLM {doc['vllm']}; tieredkv from `{doc['tieredkv']}`; "
            f"{doc['machine']}; {doc['elapsed_s']} s; pytest exit status {doc['exit_status']}"
        ),
        "",
        f"**{counts}**",
        "",
    ]
    lines += [f"- swapped: {s}" for s in doc["swapped"]]
    not_passed = {k: v for k, v in doc["tests"].items() if v["outcome"] != "passed"}
    if not_passed:
        lines += ["", "## Not passed", "", "| test | outcome | detail |", "|---|---|---|"]
        for nodeid, v in not_passed.items():
            detail = v.get("detail", "").replace("|", "\\|")
            lines.append(f"| `{nodeid}` | {v['outcome']} | {detail} |")
    lines += ["", "## Every test", "", "| test | outcome | s |", "|---|---|---|"]
    for nodeid, v in doc["tests"].items():
        lines.append(f"| `{nodeid}` | {v['outcome']} | {v['duration_s']} |")
    return "\n".join(lines) + "\n"

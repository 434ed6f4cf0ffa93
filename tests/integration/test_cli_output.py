"""CLI output that survives pipes and odd user text: one-line errors when stderr is not a
terminal, tables that never truncate or wrap a cell in a pipe, bracketed text shown as is;
``--version`` and ``config init``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.integration.test_cli_admin import ROOT, TKV, lmdb_tier, seed, write_config
from tieredkv import __version__
from tieredkv.samples import sample_config_text

LONG = "a-directory-name-long-enough-to-push-any-message-well-past-eighty-columns"


def narrow(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The CLI in a pipe with a narrow COLUMNS (rich would wrap and truncate at 40 columns)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    env["COLUMNS"] = "40"
    return subprocess.run(
        [*TKV, *args], check=False, capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_errors_are_one_line_in_a_pipe_and_bracketed_text_is_shown_as_is(tmp_path: Path) -> None:
    missing = tmp_path / LONG / "kv[prod].yaml"
    r = narrow("ls", "-c", str(missing))
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: config file ") and str(missing) in line and "check the path" in line

    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), name="kv[prod].yaml")
    for bad in ("[/bold]", "[red]x[/red]", "[link=file:///etc]y"):  # rich markup would eat or choke on these
        r = narrow("ls", "-c", str(cfg), "--tier", bad)
        assert r.returncode == 2, (bad, r.stderr)
        (line,) = r.stderr.splitlines()
        assert f"no tier named '{bad}'" in line and "Traceback" not in r.stderr

    ok = narrow("config", "check", str(cfg))
    assert ok.returncode == 0 and f"ok: {cfg} — 1 tier(s): nvme" in ok.stdout


def test_tables_in_a_pipe_are_plain_rows_with_whole_cells(tmp_path: Path) -> None:
    name = "sliding-window-attention-tier-[eu]"
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / LONG, name=name))
    keys = seed(cfg, name, 3)

    r = narrow("ls", "-c", str(cfg))
    assert r.returncode == 0 and "…" not in r.stdout
    header, *rows, footer = r.stdout.splitlines()
    assert header.split("\t") == ["tier", "key", "group", "size", "age", "tenant"]
    assert [row.split("\t")[:3] for row in rows] == [[name, k.hex(), str(i % 2)] for i, k in enumerate(keys)]
    assert footer == "records 1–3 of 3"

    st = narrow("status", "-c", str(cfg))
    assert st.returncode == 0 and "…" not in st.stdout
    (row,) = [line.split("\t") for line in st.stdout.splitlines() if line.startswith(name)]
    assert row[:3] == [name, "lmdb", "reachable"] and row[5] == "3" and row[-1] == str(tmp_path / LONG)

    shown = narrow("config", "show", "-c", str(cfg))
    assert shown.returncode == 0 and shown.stdout.splitlines()[0] == f"# effective config from {cfg}"
    assert f"tiers.0.name\t{name}\t" in shown.stdout and f"tiers.0.path\t{tmp_path / LONG}\t" in shown.stdout


def test_version_flag_and_config_init_refuses_to_overwrite(tmp_path: Path) -> None:
    v = narrow("--version")
    assert v.returncode == 0 and v.stdout.strip() == __version__

    r = narrow("config", "init", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "tieredkv.yaml").read_text() == sample_config_text()
    target = tmp_path / "etc" / "kv[prod].yaml"
    assert narrow("config", "init", str(target)).returncode == 0
    target.write_text("# edited by hand\n")
    again = narrow("config", "init", str(target))
    assert again.returncode == 2 and "--force" in again.stderr and str(target) in again.stderr
    assert target.read_text() == "# edited by hand\n"
    forced = narrow("config", "init", str(target), "--force")
    assert forced.returncode == 0 and target.read_text() == sample_config_text()
    assert narrow("config", "check", str(target)).returncode == 0


def _stderr_on_a_terminal(*args: str) -> tuple[int, str, bytes]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe): (rc, stdout, terminal bytes)."""
    import pty
    import select

    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    master, slave = pty.openpty()
    p = subprocess.Popen([*TKV, *args], stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], 120)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out, _ = p.communicate(timeout=120)
    return p.returncode, out.decode(), seen


def test_progress_shows_on_a_terminal_only(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    seed(cfg, "nvme", 20)
    rc, out, tty = _stderr_on_a_terminal("verify", "-c", str(cfg))
    assert rc == 0 and b"scan nvme" in tty and b"verify nvme" in tty
    assert out.splitlines()[1].split("\t") == ["nvme", "20", "20", "0", "0"]  # stdout stays plain
    rc, out, tty = _stderr_on_a_terminal("verify", "-c", str(cfg), "--json")
    assert rc == 0 and b"scan nvme" not in tty and '"ok": 20' in out
    piped = narrow("verify", "-c", str(cfg))
    assert piped.returncode == 0 and piped.stderr == ""

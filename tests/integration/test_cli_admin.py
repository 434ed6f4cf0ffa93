"""The tier admin CLI driven as a user would: real `tieredkv` processes against a real LMDB
directory, a real redis-server and a real 3-master Redis Cluster (session fixtures)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tieredkv.backends.registry import build_tier
from tieredkv.config import load_config
from tieredkv.keys import Namespace
from tieredkv.testing.servers import RedisCluster, RedisServer, free_port, redis_command

ROOT = Path(__file__).resolve().parents[2]
TKV = [sys.executable, "-m", "tieredkv.cli"]
NS = Namespace(model="test/admin-a")
NS_B = Namespace(model="test/admin-b")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    e.update(env or {}, COLUMNS="200")
    return subprocess.run(
        [*TKV, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def run_json(*args: str, code: int = 0, env: dict[str, str] | None = None) -> Any:
    r = run(*args, "--json", env=env)
    assert r.returncode == code, f"rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    return json.loads(r.stdout)


def write_config(tmp_path: Path, *tiers: str, name: str = "tieredkv.yaml") -> Path:
    cfg = tmp_path / name
    body = "namespace: {model: test/admin}\ntiers:\n" + "".join(
        textwrap.indent(textwrap.dedent(t), "  ") for t in tiers
    )
    cfg.write_text(body)
    load_config(cfg)  # the test's own config must be valid
    return cfg


def lmdb_tier(path: Path, name: str = "nvme") -> str:
    return f"""\
    - kind: lmdb
      name: {name}
      path: {path}
      map_size_bytes: 64MiB
      size_cap_bytes: 32MiB
    """


def redis_tier(url: str, name: str, *, cluster: bool = False, prefix: str | None = None) -> str:
    return f"""\
    - kind: redis
      name: {name}
      url: {url}
      cluster: {str(cluster).lower()}
      key_prefix: {prefix or "t" + uuid.uuid4().hex[:10]}
    """


def payload(key: bytes, n: int) -> bytes:
    return (key[-12:] * (n // 12 + 1))[:n]


def seed(cfg: Path, tier: str, count: int, *, ns: Namespace = NS, groups: int = 2, start: int = 0) -> list[bytes]:
    """Store ``count`` records through the library (the CLI then sees them in another process)."""
    keys = [ns.key((start + i).to_bytes(8, "big"), (start + i) % groups) for i in range(count)]

    async def go() -> None:
        async with build_tier(load_config(cfg).tier(tier)) as t:
            await t.put_many([(k, payload(k, 500 + i)) for i, k in enumerate(keys)])

    asyncio.run(go())
    return keys


def corrupt(cfg: Path, tier: str, key: bytes, *, where: str = "payload") -> None:
    async def go() -> None:
        async with build_tier(load_config(cfg).tier(tier)) as t:
            (raw,) = await t.raw_get_many([key])
            rec = bytearray(raw)
            rec[-1 if where == "payload" else 0] ^= 0xFF
            await t.raw_put_many([(key, rec)])

    asyncio.run(go())


def present(cfg: Path, tier: str, keys: list[bytes]) -> list[bool]:
    async def go() -> list[bool]:
        async with build_tier(load_config(cfg).tier(tier)) as t:
            return await t.contains_many(keys)

    return asyncio.run(go())


def read_back(cfg: Path, tier: str, keys: list[bytes]) -> list[bytes | None]:
    """Verified reads (get_many checks header and checksum)."""

    async def go() -> list[bytes | None]:
        async with build_tier(load_config(cfg).tier(tier)) as t:
            return await t.get_many(keys)

    return asyncio.run(go())


@pytest.fixture(params=["lmdb", "redis", "cluster"])
def any_tier(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    """A config with one tier of each kind the CLI reaches; returns (config, tier name)."""
    if request.param == "lmdb":
        return write_config(tmp_path, lmdb_tier(tmp_path / "lmdb")), "nvme"
    if request.param == "redis":
        srv: RedisServer = request.getfixturevalue("redis_server")
        return write_config(tmp_path, redis_tier(srv.url, "shared")), "shared"
    cl: RedisCluster = request.getfixturevalue("redis_cluster")
    return write_config(tmp_path, redis_tier(cl.url, "cluster", cluster=True)), "cluster"


# ---- status -----------------------------------------------------------------------------


def test_status_reports_each_tier_and_exits_3_when_one_is_unreachable(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    dead = free_port()
    cfg = write_config(
        tmp_path,
        "- kind: cpu\n  capacity_bytes: 64MiB\n  segment_bytes: 8MiB\n",
        lmdb_tier(tmp_path / "lmdb"),
        redis_tier(redis_server.url, "shared"),
        redis_tier(f"redis://127.0.0.1:{dead}/0", "dead"),
    )
    seed(cfg, "nvme", 12)
    s = run_json("status", "-c", str(cfg), code=3)
    rows = {r["tier"]: r for r in s["tiers"]}
    assert list(rows) == ["cpu", "nvme", "shared", "dead"]
    assert rows["cpu"]["reachable"] is None and rows["cpu"]["capacity_bytes"] == 64 << 20
    assert rows["nvme"]["reachable"] is True and rows["nvme"]["records"] == 12
    assert rows["nvme"]["capacity_bytes"] == 32 << 20 and rows["nvme"]["used_bytes"] > 12 * 500
    assert rows["shared"]["reachable"] is True and rows["shared"]["extra"]["nodes"] == 1
    assert rows["dead"]["reachable"] is False and str(dead) in rows["dead"]["error"]

    ok = run("status", "-c", str(cfg), "-t", "nvme", "-t", "shared")
    assert ok.returncode == 0, ok.stderr
    assert "reachable" in ok.stdout and "32.0 MiB" in ok.stdout and "unreachable" not in ok.stdout


def test_status_reads_breaker_state_from_a_running_engines_metrics(tmp_path: Path) -> None:
    """An engine process serving tieredkv metrics (TieredKVMetrics + start_metrics_server)."""
    cfg = write_config(
        tmp_path, "- kind: cpu\n  capacity_bytes: 16MiB\n  segment_bytes: 1MiB\n", lmdb_tier(tmp_path / "l")
    )
    seed(cfg, "nvme", 1)
    engine = textwrap.dedent(
        """
        import sys, time
        from tieredkv.config import MetricsConfig
        from tieredkv.metrics import TieredKVMetrics, start_metrics_server
        from tieredkv.pipeline.stats import LaneStats, PipelineStats
        class Pipeline:
            def stats(self):
                return PipelineStats(lanes={"cpu": LaneStats(breaker="closed"),
                                            "nvme": LaneStats(breaker="open", dropped=7)})
        class Tier:
            name, counters = "cpu", {"hits": 1}
            def add_observer(self, fn): pass
        m = TieredKVMetrics([Tier()], pipeline=Pipeline())
        from tieredkv.backends.base import TierStats
        m.collector.set_stats("cpu", TierStats("cpu", "cpu", 16 << 20, 4096, 3))
        srv = start_metrics_server(MetricsConfig(port=0), m.registry)
        print(srv.port, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", engine], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}/metrics"
        s = run_json("status", "-c", str(cfg), "--metrics-url", url)
        rows = {r["tier"]: r for r in s["tiers"]}
        assert rows["nvme"]["breaker"] == "open" and rows["cpu"]["breaker"] == "closed"
        assert rows["cpu"]["used_bytes"] == 4096 and rows["cpu"]["records"] == 3  # from the engine
        human = run("status", "-c", str(cfg), "--metrics-url", url)
        assert human.returncode == 0 and "open" in human.stdout
    finally:
        proc.kill()
        proc.wait(timeout=10)
    gone = run_json("status", "-c", str(cfg), "--metrics-url", url)
    assert "cannot read engine metrics" in gone["metrics_error"]
    assert all(r["breaker"] is None for r in gone["tiers"])


class _Garbage(http.server.BaseHTTPRequestHandler):
    """Serves what a wrong --metrics-url may point at: an HTML page, garbage, non-UTF-8 bytes."""

    BODIES: ClassVar[dict[str, bytes]] = {
        "/metrics": b"<html><body><h1>Welcome to nginx!</h1></body></html>\n",
        "/garbage": b"lorem ipsum dolor\n",
        "/binary": b"\xff\xfe\x00garbage",
    }

    def do_GET(self) -> None:
        body = self.BODIES.get(self.path, b"")
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_status_with_a_metrics_url_that_is_not_prometheus_exits_2_with_one_clear_line(tmp_path: Path) -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        cfg = write_config(tmp_path, "- kind: cpu\n  capacity_bytes: 16MiB\n  segment_bytes: 1MiB\n")
        for path, why in (("/metrics", "not Prometheus text format"), ("/garbage", "not Prometheus text format"),
                          ("/binary", "not UTF-8 text")):  # fmt: skip
            url = f"http://127.0.0.1:{port}{path}"
            r = run("status", "-c", str(cfg), "--metrics-url", url)
            err = " ".join(r.stderr.split())
            assert r.returncode == 2, (path, r.stdout, r.stderr)
            assert err.startswith(f"error: --metrics-url: got '{url}' — the response is {why}"), err
            assert "http://127.0.0.1:9400/metrics" in err and "Traceback" not in r.stderr
            assert r.stderr.count("error:") == 1
        bad = run("status", "-c", str(cfg), "--metrics-url", "127.0.0.1:9400")
        assert bad.returncode == 2 and "--metrics-url: got '127.0.0.1:9400' — expected the http:// URL" in " ".join(
            bad.stderr.split()
        )
        # from the config's metrics.port (no --metrics-url): a warning, like an engine that is down
        with_port = write_config(
            tmp_path, "- kind: cpu\n  capacity_bytes: 16MiB\n  segment_bytes: 1MiB\n", name="port.yaml"
        )
        with_port.write_text(with_port.read_text() + f"metrics: {{port: {port}}}\n")
        s = run_json("status", "-c", str(with_port))
        assert s["metrics_error"].startswith(f"metrics.port: http://127.0.0.1:{port}/metrics does not serve engine")
        assert s["tiers"][0]["breaker"] is None
    finally:
        srv.shutdown()
        srv.server_close()


# ---- ls / inspect -----------------------------------------------------------------------


def ls_pages(cfg: Path, ns: Namespace, total: int) -> tuple[list[str], dict[str, Any]]:
    """Every key ``ls --namespace`` lists, 10 a page (each page checked), and the last page."""
    seen: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = run_json(
            "ls", "-c", str(cfg), "--namespace", ns.fingerprint.hex(), "--limit", "10", "--offset", str(offset)
        )
        assert len(page["records"]) <= 10
        # ls stops one record past the page: the total is known only on the last page
        assert page["total"] == (total if page["next_offset"] is None else None)
        seen += [r["key"] for r in page["records"]]
        offset = page["next_offset"]
    return seen, page


def check_ls_views(cfg: Path) -> list[dict[str, Any]]:
    """``ls --group 1`` and the ``--by namespace`` / ``--by group`` summaries of the store the
    ls tests seed (25 records of NS, 12 of them in group 1; 4 of NS_B, 2 per group); the
    per-group summary of NS_B."""
    g1 = run_json("ls", "-c", str(cfg), "--group", "1", "--limit", "100")
    assert g1["total"] == 12 + 2 and {r["group"] for r in g1["records"]} == {1}
    summary = run_json("ls", "-c", str(cfg), "--by", "namespace")["summary"]
    assert {(s["namespace"], s["records"]) for s in summary} == {
        (NS.fingerprint.hex(), 25),
        (NS_B.fingerprint.hex(), 4),
    }
    by_group = run_json("ls", "-c", str(cfg), "--by", "group", "--namespace", NS_B.fingerprint.hex())["summary"]
    assert [(s["group"], s["records"]) for s in by_group] == [(0, 2), (1, 2)]
    return by_group  # type: ignore[no-any-return]


def test_ls_pages_filters_and_summarizes(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    keys = seed(cfg, "nvme", 25)
    other = seed(cfg, "nvme", 4, ns=NS_B, start=100)
    seen, page = ls_pages(cfg, NS, 25)
    assert seen == sorted(k.hex() for k in keys)  # every record once, in key order
    rec = page["records"][0]
    assert rec["namespace"] == NS.fingerprint.hex() and rec["size"] >= 500 and 0 <= rec["age_s"] < 120

    check_ls_views(cfg)
    assert len(other) == 4

    human = run("ls", "-c", str(cfg), "--limit", "5")
    assert human.returncode == 0 and "next page: --offset 5" in human.stdout and keys[0].hex() in human.stdout


def test_inspect_shows_header_fields_and_whether_the_checksum_verifies(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    keys = seed(cfg, "nvme", 4)
    good = run_json("inspect", keys[1].hex(), "-c", str(cfg))
    (entry,) = good["tiers"]
    assert good["group"] == 1 and good["namespace"] == NS.fingerprint.hex()
    assert entry["present"] and entry["verified"] is True
    assert (
        entry["header"]["group"] == 1 and entry["header"]["payload_bytes"] == 501 and entry["header"]["magic"] == "TKVR"
    )

    corrupt(cfg, "nvme", keys[2])
    bad = run_json("inspect", keys[2].hex(), "-c", str(cfg), code=1)
    assert bad["tiers"][0]["verified"] is False and "checksum" in bad["tiers"][0]["error"]
    human = run("inspect", keys[2].hex(), "-c", str(cfg))
    assert human.returncode == 1 and "CORRUPT" in human.stdout and "payload_bytes" in human.stdout

    absent = run_json("inspect", NS.key(b"nope", 0).hex(), "-c", str(cfg), code=1)
    assert absent["tiers"][0]["present"] is False
    r = run("inspect", "zz-not-hex", "-c", str(cfg))
    assert r.returncode == 2 and "not hex" in r.stderr


# ---- verify -----------------------------------------------------------------------------


def test_verify_finds_corrupt_records_and_repair_deletes_only_them(any_tier: tuple[Path, str]) -> None:
    cfg, tier = any_tier
    keys = seed(cfg, tier, 20)
    corrupt(cfg, tier, keys[3])  # payload bit flip
    corrupt(cfg, tier, keys[11], where="header")  # bad magic
    s = run_json("verify", "-c", str(cfg), code=1)
    assert {c["key"] for c in s["corrupt"]} == {keys[3].hex(), keys[11].hex()}
    (row,) = s["tiers"]
    assert (row["checked"], row["ok"], row["corrupt"], row["repaired"]) == (20, 18, 2, 0)
    assert present(cfg, tier, [keys[3], keys[11]]) == [True, True]  # nothing deleted without --repair

    human = run("verify", "-c", str(cfg))
    assert human.returncode == 1 and "--repair" in human.stdout and keys[3].hex() in human.stdout

    fixed = run_json("verify", "-c", str(cfg), "--repair", code=0)
    assert fixed["tiers"][0]["repaired"] == 2
    assert present(cfg, tier, [keys[3], keys[11]]) == [False, False]
    again = run_json("verify", "-c", str(cfg), code=0)
    assert again["tiers"][0]["checked"] == 18 and again["corrupt"] == []
    rest = [k for i, k in enumerate(keys) if i not in (3, 11)]
    assert read_back(cfg, tier, rest) == [payload(k, 500 + keys.index(k)) for k in rest]


# ---- migrate ----------------------------------------------------------------------------


def test_migrate_stopped_part_way_then_resumed_copies_every_record_verified(
    tmp_path: Path, redis_cluster: RedisCluster
) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), redis_tier(redis_cluster.url, "cluster", cluster=True))
    keys = seed(cfg, "nvme", 60)
    first = run_json(
        "migrate", "--from", "nvme", "--to", "cluster", "-c", str(cfg), "--limit", "25", "--batch-bytes", "8KiB"
    )
    assert (first["copied"], first["complete"], first["remaining"]) == (25, False, 35)
    assert sum(present(cfg, "cluster", keys)) == 25

    second = run_json("migrate", "--from", "nvme", "--to", "cluster", "-c", str(cfg))
    assert second["complete"] is True and second["skipped"] == 25 and second["copied"] == 35
    assert second["corrupt"] == 0 and second["target_failed"] == 0
    assert read_back(cfg, "cluster", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]
    v = run_json("verify", "-c", str(cfg), "-t", "cluster")
    assert v["tiers"][0]["checked"] == 60 and v["tiers"][0]["ok"] == 60

    third = run_json("migrate", "--from", "nvme", "--to", "cluster", "-c", str(cfg))
    assert (third["copied"], third["skipped"], third["complete"]) == (0, 60, True)


def test_migrate_killed_mid_run_resumes_to_completion(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = "k" + uuid.uuid4().hex[:10]
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), redis_tier(redis_server.url, "shared", prefix=prefix))
    keys = seed(cfg, "nvme", 1500, groups=3)
    baseline = int(redis_command(redis_server.port, "DBSIZE")[1:])  # the server is shared by the session
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    proc = subprocess.Popen(
        [*TKV, "migrate", "--from", "nvme", "--to", "shared", "-c", str(cfg), "--batch-bytes", "1", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if int(redis_command(redis_server.port, "DBSIZE")[1:]) >= baseline + 50:  # copying is under way
                break
            time.sleep(0.01)
        assert proc.poll() is None, "migrate finished before it could be interrupted"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done = sum(present(cfg, "shared", keys))
    assert 0 < done < len(keys)
    resumed = run_json("migrate", "--from", "nvme", "--to", "shared", "-c", str(cfg))
    assert resumed["complete"] is True and resumed["skipped"] == done and resumed["copied"] == len(keys) - done
    assert read_back(cfg, "shared", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]
    run_json("flush", "-c", str(cfg), "-t", "shared", "--all", "--yes")


def test_migrate_does_not_copy_a_corrupt_record_and_exits_1(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "a", "a"), lmdb_tier(tmp_path / "b", "b"))
    keys = seed(cfg, "a", 10)
    corrupt(cfg, "a", keys[4])
    s = run_json("migrate", "--from", "a", "--to", "b", "-c", str(cfg), code=1)
    assert (s["copied"], s["corrupt"], s["complete"]) == (9, 1, True)
    assert s["problems"][0]["key"] == keys[4].hex()
    assert present(cfg, "b", keys) == [i != 4 for i in range(10)]
    same = run("migrate", "--from", "a", "--to", "a", "-c", str(cfg))
    assert same.returncode == 2 and "same tier" in same.stderr


# ---- evict / flush ----------------------------------------------------------------------


def test_evict_by_age_namespace_and_size_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    real = time.time
    with monkeypatch.context() as m:  # written two hours ago (LMDB keeps the stamp on disk)
        m.setattr("tieredkv.backends.lmdb.writes.time.time", lambda: real() - 7200)
        old = seed(cfg, "nvme", 10, groups=1)
    new = seed(cfg, "nvme", 10, groups=1, start=10)
    g1 = seed(cfg, "nvme", 6, ns=NS_B, groups=1, start=50)
    listed = run_json("ls", "-c", str(cfg), "--limit", "1", "--namespace", NS.fingerprint.hex())["records"][0]
    assert listed["key"] == old[0].hex() and 7100 < listed["age_s"] < 7300
    aged = run_json("evict", "-c", str(cfg), "--older-than", "1h")
    assert aged["tiers"][0]["evicted"] == 10
    assert present(cfg, "nvme", old) == [False] * 10 and all(present(cfg, "nvme", new + g1))

    dry = run_json("evict", "-c", str(cfg), "--to-size", "2KiB", "--dry-run")
    assert dry["dry_run"] is True and dry["tiers"][0]["victims"] > 0 and dry["tiers"][0]["evicted"] == 0
    assert all(present(cfg, "nvme", new + g1))

    ns_only = run_json("evict", "-c", str(cfg), "--namespace", NS_B.fingerprint.hex())
    assert ns_only["tiers"][0]["evicted"] == 6 and not any(present(cfg, "nvme", g1))

    sized = run_json("evict", "-c", str(cfg), "--to-size", "3KiB")
    t = sized["tiers"][0]
    assert t["remaining_bytes"] <= 3 * 1024 and t["evicted"] == 10 - sum(present(cfg, "nvme", new))
    assert t["evicted"] in (5, 6, 7, 8)

    none = run("evict", "-c", str(cfg))
    assert none.returncode == 2 and "--older-than" in none.stderr
    bad = run("evict", "-c", str(cfg), "--older-than", "soon")
    assert bad.returncode == 2 and "--older-than" in bad.stderr


def test_evict_to_size_below_one_byte_or_fractional_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    keys = seed(cfg, "nvme", 5, groups=1)
    for size, why in (("0.5", "that is 0.5 bytes, below 1 byte"), ("0", "that is 0 bytes, below 1 byte"),
                      ("0.0001KiB", "that is 0.1024 bytes, below 1 byte"),
                      ("2.7", "not a whole number of bytes; give whole bytes (2)")):  # fmt: skip
        r = run("evict", "-c", str(cfg), "--to-size", size)
        err = " ".join(r.stderr.split())
        assert r.returncode == 2, (size, r.stdout, r.stderr)
        assert f"--to-size: got '{size}' — {why}" in err and "512MiB" in err and "Traceback" not in r.stderr
        assert all(present(cfg, "nvme", keys)), f"--to-size {size} deleted records"
    zero = " ".join(run("evict", "-c", str(cfg), "--to-size", "0").stderr.split())
    assert "leave out --to-size" in zero and "tieredkv flush" in zero
    ok = run_json("evict", "-c", str(cfg), "--to-size", "1.5KiB", "--dry-run")
    assert ok["tiers"][0]["victims"] > 0 and ok["tiers"][0]["evicted"] == 0


def test_evict_by_group_on_the_cluster(tmp_path: Path, redis_cluster: RedisCluster) -> None:
    cfg = write_config(tmp_path, redis_tier(redis_cluster.url, "cluster", cluster=True))
    keys = seed(cfg, "cluster", 16, groups=2)
    s = run_json("evict", "-c", str(cfg), "--group", "1")
    assert s["tiers"][0]["evicted"] == 8
    assert present(cfg, "cluster", keys) == [i % 2 == 0 for i in range(16)]
    aged = run_json("ls", "-c", str(cfg))["records"]
    assert len(aged) == 8 and all(r["age_s"] is not None for r in aged)  # OBJECT IDLETIME on each primary


def test_flush_without_yes_and_without_a_terminal_refuses(tmp_path: Path, redis_server: RedisServer) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), redis_tier(redis_server.url, "shared"))
    a = seed(cfg, "nvme", 6)
    b = seed(cfg, "nvme", 3, ns=NS_B, start=10)
    refused = run("flush", "-c", str(cfg), "--namespace", NS.fingerprint.hex())
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert all(present(cfg, "nvme", a))
    assert run("flush", "-c", str(cfg), "--yes").returncode == 2  # neither --namespace nor --all

    s = run_json("flush", "-c", str(cfg), "-t", "nvme", "--namespace", NS.fingerprint.hex(), "--yes")
    assert s["tiers"][0]["deleted"] == 6
    assert not any(present(cfg, "nvme", a)) and all(present(cfg, "nvme", b))

    # --all on a shared Redis empties this tier's key space only
    neighbour = write_config(tmp_path, redis_tier(redis_server.url, "other"), name="neighbour.yaml")
    mine = seed(cfg, "shared", 5)
    theirs = seed(neighbour, "other", 5)
    human = run("flush", "-c", str(cfg), "-t", "shared", "--all", "--yes")
    assert human.returncode == 0 and "deleted 5 record(s)" in human.stdout
    assert not any(present(cfg, "shared", mine)) and all(present(neighbour, "other", theirs))
    run_json("flush", "-c", str(neighbour), "--all", "--yes")


# ---- config, bad input, unreachable -----------------------------------------------------


def test_config_show_says_where_each_value_came_from_and_masks_secrets(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "tiers:\n  - kind: redis\n    name: r\n    url: redis://app:s3cret@127.0.0.1:6379/0\n    password: hunter2\n"
    )
    env = {"TIEREDKV_CONFIG": str(cfg), "TIEREDKV_TIERS__r__TTL_S": "60"}
    s = run_json("config", "show", "--sources", env=env)
    src = s["sources"]
    assert src["tiers.0.ttl_s"] == "env:TIEREDKV_TIERS__r__TTL_S"
    assert src["tiers.0.url"] == "file" and src["tiers.0.socket_timeout_s"] == "default"
    assert src["namespace.model"] == "default"
    assert s["config"]["tiers"][0]["ttl_s"] == 60 and s["config"]["tiers"][0]["password"] == "***"
    human = run("config", "show", env=env)
    assert human.returncode == 0
    assert "env:TIEREDKV_TIERS__r__TTL_S" in human.stdout and "default" in human.stdout
    for out in (json.dumps(s), human.stdout):
        assert "hunter2" not in out and "s3cret" not in out
    assert "redis://app:***@127.0.0.1" in human.stdout


def test_bad_input_exits_2_and_unreachable_tier_exits_3(tmp_path: Path) -> None:
    dead = free_port()
    cfg = write_config(
        tmp_path, "- kind: cpu\n  capacity_bytes: 16MiB\n  segment_bytes: 1MiB\n",
        lmdb_tier(tmp_path / "lmdb"), redis_tier(f"redis://127.0.0.1:{dead}/0", "dead"),
    )  # fmt: skip
    cases = [
        (("ls", "-t", "nope"), "no tier named 'nope'"),
        (("ls", "-t", "cpu"), "inside the engine process"),
        (("verify", "--namespace", "abc"), "32 hex digits"),
        (("ls", "--by", "colour"), "--by"),
        (("evict", "--to-size", "lots"), "--to-size"),
    ]
    for args, msg in cases:
        r = run(*args, "-c", str(cfg))
        assert r.returncode == 2, (args, r.stderr)
        assert msg in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("tiers:\n  - kind: lmdb\n    sync_mode: sometimes\n")
    r = run("status", "-c", str(bad_cfg))
    assert r.returncode == 2 and "tiers.0.sync_mode" in " ".join(r.stderr.split())

    for args in (("verify", "-t", "dead"), ("ls", "-t", "dead"), ("ls", "-t", "nvme")):  # nvme: no environment yet
        r = run(*args, "-c", str(cfg))
        assert r.returncode == 3, (args, r.stderr)
        assert "unavailable" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "lmdb").exists()  # a read command does not create an LMDB environment


# ---- local cluster ----------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_cluster_up_serves_a_working_cluster_and_down_leaves_no_process(tmp_path: Path) -> None:
    state_dir = tmp_path / "cluster"
    up = run_json("cluster", "up", "--base-port", "0", "--dir", str(state_dir))
    pids = [n["pid"] for n in up["nodes"]]
    ports = [n["port"] for n in up["nodes"]]
    try:
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        for port in ports:
            assert b"cluster_state:ok" in redis_command(port, "CLUSTER", "INFO")
        cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"), redis_tier(up["url"], "cluster", cluster=True))
        keys = seed(cfg, "nvme", 8)
        m = run_json("migrate", "--from", "nvme", "--to", "cluster", "-c", str(cfg))
        assert m["copied"] == 8 and read_back(cfg, "cluster", keys) == [payload(k, 500 + i) for i, k in enumerate(keys)]

        again = run("cluster", "up", "--base-port", "0", "--dir", str(state_dir))
        assert again.returncode == 1 and "still running" in again.stderr
    finally:
        down = run_json("cluster", "down", "--dir", str(state_dir))
    assert sorted(down["stopped_pids"]) == sorted(pids)
    assert not any(_alive(p) for p in pids)
    for port in ports:
        with pytest.raises(OSError):
            redis_command(port, "PING", timeout=0.5)
    assert not state_dir.exists()
    r = run("cluster", "down", "--dir", str(state_dir))
    assert r.returncode == 0 and "no cluster recorded" in r.stdout


def _free_run_of_ports(n: int) -> int:
    from tieredkv.testing.servers import _bindable

    for _ in range(200):
        base = free_port(max_port=55000, bus_offset=10000)
        if all(_bindable(base + i) and _bindable(base + i + 10000) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def test_cluster_up_human_output_names_the_url_and_a_taken_port_fails(tmp_path: Path) -> None:
    with RedisServer() as blocker:  # its port is taken
        r = run("cluster", "up", "--base-port", str(blocker.port), "--dir", str(tmp_path / "c"))
        assert r.returncode == 1 and "in use" in r.stderr
    state_dir = tmp_path / "c2"
    base = _free_run_of_ports(3)
    up = run("cluster", "up", "--base-port", str(base), "--dir", str(state_dir))
    try:
        assert up.returncode == 0, up.stderr
        assert f"redis://127.0.0.1:{base}/0" in up.stdout and "TIEREDKV_TIERS__cluster__URL" in up.stdout
    finally:
        down = run("cluster", "down", "--dir", str(state_dir))
    assert down.returncode == 0 and "stopped 3 redis-server" in down.stdout


# ---- on a terminal ----------------------------------------------------------------------


def run_tty(*args: str, answer: str = "") -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on a pseudo-terminal; type ``answer``."""
    import pty

    master, slave = pty.openpty()
    e = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    e.update(COLUMNS="200", TERM="xterm")
    proc = subprocess.Popen([*TKV, *args], stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=e)
    os.close(slave)
    if answer:
        time.sleep(0.5)
        os.write(master, answer.encode())
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_verify_shows_progress_and_flush_asks_first(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, lmdb_tier(tmp_path / "lmdb"))
    keys = seed(cfg, "nvme", 30)
    rc, text = run_tty("verify", "-c", str(cfg))
    assert rc == 0 and "verify nvme" in text and "30/30" in text  # the progress bar, on stderr
    rc, text = run_tty("verify", "-c", str(cfg), "--quiet")
    assert rc == 0 and "30/30" not in text

    rc, text = run_tty("flush", "-c", str(cfg), "--all", answer="n\n")
    assert "Delete EVERY record: 30 in nvme record(s)?" in text
    assert rc == 1 and "aborted" in text and all(present(cfg, "nvme", keys))
    rc, text = run_tty("flush", "-c", str(cfg), "--all", answer="y\n")
    assert rc == 0 and "deleted 30 record(s)" in text and not any(present(cfg, "nvme", keys))

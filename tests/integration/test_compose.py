"""docker-compose.yml: valid for `docker-compose config` (offline, no engine needed) and in
agreement with the files it mounts from config/ (ports, cluster nodes, paths, metric names)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from tieredkv.config import RedisTierConfig, load_config
from tieredkv.metrics import TieredKVMetrics
from tieredkv.pipeline.stats import GroupStats, LaneStats, PipelineStats, StagingStats

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


@cache
def normalized() -> dict[str, Any]:
    """``docker-compose config`` output: interpolated, with bind sources made absolute."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail(
            "docker-compose is not on PATH: install it with `apt-get install docker-compose`"
            " (scripts/test does this); it validates docker-compose.yml offline, no Docker engine needed"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "VLLM_", "DOCKER_"))}
    r = subprocess.run(
        [exe, "-f", str(COMPOSE), "config"], check=False, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert r.returncode == 0, f"docker-compose config failed:\n{r.stderr}"
    return dict(yaml.safe_load(r.stdout))


def services() -> dict[str, Any]:
    return dict(normalized()["services"])


def redis_nodes() -> dict[str, int]:
    """Service name -> port of every Redis Cluster node (services running redis-server)."""
    nodes = {}
    for name, svc in services().items():
        cmd = [str(c) for c in svc.get("command") or []]
        if cmd[:1] == ["redis-server"]:
            nodes[name] = int(cmd[cmd.index("--port") + 1])
    return nodes


def binds(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    out = {}
    for v in svc.get("volumes", []):
        src, _, rest = str(v).partition(":")
        if src.startswith("/"):
            out[rest.split(":")[0]] = Path(src)
    return out


def kv_transfer_config() -> dict[str, Any]:
    cmd = [str(c) for c in services()["vllm"]["command"]]
    return dict(json.loads(cmd[cmd.index("--kv-transfer-config") + 1]))


def tieredkv_config_path() -> Path:
    """The host file mounted where the vLLM kv-transfer-config says the tieredkv config is."""
    inside = kv_transfer_config()["kv_connector_extra_config"]["tieredkv_config"]
    mounts = binds(services()["vllm"])
    assert inside in mounts, f"{inside} is not mounted into the vllm service: {sorted(mounts)}"
    return mounts[inside]


def test_compose_file_is_valid_and_has_every_service() -> None:
    svcs = services()
    for name in ("redis-cluster-init", "vllm", "prometheus", "grafana"):
        assert name in svcs
    assert len(redis_nodes()) >= 3


def test_every_bind_mount_exists_in_the_repository() -> None:
    for name, svc in services().items():
        for inside, host in binds(svc).items():
            assert host.exists(), f"service {name}: {host} (mounted at {inside}) does not exist"
            assert ROOT in host.parents, f"service {name}: {host} is outside the repository"
    assert services()["vllm"]["build"]["dockerfile"] == "Dockerfile.vllm" and (ROOT / "Dockerfile.vllm").exists()


def test_cluster_nodes_agree_with_the_init_service_and_the_tieredkv_config() -> None:
    nodes = redis_nodes()
    assert len(set(nodes.values())) == len(nodes), "node ports must differ (bus port = port + 10000)"
    for name in nodes:
        svc = services()[name]
        cmd = [str(c) for c in svc["command"]]
        assert cmd[cmd.index("--cluster-announce-hostname") + 1] == svc["hostname"] == name
        conf = binds(svc)[cmd[1]].read_text()
        assert (
            re.search(r"^cluster-enabled yes", conf, re.MULTILINE)
            and "cluster-preferred-endpoint-type hostname" in conf
        )
    init = " ".join(str(c) for c in services()["redis-cluster-init"]["command"])
    created = re.findall(r"getent hosts ([\w-]+) .*?\):(\d+)", init)
    assert {(n, int(p)) for n, p in created} == set(nodes.items()), init
    assert "--cluster-replicas 0" in init and "--cluster-yes" in init
    assert set(services()["redis-cluster-init"]["depends_on"]) == set(nodes)

    cfg = load_config(tieredkv_config_path())
    (redis,) = [t for t in cfg.tiers if isinstance(t, RedisTierConfig)]
    m = re.match(r"redis://([\w.-]+):(\d+)", redis.url)
    assert m and redis.cluster is True
    assert (m.group(1), int(m.group(2))) in nodes.items(), f"{redis.url} is not a cluster node of the compose file"


def test_vllm_service_runs_tieredkv_with_a_gpu_and_the_cluster_config() -> None:
    vllm = services()["vllm"]
    ktc = kv_transfer_config()
    # TieredKVConnector: vLLM's OffloadingConnector with tieredkv's planning and its counters on vLLM's /metrics
    assert ktc["kv_connector"] == "TieredKVConnector" and ktc["kv_role"] == "kv_both"
    assert ktc["kv_connector_module_path"] == "tieredkv.integrations.vllm"
    extra = ktc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieredKVOffloadingSpec" and extra["spec_module_path"] == "tieredkv.integrations.vllm"
    assert tieredkv_config_path() == ROOT / "config" / "tieredkv-shared.yaml"
    assert vllm["environment"]["TIEREDKV_CONFIG"] == extra["tieredkv_config"]
    (dev,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in dev["capabilities"] and dev["count"] == 1
    assert "redis-cluster-init" in vllm["depends_on"]
    dockerfile = (ROOT / "Dockerfile.vllm").read_text()
    assert "FROM vllm/vllm-openai" in dockerfile and "[redis,fs]" in dockerfile
    cfg = load_config(tieredkv_config_path())
    cmd = [str(c) for c in vllm["command"]]
    assert cmd[0] == cfg.namespace.model  # the namespace names the model vLLM serves


def test_prometheus_scrapes_the_tieredkv_metrics_port_and_vllm() -> None:
    prom_svc = services()["prometheus"]
    prom_cfg_path = binds(prom_svc)["/etc/prometheus/prometheus.yml"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom_svc["command"]
    prom = yaml.safe_load(prom_cfg_path.read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    cfg = load_config(tieredkv_config_path())
    assert cfg.metrics.port is not None and cfg.metrics.addr == "0.0.0.0"  # reachable from another container
    assert targets["tieredkv"] == [f"vllm:{cfg.metrics.port}"]
    vllm_port = next(a.split("=")[1] for a in map(str, services()["vllm"]["command"]) if a.startswith("--port="))
    assert targets["vllm"] == [f"vllm:{vllm_port}"]
    published = {int(p["target"]) for p in services()["vllm"]["ports"]}
    assert {cfg.metrics.port, int(vllm_port)} <= published


def test_grafana_provisions_prometheus_and_a_dashboard_of_real_metric_names() -> None:
    graf = services()["grafana"]
    mounts = binds(graf)
    prov = mounts["/etc/grafana/provisioning"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    prom_port = services()["prometheus"]["ports"][0]["target"]
    assert ds["type"] == "prometheus" and ds["url"] == f"http://prometheus:{prom_port}"
    provider = yaml.safe_load((prov / "dashboards" / "tieredkv.yml").read_text())["providers"][0]
    dash_dir = mounts[provider["options"]["path"]]
    dash = json.loads((dash_dir / "tieredkv.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert all(p["datasource"]["uid"] == ds["uid"] for p in dash["panels"])
    used = {n for e in exprs for n in re.findall(r"\btieredkv_\w+", e)}
    assert len(used) >= 10

    class Pipe:  # every optional source present, so every family is exported
        def stats(self) -> PipelineStats:
            return PipelineStats(
                lanes={"t": LaneStats(breaker="closed")},
                groups={0: GroupStats(hits=1, misses=1, stored_bytes=1, loaded_bytes=1)},
                staging=StagingStats(),
            )

    class Tier:
        name, counters = "t", {}

        def add_observer(self, fn: Any) -> None:
            fn("t", "get_many", 1, 0, 0.001, "ok")

    m = TieredKVMetrics([Tier()], pipeline=Pipe())
    from tieredkv.backends.base import TierStats

    m.collector.set_stats("t", TierStats("t", "lmdb", 1, 1, 1))
    m.collector.set_tenant_usage("t", {0: 1})  # a tier that keeps tenants
    exported = {line.split("{")[0].split(" ")[0] for line in generate_latest(m.registry).decode().splitlines()
                if line and not line.startswith("#")}  # fmt: skip
    missing = used - exported
    assert not missing, f"dashboard queries metrics tieredkv does not export: {sorted(missing)}"


# An exact release: `name:1.2.3` / `name:v1.2.3` (optionally `-suffix`), or pinned by digest.
_PINNED = re.compile(r"^[\w./-]+(:v?\d+\.\d+\.\d+(-[\w.]+)?|@sha256:[0-9a-f]{64})$")


def test_every_image_is_pinned_to_an_exact_release() -> None:
    """No floating tags (``redis:7.2``, ``latest``): a pull gives the same bits everywhere."""
    for name, svc in services().items():
        if "build" in svc:  # built here: the base image's tag comes from a build arg
            tag = str(svc["build"].get("args", {}).get("VLLM_TAG", ""))
            assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"service {name}: build arg VLLM_TAG={tag!r} is not exact"
            dockerfile = (ROOT / svc["build"]["dockerfile"]).read_text()
            assert re.search(r"^FROM [\w./-]+:\$\{VLLM_TAG\}$", dockerfile, re.MULTILINE), dockerfile
            assert re.search(r"^ARG VLLM_TAG=v\d+\.\d+\.\d+$", dockerfile, re.MULTILINE), dockerfile
            continue
        assert _PINNED.match(str(svc["image"])), f"service {name}: image {svc['image']!r} is not an exact release tag"


def test_every_service_has_a_health_check() -> None:
    for name, svc in services().items():
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"service {name} has no healthcheck"
        test = [str(t) for t in check["test"]]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"service {name}: healthcheck test {test}"


def test_every_dependency_waits_on_a_condition() -> None:
    """``service_healthy`` for a service that must answer, ``service_completed_successfully`` for
    the one-shot cluster init; never the bare ``service_started`` of a list-form ``depends_on``."""
    svcs = services()
    edges = [(n, d, c["condition"]) for n, s in svcs.items() for d, c in (s.get("depends_on") or {}).items()]
    assert len(edges) >= 6, edges
    for name, dep, cond in edges:
        if dep == "redis-cluster-init":
            assert cond == "service_completed_successfully", (name, dep, cond)
        else:
            assert cond == "service_healthy", f"{name} depends on {dep} with {cond}; expected service_healthy"
            assert svcs[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy but {dep} has no healthcheck"
    assert svcs["redis-cluster-init"].get("restart") == "no"


def test_grafana_provisions_the_vllm_dashboard_too() -> None:
    """``vllm-tieredkv.json`` (tieredkv's counters as vLLM exports them; its metric names are checked
    against vLLM's real exporter in tests/vllm/test_vllm_metrics.py) sits in the provisioned folder."""
    mounts = binds(services()["grafana"])
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "tieredkv.yml").read_text())
    dash_dir = mounts[provider["providers"][0]["options"]["path"]]
    dashes = {p.name: json.loads(p.read_text()) for p in dash_dir.glob("*.json")}
    assert {"tieredkv.json", "vllm-tieredkv.json"} <= set(dashes)
    assert len({d["uid"] for d in dashes.values()}) == len(dashes), "dashboard uids must differ"
    vd = dashes["vllm-tieredkv.json"]
    exprs = [t["expr"] for p in vd["panels"] for t in p["targets"]]
    assert all("vllm:kv_offload_tieredkv_" in e or "vllm:kv_offload_" in e for e in exprs)
    assert all(p["datasource"]["uid"] == "prometheus" for p in vd["panels"])
    assert (
        "job_name" in (ROOT / "config" / "prometheus.yml").read_text()
        and "vllm:8000" in (ROOT / "config" / "prometheus.yml").read_text()
    )  # vLLM's /metrics, where these series live, is scraped


def test_docs_name_the_compose_file_and_the_loopback_cluster() -> None:
    page = (ROOT / "docs" / "operating.md").read_text()  # its "Local cluster" section
    assert "docker compose up" in page or "docker-compose up" in page
    assert "tieredkv cluster up" in page and "tieredkv cluster down" in page


def test_the_services_share_one_volume_as_the_fs_tier() -> None:
    """The fs tier of the vLLM config is a named volume that vLLM and the admin service both
    mount at the tier's path (across hosts, the same volume on a shared filesystem)."""
    from tieredkv.config import FSTierConfig

    cfg = load_config(tieredkv_config_path(), env={})
    (fs,) = [t for t in cfg.tiers if isinstance(t, FSTierConfig)]
    assert "aiofiles" in (ROOT / "Dockerfile.vllm").read_text()  # the image can open it
    mounting = {}
    for name, svc in services().items():
        for v in svc.get("volumes", []):
            if isinstance(v, dict) and v.get("type") == "volume" and v.get("target") == fs.path:
                mounting[name] = v["source"]
            elif isinstance(v, str) and v.split(":")[1:2] == [fs.path]:
                mounting[name] = v.split(":")[0]
    assert set(mounting) >= {"vllm", "tieredkv-admin"}, mounting
    (volume,) = set(mounting.values())
    assert volume in normalized()["volumes"], f"{volume} is not a named volume: {mounting}"
    admin = services()["tieredkv-admin"]
    assert admin["environment"]["TIEREDKV_CONFIG"] == services()["vllm"]["environment"]["TIEREDKV_CONFIG"]
    # routes: full attention to the CPU tier then the shared directory, Mamba straight to it
    routes = {tuple(r.kinds or ()): r.tiers for r in cfg.policy}
    assert routes[("full",)] == ["cpu", fs.name] and routes[("mamba",)] == [fs.name]

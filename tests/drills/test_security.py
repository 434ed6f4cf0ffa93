"""Security drills: no unpickling or eval anywhere in the package, tenant isolation on a shared
Redis, and no secret printed by the CLI.

Redis AUTH with an ACL user and TLS with a client certificate made by the test are proven in
tests/integration/test_redis_tier.py (``test_auth_password_and_acl_user``,
``test_tls_with_client_certificate``); not repeated here.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.drills._util import block_hash, payload, report
from tieredkv import open_store
from tieredkv.backends.redis import RedisTier
from tieredkv.config import ConfigError, RedisTierConfig, load_config
from tieredkv.keys import Namespace
from tieredkv.pipeline import KeyState
from tieredkv.testing.servers import RedisServer, free_port

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tieredkv"

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve", "joblib", "jsonpickle"}
BANNED_CALLS = {"eval", "exec"}  # the builtins; Redis' EVAL (a method call) is not Python eval


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def unsafe_uses(source: str, filename: str = "<src>") -> list[str]:
    """Lines that unpickle, unmarshal or eval: imports, builtin calls, unsafe loaders."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(node.func, ast.Name) and name in BANNED_CALLS | {"__import__"}:
                if name != "__import__" or any(
                    isinstance(a, ast.Constant) and str(a.value) in BANNED_MODULES for a in node.args
                ):
                    found.append(f"{where} {name}(...)")
            elif name.endswith("import_module") and any(
                isinstance(a, ast.Constant) and str(a.value).split(".")[0] in BANNED_MODULES for a in node.args
            ):
                found.append(f"{where} {name}({ast.unparse(node.args[0])})")
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
                found.append(f"{where} {name}(...)")
            elif name == "yaml.load":
                loader = kw.get("Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or "Safe" not in _dotted(loader):
                    found.append(f"{where} yaml.load without SafeLoader")
            elif name == "torch.load" and not (
                isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            ):
                found.append(f"{where} torch.load (unpickles)")
            elif (
                name.endswith(("np.load", "numpy.load"))
                and isinstance(kw.get("allow_pickle"), ast.Constant)
                and kw["allow_pickle"].value
            ):
                found.append(f"{where} numpy.load(allow_pickle=True)")
    return found


def test_package_never_unpickles_unmarshals_or_evals() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [hit for f in files for hit in unsafe_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)
    report("security-ast-scan", modules=len(files), findings=len(found))


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cPickle as p",
        "from marshal import loads",
        "import dill.source",
        "x = eval(s)",
        "exec(code)",
        "yaml.load(text)",
        "yaml.load(text, Loader=yaml.Loader)",
        "yaml.unsafe_load(t)",
        "torch.load(path)",
        "np.load(p, allow_pickle=True)",
        "importlib.import_module('pickle')",
        "__import__('marshal')",
    ],
)
def test_scanner_catches_each_banned_use(snippet: str) -> None:
    assert unsafe_uses(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "yaml.safe_load(t)",
        "yaml.load(t, Loader=yaml.SafeLoader)",
        "await client.eval(script, 1, key)",
        "torch.load(p, weights_only=True)",
        "import json",
        "ast.literal_eval(s)",
    ],
)
def test_scanner_allows_safe_uses(snippet: str) -> None:
    assert not unsafe_uses(snippet)


# ---- tenant isolation ----------------------------------------------------------------------------


def _tenant_cfg(url: str, prefix: str, salt: str) -> Any:
    return load_config(
        {
            "namespace": {"model": "shared/model", "tenant_salt": salt},
            "tiers": [{"kind": "redis", "url": url, "key_prefix": prefix}],
        },
        env={},
    )


def _get(store: Any, job: int, keys: list[bytes], size: int) -> Any:
    bufs = [bytearray(size) for _ in keys]
    assert store.get_records(list(zip(keys, bufs)), job_id=job) == job
    return store.wait([job], timeout=10)[job], bufs


def test_tenant_salt_isolates_two_tenants_on_one_redis(redis_server: RedisServer) -> None:
    prefix = f"drill{uuid.uuid4().hex[:8]}"  # the same prefix and server for both tenants
    a = open_store(_tenant_cfg(redis_server.url, prefix, "tenant-a"))
    b = open_store(_tenant_cfg(redis_server.url, prefix, "tenant-b"))
    try:
        assert a.namespace.fingerprint != b.namespace.fingerprint
        hashes = [block_hash(i) for i in range(32)]
        ka = [a.key(h, 0) for h in hashes]
        kb = [b.key(h, 0) for h in hashes]  # the same blocks (same prompt) in tenant b
        job = a.put_records([(k, payload(i, 1, 2048)) for i, k in enumerate(ka)])
        assert job is not None and a.wait([job], timeout=10)[job].ok
        assert all(s is KeyState.HIT for s, _ in a.lookup(ka))
        assert b.lookup(kb) == [(KeyState.MISS, None)] * len(kb), "tenant b sees tenant a's blocks"
        res, _ = _get(b, 2, kb, 2048)
        assert res.done == () and len(res.failed) == len(kb)
        # Even a's raw records copied under b's keys (a hostile or buggy writer) never verify:
        # the checksum covers the stored key, namespace fingerprint included.
        tier_b = b.tiers[0]
        tier_a = a.tiers[0]
        raws = a.run(tier_a.raw_get_many(ka), timeout=10)
        b.run(tier_b.raw_put_many(list(zip(kb, raws))), timeout=10)
        res, _ = _get(b, 3, kb, 2048)
        assert res.done == (), "a record copied from another tenant was served"
        corrupt = b.run(tier_b.stats(), timeout=10).counters["corrupt"]
        assert corrupt == len(kb)
        listed_b = b.run(_scan_keys(tier_b, b.namespace), timeout=10)
        assert not listed_b & set(ka)
        report("security-tenant-salt", keys=len(ka), cross_tenant_hits=0, copied_records_rejected=corrupt)
    finally:
        a.close()
        b.close()
        r = redis.Redis.from_url(redis_server.url)
        doomed = list(r.scan_iter(match=f"{prefix}:*"))
        if doomed:
            r.delete(*doomed)
        r.close()


async def _scan_keys(tier: RedisTier, ns: Namespace) -> set[bytes]:
    return {i.key async for i in tier.scan(ns)}


# ---- secrets and the CLI ---------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")} | {"COLUMNS": "250"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "tieredkv.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=e,
        cwd=ROOT,
        check=False,
    )


SECRETS = ("fieldpw-3x7", "urlpw-9q2", "envpw-4k8")


def test_cli_never_prints_secrets(tmp_path: Path) -> None:
    with RedisServer(requirepass=SECRETS[0]) as srv:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "tiers": [
                        {
                            "kind": "redis",
                            "name": "shared",
                            "url": srv.url,
                            "password": SECRETS[0],
                            "socket_timeout_s": 0.5,
                        },
                        {
                            "kind": "redis",
                            "name": "dead",
                            "url": f"redis://app:{SECRETS[1]}@127.0.0.1:{free_port()}/0",
                            "socket_timeout_s": 0.5,
                            "connect_timeout_s": 0.2,
                        },
                    ]
                }
            )
        )
        env = {"TIEREDKV_CONFIG": str(cfg)}
        runs = {
            "config show": _cli("config", "show", env=env),
            "config show --json --sources": _cli("config", "show", "--json", "--sources", env=env),
            "config show (env password)": _cli(
                "config", "show", "--json", env=env | {"TIEREDKV_TIERS__shared__PASSWORD": SECRETS[2]}
            ),
            "config check": _cli("config", "check", str(cfg)),
            "status": _cli("status", "--json", env=env),
            "status, wrong password from env": _cli(
                "status", env=env | {"TIEREDKV_TIERS__shared__PASSWORD": SECRETS[2]}
            ),
            "ls dead": _cli("ls", "-t", "dead", env=env),
        }
    leaks = [(name, s) for name, r in runs.items() for s in SECRETS if s in r.stdout + r.stderr]
    assert not leaks, leaks
    assert runs["config show"].returncode == 0 and "***" in runs["config show"].stdout
    shown = json.loads(runs["config show (env password)"].stdout)
    assert shown["tiers"][0]["password"] == "***"
    assert runs["status"].returncode == 3  # "dead" is unreachable
    assert "authentication failed" in " ".join(runs["status, wrong password from env"].stderr.split()) + " ".join(
        runs["status, wrong password from env"].stdout.split()
    )
    assert runs["ls dead"].returncode == 3 and "redis://127.0.0.1:" in " ".join(runs["ls dead"].stderr.split())
    report("security-cli-secrets", commands=len(runs), secrets=len(SECRETS), leaks=len(leaks))


@pytest.mark.parametrize(
    "tier",
    [
        {"kind": "redis", "password": 9_731_555},
        {"kind": "redis", "url": "http://app:9731555@127.0.0.1:6379"},
    ],
)
def test_config_errors_do_not_echo_secrets(tier: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [tier]}, env={})
    assert "9731555" not in str(ei.value) and "9_731_555" not in str(ei.value), str(ei.value)


def test_redis_tier_repr_and_errors_hide_url_credentials() -> None:
    port = free_port()
    tier = RedisTier(
        RedisTierConfig(url=f"redis://app:{SECRETS[1]}@127.0.0.1:{port}/0", password=SECRETS[0], connect_timeout_s=0.2)
    )

    async def go() -> str:
        try:
            await tier.get_many([Namespace(model="m").key(b"h" * 32, 0)])
        except Exception as e:  # noqa: BLE001
            return f"{e!r} {e} {e.__cause__}"
        finally:
            await tier.close()
        return ""

    text = asyncio.run(go())
    assert text and not any(s in text for s in SECRETS), text

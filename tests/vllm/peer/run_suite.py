"""vLLM 0.33.0's own offloading-connector unit suite, run against tieredkv (``./scripts/test-vllm``).

    python tests/vllm/peer/run_suite.py [--connector tieredkv|vllm] [--cache DIR] [--report DIR] [PYTEST ARGS]

1. **Fetch (cached).** The vLLM 0.33.0 source package from the package index (``pip download
   --no-binary vllm``; preparing its metadata needs ``setuptools_rust`` and ``setuptools_scm``,
   installed into this interpreter's environment when missing); from it only the suite
   (``tests/v1/kv_connector/unit/offloading_connector/``), the conftest and utils it imports, the
   ``__init__.py`` files on the way and vLLM's ``pyproject.toml`` (its pytest markers) are
   extracted, unmodified, into ``<cache>/vllm-0.33.0/``. The sdist itself is not kept.
2. **Offline model config.** The suite builds its ``VllmConfig`` from ``facebook/opt-125m``; a
   seeded Hugging Face cache (``<cache>/hf-home``: that model's ``config.json`` under a fixed
   revision, no weights, no tokenizer) with ``HF_HUB_OFFLINE=1`` keeps every test off the hub.
3. **Run.** pytest rooted in the extracted tree with the plugin :mod:`tieredkv_peer`, which swaps
   ``TieredKVConnector`` (and its scheduler class) in for vLLM's, with this checkout's tieredkv
   first on the path; the per-test report goes to ``<report>/report.{json,md}`` (printed).

Defaults: ``--cache`` ``$VLLM_PEER_CACHE`` or ``<venv>/vllm-peer-suite``; ``--report``
``<cache>/report-<connector>``. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
SUITE = "tests/v1/kv_connector/unit/offloading_connector"
#: What the suite imports besides its own directory (unmodified files of the sdist).
SUPPORT = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/conftest.py",
    "tests/v1/kv_connector/unit/utils.py",
)
HERE = Path(__file__).resolve().parent
TIEREDKV_ROOT = HERE.parents[2]

#: facebook/opt-125m's config.json as the hub serves it: all ``ModelConfig`` reads offline.
OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "_remove_final_layer_norm": False,
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
OPT_REVISION = "0" * 40  # any 40-hex revision: refs/main names it


def default_cache() -> Path:
    env = os.environ.get("VLLM_PEER_CACHE")
    return Path(env) if env else Path(sys.prefix) / "vllm-peer-suite"


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def ensure_suite(cache: Path) -> Path:
    """The extracted suite under ``cache`` (fetched and extracted on first use)."""
    root = cache / f"vllm-{VLLM_VERSION}"
    manifest = root / ".tieredkv-extracted.json"
    if manifest.is_file():
        return root
    for mod in ("setuptools_rust", "setuptools_scm"):
        if importlib.util.find_spec(mod) is None:
            say(f"installing {mod} (the vLLM sdist's metadata build needs it)")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", mod], check=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        say(f"downloading the vLLM {VLLM_VERSION} source package (~47 MB)")
        env = {**os.environ, "VLLM_TARGET_DEVICE": "empty", "VLLM_VERSION_OVERRIDE": VLLM_VERSION}
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", f"vllm=={VLLM_VERSION}", "--no-deps",
             "--no-binary", "vllm", "--no-build-isolation", "-d", tmp],
            check=True, env=env,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob(f"vllm-{VLLM_VERSION}.tar.gz")
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        staged = Path(tmp) / "tree"
        prefix = f"vllm-{VLLM_VERSION}/"
        wanted = set(SUPPORT)
        files: list[str] = []
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix(prefix)
                if not member.isfile() or not (name in wanted or name.startswith(SUITE + "/")):
                    continue
                member.name = name
                tar.extract(member, staged, filter="data")
                files.append(name)
        missing = wanted.difference(files)
        if missing or not any(f.endswith("/test_scheduler.py") for f in files):
            raise SystemExit(f"vLLM {VLLM_VERSION} sdist: missing {sorted(missing) or SUITE}")
        (staged / manifest.name).write_text(
            json.dumps({"sdist": sdist.name, "sha256": digest, "files": sorted(files)}, indent=1) + "\n"
        )
        shutil.rmtree(root, ignore_errors=True)
        staged.rename(root)
    say(f"vLLM {VLLM_VERSION}'s suite extracted to {root} ({len(files)} files)")
    return root


def ensure_hf_home(cache: Path) -> Path:
    """An offline Hugging Face cache that holds facebook/opt-125m's config.json only."""
    home = cache / "hf-home"
    repo = home / "hub" / "models--facebook--opt-125m"
    config = repo / "snapshots" / OPT_REVISION / "config.json"
    if not config.is_file():
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(OPT_125M_CONFIG, indent=2) + "\n")
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(OPT_REVISION)
    return home


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", choices=("tieredkv", "vllm"), default="tieredkv")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    args, pytest_args = ap.parse_known_args(argv)
    cache = (args.cache or default_cache()).resolve()
    root = ensure_suite(cache)
    report = (args.report or cache / f"report-{args.connector}").resolve()
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(ensure_hf_home(cache)),
        "PYTHONDONTWRITEBYTECODE": "1",
        # the plugin, then this checkout's tieredkv (ahead of any installed copy); the suite's own
        # ``tests`` package resolves from the working directory, which comes first
        "PYTHONPATH": os.pathsep.join([str(HERE), str(TIEREDKV_ROOT)]),
    }
    cmd = [
        sys.executable, "-m", "pytest", SUITE, "-p", "tieredkv_peer", f"--peer-connector={args.connector}",
        f"--peer-report={report}", "-p", "no:cacheprovider", "-q", "--timeout=300", *pytest_args,
    ]  # fmt: skip
    say(f"vLLM {VLLM_VERSION}'s offloading-connector suite against the {args.connector} connector")
    return subprocess.run(cmd, check=False, cwd=root, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())

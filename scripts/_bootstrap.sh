# Sourced by scripts/demo and scripts/test: create or reuse .venv and install what is needed.
# Usage: EXTRAS=dev source scripts/_bootstrap.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${TIEREDKV_VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-lmdb}"

pick_python() {
  for p in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 || continue
    if "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then echo "$p"; return; fi
  done
  echo "tieredkv needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 2
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating virtualenv $VENV"
  "$(pick_python)" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# Re-install only when pyproject.toml, setup.py, the C helper or the extras change.
stamp="$VENV/.tieredkv-$(cat pyproject.toml setup.py tieredkv/_native/*.c tieredkv/_native/xxhash/* scripts/_bootstrap.sh | sha1sum | cut -c1-12)-${EXTRAS//,/_}"
if [ ! -f "$stamp" ]; then
  if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "==> installing torch (CUDA machine)"
      "${PIP[@]}" install torch
    else
      # No CUDA: the CPU build (a local wheel on these machines). An unpinned torch would pull
      # a multi-GB CUDA build.
      echo "==> installing CPU torch 2.13.0"
      "${PIP[@]}" install "torch==2.13.0"
    fi
  fi
  echo "==> installing tieredkv[$EXTRAS]"
  "${PIP[@]}" install -e ".[$EXTRAS]"
  "$VENV/bin/python" -c 'import tieredkv' # fail loudly if the install did not work
  # pip -q hides setup.py's own warning: say here when the C helper did not build (docs/native.md)
  "$VENV/bin/python" -c 'import tieredkv.format as f; f.NATIVE or print("WARNING: tieredkv._fastrec (the C helper) did not build: pure-Python record checks, slower reads (docs/native.md)")' >&2
  rm -f "$VENV"/.tieredkv-*
  touch "$stamp"
fi

# Debian packages a command needs (tests: redis-server, redis-cli, redis-benchmark).
source "$ROOT/scripts/_apt.sh"

# Sourced by the scripts: ensure_apt BINARY PACKAGE... installs Debian packages when BINARY is missing.
ensure_apt() {  # ensure_apt BINARY PACKAGE...
  local bin="$1"; shift
  command -v "$bin" >/dev/null 2>&1 && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "==> installing Debian packages: $*"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  command -v "$bin" >/dev/null 2>&1 || { echo "could not install $bin" >&2; exit 2; }
}

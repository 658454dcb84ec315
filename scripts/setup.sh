#!/usr/bin/env bash
# Create (or bring up to date) the development environment in .venv/ at the repository root:
# first the system packages the job and tests load (scripts/system-deps.sh: installed when root or
# password-less sudo allows, else a one-message stop that names them), then the three Gyre
# distributions installed editable plus the test tools. Idempotent: when nothing that affects the
# installation changed since the last successful run, it returns at once.
#
#   setup.sh [run|test]        what the environment is for (default test: also Node.js for the
#                              Claude Code tests)
#   PYTHON=/path/to/python3.x  interpreter for a new .venv/ (default: python3.11, else python3)
#   GYRE_SETUP_FORCE=1         reinstall even if .venv/ looks up to date
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/system-deps.sh "${1:-test}"
VENV=.venv
STAMP="$VENV/.gyre-setup-stamp"
PIP_QUIET=(--quiet --disable-pip-version-check)

log() { echo "setup: $*" >&2; }

venv_ok() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null &&
        "$VENV/bin/python" -m pip --version >/dev/null 2>&1
}

if ! venv_ok; then
    if [ -n "${PYTHON:-}" ]; then
        py="$PYTHON"
    elif command -v python3.11 >/dev/null 2>&1; then
        py=python3.11
    else
        py=python3
    fi
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        log "error: Gyre needs Python >= 3.11, and '$py' is missing or older (set PYTHON=...)"
        exit 1
    fi
    if [ -e "$VENV" ]; then
        log "$VENV/ is incomplete (no working python or pip); recreating it"
        rm -rf "$VENV"
    fi
    log "creating $VENV/ with $("$py" --version 2>&1)"
    if ! "$py" -m venv "$VENV"; then
        log "error: '$py -m venv' failed; on Debian/Ubuntu install python3-venv (or python3.11-venv)"
        exit 1
    fi
fi

# Everything that changes what gets installed; a code change alone needs no reinstall (editable).
fingerprint=$(
    "$VENV/bin/python" - <<'PY'
import hashlib, pathlib, sys
h = hashlib.sha256(sys.version.encode())
for p in ["gyre_core/pyproject.toml", "gyre_megatron/pyproject.toml", "gyre_sglang/pyproject.toml",
          "requirements-dev.txt", "scripts/setup.sh",
          "gyre_sglang/src/gyre_sglang/cpu_patches/sglang-0.5.23-cpu-requirements.txt",
          "gyre_sglang/src/gyre_sglang/install_cpu.py"]:
    h.update(p.encode() + b"\0" + pathlib.Path(p).read_bytes())
print(h.hexdigest())
PY
)

if [ -z "${GYRE_SETUP_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] &&
    "$VENV/bin/python" -c '
import importlib.util, sys
import gyre_core, gyre_megatron, gyre_sglang, pytest  # light; sglang is only located (importing it takes seconds)
sys.exit(any(importlib.util.find_spec(m) is None for m in ("sglang", "mooncake", "megatron.core")))' 2>/dev/null; then
    exit 0
fi

log "installing gyre-core, gyre-megatron, gyre-sglang (editable) and test tools into $VENV/"
rm -f "$STAMP"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" --upgrade pip
# One pip command, so gyre-core==0.1.0 (required by the plugins) resolves to ./gyre_core and the
# versions SGLang pins (transformers, tokenizers, ...) are resolved together with everything else.
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" \
    -e ./gyre_core -e ./gyre_megatron -e ./gyre_sglang -r requirements-dev.txt \
    -r gyre_sglang/src/gyre_sglang/cpu_patches/sglang-0.5.23-cpu-requirements.txt
# SGLang itself for its CPU engine (the real server the sglang-marked tests start).
log "installing SGLang for CPU (gyre-sglang-install-cpu)"
"$VENV/bin/gyre-sglang-install-cpu" --no-dependencies  # its requirement list went in with the rest above
echo "$fingerprint" >"$STAMP"
log "done"

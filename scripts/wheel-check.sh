#!/usr/bin/env bash
# Build the three wheels, install them into an empty virtual environment (no checkout on its path,
# no editable installs), and run one step of the default job (`gyre-orchestrate run --steps 1`, at
# the e2e tests' group sizes) from a directory outside the checkout: what a user who installs Gyre
# from an index gets. Prints one JSON line at the end.
#
#   PYTHON=python3.11     interpreter for the new venv (default: python3.11, else python3)
#   GYRE_WHEEL_KEEP=1     keep the temporary folder (its path is printed)
#   GYRE_TORCH_VERSION    the torch installed first (default 2.13.0, this machine's CPU build)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gyre-wheel-check.XXXXXX")
if [ -z "${GYRE_WHEEL_KEEP:-}" ]; then trap 'rm -rf "$tmp"' EXIT; else echo "wheel-check: keeping $tmp" >&2; fi
log() { echo "wheel-check: $*" >&2; }
t0=$(date +%s)
pipq=(--quiet --disable-pip-version-check)

log "building wheels into $tmp/dist"
"$py" -m venv "$tmp/build-venv"
"$tmp/build-venv/bin/python" -m pip install "${pipq[@]}" --upgrade pip
"$tmp/build-venv/bin/python" -m pip wheel "${pipq[@]}" --no-deps -w "$tmp/dist" \
    "$repo/gyre_core" "$repo/gyre_megatron" "$repo/gyre_sglang"
rm -rf "$tmp/build-venv"

# What each wheel must carry for a run without the checkout.
"$py" - "$tmp/dist" <<'PY'
import sys, zipfile
from email.parser import Parser
from pathlib import Path

need = {
    "gyre_core": ["gyre_core/cli.py", "gyre_core/py.typed"],
    "gyre_megatron": ["gyre_megatron/cpu_patches/__init__.py", "gyre_megatron/cpu_patches/megatron_core_0_16.py",
                      "gyre_megatron/cpu_patches/megatron_core_0_13.py"],
    "gyre_sglang": ["gyre_sglang/cpu_patches/sglang_0_5_23.py", "gyre_sglang/cpu_patches/site/sitecustomize.py",
                    "gyre_sglang/cpu_patches/sglang-0.5.23-cpu-requirements.txt"],
}
wheels = {p.name.split("-")[0]: p for p in Path(sys.argv[1]).glob("*.whl")}
assert sorted(wheels) == sorted(need), wheels
for name, files in need.items():
    with zipfile.ZipFile(wheels[name]) as z:
        names = set(z.namelist())
        missing = [f for f in files if f not in names]
        assert not missing, f"{wheels[name].name} lacks {missing}"
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
        assert meta["Requires-Python"] == ">=3.11", (name, meta["Requires-Python"])
        assert meta["License-Expression"] == "Apache-2.0", (name, meta["License-Expression"])
        assert any(n.endswith("licenses/LICENSE") for n in names), f"{name}: no LICENSE in the wheel"
        requires = meta.get_all("Requires-Dist") or []
        if name in ("gyre_megatron", "gyre_sglang"):
            assert any(r.startswith("mooncake-transfer-engine-non-cuda") for r in requires), (name, requires)
print("wheel-check: wheel contents and metadata ok", file=sys.stderr)
PY

log "installing the wheels into an empty venv"
"$py" -m venv "$tmp/venv"
venv_py="$tmp/venv/bin/python"
"$venv_py" -m pip install "${pipq[@]}" --upgrade pip
# The machine's torch first, as a user does (here the CPU build; a bare `torch` is the CUDA one).
"$venv_py" -m pip install "${pipq[@]}" "torch==${GYRE_TORCH_VERSION:-2.13.0}"
# One command, so the plugins' gyre-core==0.1.0 resolves to the wheel beside them.
"$venv_py" -m pip install "${pipq[@]}" "$tmp"/dist/*.whl
"$tmp/venv/bin/gyre-sglang-install-cpu"
t_install=$(( $(date +%s) - t0 ))

mkdir -p "$tmp/elsewhere"
cd "$tmp/elsewhere"
unset PYTHONPATH
# Nothing may come from the checkout: every Gyre module is the installed one.
"$venv_py" - "$repo" <<'PY'
import sys
import gyre_core, gyre_megatron, gyre_sglang
import gyre_megatron.cpu_patches, gyre_sglang.cpu_patches
repo = sys.argv[1]
for m in (gyre_core, gyre_megatron, gyre_sglang, gyre_megatron.cpu_patches, gyre_sglang.cpu_patches):
    assert not m.__file__.startswith(repo + "/"), f"{m.__name__} imported from the checkout: {m.__file__}"
    assert "site-packages" in m.__file__, m.__file__
PY
"$tmp/venv/bin/gyre-orchestrate" --version >&2
log "gyre-orchestrate run --steps 1 in $PWD"
t1=$(date +%s)
# The default job with 2 groups of 2 a step, not 4 of 4: what is checked is that the installed
# wheels carry a whole step (ranks, engines, proxy, harnesses, publication), not the default's
# rollout volume, which test_embedded_run.py runs in full.
"$tmp/venv/bin/gyre-orchestrate" run --steps 1 --set scheduler.group_size=2 --set scheduler.groups_per_step=2 \
    --out run --json-summary >summary.json
t_run=$(( $(date +%s) - t1 ))
"$venv_py" - "$t_install" "$t_run" <<'PY'
import json, sys
from pathlib import Path

summary = json.loads(Path("summary.json").read_text().strip().splitlines()[-1])
assert summary["status"] == "ok" and summary["steps"] == 1, summary
assert Path("run/checkpoint/model.safetensors").stat().st_size > 0
print(json.dumps({"wheel_check": "ok", "install_s": int(sys.argv[1]), "run_s": int(sys.argv[2]),
                  "steps": summary["steps"], "rewards": summary["rewards"]}))
PY

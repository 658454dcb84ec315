#!/usr/bin/env bash
# The GPU check: install what the `gpu` test group needs on a machine with NVIDIA GPUs, run the
# group on one GPU, and print one JSON summary (tests passed/failed/skipped, the GPU, each
# measured figure the tests reported, wall time). Meant to finish in under 10 minutes.
#
#   scripts/gpu-check.sh                 from the repository root or anywhere
#   GYRE_GPU_PYTHON=python3              an interpreter whose torch sees CUDA (default: python3);
#                                        its packages are reused (a venv with system site packages)
#   GYRE_WHEELHOUSE=DIR                  install offline from wheels in DIR (no package index)
#   GYRE_GPU_OUT=DIR                     where the report, the JUnit XML and the log go
#                                        (default: $OUT when set, else gpu-check-out/)
#   GYRE_GPU_SKIP_INSTALL=1              use the environment as it is
#
# What the group measures: a real model's training state and a SGLang engine taking turns on one
# GPU across role switches (NVML per phase, each phase's time), bf16 with a float32 optimizer
# and bf16 publication (Qwen3 and Qwen3-MoE layouts),
# the offloader on device tensors, the engine's memory saver, bf16 with full activation
# recompute ([training.megatron]) against bf16 without, TransformerEngine's layer spec (fused
# kernels, TE attention) against the local spec with each one's first step time, and a bf16 core
# resumed from its distributed checkpoint (master weights included). Each check that measures
# something prints one JSON line; the summary comes last.
#
# Not covered: context parallelism (training.cp is not offered yet), TP 2 on two GPUs (no test
# asks for two).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$(date +%s)
out=${GYRE_GPU_OUT:-${OUT:-gpu-check-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log() { echo "gpu-check: $*" >&2; }

py=${GYRE_GPU_PYTHON:-python3}
if ! "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    log "error: '$py' has no torch that sees a GPU (set GYRE_GPU_PYTHON, or install a CUDA build of torch)"
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true

venv=.venv-gpu
if [ -z "${GYRE_GPU_SKIP_INSTALL:-}" ]; then
    [ -x "$venv/bin/python" ] || "$py" -m venv --system-site-packages "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    if [ -n "${GYRE_WHEELHOUSE:-}" ]; then
        pip+=(--no-index --find-links "$GYRE_WHEELHOUSE")
    fi
    log "installing Gyre (editable), megatron-core, Mooncake, nvidia-ml-py and the test tools"
    # torch stays the interpreter's own CUDA build: nothing below may replace it
    "${pip[@]}" --no-deps -e ./gyre_core -e ./gyre_megatron -e ./gyre_sglang
    "${pip[@]}" "megatron-core>=0.13,<0.17" "mooncake-transfer-engine-non-cuda>=0.3.10" nvidia-ml-py pluggy \
        "pytest>=8" "pytest-timeout>=2.2" hypothesis transformers safetensors numpy packaging httpx fastapi uvicorn
    # SGLang's GPU build is large; without it the engine's GPU tests skip and the summary says so
    if ! "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sglang") is None)'; then
        "${pip[@]}" "sglang>=0.5.22,<0.5.24" || log "SGLang could not be installed: its GPU tests will skip"
    fi
fi
python=$venv/bin/python
[ -x "$python" ] || python=$py

log "running the gpu group"
rc=0
GYRE_GPU_REPORT="$out/gpu-report.jsonl" PYTHONUNBUFFERED=1 timeout 540 "$python" -m pytest -m gpu -p no:cacheprovider \
    -q -rs --junitxml="$out/gpu-junit.xml" integration_tests tests 2>&1 | tee "$out/gpu-check.log" || rc=$?

"$python" - "$out" "$rc" "$t0" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path

out, rc, t0 = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"check": "gpu", "rc": rc, "wall_s": round(time.time() - t0, 1)}
try:
    import torch
    summary["gpu"] = torch.cuda.get_device_name(0)
    summary["torch"] = torch.__version__
except Exception as e:  # noqa: BLE001
    summary["gpu"] = f"unknown ({e})"
junit = out / "gpu-junit.xml"
if junit.exists():
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = [c for s in suites for c in s.iter("testcase")]
    def state(c):
        return "failed" if c.find("failure") is not None or c.find("error") is not None else (
            "skipped" if c.find("skipped") is not None else "passed")
    summary["tests"] = {f"{c.get('classname')}::{c.get('name')}": state(c) for c in tests}
    for k in ("passed", "failed", "skipped"):
        summary[k] = sum(v == k for v in summary["tests"].values())
    summary["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:160] for c in tests
                                      if c.find("skipped") is not None})
report = out / "gpu-report.jsonl"
summary["figures"] = [json.loads(line) for line in report.read_text().splitlines() if line.strip()] if report.exists() else []
for figure in summary["figures"]:  # one line per check with what it measured, then the summary
    print(json.dumps(figure))
print(json.dumps(summary))
PY
exit "$rc"

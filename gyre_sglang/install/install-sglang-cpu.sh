#!/usr/bin/env bash
# Install SGLang 0.5.23 for its CPU engine into an existing environment, in the order that works
# without CUDA (see ../shared/notes/sglang-on-cpu.md):
#   1. the light dependencies (sglang-cpu-requirements.txt), keeping the installed torch;
#   2. sglang itself and its two pure-Python pins, without dependencies (a plain `pip install
#      sglang` pulls CUDA-only wheels: sglang-kernel, flashinfer, torch==2.14.1, ...).
# The three modules the CPU engine still imports (triton, torchvision, sgl_kernel) are stood in for
# by patches/sglang/, applied by gyre_sglang.server in every server process.
# On a GPU cluster install SGLang the usual way instead: `pip install sglang==0.5.23`.
#
#   install-sglang-cpu.sh [PYTHON]      (default: python3; scripts/setup.sh passes .venv/bin/python)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-python3}"
pip=("$py" -m pip install --quiet --disable-pip-version-check)

torch_version=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" >"$constraints"

"${pip[@]}" -c "$constraints" -r "$here/sglang-cpu-requirements.txt"
"${pip[@]}" --no-deps sglang==0.5.23 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0
"$py" - <<'PY'
from importlib.metadata import version
assert version("sglang") == "0.5.23", version("sglang")
PY

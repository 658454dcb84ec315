"""Install SGLang for its CPU engine into this environment: ``gyre-sglang-install-cpu``.

A plain ``pip install sglang`` pulls CUDA-only wheels (sglang-kernel, flashinfer, a CUDA torch).
On a machine without CUDA this installs, in the order that works:

1. the light dependencies SGLang's CPU engine needs (``cpu_patches/sglang-<v>-cpu-requirements.txt``),
   keeping the installed torch;
2. SGLang itself and its pure-Python pins, without dependencies.

The three modules the CPU engine still imports (``triton``, ``torchvision``, ``sgl_kernel``) are
stood in for by :mod:`gyre_sglang.cpu_patches`, which :mod:`gyre_sglang.server` applies in every
server process it starts. On a GPU cluster install SGLang the usual way instead
(``pip install sglang==<v>``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib.metadata import version as installed_version
from pathlib import Path

__all__ = ["NO_DEPS", "SUPPORTED", "main", "requirements_file"]

NO_DEPS: dict[str, tuple[str, ...]] = {
    "0.5.22": ("sglang==0.5.22", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0"),
    "0.5.23": ("sglang==0.5.23", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0"),
}
"""Per supported release: what is installed with ``--no-deps`` (SGLang and its pure-Python pins)."""
SUPPORTED = tuple(NO_DEPS)


def requirements_file(version: str) -> Path:
    return Path(__file__).resolve().parent / "cpu_patches" / f"sglang-{version}-cpu-requirements.txt"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gyre-sglang-install-cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sglang", default=SUPPORTED[-1], choices=SUPPORTED, help="the SGLang release (default %(default)s)")
    ap.add_argument("--no-dependencies", action="store_true",
                    help="step 2 only: the requirement list was installed already, resolved together with others")
    args = ap.parse_args(argv)
    if not args.no_dependencies:
        import torch

        with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
            constraints.write(f"torch=={torch.__version__.split('+')[0]}\n")  # never swap the installed torch
            constraints.flush()
            _pip("-c", constraints.name, "-r", str(requirements_file(args.sglang)))
    _pip("--no-deps", *NO_DEPS[args.sglang])
    got = installed_version("sglang")
    if got != args.sglang:
        print(f"gyre-sglang-install-cpu: expected sglang {args.sglang}, found {got}", file=sys.stderr)
        return 1
    print(f"gyre-sglang-install-cpu: sglang {got} installed for its CPU engine", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

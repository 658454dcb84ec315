"""What a run's training side needs loaded, checked in the orchestrator before any rank starts.

Light on purpose: it locates megatron-core instead of importing it (seconds, and warnings), but
does load Mooncake's transfer engine, because what fails there is the dynamic loader
(``libibverbs.so.1``), which only a real import shows.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

__all__ = ["model_problems", "mooncake_problem", "training_side_problems"]

MOONCAKE_FIX = ("install the system package libibverbs1 (as root: apt-get install -y libibverbs1; "
                "without root see the README, 'System packages')")


def mooncake_problem() -> str | None:
    """Why Mooncake's transfer engine cannot be loaded here, or ``None`` when it can."""
    from gyre_core.upstream_noise import mooncake_quiet_env

    mooncake_quiet_env()  # its log level is read once, at this first import
    try:
        importlib.import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("mooncake"):
            return ("Mooncake transfer engine: not installed (pip install mooncake-transfer-engine-non-cuda "
                    "on CPU, mooncake-transfer-engine with CUDA)")
        return f"Mooncake transfer engine: cannot be loaded ({exc})"
    except ImportError as exc:
        msg = str(exc)
        if "libibverbs" in msg:
            return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0]}); {MOONCAKE_FIX}"
        return f"Mooncake transfer engine: cannot be loaded ({msg.splitlines()[0] if msg else exc!r})"
    return None


def model_problems(model_dir: str) -> list[str]:
    """Why the training side cannot start from the HF checkpoint ``model_dir`` (empty: it can)."""
    from gyre_megatron.hf_import import UnsupportedModel, spec_from_hf_dir

    try:
        spec_from_hf_dir(model_dir)
    except UnsupportedModel as exc:
        return [f"model.dir: {exc}"]

    if not any(Path(model_dir).glob("*.safetensors")):
        return [f"model.dir: {model_dir} has no *.safetensors weights (convert .bin checkpoints first)"]
    return []


def training_side_problems(cells: int, model_dir: str = "") -> list[str]:
    problems: list[str] = []
    if model_dir and (Path(model_dir) / "config.json").is_file():  # a missing one is the core's to report
        problems.extend(model_problems(model_dir))
    for mod, fix in (("torch", "pip install torch"), ("megatron.core", "pip install 'megatron-core>=0.13,<0.17'")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{mod}: not installed ({fix})")
    if cells > 1:  # satellites join a running step by pulling the core's weights over Mooncake
        p = mooncake_problem()
        if p:
            problems.append(p)
    return problems

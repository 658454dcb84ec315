"""Before a live run starts anything: can every part the configuration names be loaded?

A run that cannot start should say why in seconds, one line per missing part, instead of failing
minutes later in a rank's traceback (a missing system library behind Mooncake, an SGLang that is
not installed, a harness binary that is not on PATH). The core checks what it owns (the model
directory, the harness executable, that a training and a serving backend are installed); each
plugin checks its own dependencies through the ``gyre_preflight`` hook.
"""

from __future__ import annotations


import json
import os
import shutil
from pathlib import Path
from typing import Any

from gyre_core.config import ConfigError
from gyre_core.orchestrator.run_config import RunConfig

__all__ = ["PreflightFailed", "preflight", "check_preflight"]

MODEL_FILES = ("config.json", "tokenizer_config.json")


class PreflightFailed(ConfigError):
    """Parts of the configured run cannot be loaded; ``problems`` has one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("cannot start the run:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _executable(name: str) -> bool:
    if os.sep in name:
        return os.path.isfile(name) and os.access(name, os.X_OK)
    return shutil.which(name) is not None


def _core_problems(cfg: RunConfig, pm: Any) -> list[str]:
    problems: list[str] = []
    if cfg.model.dir:
        d = Path(cfg.model.dir)
        if not d.is_dir():
            problems.append(f"model.dir: {d} is not a directory (an HF model folder with config.json and a tokenizer)")
        else:
            for name in MODEL_FILES:
                if not (d / name).is_file():
                    problems.append(f"model.dir: {d} has no {name}")
            if (d / "config.json").is_file():
                try:
                    json.loads((d / "config.json").read_text())
                except (OSError, ValueError) as exc:
                    problems.append(f"model.dir: {d / 'config.json'} is not readable JSON ({exc})")
    h = cfg.harness
    if h.kind == "claude-code" and not _executable(h.claude_bin):
        problems.append(f"harness.claude_bin: {h.claude_bin!r} is not an executable on PATH "
                        "(install it: npm install -g @anthropic-ai/claude-code, or set harness.claude_bin)")
    if h.kind == "command" and h.command and not _executable(h.command[0]):
        problems.append(f"harness.command: {h.command[0]!r} is not an executable on PATH")
    from gyre_core.tasks.file_tasks import file_task_problems

    problems += file_task_problems(cfg.task.model_dump())
    from gyre_core.orchestrator.sandbox import sandbox_problem

    if (why := sandbox_problem(h.sandbox)) is not None:
        problems.append(why)
    import importlib.util

    for backend, module, install in (("tensorboard", "tensorboard", "pip install tensorboard"),
                                     ("wandb", "wandb", "pip install wandb")):
        if backend in cfg.metrics.backends and importlib.util.find_spec(module) is None:
            problems.append(f"metrics.backends: {backend!r} needs the {module} package ({install}, "
                            "or leave it out of metrics.backends)")
    seams = {s for info in pm.hook.gyre_plugin_info() for s in info.get("seams", [])}
    if "training" not in seams:
        problems.append("training backend: no plugin provides it (pip install gyre-megatron)")
    if "serving" not in seams:
        problems.append("serving backend: no plugin provides it (pip install gyre-sglang)")
    return problems


def preflight(cfg: RunConfig, pm: Any) -> list[str]:
    """Every problem that would stop ``cfg`` from running, one line each (empty: all loadable)."""
    problems = _core_problems(cfg, pm)
    for answer in pm.hook.gyre_preflight(config=cfg.as_dict()):
        problems.extend(answer or [])
    return problems


def check_preflight(cfg: RunConfig, pm: Any) -> None:
    """Raise :class:`PreflightFailed` when :func:`preflight` finds anything."""
    problems = preflight(cfg, pm)
    if problems:
        raise PreflightFailed(problems)

"""The typed options each plugin is handed, built once from the run configuration.

One function per seam: each fills an options type of :mod:`gyre_core.interfaces` from the
``section.key`` settings it is made of, so a setting's path from the config file to the plugin
that acts on it is one assignment here. Plugins read fields and keep no defaults of their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from gyre_core.interfaces import (
    EngineOptions,
    LaunchOptions,
    MooncakeOptions,
    PublicationOptions,
    ServingOptions,
    TaskOptions,
    TrainingOptions,
)
from gyre_core.orchestrator.run_config import RunConfig

__all__ = ["engine_options", "launch_options", "mooncake_options", "publication_options", "serving_options",
           "task_options", "training_options"]


def mooncake_options(cfg: RunConfig) -> MooncakeOptions:
    """Every Mooncake engine of the run speaks one protocol; each advertises its own node's
    address, found toward the control host on a cluster."""
    peer = cfg.cluster.control_host if cfg.cluster.launcher != "local" else ""
    return MooncakeOptions(protocol=cfg.publication.protocol, device=cfg.publication.device, peer=peer)


def publication_options(cfg: RunConfig, out: Path) -> PublicationOptions:
    p = cfg.publication
    return PublicationOptions(transport=p.transport, folder=str(out / "weights"), mooncake=mooncake_options(cfg),
                              version_wait_s=p.version_wait_s, load_attempts=p.load_attempts)


def launch_options(cfg: RunConfig, out: Path) -> LaunchOptions:
    c = cfg.cluster
    return LaunchOptions(launcher=c.launcher, control_host=c.control_host, control_port=c.control_port,
                         key_file=c.key_file or str(out / "control.key"), join_timeout_s=c.join_timeout_s,
                         ray_address=c.ray_address, ray_gpus_per_rank=c.ray_gpus_per_rank,
                         ray_resources_per_rank=dict(c.ray_resources_per_rank))


def training_options(cfg: RunConfig, out: Path, model: Mapping[str, Any],
                     announce: Callable[[str], None] | None = None) -> TrainingOptions:
    """``model``: the tiny model's sizes (unused when ``model.dir`` names a checkpoint)."""
    t = cfg.training
    return TrainingOptions(
        cells=cfg.scheduler.cells, model=dict(model),
        init_from=str(Path(cfg.model.dir).resolve()) if cfg.model.dir else "",
        pp=t.pp, tp=t.tp, ep=t.ep, precision=t.precision, transformer_impl=t.transformer_impl,
        lr=t.lr, clip_grad=t.clip_grad,
        megatron=dict(t.megatron), total_steps=cfg.run.steps,
        objective=t.objective_config(),
        # the objective's weights (W_t, or V_t) already normalise the loss: no division by tokens
        normalise_by_tokens=False,
        burst_steps=cfg.scheduler.steps_per_burst,
        # one micro-step queue per step, plus the re-streams of steps that lost a cell
        max_steps=cfg.run.steps + 8,
        step_timeout_s=t.step_timeout_s, data_timeout_s=t.collective_timeout_s,
        log_dir=str(out.resolve()),  # rank<N>.log, beside the engines' logs
        publication=publication_options(cfg, out), launch=launch_options(cfg, out), announce=announce)


def engine_options(cfg: RunConfig, api_key: str, log_path: Path, *, base_gpu_id: int, tp_size: int,
                   memory_saver: bool = False, mooncake: bool = True) -> EngineOptions:
    """One engine of the run: ``memory_saver`` for a cell's engine (it yields its memory to
    training); ``mooncake`` when it pulls weights or hands off KV (not an evaluation's engine)."""
    s = cfg.serving
    return EngineOptions(max_total_tokens=s.max_total_tokens, extra_args=tuple(s.extra_args),
                         start_timeout_s=s.start_timeout_s, api_key=api_key, log_path=str(log_path),
                         base_gpu_id=base_gpu_id, tp_size=tp_size, memory_saver=memory_saver,
                         mooncake=mooncake_options(cfg) if mooncake else None)


def serving_options(cfg: RunConfig, url: str, api_key: str) -> ServingOptions:
    """One engine's serving side and client: the run's engine key, and how loads are checked."""
    p = cfg.publication
    return ServingOptions(url=url, api_key=api_key, version_wait_s=p.version_wait_s, load_attempts=p.load_attempts)


def task_options(cfg: RunConfig, held_out: bool = False) -> TaskOptions:
    """The ``[task]`` section as the task plugins read it; ``held_out``: its held-out file
    (``task.eval``) in place of the train file, drawn the same way."""
    t = cfg.task
    return TaskOptions(name=t.name, turns=t.turns, train=t.eval if held_out else t.train,
                       prompt_template=t.prompt_template, reward=t.reward, evaluator=tuple(t.evaluator),
                       setup=tuple(t.setup), setup_timeout_s=t.setup_timeout_s)


"""The configuration of a live run: one TOML (or YAML) file, validated before anything starts.

Every knob of the scheduler (``[scheduler]``, the fields of
:class:`~gyre_core.config.SchedulerConfig`) and of the data plane, the model, the cells, the
harness and the proxy lives here; command-line flags override the file (``--set
section.key=value`` for any of them). Unknown sections or keys, wrong types and out-of-range values
are :class:`~gyre_core.config.ConfigError` naming ``section.key`` -- a typo must not silently run
a multi-hour job with a default. Each table is a pydantic model whose fields carry their type,
default and range; :meth:`RunConfig.validate` holds only the checks that span settings. The
plugins get what they need from here as typed options
(:mod:`gyre_core.orchestrator.plugin_options`).

Defaults describe the *embedded* job: a tiny model built locally, a core and one satellite on
one CPU machine, the built-in ``number-guess`` task, three training steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gyre_core.config import ConfigError, SchedulerConfig
from gyre_core.interfaces import CORRECTIONS, OBJECTIVE_CLIPS, OBJECTIVES, ObjectiveConfig

__all__ = ["HARNESSES", "RunConfig", "load_run_config"]

HarnessKind = Literal["number-guess", "reply", "replay", "command", "claude-code"]
HARNESSES: tuple[str, ...] = get_args(HarnessKind)


class _Section(BaseModel):
    """One table of the file. Each setting is declared once, with its type, its default and its
    range beside it; a wrong type is refused, not converted (``true`` is no number, ``"3"`` no
    integer), and so are unknown keys: a typo must not silently run a multi-hour job with a
    default. Settings that depend on each other are checked by :meth:`RunConfig.validate`."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)



class RunSection(_Section):
    steps: int = Field(3, ge=1)
    """Training steps to run (policy versions produced)."""
    seed: int = Field(0, ge=0)
    out_dir: str = ""
    """Where the run writes its journal and outputs; empty: a new runs/run-<time>/ folder."""
    resume: bool = False
    """Continue the run journalled in ``out_dir`` instead of starting a new one."""
    max_wall_s: float = Field(1800.0, gt=0)
    """Give up (cleanly, with a summary) after this long."""


class ModelSection(_Section):
    dir: str = ""
    """A Hugging Face model directory (Qwen2, Qwen3, Llama or Qwen3-MoE; safetensors) whose weights the
    trainer and the engines start from, every size read from its ``config.json`` (the sizes below
    are then unused); a run's ``checkpoint/`` folder is one. Empty: build the tiny model from the
    sizes below."""
    name: str = "gyre-policy"
    """The model name harnesses send; any other name is refused by the proxy."""
    hidden_size: int = 256
    """Large enough that a training step costs seconds, so a satellite can join it mid-way."""
    num_layers: int = 4
    vocab_size: int = 1024
    max_seq_len: int = 2048


class TaskSection(_Section):
    name: str = "number-guess"
    """A built-in task (``number-guess``, ``sum-file``, ``digits``), one a plugin provides, or
    ``file`` (the default when ``train`` is set): the user's own tasks from a file."""
    turns: int = Field(3, ge=1)
    train: str = ""
    """Task file (JSON lines, or a JSON list of records); see :mod:`gyre_core.tasks.file_tasks`."""
    prompt_template: str = ""
    """Formats each record's fields into its prompt (empty: the record's ``prompt``)."""
    reward: str = ""
    """``path/to/file.py:function`` scoring a record's workspace (or use ``evaluator``)."""
    evaluator: list[str] = Field(default_factory=list)
    """A command run in the workspace, in the sandbox: exit 0/1, or a last line ``{"reward": x}``."""
    eval: str = ""
    """Held-out task file (same format as ``train``), run by ``[eval]`` and never trained on."""
    setup: list[str] = Field(default_factory=list)
    """A command run in each workspace, in the sandbox, after the task's files are in and before
    the harness starts (install the repository, build it); if it fails the execution is excluded."""
    setup_timeout_s: float = Field(300.0, gt=0)


class EvalSection(_Section):
    """Held-out evaluation during the run (:mod:`gyre_core.orchestrator.evaluation`)."""

    interval: int = Field(0, ge=0)
    """Evaluate the policy after every ``interval`` steps (0: never during the run); the run's
    last version is evaluated whenever ``task.eval`` is set."""
    before_train: bool = False
    """Also evaluate the starting policy (version 0)."""
    samples: int = Field(1, ge=1)
    """Executions per eval task (the pass rate is pass@samples)."""
    max_concurrent: int = Field(4, ge=1)
    """Evaluation executions running at once: their load on the rollout engines is bounded by it."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this."""


class HarnessSection(_Section):
    kind: HarnessKind = "number-guess"
    command: list[str] = Field(default_factory=list)
    timeout_s: float = 180.0
    """Harness timeout: past it the harness is killed and its workspace assessed and used."""
    overall_budget_s: float = Field(420.0, gt=0)
    """Overall budget of an execution incl. evaluation retries: past it it is discarded."""
    evaluator_timeout_s: float = Field(0.0, ge=0)
    """Bound on one evaluator attempt (a hung one is unresolved and retried within the budget);
    0: a quarter of ``overall_budget_s``, between 1 and 60 s (:attr:`evaluator_bound_s`)."""
    sandbox: Literal["bwrap", "none"] = "bwrap"
    """``bwrap``: each harness in its own bubblewrap sandbox (own /proc, run folder hidden, network
    only to the proxy); ``none``: unsandboxed, explicitly."""
    sandbox_expose: list[str] = Field(default_factory=list)
    """Host paths a sandboxed harness may read besides the Python environment and the files its
    command names (e.g. a tool's folder under a home that the sandbox empties)."""
    sandbox_hide: list[str] = Field(default_factory=list)
    """Host paths hidden from the harness and the task's set-up (not from the evaluator) besides
    the task files, the reward or evaluator source and the run folder, which always are: e.g. a
    task generator that holds the solutions."""
    claude_bin: str = "claude"
    """The Claude Code executable (``harness.kind = "claude-code"``)."""
    args: list[str] = Field(default_factory=list)
    """Extra arguments for the Claude Code CLI (e.g. ``--tools``, ``--system-prompt``, ``--max-turns``)."""
    trace: str = ""
    """``replay``: the JSON-lines trace (the simulator's format) whose executions are replayed;
    empty: one synthesised from the paper preset."""
    time_scale: float = Field(0.002, gt=0)
    """``replay``: seconds of replay per recorded second (0.002: a 2 h execution in 14.4 s). Set
    ``timeout_s`` to the recording's harness timeout times this, so timeouts land where they did."""
    replay_calls: int = Field(3, ge=1)
    """``replay``: model calls per execution, the context growing with each."""
    token_scale: float = Field(0.0, ge=0)
    """``replay``: context tokens per recorded token (the trace's ``tokens``): the tool results
    grow each replay's context to that many tokens, capped to fit ``dataplane.token_budget``, so a
    step trains on contexts in proportion to the recording's. 0: one-line tool results."""
    paced: bool = False
    """Any other harness kind: give each training execution the scaled duration of the recorded
    execution the trace assigns it (``trace`` and ``time_scale``, drawn as for ``replay``) in
    ``GYRE_PACE_S``, so a harness that waits it out as tool time ends no sooner: a real task on the
    trace's long tail. Held-out evaluations are not paced."""


    @property
    def evaluator_bound_s(self) -> float:
        """What one evaluator attempt may take (``evaluator_timeout_s``, or its default)."""
        return self.evaluator_timeout_s or max(1.0, min(60.0, self.overall_budget_s / 4))

class DataPlaneSection(_Section):
    j_max: int = Field(2, ge=1)
    """Trajectories selected per execution."""
    token_budget: int = Field(2048, ge=64)
    """Tokens per micro-step per data-parallel rank."""
    whole_executions: bool = True
    """Pack all rows of an execution together (exact execution ratios; see PackingConfig)."""


class TrainingSection(_Section):
    lr: float = Field(1e-4, gt=0)
    pp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    """Tensor-parallel width of each pipeline stage: a cell holds ``tp × pp`` ranks (GPUs)."""
    ep: int = 1
    """Expert-parallel width for a mixture-of-experts ``model.dir``, on the tensor-parallel ranks:
    1 (every expert split over the ``tp`` ranks) or ``tp`` (each rank holds ``1/tp`` of the
    experts whole)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``fp32``, or ``bf16`` parameters and activations with a float32 optimizer (needs CUDA)."""
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    """Which of megatron-core's layer specs builds each stage: ``transformer_engine`` (TE's
    layers, its fused kernels and flash attention; needs TransformerEngine and CUDA), ``local``
    (megatron-core's plain torch layers; runs anywhere), or ``auto``: TE's where TransformerEngine
    imports and CUDA is present, else the local one."""
    clip_grad: float = Field(1.0, ge=0)
    """0: no clipping."""
    step_timeout_s: float = Field(600.0, gt=0)
    collective_timeout_s: float = Field(60.0, gt=0)
    """How long a gradient collective waits for a peer: a satellite that died mid-step is given
    up on within about this, and the step finishes on the cells that survived."""
    megatron: dict[str, Any] = Field(default_factory=dict)
    """``[training.megatron]``: the team's own megatron-core settings, by the names of
    megatron-core's ``TransformerConfig``, ``DistributedDataParallelConfig`` and
    ``OptimizerConfig`` fields and its learning-rate scheduler's parameters (README, "Your
    Megatron settings"). The training plugin checks them against the installed release before
    any process starts."""
    objective: str = "gspo"
    """``gspo`` (execution-level, the default), ``grpo``, ``dapo``, ``cispo``, or
    ``"file.py:function"``: a loss of the user's own (see README, "Objectives")."""
    importance_cap: float = Field(5.0, gt=0)
    """GSPO: each token's importance weight π/π_behaviour is capped here."""
    clip_low: float | None = Field(None, ge=0, le=1)
    """ε_low; unset: the objective's own (GSPO 0.005, GRPO 0.2, DAPO 0.2, CISPO 1: no lower bound).
    GSPO clips an execution whose ratio falls below 1 − clip_low with a negative advantage; GRPO
    and DAPO a token's ratio; CISPO truncates each token's IS weight there."""
    clip_high: float | None = Field(None, ge=0)
    """ε_high; unset: the objective's own (GSPO 0.005, GRPO 0.2, DAPO 0.28, CISPO 0.28)."""
    token_normaliser: int = Field(1024, ge=1)
    """DAPO and CISPO: each trained token weighs 1 / (executions per step × token_normaliser),
    a constant, since a streamed step is trained before its token count is known."""

    correction: Literal["none", "tis", "mis", "icepop"] = "none"
    """The sampler–trainer correction: none, ``tis`` (truncated IS), ``mis`` (masked IS) or
    ``icepop`` (two-sided mask) on each token's π_trainer / π_sampler (README, "Objectives")."""
    correction_low: float | None = Field(None, ge=0, lt=1)
    """The correction's lower bound; unset: its own (tis and mis 0, icepop 0.5)."""
    correction_high: float | None = Field(None, gt=1)
    """The correction's upper bound; unset: its own (tis and mis 2, icepop 5)."""

    kl_coef: float = Field(0.0, ge=0)
    """β of a KL penalty to the reference policy, the run's warm start (``model.dir``, or the
    seeded tiny model); 0: none. Above 0 every training rank holds a frozen copy of its
    parameters and runs each micro-step forward once more through it (README, "Objectives")."""
    kl_estimator: Literal["k1", "k3", "low_var"] = "low_var"
    """``k1`` (log π_θ − log π_ref), ``k3`` (Schulman's), or ``low_var`` (k3 clamped to [−10, 10])."""

    def objective_config(self) -> ObjectiveConfig:
        """The objective's settings, with each unset bound the objective's (or correction's) own."""
        builtin = self.objective in OBJECTIVES
        low, high = OBJECTIVE_CLIPS.get(self.objective, OBJECTIVE_CLIPS["gspo"])
        c_low, c_high = CORRECTIONS[self.correction]
        return ObjectiveConfig(
            kind=self.objective if builtin else "custom", custom="" if builtin else self.objective,
            token_weight_cap=self.importance_cap, token_normaliser=self.token_normaliser,
            clip_low=low if self.clip_low is None else self.clip_low,
            clip_high=high if self.clip_high is None else self.clip_high,
            correction=self.correction,
            correction_low=c_low if self.correction_low is None else self.correction_low,
            correction_high=c_high if self.correction_high is None else self.correction_high,
            kl_coef=self.kl_coef, kl_estimator=self.kl_estimator)


class ServingSection(_Section):
    max_total_tokens: int = Field(16384, ge=1024)
    extra_args: list[str] = Field(default_factory=list)
    """Passed to every SGLang server unchanged."""
    start_timeout_s: float = Field(300.0, gt=0)


class ProxySection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, lt=65536)
    """0: any free port."""
    kv_handoff: bool = True
    """On a role change, hand each running call's KV cache to its execution's new engine and
    continue the call there (false: the new engine re-prefills the call's context)."""


class MetricsSection(_Section):
    """Where each step's figures go (the ``gyre_on_metrics`` observers that are built in)."""

    backends: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Any of ``tensorboard`` (event files under ``dir``) and ``wandb`` (needs ``pip install wandb``); [] for none."""
    dir: str = ""
    """Empty: ``<out_dir>/metrics``."""
    wandb_project: str = "gyre"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` (a run folder to ``wandb sync`` later), ``online`` or ``disabled``."""


class ClusterSection(_Section):
    """Where the cells' ranks and engines run.

    ``local``: this process spawns every rank and engine on this machine. ``torchrun``: the
    site's launcher starts the ranks on any number of nodes (``torchrun ... -m
    gyre_megatron.worker``, the command is printed at start); they reach this process's control
    plane, and each cell's first rank starts the cell's SGLang server on its own node. ``ray``:
    this process connects to a Ray cluster (``ray_address``), reserves one placement group per
    cell and starts its ranks and its SGLang server there as actors."""

    launcher: Literal["local", "torchrun", "ray"] = "local"
    control_host: str = "127.0.0.1"
    """Address the control plane binds (a head-node address the other nodes reach, for torchrun)."""
    control_port: int = Field(0, ge=0, lt=65536)
    """0: any free port (printed); fix it when the nodes are launched by a script."""
    key_file: str = ""
    """The control plane's per-run key; empty: ``<out_dir>/control.key`` (0600), created if absent."""
    engine_host: str = "127.0.0.1"
    """Address each cell's SGLang server binds on its node (``0.0.0.0`` across nodes)."""
    join_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for every rank to join before giving up."""
    ray_address: str = ""
    """``ray`` launcher: the cluster to join (``ray://head:10001``, ``head:6379`` or ``auto``); empty:
    a Ray of this machine's own, started for the run."""
    ray_gpus_per_rank: float = Field(0.0, ge=0)
    """``ray`` launcher: GPUs in each rank's bundle (1 on a GPU cluster)."""
    ray_resources_per_rank: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    """``ray`` launcher: custom Ray resources in each rank's bundle (e.g. to keep cells on
    labelled nodes)."""


class PublicationSection(_Section):
    """How each published policy version reaches the engines, and how Mooncake peers find each other.

    ``mooncake`` (default): the orchestrator copies the core's weights into one registered buffer
    per version and every engine pulls it (one-sided reads, CRC and layout checked before any
    parameter changes); no weight file is written, so nodes need no shared filesystem. ``disk``:
    each version is written as safetensors under ``<out_dir>/weights/`` and engines load the
    files (every node must see that folder). ``protocol`` and ``device`` apply to every Mooncake
    engine of the run: publication, satellite joins and KV hand-off."""

    transport: Literal["mooncake", "disk"] = "mooncake"
    protocol: Literal["tcp", "rdma"] = "tcp"
    """``tcp``, or ``rdma`` on a cluster with RDMA NICs (then name them in ``device``)."""
    device: str = ""
    """RDMA devices for Mooncake (e.g. ``mlx5_0,mlx5_1``); empty for TCP."""
    host: str = ""
    """Address the engines reach the orchestrator's publication at; empty: ``cluster.control_host``
    (every other node already reaches it). Ranks and engines advertise their own node's address
    (``GYRE_MOONCAKE_HOST`` on a node overrides what it would pick)."""
    version_wait_s: float = Field(30.0, ge=0)
    """How long a load waits for the engine to report the version it loaded: a busy engine's
    ``/model_info`` may learn the new version well after the load's answer."""
    load_attempts: int = Field(2, ge=1)
    """Tries of one engine's load before it is called failed; a rollout engine that fails them is
    restarted by the watchdog on the current policy and the run goes on."""


class CheckpointSection(_Section):
    """The core's training state (weights and optimizer) saved after each step, for ``--resume``,
    and the model folders a user keeps."""

    keep_last: int = Field(2, ge=0)
    """How many of the newest kept step checkpoints to keep (0: all). The newest (``--resume``
    continues from it) and the one a resume needs to rebuild the last published policy are always
    kept too. A 7B model's state is ~100 GB a step."""
    interval: int = Field(1, ge=1)
    """Which step checkpoints count for ``keep_last``: those after every ``interval`` steps. The
    state is still written after each step (a resume continues from the newest); the others go
    as soon as a newer one is written."""
    hf_interval: int = Field(0, ge=0)
    """Also write the policy after every ``hf_interval`` steps as a model folder ``hf/step<N>/``
    in the model's own dtype (0: only the final ``checkpoint/``, which is always written)."""
    hf_keep_last: int = Field(0, ge=0)
    """How many of the newest ``hf/step<N>/`` folders to keep (0: all)."""


class WatchdogSection(_Section):
    """The engine watchdog (:class:`~gyre_core.orchestrator.watchdog.EngineWatchdog`)."""

    interval_s: float = Field(0.5, gt=0)
    """How often each engine's process is checked."""
    health_every_s: float = Field(5.0, gt=0)
    """How often each serving engine answers a health check."""
    health_timeout_s: float = Field(10.0, gt=0)
    failures: int = Field(3, ge=1)
    """Consecutive failed checks that mean an engine is dead (it is then restarted)."""
    max_restarts: int = Field(2, ge=0)
    """Restarts per cell; one more death fails the run (with its summary)."""


class SamplingSection(_Section):
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = Field(24, ge=1)


def _absolute_if_file(arg: str, config_dir: Path | None = None) -> str:
    """``arg`` made absolute when it names an existing file relative to the config file's folder,
    or else to the current folder (a symlink stays a symlink: ``.venv/bin/python`` keeps its
    virtual environment)."""
    if not arg or os.path.isabs(arg):
        return arg
    for base in ([config_dir] if config_dir is not None else []) + [Path.cwd()]:
        candidate = base / arg
        if candidate.is_file():
            return os.path.abspath(candidate)
    return arg


_SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".js", ".mjs", ".pl", ".rb")


def _evaluator_problem(cmd: list[str]) -> str | None:
    """Why an evaluator command (after path resolution) would run something the agent wrote:
    it runs in the workspace, so a path left relative, or ``python -m`` (which puts the working
    folder first on ``sys.path``), resolves to the agent's files."""
    for i, arg in enumerate(cmd):
        if i and cmd[i - 1] == "-c":  # a program's text, not a path
            continue
        if not os.path.isabs(arg) and " " not in arg and ("/" in arg or arg.endswith(_SCRIPT_SUFFIXES)):
            return (f"{arg!r} names no file relative to the config's folder or the start folder; in the "
                    "workspace it would name a file the agent wrote")
    if cmd and os.path.basename(cmd[0]).startswith("python"):
        isolated, i = False, 1
        while i < len(cmd) and cmd[i].startswith("-") and not cmd[i].startswith("--") and cmd[i] != "-":
            arg, i = cmd[i], i + 1
            for j, flag in enumerate(arg[1:], 1):
                isolated = isolated or flag in "IP"
                if flag == "m" and not isolated:
                    return ("python -m in the workspace imports the agent's files first (the working folder "
                            "heads sys.path): add -I before -m, or use the gyre-score command")
                if flag in "mc":  # the program follows: no more interpreter options
                    return None
                if flag in "WX":  # that option's value: the rest of this argument, or the next one
                    i += j == len(arg) - 1
                    break
    return None


def _embedded_scheduler() -> dict[str, Any]:
    # Sized so that the embedded job shows the mechanism: 16 executions at once end in a cluster,
    # the core starts training on the first finished groups while the satellite serves the rest,
    # then the satellite joins the running step once nothing is left to serve (φ = 0: on-policy).
    return {"mode": "gyre", "cells": 2, "cell_capacity": 8, "group_size": 4, "groups_per_step": 4,
            "steps_per_burst": 1, "extra_dispatch": 0.0, "rho_min": 0.25, "supply_window_s": 0.0}


@dataclass
class RunConfig:
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(**_embedded_scheduler()))
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    harness: HarnessSection = field(default_factory=HarnessSection)
    dataplane: DataPlaneSection = field(default_factory=DataPlaneSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    serving: ServingSection = field(default_factory=ServingSection)
    proxy: ProxySection = field(default_factory=ProxySection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    watchdog: WatchdogSection = field(default_factory=WatchdogSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    publication: PublicationSection = field(default_factory=PublicationSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def validate(self, config_dir: Path | None = None) -> "RunConfig":
        """The checks that span settings (each single setting's range is on its field);
        ``config_dir``: the config file's folder, against which commands' relative paths resolve
        first."""
        def need(cond: bool, where: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{where}: {msg}")

        need(not self.run.resume or bool(self.run.out_dir), "run.out_dir",
             "--resume needs the output folder of the run to continue (--out)")
        need(self.harness.kind != "command" or bool(self.harness.command), "harness.command", "needed for harness 'command'")
        # a program or script named relative to where the run starts: harnesses and evaluator
        # commands run in their workspace, so such paths become absolute here
        self.harness.command = [_absolute_if_file(a, config_dir) for a in self.harness.command]
        self.task.evaluator = [_absolute_if_file(a, config_dir) for a in self.task.evaluator]
        self.task.setup = [_absolute_if_file(a, config_dir) for a in self.task.setup]
        self.harness.sandbox_hide = [_absolute_if_file(a, config_dir) for a in self.harness.sandbox_hide]
        if self.task.evaluator[:1] == ["gyre-score"]:  # Gyre's own scorer: the one installed beside Gyre
            beside = os.path.join(os.path.dirname(sys.executable), "gyre-score")
            self.task.evaluator[0] = beside if os.path.isfile(beside) else shutil.which("gyre-score") or "gyre-score"
        evaluator_problem = _evaluator_problem(self.task.evaluator)
        need(evaluator_problem is None, "task.evaluator", str(evaluator_problem))
        need(not self.task.setup or self.task.name == "file", "task.setup",
             f"a set-up command belongs to file tasks (task.train), not {self.task.name!r}")
        if self.task.train and self.task.name == TaskSection.model_fields["name"].default:
            self.task.name = "file"  # a task file means the user's own tasks
        if self.task.name == "file":
            need(bool(self.task.train), "task.train", 'task.name = "file" needs a task file (task.train)')
            need(bool(self.task.reward) != bool(self.task.evaluator), "task.reward",
                 "give exactly one of task.reward (\"file.py:function\") and task.evaluator (a command)")
        else:
            need(not self.task.train, "task.train", f"a task file needs task.name = \"file\", not {self.task.name!r}")
            need(not self.task.eval, "task.eval", f"an eval task file needs task.name = \"file\", not {self.task.name!r}")
        need(bool(self.task.eval) or not (self.eval.interval or self.eval.before_train), "task.eval",
             "[eval] needs held-out tasks: a task file in task.eval")
        need(not self.task.eval or self.harness.kind != "replay", "task.eval",
             "a replayed workload has no held-out tasks to run")
        need(self.harness.timeout_s > 0 and self.harness.timeout_s <= self.harness.overall_budget_s,
             "harness.timeout_s", "must be > 0 and ≤ harness.overall_budget_s")
        need(self.task.name == "number-guess" or self.harness.kind != "number-guess", "task.name",
             "the number-guess harness plays the number-guess task")
        need(self.harness.kind != "replay" or self.task.name == "digits", "task.name",
             "the replay harness leaves reply.txt, which the digits task scores: set task.name = \"digits\"")
        need(not self.harness.paced or self.harness.kind != "replay", "harness.paced",
             "the replay harness is paced by its trace already")
        need(self.harness.token_scale == 0 or self.harness.replay_calls >= 2, "harness.token_scale",
             "needs harness.replay_calls ≥ 2 (the context grows through tool results between calls)")
        if (self.harness.kind == "replay" or self.harness.paced) and self.harness.trace:
            from gyre_core.simulator.workload import TraceError, load_trace

            try:
                load_trace(self.harness.trace)
            except (TraceError, OSError) as exc:
                raise ConfigError(f"harness.trace: {exc}") from None
        if self.training.objective not in OBJECTIVES:  # the user's own: file.py:function
            path, sep, name = self.training.objective.rpartition(":")
            need(bool(sep) and path.endswith(".py"), "training.objective",
                 f"expected one of {', '.join(OBJECTIVES)} or \"file.py:function\", got {self.training.objective!r}")
            self.training.objective = f"{_absolute_if_file(path, config_dir)}:{name}"
            from gyre_core.dataplane.objective import load_custom_objective  # torch: only for a custom loss

            try:
                load_custom_objective(self.training.objective)
            except ValueError as exc:
                raise ConfigError(f"training.objective: {exc}") from None
        try:
            self.training.objective_config()
        except ValueError as exc:
            key = "training.correction" if "correction" in str(exc) else "training.clip_low"
            raise ConfigError(f"{key}: {exc}") from None
        need(self.training.ep in (1, self.training.tp), "training.ep",
             f"must be 1 or training.tp ({self.training.tp}): expert parallelism runs on the tensor-parallel ranks")
        need(self.training.ep == 1 or bool(self.model.dir), "training.ep",
             "needs a mixture-of-experts model.dir (the tiny model is dense)")
        need(bool(self.proxy.host.strip()), "proxy.host",
             "must not be empty (an empty host binds every interface; name 0.0.0.0 to mean that)")
        need(bool(self.cluster.engine_host.strip()), "cluster.engine_host", "must not be empty")
        need(bool(self.cluster.control_host), "cluster.control_host", "must not be empty")
        need(self.scheduler.cells <= 4096, "scheduler.cells", "must be ≤ 4096")
        if self.model.dir:
            need(Path(self.model.dir).is_dir(), "model.dir",
                 f"{self.model.dir} is not a directory (expected an HF model folder with config.json)")
            for key, problem in tp_split_problems(Path(self.model.dir) / "config.json", self.training.tp,
                                                  self.training.ep):
                need(False, key, problem)
        else:  # the tiny model is built from these sizes (4 attention heads, 2 KV groups)
            need(self.model.hidden_size >= 8 and self.model.hidden_size % 4 == 0, "model.hidden_size",
                 "must be ≥ 8 and a multiple of 4 (the tiny model has 4 attention heads)")
            need(self.model.num_layers >= 1, "model.num_layers", "must be ≥ 1")
            need(self.model.num_layers % self.training.pp == 0, "model.num_layers",
                 "must be a multiple of training.pp (each pipeline stage holds the same number of layers)")
            need(self.training.tp in (1, 2), "training.tp",
                 "must be 1 or 2 for the tiny model (2 KV groups split whole over the tensor-parallel ranks)")
            need(self.model.vocab_size >= 300, "model.vocab_size", "must be ≥ 300 (bytes and special tokens)")
        # The trainer takes its log-probs of softmax(logits / T) at each call's temperature, the
        # distribution SGLang samples from and reports. A truncated distribution (top_p < 1) is
        # not: SGLang reports log-probs before truncation. Refused, not ignored.
        need(0 < self.sampling.temperature <= 100, "sampling.temperature",
             "must lie in (0, 100] (0 is greedy decoding, which has no behaviour distribution to train on)")
        need(self.sampling.top_p == 1.0, "sampling.top_p",
             "must be 1.0: with top_p < 1 the behaviour log-probs SGLang reports are not those of the "
             "truncated distribution the tokens were sampled from")
        need(self.model.max_seq_len >= self.dataplane.token_budget, "model.max_seq_len",
             "must be ≥ dataplane.token_budget (a micro-step row must fit the model)")
        need(self.publication.protocol != "rdma" or bool(self.publication.device.strip()), "publication.device",
             "name the RDMA devices for protocol \"rdma\" (e.g. \"mlx5_0\")")
        from gyre_core.metrics import BACKENDS

        for b in self.metrics.backends:
            need(b in BACKENDS, "metrics.backends", f"unknown backend {b!r} (expected any of {', '.join(BACKENDS)})")
        need(len(set(self.metrics.backends)) == len(self.metrics.backends), "metrics.backends", "names a backend twice")
        return self

    def as_dict(self) -> dict[str, Any]:
        """Every setting as plain JSON values (the journal's record of what a run was started with)."""
        d: dict[str, Any] = {name: getattr(self, name).model_dump() for name in _SECTIONS if name != "scheduler"}
        d["scheduler"] = dataclasses.asdict(self.scheduler)
        d["scheduler"]["mode"] = self.scheduler.mode.value
        d["scheduler"]["short_group"] = self.scheduler.short_group.value
        return {name: d[name] for name in _SECTIONS}


_SECTIONS = {f.name: f for f in fields(RunConfig)}
_SECTION_TYPES: dict[str, type[_Section]] = {
    f.name: type(f.default_factory()) for f in fields(RunConfig) if f.name != "scheduler"}  # type: ignore[misc]


def _problem(err: Mapping[str, Any], known: Sequence[str], value: Any) -> str:
    """One of pydantic's errors said as this file's errors say it."""
    kind, ctx = err["type"], err.get("ctx") or {}
    bounds = {"greater_than_equal": ("≥", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("≤", "le"),
              "less_than": ("<", "lt")}
    if kind == "extra_forbidden":
        return f"unknown key (known: {', '.join(sorted(known))})"
    if kind == "dict_type" or len(err["loc"]) > 1 and isinstance(value, Mapping):
        return f"expected a table of names to non-negative numbers, got {value!r}"
    if kind in bounds:
        sign, key = bounds[kind]
        return f"must be {sign} {ctx[key]:g}, got {value!r}"
    if kind == "literal_error":  # wandb_mode -> "unknown mode 'x' (expected 'offline', ...)"
        return f"unknown {str(err['loc'][0]).split('_')[-1]} {value!r} (expected {ctx['expected']})"
    if kind == "bool_type":
        return f"expected true or false, got {value!r}"
    if kind.startswith("int_"):
        return f"expected an integer, got {value!r}"
    if kind.startswith("float_") or kind == "finite_number":
        return f"expected a finite number, got {value!r}"
    if kind == "list_type" or kind == "string_type" and isinstance(value, list):
        return f"expected a list of strings, got {value!r}"
    if kind == "string_type":
        return f"expected a string, got {value!r}"
    return str(err["msg"])


def _build_section(name: str, raw: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[{name}]: expected a table, got {raw!r}")
    if name == "scheduler":
        merged = {**_embedded_scheduler(), **raw}
        known = {f.name for f in fields(SchedulerConfig)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ConfigError(f"scheduler.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        try:
            return SchedulerConfig(**merged)
        except ConfigError as e:
            raise ConfigError(f"scheduler.{e}") from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"scheduler: {e}") from e
    cls = _SECTION_TYPES[name]
    try:
        return cls.model_validate(dict(raw))
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        raise ConfigError(f"{name}.{key}: {_problem(err, list(cls.model_fields), raw.get(key))}") from None


def _parse_value(text: str) -> Any:
    """A ``--set`` value: TOML/JSON literal if it parses as one, else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(text)
        except ValueError:
            return text


def load_run_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Read ``path`` (TOML, or YAML if PyYAML is installed), apply ``overrides``
    (``{"section.key": value}``; string values are parsed as TOML literals), validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"config file {p}: {e.strerror or e}") from e
        try:
            if p.suffix in (".yaml", ".yml"):
                import yaml  # type: ignore[import-untyped]

                raw = yaml.safe_load(text) or {}
            else:
                raw = tomllib.loads(text)
        except ImportError as e:
            raise ConfigError(f"config file {p}: YAML needs PyYAML (pip install pyyaml), or use TOML") from e
        except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
            raise ConfigError(f"config file {p}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p}: expected a table of sections")
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"--set {dotted}: expected section.key=value")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"[{section}]: expected a table")
        raw[section][key] = _parse_value(value) if isinstance(value, str) else value
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"[{unknown[0]}]: unknown section (known: {', '.join(_SECTIONS)})")
    cfg = RunConfig()
    for name, section in raw.items():
        setattr(cfg, name, _build_section(name, section))
    return cfg.validate(Path(path).resolve().parent if path is not None else None)


def tp_split_problems(config_json: Path, tp: int, ep: int = 1) -> list[tuple[str, str]]:
    """``(setting, why)`` for each way an HF model's sizes cannot split evenly over ``tp``
    tensor-parallel and ``ep`` expert-parallel ranks (empty: they can). Megatron divides attention
    heads, KV groups, the FFN width and the vocabulary over the tensor ranks; experts over the
    expert ranks, or each expert's width over the tensor ranks when ``ep`` is 1."""
    if tp == 1 and ep == 1:
        return []
    try:
        raw = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return []  # the model check reports an unreadable config.json by itself
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    sizes = {"num_attention_heads": raw.get("num_attention_heads"),
             "num_key_value_heads": raw.get("num_key_value_heads") or raw.get("num_attention_heads"),
             "intermediate_size": raw.get("intermediate_size"), "vocab_size": raw.get("vocab_size")}
    if experts and ep == 1:
        sizes["moe_intermediate_size"] = raw.get("moe_intermediate_size")
    out = [("training.tp", f"{config_json}: {k} {v} is not a multiple of training.tp {tp}")
           for k, v in sizes.items() if isinstance(v, int) and v % tp]
    if ep > 1 and not isinstance(experts, int):
        out.append(("training.ep", f"{config_json}: a dense model (no num_experts) has no experts to spread"))
    elif ep > 1 and experts % ep:
        out.append(("training.ep", f"{config_json}: num_experts {experts} is not a multiple of training.ep {ep}"))
    return out

"""Types shared between the core and its plugins.

The hook specifications in :mod:`gyre_core.hookspecs` hand these values across the plugin seam.
They live here, in plain standard-library Python, so that a plugin can type against them without
the core importing Megatron, SGLang or torch, and so that the simulator can provide stand-ins that
satisfy the same Protocols. Protocols are structural: a backend object conforms by having the
methods, not by inheriting from anything in Gyre.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "SEAMS",
    "Assessment",
    "Checkpointing",
    "EngineClient",
    "EngineError",
    "EngineProcess",
    "EngineOptions",
    "EngineUnreachable",
    "ExecutionSpec",
    "GSPOConfig",
    "CORRECTIONS",
    "OBJECTIVES",
    "OBJECTIVE_CLIPS",
    "ObjectiveConfig",
    "SEQUENCE_OBJECTIVES",
    "KL_ESTIMATORS",
    "GenerateResult",
    "HarnessEnds",
    "HarnessHandle",
    "KVHandOff",
    "KVHandOffEngine",
    "LaunchOptions",
    "MooncakeOptions",
    "PhaseTiming",
    "PublicationOptions",
    "RoleClass",
    "ServingOptions",
    "ServingSide",
    "StateRef",
    "StepFailed",
    "StepRecovery",
    "StreamHealth",
    "TaskInstance",
    "TaskOptions",
    "TrainingOptions",
    "TrainingSide",
    "TrajectoryLeaf",
    "Validity",
    "WeightsRef",
]

SEAMS: frozenset[str] = frozenset(
    {"training", "serving", "harness", "evaluation", "classification", "events"}
)
"""Names a plugin may list under ``"seams"`` in its :func:`gyre_plugin_info` answer.

They let ``gyre-orchestrate`` report, before a run starts, which parts of a cell are backed by a
real implementation and which are missing, instead of failing halfway through a role switch.
"""


class RoleClass(enum.IntEnum):
    """Priority class of a trajectory (a leaf of an execution's trajectory tree).

    Members are declared, and numbered, in priority order: a lower value is selected first, so
    ``sorted(classes)`` and ``min(classes)`` give the highest-priority class. Main-agent
    task-driving trajectories carry the learning signal the reward is about; summaries and
    sub-agent work support it and are only drawn when the per-execution budget leaves room.
    """

    MAIN_AGENT_TASK = 0
    """The main agent driving the task (the trajectory the reward is mainly about)."""
    MAIN_AGENT_SUMMARY = 1
    """The main agent compacting/summarising its own context."""
    SUB_AGENT_TASK = 2
    """A sub-agent spawned by the main agent, working on its delegated task."""
    SUB_AGENT_SUMMARY = 3
    """A sub-agent compacting/summarising its own context."""


class Validity(str, enum.Enum):
    """Whether an evaluator produced a usable score.

    ``UNRESOLVED`` exists so that an evaluator failure is never silently turned into a zero
    reward: the core retries against the same preserved state while the execution's overall
    budget lasts, and excludes the execution if it never resolves.
    """

    VALID = "valid"
    UNRESOLVED = "unresolved"


@dataclass(frozen=True)
class StateRef:
    """Which state of an execution's workspace was assessed.

    Assessments stay attached to the artifact version they scored, so an intermediate assessment
    is never mistaken for one of the final state, and a retry can target the same preserved state.
    """

    artifact_version: str
    branch: str


@dataclass(frozen=True)
class Assessment:
    """The evaluator's answer: a score, its validity, and the state it refers to.

    Invariant (checked): a ``VALID`` assessment has a finite score, an ``UNRESOLVED`` one has
    ``score=None`` -- an unresolved outcome must not be able to leak a number into advantages.
    """

    score: float | None
    validity: Validity
    state: StateRef
    detail: str = ""
    """Free text for logs (evaluator output, failure reason); never parsed by the core."""
    despite_infrastructure_errors: bool = False
    """The evaluator vouches that this score stands although the execution was answered with
    infrastructure errors (``ExecutionSpec.extra["infrastructure_errors"]``: the proxy's 5xx
    answers). Without it, a valid score of such an execution is not taken: the run cannot tell
    the policy's failure from Gyre's, and only the task may decide a zero."""
    nothing_to_assess: bool = False
    """A complete failure the task defines (the harness ran and left nothing its evaluator can
    judge): the reward is the zero-reward placeholder, which counts in its group's advantages but
    trains no token of the execution."""

    def __post_init__(self) -> None:
        if self.validity is Validity.VALID:
            if self.score is None or not math.isfinite(self.score):
                raise ValueError(f"a valid assessment needs a finite score, got {self.score!r}")
            if self.nothing_to_assess and self.score != 0.0:
                raise ValueError(f"a complete failure scores 0.0, got {self.score!r}")
        elif self.validity is Validity.UNRESOLVED:
            if self.score is not None or self.nothing_to_assess:
                raise ValueError("an unresolved assessment must not carry a score")
        else:  # pragma: no cover - guards against a plain string slipping through
            raise TypeError(f"validity must be a Validity, got {self.validity!r}")

    @classmethod
    def valid(cls, score: float, state: StateRef, detail: str = "", *,
              despite_infrastructure_errors: bool = False) -> Assessment:
        return cls(float(score), Validity.VALID, state, detail, despite_infrastructure_errors)

    @classmethod
    def complete_failure(cls, state: StateRef, detail: str = "") -> Assessment:
        """The task's own verdict that there is nothing to assess: the zero-reward placeholder."""
        return cls(0.0, Validity.VALID, state, detail, nothing_to_assess=True)

    @classmethod
    def unresolved(cls, state: StateRef, detail: str = "") -> Assessment:
        return cls(None, Validity.UNRESOLVED, state, detail)


@dataclass(frozen=True)
class ExecutionSpec:
    """Everything a harness needs to run one execution against Gyre's proxy.

    The harness is a black box: all it learns about Gyre is a base URL and an API key. The key is
    per execution so the proxy can attribute every model call to its execution (and reject calls
    from executions that were cancelled); it is kept out of ``repr`` so it does not end up in logs.
    """

    execution_id: int
    workdir: str
    """Working directory prepared for this execution (the harness runs with it as cwd)."""
    proxy_base_url: str
    """Base URL of the TITO proxy, e.g. ``http://127.0.0.1:8100`` (OpenAI/Anthropic-compatible)."""
    api_key: str = field(repr=False)
    harness_timeout_s: float
    """Wall-clock limit for the harness process itself; past it the run is assessed as is."""
    overall_budget_s: float
    """Limit for the whole execution including evaluation retries; past it it is excluded."""
    harness: str = ""
    """Name of the harness to launch (e.g. ``"claude_code"``); launch hooks that do not own it
    return ``None``."""
    task: str = ""
    """The task prompt handed to the harness."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Harness-specific settings from the run configuration (model name, env, flags)."""


@runtime_checkable
class HarnessHandle(Protocol):
    """A launched harness process, as returned by the launch hook."""

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (``None``: forever); return the exit code, or ``None``
        if the harness is still running."""
        ...

    def kill(self) -> None:
        """Terminate the harness and its children. Idempotent; the workspace is left in place so
        the state can still be assessed."""
        ...


@runtime_checkable
class HarnessEnds(Protocol):
    """An optional capability of a harness handle: it can tell how its process ended (a crash, a
    failure, killed for memory...), which the evaluator is told. Without it a non-zero exit is
    classified from the harness kind and the code alone."""

    def end_kind(self, code: int) -> str:
        """How the process that exited with ``code`` ended (one of the run's harness ends)."""
        ...


@dataclass(frozen=True)
class WeightsRef:
    """Where a published policy version can be loaded from.

    ``location`` is opaque to the core (a directory, a Mooncake session handle, a
    distributed-group name): the training plugin produces it and the serving plugin consumes it,
    so the two backends can agree on a transport without the core knowing about it.
    """

    version: int
    location: str


# --------------------------------------------------------------------------- options across the seam
# What a plugin is handed to build its part, built once from the run configuration
# (:mod:`gyre_core.orchestrator.plugin_options`): each setting has one name and one default here,
# and a plugin reads fields, never keys.


OBJECTIVES = ("gspo", "grpo", "dapo", "cispo")
"""The built-in objectives (``training.objective``); anything else is a ``file.py:function`` of the user's."""

OBJECTIVE_CLIPS: dict[str, tuple[float, float]] = {
    "gspo": (0.005, 0.005),  # the paper's execution-level bounds [0.995, 1.005]
    "grpo": (0.2, 0.2),  # PPO's ε
    "dapo": (0.2, 0.28),  # clip-higher
    "cispo": (1.0, 0.28),  # no lower bound on the IS weight, only the upper one tuned (MiniMax-M1)
}
"""Each built-in objective's default ``(clip_low, clip_high)``."""

CORRECTIONS: dict[str, tuple[float, float]] = {
    "none": (0.0, math.inf),
    "tis": (0.0, 2.0),  # truncated importance sampling: the weight clamped into [low, high]
    "mis": (0.0, 2.0),  # masked: a token whose weight leaves [low, high] is not trained
    "icepop": (0.5, 5.0),  # IcePop's two-sided mask
}
"""Each sampler–trainer correction (``training.correction``) and its default ``(low, high)``."""

KL_ESTIMATORS = ("k1", "k3", "low_var")
"""Estimators of KL(π_θ ‖ π_ref) on the sampled tokens (``training.kl_estimator``): ``k1`` the
log-ratio, ``k3`` Schulman's unbiased non-negative one, ``low_var`` k3 clamped to [−10, 10]
(verl's ``low_var_kl``)."""

SEQUENCE_OBJECTIVES = ("gspo",)
"""Objectives whose clipping needs the whole execution's ratio (a split execution's other rows
run forward only for it); the token-level ones need no such pass."""


@dataclass(frozen=True)
class ObjectiveConfig:
    """The objective a run trains on and its settings (``[training]``: ``objective``,
    ``clip_low``, ``clip_high``, ``importance_cap``, ``token_normaliser``, ``correction``,
    ``correction_low``, ``correction_high``). The default is the paper's execution-level GSPO:
    token weights capped at 5, clipping ``[0.995, 1.005]``, no correction."""

    token_weight_cap: float = 5.0
    """GSPO: each token's detached weight π/π_b is capped here."""
    clip_low: float = 0.005
    """ε_low: the lower bound is ``1 − clip_low`` (on the execution ratio for GSPO, on each
    token's ratio for GRPO and DAPO, on each token's IS weight for CISPO)."""
    clip_high: float = 0.005
    """ε_high: the upper bound is ``1 + clip_high``."""
    kind: str = "gspo"
    """One of :data:`OBJECTIVES`, or ``custom`` (then ``custom`` names the function)."""
    token_normaliser: int = 1024
    """DAPO and CISPO: every trained token weighs ``1 / (E · token_normaliser)`` (see
    :mod:`gyre_core.dataplane.objective` for why not the batch's token count)."""
    custom: str = ""
    """``/absolute/path/file.py:function`` for ``kind == "custom"``."""
    correction: str = "none"
    """The sampler–trainer correction: one of :data:`CORRECTIONS` (see
    :mod:`gyre_core.dataplane.objective`)."""
    correction_low: float = 0.0
    correction_high: float = math.inf
    """The correction's bounds on each token's weight π_trainer / π_sampler."""
    kl_coef: float = 0.0
    """β of a KL penalty to the reference policy (the warm start); 0: none, and no reference
    is held."""
    kl_estimator: str = "low_var"
    """One of :data:`KL_ESTIMATORS`."""

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, got {self.correction!r}")
        if self.correction != "none" and self.kind == "custom":
            raise ValueError("a custom objective makes its own correction: leave training.correction at none")
        if self.correction != "none" and not 0 <= self.correction_low < 1 < self.correction_high:
            raise ValueError(f"need 0 <= correction_low < 1 < correction_high, got "
                             f"{self.correction_low}, {self.correction_high}")
        if self.kind not in OBJECTIVES and self.kind != "custom":
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)} or custom, got {self.kind!r}")
        if (self.kind == "custom") != bool(self.custom):
            raise ValueError("a custom objective names its function (file.py:function), and only a custom one does")
        if not self.token_weight_cap > 0:
            raise ValueError(f"token_weight_cap must be > 0, got {self.token_weight_cap}")
        low_ok = 0 <= self.clip_low < 1 or (self.kind == "cispo" and self.clip_low == 1)  # an IS weight may reach 0
        if not (low_ok and self.clip_high >= 0):
            bound = "<= 1" if self.kind == "cispo" else "< 1"
            raise ValueError(f"need 0 <= clip_low {bound} and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.token_normaliser < 1:
            raise ValueError(f"token_normaliser must be >= 1, got {self.token_normaliser}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")

    @property
    def sequence_level(self) -> bool:
        """Whether clipping needs the whole execution's ratio (see :data:`SEQUENCE_OBJECTIVES`;
        not with a correction, which clips nothing); a custom objective is given it too, as
        ``outside_sums``."""
        return (self.kind in SEQUENCE_OBJECTIVES and self.correction == "none") or self.kind == "custom"


GSPOConfig = ObjectiveConfig
"""The objective's settings under their first name (the default is GSPO)."""


@dataclass(frozen=True)
class MooncakeOptions:
    """How every Mooncake engine of a run connects: publication, satellite joins, KV hand-off."""

    protocol: str = "tcp"
    """``tcp``, or ``rdma`` (then ``device`` names the NICs)."""
    device: str = ""
    host: str = ""
    """The address this endpoint advertises; empty: its own node's, found toward ``peer``."""
    peer: str = ""
    """A host the endpoint must reach (the control host on a cluster; empty: this machine)."""


@dataclass(frozen=True)
class PublicationOptions:
    """How each published policy version reaches the engines (``[publication]``)."""

    transport: str = "disk"
    """``mooncake`` (one registered buffer per version, pulled by every engine) or ``disk``."""
    folder: str = "gyre-weights"
    """``disk``: where version ``v`` is written, as ``<folder>/v<v>``."""
    mooncake: MooncakeOptions = MooncakeOptions()
    version_wait_s: float = 30.0
    """How long a load waits for the engine to report the version it loaded."""
    load_attempts: int = 2
    """Tries of one engine's load before it is called failed."""


@dataclass(frozen=True)
class LaunchOptions:
    """Where a run's ranks start (``[cluster]``): spawned here, by ``torchrun``, or as Ray actors."""

    launcher: str = "local"
    control_host: str = "127.0.0.1"
    control_port: int = 0
    key_file: str = ""
    join_timeout_s: float = 600.0
    ray_address: str = ""
    ray_gpus_per_rank: float = 0.0
    ray_resources_per_rank: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingOptions:
    """What the training plugin builds every cell's side from (``gyre_make_training_side``)."""

    cells: int
    model: Mapping[str, Any] = field(default_factory=dict)
    """The tiny model's sizes (unused when ``init_from`` names a checkpoint)."""
    init_from: str = ""
    """A Hugging Face model folder whose sizes and weights every cell starts from."""
    pp: int = 1
    tp: int = 1
    ep: int = 1
    precision: str = "fp32"
    transformer_impl: str = "auto"
    """``training.transformer_impl``: ``auto``, ``transformer_engine`` or ``local``."""
    lr: float = 1e-4
    clip_grad: float = 1.0
    megatron: Mapping[str, Any] = field(default_factory=dict)
    """``[training.megatron]``: megatron-core settings by their own names, for a Megatron plugin."""
    total_steps: int = 0
    """``run.steps``: the length a learning-rate schedule decays over unless it says otherwise."""
    objective: GSPOConfig = GSPOConfig()
    normalise_by_tokens: bool = True
    """Divide gradients by loss-bearing tokens; off for the data plane's ``W_t``, which already
    normalise per execution."""
    burst_steps: int = 0
    """μ: the steps of one burst (a satellite joins each of them)."""
    max_steps: int = 16
    """Micro-step queues to create before the ranks start: one a step, plus re-streams."""
    step_timeout_s: float = 600.0
    data_timeout_s: float = 60.0
    """How long a gradient collective waits for a peer (``training.collective_timeout_s``)."""
    side_timeout_s: float = 60.0
    heartbeat_s: float = 0.5
    log_dir: str = ""
    """Where each rank writes ``rank<N>.log`` (empty: the parent's console)."""
    publication: PublicationOptions = PublicationOptions()
    launch: LaunchOptions = LaunchOptions()
    announce: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Progress lines while ranks join (cluster launchers)."""


@dataclass(frozen=True)
class EngineOptions:
    """How to start one engine (``gyre_start_engine``; ``[serving]`` and the cell's GPUs)."""

    max_total_tokens: int = 16384
    extra_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    api_key: str | None = field(default=None, repr=False)
    """The run's engine key: every route but health needs it."""
    log_path: str | None = None
    host: str = "127.0.0.1"
    base_gpu_id: int | None = None
    tp_size: int = 1
    memory_saver: bool = False
    """Start with memory release and resume enabled (a cell's engine, which yields to training)."""
    mooncake: MooncakeOptions | None = None
    """The engine's Mooncake endpoint (weight pulls, KV hand-off); ``None``: none."""


@dataclass(frozen=True)
class TaskOptions:
    """What a task plugin draws each group's query from (``gyre_task_instance``; ``[task]``)."""

    name: str = "number-guess"
    turns: int = 3
    """Turns of a multi-turn built-in task (number-guess)."""
    train: str = ""
    """The task file (file tasks); an evaluation hands its held-out file here instead."""
    prompt_template: str = ""
    reward: str = ""
    """``path/to/file.py:function`` scoring a record's workspace."""
    evaluator: tuple[str, ...] = ()
    """A command run in the workspace, in the sandbox (instead of ``reward``)."""
    setup: tuple[str, ...] = ()
    setup_timeout_s: float = 300.0


@dataclass(frozen=True)
class ServingOptions:
    """What the serving plugin drives one engine with (``gyre_make_serving_side`` and
    ``gyre_make_engine_client``)."""

    url: str
    api_key: str | None = field(default=None, repr=False)
    version_wait_s: float = 30.0
    load_attempts: int = 2


@dataclass(frozen=True)
class PhaseTiming:
    """One timed phase of a role switch, e.g. ``("to_training", "release_memory")``.

    Role-switch cost is what decides whether fine-grained switching pays off, so every phase is
    reported to observers (see ``gyre_on_event``) rather than only the total.
    ``start``/``end`` are seconds on the driver's clock (``time.monotonic()`` live, simulated
    time in the simulator).
    """

    cell: int
    transition: str
    """``"to_training"`` or ``"to_rollout"``."""
    phase: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class StepFailed(RuntimeError):
    """Raised by ``TrainingSide.close_stream`` when a step could not complete (a cell died or
    timed out); no update was applied.

    ``requeue`` maps each dropped cell (the dead one and any cell after it in the prefix) to the
    micro-step indices it had claimed: they were never counted and must be streamed again.
    ``survivors``: cells ``0..survivors−1`` kept their gradients and can finish the step
    (:class:`StepRecovery`); 0 when the cell that raised is itself gone (its ranks died, raised or
    hung)."""

    def __init__(self, message: str, requeue: Mapping[int, Sequence[int]] | None = None, survivors: int = 1) -> None:
        super().__init__(message)
        self.requeue: dict[int, list[int]] = {int(c): list(v) for c, v in (requeue or {}).items()}
        self.survivors = survivors


@runtime_checkable
class TrainingSide(Protocol):
    """The training half of one cell (backed by Megatron in ``gyre-megatron``).

    A cell keeps its backend processes and communication groups alive across role switches; these
    methods only move memory and state. Methods may block; the orchestrator calls them off its
    event loop and turns their completion into scheduler events. Cell 0 is the *core*: it holds
    the authoritative weights, runs the optimizer and publishes weights; satellites only join
    running batches and contribute gradients.
    """

    cell: int
    """The cell's index (0: the core)."""

    last_step_info: Sequence[Mapping[str, Any]]
    """Per-rank statistics of the last step this cell closed (``close_stream``): claims,
    micro-steps, pulls, gradient norm; what the step record reports for the cell."""

    def placement(self) -> Mapping[str, Any]:
        """Where the cell's ranks run, for the start-up plan: ``ranks``, ``tp``, ``pp``, ``nodes``,
        ``devices`` (one per rank)."""
        ...

    def enter_training(self) -> Sequence[PhaseTiming]:
        """Restore training parameters and buffers. Called after the cell's serving side has
        released its memory (``ServingSide.to_training``)."""
        ...

    def leave_training(self) -> Sequence[PhaseTiming]:
        """Offload training state and free device memory so the serving side can resume.
        Called at the end of a burst, before ``ServingSide.to_rollout``."""
        ...

    def start_step(self, step: int) -> None:
        """Core only: begin training step ``step``. Expose the current authoritative weights so
        satellites can join, then start claiming micro-steps from the stream."""
        ...

    def join_step(self, step: int) -> None:
        """Satellite only: join the running step ``step`` without interrupting the core --
        register, pull the core's weight snapshot, start claiming micro-steps."""
        ...

    def close_stream(self, step: int) -> None:
        """No more micro-steps will be enqueued for ``step``. Return once this cell has drained
        its pipeline and contributed its gradients (on the core: once the optimizer update is
        applied).

        When a participant fails, raise :class:`StepFailed`. A backend that can finish such a
        step on the survivors also implements :class:`StepRecovery`."""
        ...

    def publish_weights(self, version: int) -> WeightsRef:
        """Core only, at the end of a burst: publish the weights in the serving layout as policy
        ``version`` and say where rollout engines load them from, by the run's transport: the
        processes that hold the model expose their parts for the engines to pull (Mooncake, the
        default; no process gathers the whole model), or write files (``disk``)."""
        ...

    def write_weights(self, version: int, folder: str) -> WeightsRef:
        """Core only: policy ``version`` (the one published last, or the current one) as an HF
        checkpoint's weights and ``config.json`` in ``folder`` (the folder engines start on, the
        run's model folders, a resume's rebuilt publication)."""
        ...

    def release_weights_older_than(self, version: int) -> None:
        """Core only: stop exposing published versions before ``version`` (every engine holds a
        newer one); a no-op where nothing stays exposed."""
        ...


@runtime_checkable
class StepRecovery(Protocol):
    """An optional capability of a training side: a satellite's death does not end the run.
    The live run tests for it with ``isinstance``; without it a failed step fails the run."""

    def resume_step(self, step: int) -> tuple[Any, Callable[[], Sequence[Mapping[str, Any]]]]:
        """After ``close_stream`` failed: finish ``step`` on the surviving cells' kept gradients
        plus the dropped cells' micro-steps. Called on the core first, then on each surviving
        satellite; returns the queue the re-streamed micro-steps go into (the core's; closed by
        the caller) and a callable that waits for this cell's part and returns its statistics."""
        ...

    def restart_ranks(self) -> Mapping[str, Any]:
        """Core only: start the training processes anew after a cell's died (the core's state
        carried across), so every cell can join later steps; ``{"restart_s": ...}``. Raises
        ``NotImplementedError`` where the processes are a cluster launcher's to restart."""
        ...


@runtime_checkable
class StreamHealth(Protocol):
    """An optional capability of a training side: it can tell, without waiting, that its ranks
    stopped working on an open step (one raised, e.g. out of memory, or died). The step's
    micro-steps are then claimed by nobody and the packing buffer never runs low again, so
    without it such a step is seen only at ``run.max_wall_s``."""

    def stream_failure(self, step: int) -> str | None:
        """Why this cell's part of ``step`` already failed, or ``None`` while it runs."""
        ...


@runtime_checkable
class Checkpointing(Protocol):
    """An optional capability of the core's training side: training state kept after each step,
    for ``--resume``. The live run tests for it with ``isinstance``; without it the run keeps no
    checkpoints."""

    def save_checkpoint(self, path: str) -> None:
        """Persist the training state after a step (weights, optimizer, version) under ``path``."""
        ...


@runtime_checkable
class ServingSide(Protocol):
    """The rollout half of one cell, or one standalone engine (backed by SGLang in ``gyre-sglang``).

    Every method the live run calls, and it calls nothing else. They are coroutines: the run
    drives every cell's switches, loads and health checks from one event loop."""

    async def ato_training(self, hand_off: Callable[[Sequence[str]], Any]) -> Sequence[PhaseTiming]:
        """Give the cell's GPUs up for training, in this order: stop accepting new requests;
        call ``hand_off`` with the ids of the requests still in flight, awaiting its result when
        it is a coroutine (the orchestrator has rerouted their executions; the proxy hands each
        call's KV cache to its new engine, which aborts it here, and continues it there,
        invisibly to the harness); abort whatever is still running on this engine; flush the
        cache; release weights and KV cache memory. The engine process stays alive."""
        ...

    async def ato_rollout(self, weights: WeightsRef | None) -> Sequence[PhaseTiming]:
        """Take the GPUs back for serving: resume memory, have ``weights`` loaded if given (the
        current version; an engine that kept that very version through the release need not
        pull it again), and continue generation."""
        ...

    async def aload_weights(self, weights: WeightsRef) -> str:
        """Switch a serving engine to a newly published policy version (engines in rollout at a
        publication); returns the version the engine reports."""
        ...

    async def ahealth(self) -> bool:
        """True when the engine answers and can generate."""
        ...

    async def arole_switch_problems(self, *, kv_handoff: bool) -> list[str]:
        """Asked once at start, for a cell's engine: why this engine cannot switch roles as the
        run is configured, one line each (empty: it can). For example an engine on a GPU that
        cannot release its memory for training, or one whose KV cache is sharded over ranks that
        a hand-off (``kv_handoff``) would not all move. The run refuses to start on any."""
        ...


@runtime_checkable
class TrajectoryLeaf(Protocol):
    """What the role-classification hook gets to see of a trajectory-tree leaf.

    Deliberately narrow so that classification plugins do not depend on the tree's internals:
    ``metadata`` is the metadata recorded with the leaf's model calls (agent id, harness-reported
    role, request headers the harness set, ...).
    """

    @property
    def execution_id(self) -> int: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


class EngineError(RuntimeError):
    """A rollout engine answered a request with an error (non-2xx, or a malformed answer).

    Carries the endpoint and the engine's own message, so a failure deep inside a role switch or
    a retried model call still says which call failed and why.
    """

    def __init__(self, endpoint: str, status: int | None, message: str) -> None:
        self.endpoint = endpoint
        self.status = status
        self.message = message
        where = f"{endpoint} -> HTTP {status}" if status is not None else endpoint
        super().__init__(f"{where}: {message}")


class EngineUnreachable(EngineError):
    """The engine did not answer at all (connection refused or reset, timeout): the request may
    be retried elsewhere."""


@dataclass(frozen=True)
class GenerateResult:
    """What one engine call produced, token-exact: the proxy records exactly these.

    ``logprobs[i]`` is the behaviour log-prob of ``output_ids[i]``. ``finish_reason`` is
    ``"stop"``, ``"length"`` or ``"abort"`` (an abort returns the partial output generated so far).
    ``cached_tokens`` counts prompt tokens the engine did not have to recompute.
    """

    rid: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0
    weight_version: str = ""
    matched_stop: int | str | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"GenerateResult: {len(self.output_ids)} output ids but {len(self.logprobs)} log-probs"
            )


@runtime_checkable
class EngineClient(Protocol):
    """The part of a rollout engine the TITO proxy needs: token ids in, token ids out.

    Implemented by ``gyre_sglang.client.SGLangClient``; the core never imports a backend.
    Errors are :class:`EngineError` (:class:`EngineUnreachable` when nothing answered).
    """

    url: str

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult: ...

    async def abort_request(self, rid: str) -> None: ...


@dataclass(frozen=True)
class KVHandOff:
    """What moving one running call's KV cache to another engine did.

    ``moved``: the destination now holds ``prefix_tokens`` of the call's prompt + partial output
    in its cache, so continuing there does not prefill them again. When not moved, ``reason``
    says why (the continuation then re-prefills; nothing else changes).
    """

    rid: str
    moved: bool
    reason: str = ""
    prefix_tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dest: str = ""
    """The engine that received the KV (filled in by the proxy)."""


@runtime_checkable
class KVHandOffEngine(EngineClient, Protocol):
    """An engine that can hand a running call's KV cache to another engine of the same run.

    Optional: the proxy re-prefills on the destination when an engine does not offer it.
    ``hand_off_kv`` pins ``rid``'s KV, aborts the call (its ``generate`` returns the partial
    output with ``finish_reason == "abort"``) and has ``dest`` import the KV.
    """

    async def hand_off_kv(self, rid: str, dest: EngineClient, *, timeout: float) -> KVHandOff: ...


@runtime_checkable
class EngineProcess(Protocol):
    """A rollout engine process Gyre started (``gyre_start_engine``): where it listens, and how
    to stop it (only it: its own process group)."""

    url: str

    def stop(self) -> None:
        """Stop the engine and every process it spawned; idempotent."""
        ...

    def alive(self) -> bool | None:
        """False once its process has exited; None where this process cannot tell (an engine
        another node started: the watchdog's health checks decide)."""
        ...

    def placement(self) -> str:
        """Where it runs beyond its URL, for the start-up plan (its GPU flags, its node); may be
        empty."""
        ...

    def kill(self) -> None:
        """Kill it at once (fault injection, or a failed start)."""
        ...


@runtime_checkable
class TaskInstance(Protocol):
    """The query of one rollout group: every execution of the group gets the same instance.

    ``prompt`` is what the harness is asked; ``as_extra()`` is handed to the harness launcher and
    the evaluator in ``ExecutionSpec.extra`` (it must name the task under ``"task"``, so the task's
    own evaluator recognises its executions and the secret parts never reach the prompt).
    """

    @property
    def prompt(self) -> str: ...

    def as_extra(self) -> dict[str, Any]: ...

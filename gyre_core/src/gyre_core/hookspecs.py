"""Pluggy hook specifications: the seams through which backends attach to Gyre.

The core never imports Megatron or SGLang. Backends are plugins -- modules registered under the
``gyre`` entry-point group (see :mod:`gyre_core.plugins`) -- that implement some of the hooks below
with ``@hookimpl``. Hook names start with ``gyre_`` so that a misspelt implementation is reported
(``PluginManager.check_pending``) instead of silently never being called.

Two calling conventions are used:

* *firstresult* hooks are factories or decisions with exactly one answer. Implementations are
  tried most-recently-registered first; the first one that returns something other than ``None``
  wins and the rest are not called. Return ``None`` to say "not mine".
* *broadcast* hooks (not firstresult) are called on every implementation; the caller gets the
  list of non-``None`` results.

Plugin modules are imported when ``gyre-orchestrate`` starts, also for a pure simulation, so they
must import heavy dependencies (torch, megatron, sglang) lazily, inside the hook bodies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import pluggy

if TYPE_CHECKING:
    from gyre_core.interfaces import (
        Assessment,
        EngineClient,
        EngineOptions,
        EngineProcess,
        ExecutionSpec,
        HarnessHandle,
        RoleClass,
        ServingOptions,
        ServingSide,
        StateRef,
        TaskInstance,
        TaskOptions,
        TrainingOptions,
        TrainingSide,
        TrajectoryLeaf,
    )

PROJECT_NAME = "gyre"
"""Pluggy project name; also the setuptools entry-point group plugins register under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def gyre_plugin_info() -> dict[str, Any]:  # type: ignore[empty-body]
    """Describe this plugin. Broadcast (every plugin answers).

    Called by :func:`gyre_core.plugins.describe_plugins`, which ``gyre-orchestrate`` uses to report
    what is installed before a run and to refuse a live run whose needed seams nobody provides.

    Return a dict with at least ``"name"`` (str), ``"version"`` (str) and ``"seams"`` (list of
    names from :data:`gyre_core.interfaces.SEAMS` that this plugin implements, or will).
    """


@hookspec(firstresult=True)
def gyre_make_training_side(cell: int, options: TrainingOptions) -> TrainingSide | None:
    """Create the training side of cell ``cell``. firstresult.

    Called once per cell by the live orchestrator at start-up, before the first role switch; the
    object lives for the whole run (backend processes and communication groups persist across
    switches). Cell 0 is the core (authoritative weights, optimizer, weight publication); cells
    1..K-1 are satellites that join running batches.

    ``options`` (:class:`gyre_core.interfaces.TrainingOptions`) is built once from the run
    configuration; every cell's call gets the same object.

    Return an object implementing :class:`gyre_core.interfaces.TrainingSide`, or ``None`` if this
    plugin does not provide training (or not with these options).
    """


@hookspec(firstresult=True)
def gyre_make_serving_side(engine: int, options: ServingOptions) -> ServingSide | None:
    """Create the serving side of cell ``engine`` (``-1``: a standalone rollout engine). firstresult.

    Called once per cell and once per standalone engine by the live orchestrator at start-up. The
    orchestrator calls ``to_training`` / ``to_rollout`` on it when the scheduler switches the cell's
    role, ``load_weights`` after each weight publication for engines that stayed in rollout, and
    ``health`` before routing work to it.

    ``options`` (:class:`gyre_core.interfaces.ServingOptions`): the engine's URL, the run's engine
    key and how a load is checked (``[publication]``).

    Return an object implementing :class:`gyre_core.interfaces.ServingSide`, or ``None`` if this
    plugin does not provide serving (or not with these options).
    """


@hookspec(firstresult=True)
def gyre_start_engine(model_dir: str, options: EngineOptions) -> EngineProcess | None:
    """Start a rollout engine process serving ``model_dir``. firstresult.

    Used when Gyre itself brings up the engines (the embedded default, tests); on a cluster the
    user's own launcher usually starts them and passes their URLs. ``options``
    (:class:`gyre_core.interfaces.EngineOptions`): ``[serving]``'s settings, the engine's GPUs,
    its log file and its Mooncake endpoint. Return a started
    :class:`gyre_core.interfaces.EngineProcess`, or ``None`` if this plugin does not start engines.
    """


@hookspec(firstresult=True)
def gyre_make_engine_client(url: str, options: ServingOptions) -> EngineClient | None:
    """A token-in/token-out client for the engine at ``url``, used by the TITO proxy. firstresult.

    Return a :class:`gyre_core.interfaces.EngineClient`, or ``None`` if this plugin does not speak
    to that kind of engine.
    """


@hookspec(firstresult=True)
def gyre_task_instance(task: str, group_id: int, seed: int, options: TaskOptions) -> TaskInstance | None:
    """The query of rollout group ``group_id`` of task ``task``. firstresult.

    Called by the live orchestrator once per dispatched group (a short group's top-up reuses its
    group's instance), and once before a run starts to check that some plugin provides ``task``.
    Deterministic in ``(group_id, seed)``, so a resumed run gives every group the same query.
    ``options`` (:class:`gyre_core.interfaces.TaskOptions`) is the run configuration's ``[task]``
    section (an evaluation's names its held-out file as ``train``). Return a
    :class:`gyre_core.interfaces.TaskInstance`, or ``None`` if this plugin does not provide
    ``task``.
    """


@hookspec(firstresult=True)
def gyre_launch_harness(spec: ExecutionSpec) -> HarnessHandle | None:
    """Start the agent harness for one execution. firstresult.

    Called by the orchestrator when the scheduler launches a queued execution (harnesses and
    sandboxes are created at launch, not at dispatch). The harness must talk to the model only
    through ``spec.proxy_base_url`` with ``spec.api_key``, run in ``spec.workdir``, and be
    killable.

    Return a :class:`gyre_core.interfaces.HarnessHandle` (``wait``/``kill``) without waiting for
    the harness to finish, or ``None`` if this plugin does not own ``spec.harness``. The
    orchestrator enforces ``harness_timeout_s`` by calling ``kill``.
    """


@hookspec(firstresult=True)
def gyre_evaluate(spec: ExecutionSpec, state: StateRef) -> Assessment | None:
    """Assess the workspace state ``state`` of execution ``spec``. firstresult.

    Called by the orchestrator after an execution's harness exits or times out, again with the
    *same* ``state`` while earlier attempts were unresolved and the overall budget lasts, and for
    intermediate assessments of earlier artifact versions.

    Return an :class:`gyre_core.interfaces.Assessment` whose ``state`` is the one assessed. If the
    evaluator itself fails, return ``Assessment.unresolved(...)`` -- never a zero score; the core
    retries or excludes the execution; callers treat an exception the same way. Return ``None`` if
    this plugin does not evaluate this kind of task.
    """


@hookspec(firstresult=True)
def gyre_classify_role(leaf: TrajectoryLeaf) -> RoleClass | None:
    """Classify one leaf of an execution's trajectory tree into a priority class. firstresult.

    Called by trajectory selection for every candidate leaf when an execution is selected for
    training; selection draws trajectories class by class in :class:`RoleClass` priority order.
    Harnesses differ in how they mark sub-agents and summaries, so each harness plugin recognises
    its own.

    Return a :class:`gyre_core.interfaces.RoleClass`, or ``None`` if this plugin does not recognise
    the leaf, so the next plugin is asked.
    """


@hookspec
def gyre_on_event(time: float, event: object) -> None:
    """Observe what the orchestrator does. Broadcast; return values are ignored.

    Called by the scheduler's driver (the simulator or the live orchestrator) for every scheduler
    event it feeds in, every command the scheduler emits, and every
    :class:`gyre_core.interfaces.PhaseTiming` of a role switch, with ``time`` on the driver's clock.
    Observers dispatch on the type of ``event``. They must be quick and must not raise (the call is
    on the scheduling path); anything slow belongs in a queue the observer drains itself.
    """


@hookspec
def gyre_on_metrics(step: int, metrics: Mapping[str, float]) -> None:
    """Receive one finished training step's figures. Broadcast; return values are ignored.

    Called by the live orchestrator once per step, after the core applied the update, with flat
    ``section/figure`` scalars (:func:`gyre_core.metrics.step_metrics`): ``train/`` (loss, grad
    norm, clip fraction, importance ratios, tokens), ``rollout/`` (mean reward, staleness),
    ``executions/`` (by state), ``switch/`` (role-switch phase seconds), ``calls/`` (interrupted
    calls), ``publication/``. A figure not measured is absent, never 0. The built-in TensorBoard
    and W&B observers implement it; must be quick and must not raise.
    """


@hookspec
def gyre_shutdown() -> None:
    """The run is over: stop what this plugin keeps for the whole process. Broadcast.

    Called once by ``gyre-orchestrate run`` as it exits, after the engines were stopped, whether
    the run finished or failed. ``gyre-megatron`` stops the rank processes it keeps per
    configuration (a training side is made per cell, the ranks are shared). Must not raise.
    """


@hookspec
def gyre_preflight(config: Mapping[str, Any]) -> list[str] | None:
    """Say what this plugin's part of a run would fail to load, before anything starts. Broadcast.

    Called by ``gyre-orchestrate run`` (:mod:`gyre_core.orchestrator.preflight`) with the validated
    run configuration as a plain dict (``RunConfig.as_dict()``), before any process is started, so
    that a missing library fails in seconds with its cause instead of minutes later inside a rank.
    Check what the configured run will actually load (import it, or locate it when an import
    would be heavy) and nothing else; never start a process.

    Return one line per problem, each naming what is missing and how to install it (``[]`` or
    ``None`` when all is well or the configuration is not this plugin's).
    """

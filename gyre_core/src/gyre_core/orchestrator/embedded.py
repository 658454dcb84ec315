"""Assemble a live run from its configuration: model, cells, engines, proxy, and run it.

With the defaults this is the *embedded* job of ``gyre-orchestrate run``: a tiny Qwen2 policy
(Megatron initialises it; its export is what the SGLang engines serve, so training and serving
start from the same weights), a core and one satellite cell, each a Megatron rank plus a real
SGLang server, the TITO proxy in this process, and the built-in ``number-guess`` task whose
harness talks to the proxy over HTTP with the official OpenAI SDK.

Everything Gyre starts it stops again, by pid (engines, ranks, harnesses), also on errors and
Ctrl-C. Outputs in ``run.out_dir``: ``summary.json``, ``events.jsonl``, ``role_timeline.svg``,
``checkpoint/model.safetensors`` (the last published policy), per-execution workspaces and logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gyre_core.interfaces import EngineOptions, EngineProcess, ServingOptions, TrainingSide, WeightsRef
from gyre_core.metrics.observers import close_observers, open_observers
from gyre_core.config import ConfigError
from gyre_core.orchestrator.journal import Journal, Replay
from gyre_core.orchestrator.failure import RunError, cause_lines, write_error_log
from gyre_core.orchestrator.hf_folders import TOKENIZER_FILES
from gyre_core.orchestrator.live import CellHandles, LiveOrchestrator, StandaloneHandles
from gyre_core.orchestrator.plugin_options import engine_options, serving_options, task_options, training_options
from gyre_core.orchestrator.preflight import check_preflight
from gyre_core.orchestrator.run_config import RunConfig
from gyre_core.orchestrator.status_line import StatusLine
from gyre_core.orchestrator.watchdog import EngineWatchdog
from gyre_core.upstream_noise import upstream_log_file

__all__ = ["run_live"]

log = logging.getLogger("gyre.orchestrator")



JOURNAL = "journal.jsonl"
"""The run's durable state in ``run.out_dir`` (see :mod:`gyre_core.orchestrator.journal`)."""

RESUME_MAY_CHANGE = ("run.steps", "run.max_wall_s", "run.out_dir", "run.resume", "training.step_timeout_s",
                     "training.collective_timeout_s", "serving.start_timeout_s", "watchdog.", "proxy.", "cluster.", "publication.", "metrics.",
                     "checkpoint.", "harness.evaluator_timeout_s", "harness.sandbox_expose",
                     "harness.sandbox_hide", "training.tp", "training.pp", "training.ep")
"""What a resumed run may change (how long and how watched it runs, where it listens, and the
layout of each cell: training checkpoints are stored by each tensor's global shape and load at
any TP/PP/EP): everything else shapes what the journal recorded (the scheduler, the task,
sampling, the objective, the harness, the seed) and must match, unless the resume is forced."""


def tokenizer_window(tokenizer: Any) -> int | None:
    """The model's own window as its tokenizer states it (``model_max_length``; None if unset)."""
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < 10**9 else None


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(journalled: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Keys whose value differs between the journalled run's config and ``now``, except those a
    resume may change (:data:`RESUME_MAY_CHANGE`)."""
    a, b = _flat(journalled), _flat(now)
    return sorted(k for k in a.keys() | b.keys()
                  if a.get(k) != b.get(k) and not any(k == m or (m.endswith(".") and k.startswith(m))
                                                      for m in RESUME_MAY_CHANGE))


def _check_resumable(replay: Replay, cfg: RunConfig, force: bool = False) -> list[str]:
    changed = config_changes(replay.config, cfg.as_dict())
    if changed and not force:
        raise ConfigError(f"a resume must keep what the journal depends on; changed: {', '.join(changed)} "
                          "(restore them, or pass --force-resume to continue with the new values)")
    return changed


def _plugin_manager(extra_plugins: Sequence[Any] = ()) -> Any:
    from gyre_core.orchestrator import harness
    from gyre_core.plugins import plugin_manager
    from gyre_core.proxy.classify import DEFAULT_CLASSIFIER
    from gyre_core.tasks import digits, file_tasks, number_guess, sum_file

    pm = plugin_manager()
    for mod, name in ((harness, "gyre-core.harness"), (number_guess, "gyre-core.number-guess"),
                      (sum_file, "gyre-core.sum-file"), (digits, "gyre-core.digits"),
                      (file_tasks, "gyre-core.file-tasks"),
                      (DEFAULT_CLASSIFIER, "gyre-core.claude-code-roles")):
        if pm.get_plugin(name) is None:
            pm.register(mod, name=name)
    for i, plugin in enumerate(extra_plugins):  # e.g. a test's evaluator that raises or hangs
        pm.register(plugin, name=f"extra-{i}")
    return pm


def _prepare_tokenizer(cfg: RunConfig, out: Path) -> Path:
    """The tokenizer (and chat template) directory: the configured model's, or a tiny one."""
    if cfg.model.dir:
        return Path(cfg.model.dir)
    from gyre_core.tiny_model import build_tiny_model

    src = out / "tokenizer-src"
    if not (src / "tokenizer.json").exists():
        build_tiny_model(src, vocab_size=cfg.model.vocab_size, hidden_size=cfg.model.hidden_size,
                         num_layers=cfg.model.num_layers, max_position_embeddings=cfg.model.max_seq_len,
                         seed=cfg.run.seed)
    return src


def _serving_dir(v0: WeightsRef, tokenizer_dir: Path) -> Path:
    """Make the published version-0 checkpoint a complete model directory an engine can start on."""
    d = Path(v0.location)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, d / name)
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((tokenizer_dir / "generation_config.json").read_text()) if (tokenizer_dir / "generation_config.json").exists() else {}
    tok_cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    eos = gen.get("eos_token_id")
    cfg["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
    cfg.setdefault("pad_token_id", gen.get("pad_token_id"))
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 0)),
                                         int(tok_cfg.get("model_max_length", 0) or 0))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def proxy_fd_headroom(service: Any, extra_executions: int = 0) -> str:
    """Raise the descriptor limit before the proxy serves (every harness connection is one) and
    check it against the executions the engines hold at their capacity, each at the proxy's
    per-execution connection cap, plus the engines: the line to report (a warning when short)."""
    from gyre_core.procutil import fds_needed, raise_fd_limit

    slots = service.router.engines()
    executions = sum(int(s.capacity) for s in slots if s.capacity != float("inf")) + extra_executions
    fd = raise_fd_limit(fds_needed(executions, service.config.max_connections_per_execution, len(slots)))
    if not fd.ok:
        log.warning("%s", fd.line())
    return fd.line()


async def _serve_proxy(app: Any, host: str, port: int, uds: str | None = None) -> tuple[Any, asyncio.Task[Any], int]:
    import uvicorn

    from gyre_core.proxy.http_layer import uvicorn_config

    config = uvicorn_config(app, uds=uds) if uds else uvicorn_config(app, host=host, port=port)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    for _ in range(200):
        if server.started:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    sockets = [s for srv in server.servers for s in srv.sockets]
    return server, task, 0 if uds else int(sockets[0].getsockname()[1])


def make_proxy_service(cfg: RunConfig, tokenizer: Any, pm: Any) -> Any:
    """The run's TITO proxy service (engines are added by the caller)."""
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService

    return ProxyService(ChatRenderer(tokenizer), ProxyConfig(
        served_models=(cfg.model.name,),
        sampling={"temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p},
        max_new_tokens=cfg.sampling.max_new_tokens,
        # what can be trained, not only what the model reads: a call whose prompt and reply would
        # not fit one micro-step row is refused with the API's own context-length error (the
        # harness reacts as to a real API: compacts, or ends), and never reaches the trainer
        context_window=min(w for w in (tokenizer_window(tokenizer), cfg.dataplane.token_budget) if w),
        kv_handoff=cfg.proxy.kv_handoff,
    ), classify=lambda leaf: pm.hook.gyre_classify_role(leaf=leaf))


def hidden_paths(cfg: RunConfig, out: Path) -> tuple[list[str], list[str]]:
    """What no sandbox may see (the run folder, the cluster key, the model folder, the task files
    train and held-out) and what only the evaluator may see: the reward function's file, the
    files the evaluator command names (not its program, which may be the harness's interpreter
    too), and ``harness.sandbox_hide``."""
    hide = [out] + [p for p in (cfg.cluster.key_file, cfg.model.dir, cfg.task.train, cfg.task.eval) if p]
    judge_only = [cfg.task.reward.rpartition(":")[0]] if cfg.task.reward else []
    judge_only += [a for a in cfg.task.evaluator[1:] if os.path.isabs(a) and os.path.isfile(a)]
    judge_only += list(cfg.harness.sandbox_hide)
    return [str(Path(p).resolve()) for p in hide], [str(Path(p).resolve()) for p in judge_only if p]


async def sandbox_gate(app: Any, cfg: RunConfig, out: Path, port: int
                       ) -> tuple[dict[str, Any] | None, Any, asyncio.Task[Any] | None, Path | None]:
    """With ``harness.sandbox = "bwrap"``: the sandboxes' only way out, the proxy on a Unix socket
    in a private folder (short path: AF_UNIX allows ~100 bytes), relayed inside each sandbox to the
    proxy's own address. Returns the sandbox spec (as ``extra``), the socket's server, its task and
    its folder (all None without a sandbox)."""
    if cfg.harness.sandbox != "bwrap":
        return None, None, None, None
    import tempfile

    from gyre_core.orchestrator.sandbox import SandboxSpec

    sock_dir = Path(tempfile.mkdtemp(prefix="gyre-proxy-"))
    sock = str(sock_dir / "proxy.sock")
    sock_server, sock_task, _ = await _serve_proxy(app, cfg.proxy.host, 0, uds=sock)
    # the sandboxes' user (not the run's) connects: the folder holds nothing else, and the proxy
    # asks every call for its execution's own key
    os.chmod(sock_dir, 0o711)
    os.chmod(sock, 0o666)
    hide, judge_only = hidden_paths(cfg, out)
    sandbox = SandboxSpec(tuple(hide), sock, cfg.proxy.host, port, tuple(cfg.harness.sandbox_expose),
                          tuple(judge_only)).as_extra()
    return sandbox, sock_server, sock_task, sock_dir


def run_live(
    cfg: RunConfig,
    progress: Callable[[str], None] | None = None,
    *,
    plugins: Sequence[Any] = (),
    on_started: Callable[[dict[str, Any]], Any] | None = None,
    force_resume: bool = False,
) -> dict[str, Any]:
    """Run ``cfg`` to its end and return the summary (also written to ``summary.json``).

    ``plugins`` are registered on top of the installed ones (their hooks are called first).
    ``on_started`` is called once everything runs, with ``{"orchestrator", "engines", "proxy",
    "proxy_url", "loop"}`` -- for tools and fault-injection tests that need to reach the parts."""
    status = StatusLine(sys.stderr) if progress is None else None  # the caller's progress lines: no display
    say = progress or status.log  # type: ignore[union-attr]
    pm = _plugin_manager(plugins)
    if pm.hook.gyre_task_instance(task=cfg.task.name, group_id=0, seed=cfg.run.seed,
                                  options=task_options(cfg)) is None:
        raise ConfigError(f"task.name: no installed plugin provides task {cfg.task.name!r}")
    check_preflight(cfg, pm)  # before any process starts: every part loadable, or one line each
    out = Path(cfg.run.out_dir or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg.run.out_dir = str(out)
    journal_path = out / JOURNAL
    if cfg.run.resume:
        replay = Replay.load(journal_path)
        changed = _check_resumable(replay, cfg, force_resume)
        if changed:
            say(f"resuming with changed settings (forced): {', '.join(changed)}")
    elif journal_path.exists():
        raise ConfigError(f"run.out_dir: {out} holds a run already: pass --resume to continue it, or another --out")
    else:
        replay = None
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)  # trajectories, the journal, keys: the run's user only (no harness's uid)
    engines: list[Any] = []
    t0 = time.monotonic()
    observers: list[Any] = []
    quiet = contextlib.ExitStack()
    try:
        quiet.enter_context(upstream_log_file(out / "upstream.log"))
        observers = open_observers(cfg.metrics, out, pm, cfg.as_dict())
        return asyncio.run(_run(cfg, out, pm, engines, say, t0, on_started, replay, status))
    except Exception as exc:  # one line per cause for the console; every traceback to error.log
        causes = cause_lines(exc)
        error_log = write_error_log(out, exc)
        summary_path = out / "summary.json"
        with contextlib.suppress(OSError):
            summary_path.write_text(json.dumps({"status": "failed", "causes": causes, "error_log": str(error_log),
                                                "wall_s": round(time.monotonic() - t0, 2)}, indent=1))
        raise RunError(causes, error_log) from exc
    finally:
        close_observers(observers, pm)
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop()
        with contextlib.suppress(Exception):  # each plugin stops what it keeps for the process (ranks)
            pm.hook.gyre_shutdown()
        quiet.close()


async def _run(cfg: RunConfig, out: Path, pm: Any, engines: list[Any], say: Callable[[str], None], t0: float,
               on_started: Callable[[dict[str, Any]], Any] | None = None, replay: Replay | None = None,
               status: StatusLine | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from gyre_core.proxy.app import build_app, default_faces

    k = cfg.scheduler.cells
    tok_dir = _prepare_tokenizer(cfg, out)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))

    say(f"starting {k} Megatron cell(s)")
    spec = {"num_layers": cfg.model.num_layers, "hidden_size": cfg.model.hidden_size,
            "ffn_hidden_size": 2 * cfg.model.hidden_size, "num_attention_heads": 4, "num_query_groups": 2,
            "vocab_size": len(tokenizer), "max_seq_len": cfg.model.max_seq_len, "seed": cfg.run.seed + 1234}
    if len(tokenizer) % cfg.training.tp:
        raise ConfigError(f"training.tp: the tokenizer has {len(tokenizer)} tokens, not a multiple of "
                          f"training.tp {cfg.training.tp} (Megatron splits the vocabulary evenly)")
    if cfg.publication.host:
        say("publication.host is no longer used: the core's ranks publish from their own nodes, each "
            "advertising its own address (GYRE_MOONCAKE_HOST on a node overrides it)")
    train_opts = training_options(cfg, out, spec, announce=say)
    training = [await asyncio.to_thread(pm.hook.gyre_make_training_side, cell=i, options=train_opts) for i in range(k)]
    if any(t is None for t in training):
        raise RuntimeError("no training backend: install gyre-megatron (and megatron-core)")
    if replay is None or not (out / "weights" / "v0" / "config.json").exists():  # the folder engines start on
        v0 = await asyncio.to_thread(training[0].write_weights, 0, str(out / "weights" / "v0"))
    else:
        v0 = WeightsRef(0, str(out / "weights" / "v0"))
    start_weights = v0
    if replay is not None:
        done = {e.step for _, e in replay.events if type(e).__name__ == "MicroStepsDone"}
        ckpt = max((s for s in replay.checkpoints if s in done), default=None)
        if replay.published:
            start_weights = await _republished(training[0], replay, out, say)
        if ckpt is not None:
            say(f"resuming: core loads its state after step {ckpt}")
            await asyncio.to_thread(training[0].load_checkpoint, replay.checkpoints[ckpt])
    model_dir = _serving_dir(start_weights, tok_dir)
    say(f"starting {k} SGLang engine(s) on {model_dir}")
    import secrets

    engine_key = secrets.token_urlsafe(24)  # per run: every engine route but health needs it
    n = cfg.training.tp * cfg.training.pp  # GPUs per cell; its engine spans them (SGLang tensor parallelism)
    # each engine's options, kept: a restarted engine starts again with its own (GPUs, memory saver)
    engine_opts = {i: engine_options(cfg, engine_key, out / f"engine{i}.log", base_gpu_id=i * n, tp_size=n,
                                     memory_saver=True) for i in range(k)}
    started = await asyncio.gather(*(asyncio.to_thread(_start_engine, pm, cfg, training[i], model_dir,
                                                       engine_opts[i], engines) for i in range(k)))
    standalone_engine = None
    if cfg.scheduler.standalone_capacity > 0:  # the pool: an engine of its own on this node, never switched
        engine_opts[-1] = engine_options(cfg, engine_key, out / "engine-standalone.log", base_gpu_id=k * n, tp_size=1)
        standalone_engine = await asyncio.to_thread(_start_engine, pm, cfg, None, model_dir, engine_opts[-1], engines)
    say(f"engines ready after {time.monotonic() - t0:.0f} s")
    for line in placement_plan(training, started, standalone_engine):
        say(line)

    service = make_proxy_service(cfg, tokenizer, pm)
    cells = []
    for i, e in enumerate(started):
        serving_opts = serving_options(cfg, e.url, engine_key)
        service.add_engine(pm.hook.gyre_make_engine_client(url=e.url, options=serving_opts),
                           kind="cell", cell_index=i, capacity=cfg.scheduler.cell_capacity)
        serving = pm.hook.gyre_make_serving_side(engine=i, options=serving_opts)
        cells.append(CellHandles(i, serving, training[i], e.url))
    # before any execution: an engine that could not switch roles as configured stops the run here
    problems = [p for c in cells for p in await c.serving.arole_switch_problems(kv_handoff=cfg.proxy.kv_handoff)]
    if problems:
        raise ConfigError("\n".join(problems))
    standalone = None
    if standalone_engine is not None:
        serving_opts = serving_options(cfg, standalone_engine.url, engine_key)
        service.add_engine(pm.hook.gyre_make_engine_client(url=standalone_engine.url, options=serving_opts),
                           kind="standalone", capacity=cfg.scheduler.standalone_capacity)
        standalone = StandaloneHandles(pm.hook.gyre_make_serving_side(engine=-1, options=serving_opts),
                                       standalone_engine.url)
    say(proxy_fd_headroom(service, extra_executions=cfg.eval.max_concurrent))
    app = build_app(service, admin_token=secrets.token_urlsafe(24), faces=default_faces())
    server, serve_task, port = await _serve_proxy(app, cfg.proxy.host, cfg.proxy.port)
    proxy_url = f"http://{cfg.proxy.host}:{port}"
    sandbox, sock_server, sock_task, sock_dir = await sandbox_gate(app, cfg, out, port)
    say(f"proxy on {proxy_url}; running {cfg.run.steps} step(s) in {cfg.scheduler.mode.value} mode")
    try:
        journal = Journal(out / JOURNAL, fresh=replay is None)
        if journal.cut_bytes:
            say(f"journal: cut a torn last record ({journal.cut_bytes} bytes, a crash mid-write; it never took effect)")
        with open(out / "events.jsonl", "a" if replay is not None else "w") as event_log:
            orch = LiveOrchestrator(cfg, cells=cells, proxy=service, proxy_url=proxy_url, pm=pm, out_dir=out,
                                    weights=WeightsRef(start_weights.version, str(model_dir)), progress=say,
                                    event_log=event_log, journal=journal, replay=replay, sandbox=sandbox,
                                    standalone=standalone, status=status)
            orch.watchdog = _engine_watchdog(pm, engine_opts, serving_options(cfg, "", engine_key), out, model_dir,
                                             engines, started,
                                             start_weights.version, say, cfg, training, standalone_engine).attach(orch)
            orch._spawn(orch.watchdog.run(), "engine watchdog")
            if on_started is not None:
                on_started({"orchestrator": orch, "engines": list(started), "standalone_engine": standalone_engine,
                            "proxy": service,
                            "proxy_url": proxy_url, "loop": asyncio.get_running_loop()})
            try:
                summary = await orch.run()
            finally:
                await orch.shutdown()
                summary_at_stop = orch.summary()
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve_task, 10)
        if sock_server is not None:
            sock_server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sock_task, 10)
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)
        for slot in service.router.engines():
            with contextlib.suppress(Exception):
                await slot.client.close()
    journal.close()
    summary["executions"] = summary_at_stop["executions"]
    summary["engine_restarts"] = [dataclasses.asdict(r) for r in orch.watchdog.restarts]
    summary["wall_s"] = round(time.monotonic() - t0, 2)
    summary["status"] = "ok"
    _write_outputs(out, orch, summary, cfg)
    return summary


async def _republished(core: Any, replay: Replay, out: Path, say: Callable[[str], None]) -> WeightsRef:
    """The last version the journalled run published, as a model folder engines can start on.

    A disk publication is still there. A Mooncake one lived in the crashed run's memory: the core
    rebuilds it from its checkpoint of the step before (version v is the policy after step v-1)
    and writes it once, so the resumed engines serve exactly what the run had published."""
    v = max(replay.published)
    location = replay.published[v]
    if not location.lstrip().startswith("{") and Path(location).is_dir():  # JSON: a Mooncake publication
        return WeightsRef(v, replay.published[v])
    folder = out / "weights" / f"v{v}"
    if not (folder / "config.json").exists():
        if v - 1 not in replay.checkpoints:
            raise RuntimeError(f"resume: policy version {v} was published over Mooncake and the core's "
                               f"checkpoint after step {v - 1} that would rebuild it is missing")
        say(f"resuming: rebuilding published policy version {v} from the checkpoint after step {v - 1}")
        await asyncio.to_thread(core.load_checkpoint, replay.checkpoints[v - 1])
        await asyncio.to_thread(core.write_weights, v, str(folder))
    return WeightsRef(v, str(folder))


def placement_plan(training: Sequence[TrainingSide], engines: Sequence[EngineProcess],
                   standalone: EngineProcess | None = None) -> list[str]:
    """One line per cell: cell → node → devices → ranks → engine (where each part runs).

    A cell's engine starts on the GPUs its ranks train on (``--base-gpu-id`` at the cell's first
    GPU, ``--tp-size`` its GPU count); on a machine without CUDA every part runs on the CPU."""
    lines = []
    for side, engine in zip(training, engines):
        where = side.placement()
        role = "core" if side.cell == 0 else "satellite"
        extra = engine.placement()
        lines.append(
            f"cell {side.cell} ({role}): node {','.join(where.get('nodes', ['?']))} · "
            f"devices {','.join(where.get('devices', ['?']))} · ranks {list(where.get('ranks', []))} "
            f"(tp {where.get('tp', 1)} × pp {where.get('pp', 1)}) · engine {engine.url}" + (f" {extra}" if extra else ""))
    if standalone is not None:
        lines.append(f"standalone pool: engine {standalone.url} (never trains)")
    return lines


def _start_engine(pm: Any, cfg: RunConfig, training: Any, model_dir: Path, options: EngineOptions,
                  engines: list[Any]) -> Any:
    """Start one cell's SGLang server where the cell runs: here, or (cluster launchers) on the
    cell's node by its first rank; ``training=None``: the standalone pool's engine, always here.
    Registered in ``engines`` (stopped at the end of the run)."""
    if cfg.cluster.launcher == "local" or training is None:
        e = pm.hook.gyre_start_engine(model_dir=str(model_dir), options=options)
        if e is None:
            raise RuntimeError("no serving backend: install gyre-sglang (and SGLang)")
    else:
        e = training.start_engine(str(model_dir), dataclasses.replace(options, host=cfg.cluster.engine_host))
    engines.append(e)
    return e


def _engine_watchdog(pm: Any, engine_opts: Mapping[int, EngineOptions], serving_opts: ServingOptions, out: Path,
                     model_dir: Path, engines: list[Any],
                     started: Sequence[Any], version: int, say: Callable[[str], None],
                     cfg: RunConfig, training: Sequence[Any], standalone: Any = None) -> EngineWatchdog:
    """The run's engine watchdog: a dead engine (a cell's, or ``-1``: the standalone pool's) is
    killed for good and started again with its own options on ``model_dir`` (policy
    ``version``); the watchdog brings it up to date."""
    current = dict(enumerate(started))
    if standalone is not None:
        current[-1] = standalone
    restarts = dict.fromkeys(current, 0)

    async def restart(cell: int) -> Any:
        await asyncio.to_thread(current[cell].kill)
        restarts[cell] += 1
        log_path = out / (f"engine-standalone.restart{restarts[cell]}.log" if cell < 0
                          else f"engine{cell}.restart{restarts[cell]}.log")

        # registered in the worker thread: a run ending meanwhile still stops it
        e = await asyncio.to_thread(_start_engine, pm, cfg, None if cell < 0 else training[cell], model_dir,
                                    dataclasses.replace(engine_opts[cell], log_path=str(log_path)), engines)
        current[cell] = e
        return e

    def alive(cell: int) -> bool | None:
        return current[cell].alive()

    return EngineWatchdog(restart, alive=alive, initial_version=version, progress=say,
                          serving_options=serving_opts, **cfg.watchdog.model_dump())


def _write_outputs(out: Path, orch: LiveOrchestrator, summary: dict[str, Any], cfg: RunConfig) -> None:
    from gyre_core.simulator.timeline import write_role_timeline_svg

    steps = [(int(r["step"]), float(r["started_s"]), float(r["ended_s"])) for r in orch.steps.records
             if "started_s" in r and "ended_s" in r]
    pubs = [(int(p["version"]), float(p["at_s"])) for p in orch.publication.records if "at_s" in p]
    joins = [(int(r["step"]), int(j["cell"]), float(j["at_s"])) for r in orch.steps.records
             for j in r.get("joined_running", [])]
    end = max([i[3] for i in orch.cells.role_intervals] + [b for _, _, b in steps] + [t for _, t in pubs], default=0.0)
    intervals = [(c, r, a, b) for c, r, a, b in orch.cells.role_intervals]
    try:
        write_role_timeline_svg(out / "role_timeline.svg", intervals, len(orch.cells), end,
                                f"Gyre live run ({cfg.scheduler.mode.value}), {summary['steps']} steps",
                                steps=steps, publications=pubs, joins=joins)
        summary["timeline"] = str(out / "role_timeline.svg")
    except Exception as e:  # a picture must not cost the run's results
        log.warning("role timeline not written: %s", e)
    ckpt = out / "checkpoint"
    # the final policy, always: a complete model folder a later run can start from (model.dir)
    if orch.publication.save_hf(orch.weights.version, ckpt):  # one weight file, or one per pipeline stage
        summary["checkpoint"] = str(ckpt / "model.safetensors") if (ckpt / "model.safetensors").exists() else str(ckpt)
    summary["hf_checkpoints"] = {str(k): str(v) for k, v in sorted(orch.publication.hf_saved.items())}
    summary["policy_version"] = orch.weights.version
    summary["event_log"] = str(out / "events.jsonl")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

"""``gyre-orchestrate``: the command line of Gyre.

Subcommands:
  simulate  race Gyre, Async and Colocate on a preset or a recorded trace (the same scheduler the
            live orchestrator runs);
  plugins   list the plugins found through the ``gyre`` entry-point group;
  proxy     serve the TITO proxy (OpenAI and Anthropic APIs) in front of rollout engines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from gyre_core.config import ConfigError, Mode, SchedulerConfig
from gyre_core.scheduler.burst import solve_burst


def _version_text() -> str:
    """``gyre-orchestrate 0.1.0`` and one line per Gyre plugin and upstream part installed."""
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    from gyre_core import __version__

    lines = [f"gyre-orchestrate {__version__} (gyre-core {v('gyre-core') or __version__})"]
    for dist in ("gyre-megatron", "gyre-sglang", "megatron-core", "sglang", "mooncake-transfer-engine-non-cuda",
                 "mooncake-transfer-engine", "torch"):
        if (found := v(dist)) is not None:
            lines.append(f"  {dist} {found}")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """``--version`` printed as written (argparse's own action re-wraps it into one paragraph)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(_version_text())
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre-orchestrate", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action=_VersionAction,
                        help="print Gyre's distributions and the upstream releases installed beside them, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="race the scheduling modes on a preset or a trace")
    sim.add_argument("--preset", default="paper-122b", help="named setting (default: paper-122b)")
    sim.add_argument("--trace", type=Path, help="JSON-lines trace of executions (replaces the preset's workload)")
    sim.add_argument("--modes", default="gyre,async,colocate", help="comma list of gyre, async, colocate")
    sim.add_argument("--staleness", type=float, help="target mean scheduling staleness E[d] (preset default)")
    sim.add_argument("--steps", type=int, help="training steps to simulate (preset default)")
    sim.add_argument("--seed", type=int, help="random seed (default 0; with --calibrate-from: the run's)")
    sim.add_argument("--out", type=Path, help="write timelines, training shares, event logs and summary here")
    sim.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sim.add_argument("--auto-burst", action="store_true", help="let Gyre choose (φ, μ) by simulation: every μ on the target staleness "
                     "(with --phi: that φ, every μ within the target); prints the table it searched")
    sim.add_argument("--mu", type=int, help="override Gyre's steps per burst μ (φ from the law)")
    sim.add_argument("--phi", type=float, help="override Gyre's extra dispatch φ (μ from the law)")
    sim.add_argument("--train-minutes", type=float, help="minutes for the full pool to train one step")
    sim.add_argument("--cells", type=int, help="K")
    sim.add_argument("--cell-capacity", type=int, help="C_e, concurrent executions per cell in rollout")
    sim.add_argument("--standalone-capacity", type=int, help="C_s, standalone rollout pool")
    sim.add_argument("--group-size", type=int, help="N, executions per group")
    sim.add_argument("--groups-per-step", type=int, help="B, groups per training step")
    sim.add_argument("--rho-min", type=float, help="ρ_min, supply fraction of B needed to add a cell")
    sim.add_argument("--tau", type=float, help="τ, seconds the supply must hold before a transition")
    sim.add_argument("--oversample", type=int, help="N' > N executions launched per group")
    sim.add_argument("--short-group", choices=["filter", "top_up", "drop"],
                     help="rule for groups short of N valid rewards (default filter, the paper's)")
    sim.add_argument("--min-valid-rewards", type=int, help="valid rewards a filtered group needs to train (default 2)")
    sim.add_argument("--publication-s", type=float, help="seconds to publish weights to every engine")
    sim.add_argument("--calibrate-from", type=Path, metavar="RUN_DIR",
                     help="simulate a finished live run: its scheduler section, its measured switch, publication "
                          "and training times, and the executions it replayed or measured (prints the live "
                          "run's time beside the prediction)")
    sim.add_argument("--quiet", action="store_true", help="no progress on stderr")

    sub.add_parser("plugins", help="list installed Gyre plugins")

    run = sub.add_parser("run", help="elastic agent RL on real cells (no arguments: the embedded CPU job)")
    run.add_argument("--config", type=Path, help="run configuration (TOML, or YAML with PyYAML)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one configuration value (repeatable), e.g. --set scheduler.cells=4")
    run.add_argument("--steps", type=int, help="training steps (run.steps)")
    run.add_argument("--mode", choices=[m.value for m in Mode], help="scheduling mode (scheduler.mode)")
    run.add_argument("--out", help="output directory (run.out_dir)")
    run.add_argument("--resume", action="store_true", help="continue the run journalled in the output directory")
    run.add_argument("--force-resume", action="store_true",
                     help="with --resume: continue even if settings the journal depends on changed")
    run.add_argument("--json-summary", action="store_true", help="print the summary as one JSON object on stdout")

    ev_ = sub.add_parser("eval", help="evaluate a model folder on the configuration's held-out tasks (no trainer)")
    ev_.add_argument("--model", type=Path, required=True, help="HF model folder (e.g. a run's checkpoint/)")
    ev_.add_argument("--config", type=Path, required=True, help="run configuration with task.eval")
    ev_.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one configuration value (repeatable), e.g. --set eval.samples=4")
    ev_.add_argument("--out", help="output directory (run.out_dir)")
    ev_.add_argument("--json-summary", action="store_true", help="print the summary as one JSON object on stdout")

    px = sub.add_parser("proxy", help="serve the TITO proxy in front of SGLang engines")
    px.add_argument("--engine", action="append", required=True, metavar="URL", help="SGLang server URL (repeatable)")
    px.add_argument("--model-dir", type=Path, required=True, help="model directory (tokenizer and chat template)")
    px.add_argument("--port", type=int, required=True)
    px.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    px.add_argument("--model-name", action="append", help="model name harnesses ask for (default: the model dir's name)")
    px.add_argument("--max-new-tokens", type=int, default=4096)
    px.add_argument("--temperature", type=float, default=1.0)
    px.add_argument("--top-p", type=float, default=1.0)
    px.add_argument("--admin-token", help="admin token for /gyre/ routes (default: GYRE_ADMIN_TOKEN or random)")
    return parser


_FLAG_TO_FIELD = {
    "cells": "cells",
    "cell_capacity": "cell_capacity",
    "standalone_capacity": "standalone_capacity",
    "group_size": "group_size",
    "groups_per_step": "groups_per_step",
    "rho_min": "rho_min",
    "tau": "supply_window_s",
    "oversample": "oversample",
    "short_group": "short_group",
    "min_valid_rewards": "min_valid_rewards",
}


def _simulate(args: argparse.Namespace) -> int:
    from gyre_core.simulator.engine import SimParams
    from gyre_core.simulator.presets import get_preset
    from gyre_core.simulator.race import calibrate_cell_rate, race
    from gyre_core.simulator.workload import TraceWorkload, load_trace, with_default_tokens

    if args.calibrate_from is not None:
        return _simulate_calibrated(args)
    # --- validate everything before anything runs
    preset = get_preset(args.preset)
    fields = dict(preset.scheduler)
    for flag, name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag)
        if value is not None:
            fields[name] = value
    modes = [Mode.parse(m.strip()) for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ConfigError("modes: at least one mode is required")
    staleness = preset.staleness if args.staleness is None else args.staleness
    base = SchedulerConfig(**fields)
    for mode in modes:  # every mode's own (φ, μ) must form a valid config
        if mode is Mode.GYRE and args.auto_burst:
            if args.mu is not None:
                raise ConfigError("auto_burst: the search chooses μ; give --phi to fix φ, not --mu")
            from gyre_core.scheduler.burst import burst_candidates

            for phi, mu in burst_candidates(staleness, args.phi):
                SchedulerConfig(**{**fields, "mode": mode, "extra_dispatch": phi, "steps_per_burst": mu})
            continue
        if mode is Mode.GYRE:
            phi, mu = solve_burst(mode, staleness, mu=args.mu, phi=args.phi)
        else:
            phi, mu = solve_burst(mode, staleness)
        extra = {"async_training_cells": 1} if mode is Mode.ASYNC else {}
        SchedulerConfig(**{**fields, **extra, "mode": mode, "extra_dispatch": phi, "steps_per_burst": mu})
    steps = preset.steps if args.steps is None else args.steps
    minutes = preset.full_pool_step_minutes if args.train_minutes is None else args.train_minutes
    if not minutes > 0:
        raise ConfigError(f"train_minutes: must be > 0, got {minutes!r}")
    if args.trace is not None:
        workload = TraceWorkload(with_default_tokens(load_trace(args.trace)))
    else:
        workload = preset.workload()
    rate = calibrate_cell_rate(workload, base, minutes * 60.0, seed=args.seed or 0)
    params_kwargs = {"steps": steps, "seed": args.seed or 0, "cell_tokens_per_s": rate}
    if args.publication_s is not None:
        params_kwargs["publication_s"] = args.publication_s
    params = SimParams(**params_kwargs)

    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if progress:
        source = args.trace or f"preset {preset.name}"
        progress(f"simulating {steps} steps on {source} at E[d]={staleness:g}, "
                 f"full-pool step {minutes:g} min, modes {','.join(m.value for m in modes)}")
    result = race(
        base, workload, params, modes=modes, staleness=staleness, gyre_mu=args.mu,
        gyre_phi=args.phi, auto_burst=args.auto_burst, out_dir=args.out, progress=progress,
    )
    summary = result.to_json()
    summary["train_minutes"] = minutes
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
    if args.out is not None:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if progress:
            progress(f"wrote {args.out}/summary.json, timeline_<mode>.svg, training_shares_<mode>.csv, events_<mode>.jsonl")
    return 0


def _simulate_calibrated(args: argparse.Namespace) -> int:
    """``simulate --calibrate-from RUN_DIR``: the live run's own world, every mode raced on it."""
    import dataclasses

    from gyre_core.simulator.calibration import calibrate_from_run
    from gyre_core.simulator.race import race

    for flag in ("trace", "train_minutes", "publication_s"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: measured by the live run; not with --calibrate-from")
    if args.preset != "paper-122b":
        raise ConfigError("--preset: the live run is the setting; not with --calibrate-from")
    cal = calibrate_from_run(args.calibrate_from, steps=args.steps, seed=args.seed)
    base = dataclasses.replace(cal.config, **{name: getattr(args, flag) for flag, name in _FLAG_TO_FIELD.items()
                                              if getattr(args, flag) is not None})
    modes = [Mode.parse(m.strip()) for m in args.modes.split(",") if m.strip()]
    live_mode = Mode.parse(cal.live["mode"] or base.mode.value)
    staleness = cal.staleness if args.staleness is None else args.staleness
    mu, phi = args.mu, args.phi
    if live_mode is Mode.GYRE and mu is None and phi is None and not args.auto_burst and args.staleness is None:
        mu, phi = base.steps_per_burst, base.extra_dispatch  # Gyre as the live run ran it
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if progress:
        progress(f"simulating {cal.params.steps} steps of {args.calibrate_from} ({cal.source}) at E[d]={staleness:g}: "
                 f"{json.dumps(cal.measured)}")
    result = race(base, cal.workload, cal.params, modes=modes, staleness=staleness, gyre_mu=mu, gyre_phi=phi,
                  auto_burst=args.auto_burst, out_dir=args.out, progress=progress)
    summary = result.to_json()
    summary["calibration"] = {"run_dir": str(args.calibrate_from), "source": cal.source, "measured": cal.measured,
                              "live": cal.live}
    sim = summary["modes"].get(live_mode.value)
    if sim is not None and cal.live.get("run_s"):
        summary["calibration"]["predicted_s"] = sim["end_to_end_s"]
        summary["calibration"]["gap"] = round(sim["end_to_end_s"] / cal.live["run_s"] - 1.0, 4)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
        c = summary["calibration"]
        if "gap" in c:
            print(f"live {live_mode.value} run: {c['live']['run_s']:.1f} s to its last step; simulated "
                  f"{c['predicted_s']:.1f} s ({c['gap']:+.1%})")
    if args.out is not None:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _print_table(summary: dict) -> None:
    print(f"target E[d] = {summary['target_staleness']:g}")
    longest = max((r["end_to_end_s"] for r in summary["modes"].values()), default=0.0)
    unit, per = ("hours", 3600.0) if longest >= 7200 else ("seconds", 1.0)  # a calibrated live run lasts minutes
    print(f"{'mode':<10}{'φ':>6}{'μ':>4}{unit:>10}{'steps':>7}{'staleness':>11}  training share per cell")
    for mode, r in summary["modes"].items():
        shares = " ".join(f"{s:.2f}" for s in r["cell_training_share"])
        print(f"{mode:<10}{r['phi']:>6g}{r['mu']:>4}{r['end_to_end_s'] / per:>10.2f}{r['steps']:>7}"
              f"{r['mean_staleness']:>11.3f}  {shares}")
    if summary.get("auto_burst"):
        chosen = summary["modes"].get("gyre", {})
        print("burst search (gyre):")
        print(f"  {'φ':>6}{'μ':>4}{'E[d] law':>10}{'measured':>10}{unit:>10}")
        for t in summary["auto_burst"]:
            mark = "  <- chosen" if (t["phi"], t["mu"]) == (chosen.get("phi"), chosen.get("mu")) else ""
            print(f"  {t['phi']:>6g}{t['mu']:>4}{t['expected_staleness']:>10g}{t['mean_staleness']:>10.3f}"
                  f"{t['end_to_end_s'] / per:>10.2f}{mark}")
    if "async_training_cells" in summary["modes"].get("async", {}):
        print(f"async uses its best split: {summary['modes']['async']['async_training_cells']} training cells")
    for name, value in summary["speedup"].items():
        print(f"speedup {name}: {value:.2f}x")


def _plugins() -> int:
    from gyre_core.plugins import describe_plugins, plugin_manager

    for info in describe_plugins(plugin_manager()):
        print(json.dumps(info))
    return 0


def _proxy(args: argparse.Namespace) -> int:
    import os
    import secrets

    import uvicorn

    from gyre_core.plugins import plugin_manager
    from gyre_core.proxy.app import build_app
    from gyre_core.proxy.render import ChatRenderer
    from gyre_core.proxy.service import ProxyConfig, ProxyService

    if not (0 < args.port < 65536):
        raise ConfigError(f"--port: expected 1..65535, got {args.port}")
    if not args.model_dir.is_dir():
        raise ConfigError(f"--model-dir: {args.model_dir} is not a directory")
    pm = plugin_manager()
    clients = _engine_clients(pm, args.engine)
    names = tuple(args.model_name or [args.model_dir.resolve().name])
    config = ProxyConfig(served_models=names, max_new_tokens=args.max_new_tokens,
                         sampling={"temperature": args.temperature, "top_p": args.top_p})
    service = ProxyService(ChatRenderer.from_model_dir(args.model_dir), config,
                           classify=lambda leaf: pm.hook.gyre_classify_role(leaf=leaf))
    for client in clients:
        service.add_engine(client)
    token = args.admin_token or os.environ.get("GYRE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    base = f"http://{args.host}:{args.port}"
    print(f"gyre proxy on {base} (models: {', '.join(names)}; engines: {', '.join(args.engine)})", file=sys.stderr)
    print(f"admin token: {token}", file=sys.stderr)
    print(f"create an execution: curl -s -X POST {base}/gyre/executions -H 'Authorization: Bearer {token}' "
          "-H 'Content-Type: application/json' -d '{}'   # -> execution_id, api_key", file=sys.stderr)
    print(f"then point the harness at {base}/v1 (OpenAI) or {base} (Anthropic) with that api_key", file=sys.stderr)
    from gyre_core.procutil import fds_needed, raise_fd_limit
    from gyre_core.proxy.http_layer import uvicorn_config

    # executions are created over HTTP here, so the global connection cap is what must fit
    fd = raise_fd_limit(fds_needed(1, config.max_connections, len(clients)))
    print(fd.line(), file=sys.stderr)
    app = build_app(service, admin_token=token)
    uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port)).run()
    return 0


def _engine_clients(pm: Any, urls: Sequence[str]) -> list:
    """Engine clients from the installed serving plugin (``gyre_make_engine_client``): the core
    does not import SGLang."""
    from gyre_core.interfaces import ServingOptions

    clients = [pm.hook.gyre_make_engine_client(url=u, options=ServingOptions(url=u)) for u in urls]
    if any(c is None for c in clients):
        raise ConfigError("--engine needs a serving plugin (pip install gyre-sglang)")
    return clients


def _overrides(items: Sequence[str]) -> dict[str, object]:
    overrides: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    return overrides


def _eval(args: argparse.Namespace) -> int:
    """``gyre-orchestrate eval``: a model folder on the held-out tasks, engines only."""
    from gyre_core.orchestrator.eval_only import evaluate_model
    from gyre_core.orchestrator.run_config import load_run_config

    overrides = _overrides(args.set)
    if args.out is not None:
        overrides["run.out_dir"] = args.out
    cfg = load_run_config(args.config, overrides)
    summary = evaluate_model(cfg, args.model)
    if args.json_summary:
        print(json.dumps(summary))
    else:
        r = summary["evaluation"]
        print(f"{args.model}: pass rate {r['pass_rate']} (pass@{cfg.eval.samples}) on {r['tasks']} held-out task(s), "
              f"mean reward {r['mean_reward']}, {r['unresolved']} of {r['executions']} execution(s) unresolved; "
              f"per task in {Path(cfg.run.out_dir) / 'eval' / 'step0.jsonl'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """``gyre-orchestrate run``: validate the whole configuration first, then run it."""
    from gyre_core.orchestrator.run_config import load_run_config

    overrides = _overrides(args.set)
    for flag, key in (("steps", "run.steps"), ("mode", "scheduler.mode"), ("out", "run.out_dir")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.resume:
        overrides["run.resume"] = True
    cfg = load_run_config(args.config, overrides)

    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.failure import RunError

    if args.force_resume and not args.resume:
        raise ConfigError("--force-resume needs --resume")
    try:
        summary = run_live(cfg, force_resume=args.force_resume)
    except RunError as exc:
        print(f"gyre-orchestrate: run failed: {exc.causes[0] if exc.causes else exc}", file=sys.stderr)
        for line in exc.causes[1:]:
            print(f"  caused by: {line}", file=sys.stderr)
        print(f"gyre-orchestrate: full tracebacks in {exc.error_log}", file=sys.stderr)
        return 1
    if args.json_summary:
        print(json.dumps(summary))
    else:
        ex = dict(summary["executions"])
        causes = ex.pop("not_trained", None) or {}
        print(f"{summary['steps']} steps in {summary['wall_s']:.0f} s ({summary['mode']}); mean staleness "
              f"{summary['mean_staleness']}; rewards per step {summary['rewards']}; "
              f"{len(summary['role_switches'])} role switches; executions {ex}; outputs in {cfg.run.out_dir}")
        if causes:
            print("not trained: " + "; ".join(f"{fate}: " + ", ".join(f"{n} {why}" for why, n in c.items())
                                              for fate, c in causes.items()))
        for f in summary.get("satellite_failures") or []:
            print(f"step {f['step']}: cell(s) {f['cells']} died, the step finished on cells {f['survivors']}"
                  + (f", ranks restarted in {f['restart_s']} s" if f.get("restarted") else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from gyre_core.orchestrator.journal import JournalError
    from gyre_core.scheduler.state_machine import NoProgress
    from gyre_core.simulator.engine import SimulationStalled
    from gyre_core.simulator.workload import TraceError

    args = _build_parser().parse_args(argv)
    try:
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "proxy":
            return _proxy(args)
        if args.command == "run":
            return _run(args)
        if args.command == "eval":
            return _eval(args)
        return _plugins()
    except (ConfigError, TraceError, OSError, JournalError) as exc:  # bad input: nothing ran
        print(f"gyre-orchestrate: error: {exc}", file=sys.stderr)
        return 2
    except SimulationStalled as exc:
        print(f"gyre-orchestrate: simulation stalled: {exc}", file=sys.stderr)
        return 1
    except NoProgress as exc:  # the scheduler's own verdict, in a simulation or a live run
        print(f"gyre-orchestrate: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``gyre-orchestrate eval --model DIR --config FILE``: a checkpoint on the held-out tasks, alone.

Engines only, no trainer: one SGLang server on the HF folder ``DIR`` (a run's ``checkpoint/``, or
any model folder with its tokenizer), the proxy, and the run configuration's harness, sandbox and
task evaluator -- the very path a run's evaluations take (:mod:`gyre_core.orchestrator.evaluation`),
so a number from here and one from ``summary.json`` ``evaluations`` mean the same thing. Results
go to ``OUT/eval/step0.jsonl`` (one line a task) and ``OUT/summary.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gyre_core.orchestrator.embedded import (
    _plugin_manager,
    _serve_proxy,
    _start_engine,
    make_proxy_service,
    sandbox_gate,
)
from gyre_core.orchestrator.evaluation import EvalPlan, HeldOutEvaluation
from gyre_core.orchestrator.plugin_options import engine_options, serving_options
from gyre_core.orchestrator.preflight import check_preflight
from gyre_core.orchestrator.run_config import ConfigError, RunConfig

__all__ = ["evaluate_model"]


def evaluate_model(cfg: RunConfig, model_dir: str | Path, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Evaluate the model in ``model_dir`` on ``task.eval``; returns (and writes) the summary."""
    say = progress or (lambda msg: print(f"gyre: {msg}", file=sys.stderr, flush=True))
    model = Path(model_dir).resolve()
    if not (model / "config.json").is_file():
        raise ConfigError(f"--model: {model} is not a model folder (no config.json)")
    if not cfg.task.eval:
        raise ConfigError("task.eval: evaluation needs held-out tasks (a task file in task.eval)")
    cfg.model.dir = str(model)
    pm = _plugin_manager()
    check_preflight(cfg, pm)
    out = Path(cfg.run.out_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg.run.out_dir = str(out)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    engines: list[Any] = []
    t0 = time.monotonic()
    try:
        result = asyncio.run(_evaluate(cfg, model, out, pm, engines, say))
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop()
    summary = {"status": "ok", "model": str(model), "evaluation": result, "wall_s": round(time.monotonic() - t0, 2)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


async def _evaluate(cfg: RunConfig, model: Path, out: Path, pm: Any, engines: list[Any],
                    say: Callable[[str], None]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from gyre_core.proxy.app import build_app, default_faces

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    engine_key = secrets.token_urlsafe(24)
    say(f"starting an SGLang engine on {model}")
    engine = await asyncio.to_thread(_start_engine, pm, cfg, None, model, engine_options(
        cfg, engine_key, out / "engine.log", base_gpu_id=0, tp_size=cfg.training.tp * cfg.training.pp,
        mooncake=False), engines)
    service = make_proxy_service(cfg, tokenizer, pm)
    service.policy_version = 0  # the one version this engine serves: every sample is served by it
    service.add_engine(pm.hook.gyre_make_engine_client(url=engine.url, options=serving_options(cfg, engine.url, engine_key)),
                       kind="standalone", capacity=cfg.eval.max_concurrent)
    app = build_app(service, admin_token=secrets.token_urlsafe(24), faces=default_faces())
    server, serve_task, port = await _serve_proxy(app, cfg.proxy.host, cfg.proxy.port)
    sandbox, sock_server, sock_task, sock_dir = await sandbox_gate(app, cfg, out, port)
    try:
        e = cfg.eval
        t0 = time.monotonic()
        evaluation = HeldOutEvaluation.for_run(
            cfg, pm, proxy=service, proxy_url=f"http://{cfg.proxy.host}:{port}", out_dir=out, sandbox=sandbox,
            progress=say, report=lambda version, metrics: None, now=lambda: time.monotonic() - t0,
            plan=EvalPlan(0, True, e.samples, e.max_concurrent, e.pass_threshold))
        evaluation.start(0, last=0)
        await evaluation.finish()
        if not evaluation.results:
            raise RuntimeError("the evaluation did not complete (see the lines above)")
        return evaluation.results[0]
    finally:
        for srv, task in ((server, serve_task), (sock_server, sock_task)):
            if srv is not None:
                srv.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 10)  # type: ignore[arg-type]
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)
        for slot in service.router.engines():
            with contextlib.suppress(Exception):
                await slot.client.close()

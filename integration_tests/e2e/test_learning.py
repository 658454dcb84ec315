"""A live run learns, and a later run starts from what it learnt.

Run 1: ``gyre-orchestrate run`` (in process) on the built-in ``digits`` task, the ``reply``
harness, 10 GSPO steps, on-policy (φ = 0). The evidence is not the run's own noisy per-step means
but the two policies themselves: 256 replies sampled (temperature 1) from the version-0 weights
and from the run's ``checkpoint/``, with HF transformers, scored by the task's own scorer. With 256
samples the standard error of each mean is about 0.01, so the required gain (more than 3 standard
errors of the difference, one-sided p ≈ 0.001 if nothing was learnt) does not come from sampling
noise.

Why on-policy: with the small job's φ = 1 most executions ran one version behind, and at lr 1e-2
GSPO's [0.995, 1.005] ratio clip dropped up to 88% of them from the gradient; the gain then varied
from run to run between 0.013 and 0.135 on the same code, and the smallest failed the margin. On
policy nothing is clipped for staleness: 0.277 → 0.460 (se 0.010) in 16 steps, 0.277 → 0.370 (se
0.009, ten standard errors) in the 10 steps run here.

Run 2 starts from run 1's ``checkpoint/`` (``model.dir``): its version 0 (what the engines serve,
exported by the trainer after the import) holds exactly the checkpoint's weights. It also shows a
satellite's rank dying mid-step, and the run going on: Colocate with two cells, so the satellite
(cell 1) trains in every step; in step 1 its rank is SIGKILLed once it has joined the step
(registered in the ranks' c10d store, as the core reads it). The step must finish on the core, with
the micro-steps the dead rank had claimed streamed again; every training process is then started
anew with the core's state, and cell 1 joins step 2, pulling the core's weights. Every finished
execution is accounted for and each step trains N·B.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(1200)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

SAMPLES = 256
N, B, STEPS, KILL_AT = 4, 2, 3, 1  # run 2


def _sample_scores(model_dir: Path, tokenizer_dir: Path, prompt: str) -> list[float]:
    from gyre_core.tasks.digits import score_reply

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids.repeat(SAMPLES, 1), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=24, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return [score_reply(tok.decode(row[ids.shape[1]:], skip_special_tokens=True)) for row in out]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def test_a_run_learns_the_digits_task_and_a_later_run_starts_from_its_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from gyre_core.orchestrator.embedded import run_live
    from gyre_core.orchestrator.run_config import load_run_config
    from gyre_core.tasks.digits import DigitsInstance

    common = {"task.name": '"digits"', "harness.kind": '"reply"', "training.lr": 1e-2,
              "scheduler.extra_dispatch": 0.0}  # on-policy: no execution is clipped for staleness
    out1 = tmp_path / "run1"
    s1 = run_live(load_run_config(SMALL_JOB, {**common, "run.out_dir": str(out1), "run.steps": 10}), lambda m: None)
    assert s1["status"] == "ok" and s1["steps"] == 10
    assert all(r["tokens"] > 0 for r in s1["step_records"]), s1["step_records"]
    # every step moved the policy, except one whose executions all scored alike: a policy that has
    # learned the task (every reply all digits, reward 1) gets zero advantages, hence no gradient
    assert all(r["grad_norm"] > 0 or r["mean_reward"] in (0.0, 1.0) for r in s1["step_records"]), [
        (r["step"], r["mean_reward"], r["grad_norm"]) for r in s1["step_records"]]

    prompt = DigitsInstance(0).prompt
    before, se_b = _mean_se(_sample_scores(out1 / "weights" / "v0", out1 / "tokenizer-src", prompt))
    after, se_a = _mean_se(_sample_scores(out1 / "checkpoint", out1 / "checkpoint", prompt))
    se = math.sqrt(se_a ** 2 + se_b ** 2)
    print(f"\ndigits: {SAMPLES} samples, version 0 {before:.3f} -> checkpoint {after:.3f} (se {se:.3f}); "
          f"run's rewards {s1['rewards']}")
    assert after - before > max(0.02, 3 * se), (before, after, se)

    out2 = tmp_path / "run2"
    s2, parts, killed = _run_killing_the_satellite(load_run_config(SMALL_JOB, {
        **common, "run.out_dir": str(out2), "model.dir": str(out1 / "checkpoint"),
        "run.steps": STEPS, "run.max_wall_s": 720.0,
        "scheduler.mode": "colocate", "scheduler.steps_per_burst": 1,
        "scheduler.group_size": N, "scheduler.groups_per_step": B,
        "dataplane.token_budget": 512, "training.collective_timeout_s": 5.0}))
    assert s2["status"] == "ok"
    served = load_file(str(out2 / "weights" / "v0" / "model.safetensors"))
    saved = load_file(str(out1 / "checkpoint" / "model.safetensors"))
    assert served.keys() == saved.keys()
    assert all(torch.equal(served[k], saved[k]) for k in saved)
    _assert_the_run_survived_its_dead_satellite(s2, parts, killed)


def _run_killing_the_satellite(cfg: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run ``cfg``, SIGKILLing the satellite's rank once it has joined step ``KILL_AT``."""
    from gyre_core.orchestrator.embedded import run_live
    from gyre_megatron.testing import kill_once_joined

    def kill(world: Any) -> dict[str, Any]:
        pid = world.procs[1].pid
        os.kill(pid, signal.SIGKILL)
        return {"pid": pid}

    on_started, parts, killed = kill_once_joined(KILL_AT, 1, kill)
    summary = run_live(cfg, lambda m: None, on_started=on_started)
    print(f"killed {killed}; satellite failures {summary['satellite_failures']}; "
          f"steps {[(r['step'], r['cells'], r['micro_steps'], r['duration_s']) for r in summary['step_records']]}")
    return summary, parts, killed


def _assert_the_run_survived_its_dead_satellite(summary: dict[str, Any], parts: dict[str, Any],
                                                killed: dict[str, Any]) -> None:
    from gyre_core.testing import assert_accounted

    assert killed and "error" not in killed, f"the satellite never joined step {KILL_AT} ({killed})"
    # the run trained all its steps, each on its N·B executions, nothing lost
    assert summary["steps"] == STEPS and len(summary["step_records"]) == STEPS
    ex = summary["executions"]
    assert_accounted(ex)
    assert ex["trained"] == STEPS * B * N, ex
    for rec in summary["step_records"]:
        assert rec["executions"] == B * N and rec["grad_norm"] is not None, rec

    # step 1 lost cell 1 and finished on the core, re-streaming what cell 1 had claimed
    (failure,) = summary["satellite_failures"]
    redone = [int(i) for i in killed["claimed"].split(",") if i]
    assert failure["step"] == KILL_AT and failure["cells"] == [1] and failure["survivors"] == [0], failure
    assert failure["redone_micro_steps"] == len(redone) and failure["restarted"] and failure["restart_s"] > 0
    by_step = {r["step"]: r for r in summary["step_records"]}
    assert by_step[KILL_AT]["cells"] == [0]
    assert by_step[KILL_AT]["tokens"] > 0 and by_step[KILL_AT]["loss"] is not None  # the survivors' figures

    # the restarted cell 1 joined the next step, pulling the core's weights
    assert by_step[KILL_AT + 1]["cells"] == [0, 1]
    (join,) = by_step[KILL_AT + 1]["joins"]
    assert join["cell"] == 1 and join["pull_bytes"] > 0
    world = parts["orchestrator"].cells[0].training.world
    assert world.restarts == 1 and killed["pid"] not in [p.pid for p in world.procs]
    assert not any(p.is_alive() for p in world.procs)  # the run's end stopped every rank it started

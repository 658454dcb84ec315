"""Each objective's training step against GSPO's (real megatron-core ranks, gloo, CPU).

The step of ``benchmarks/split_ratio_cost.py`` (``--executions`` executions of ``--rows`` rows,
long-tailed lengths, a share of the executions split over packs of ``--budget`` tokens), trained
from the same weights under each ``training.objective``: GSPO runs a split execution's other rows
forward once more for its whole-execution ratio; GRPO, DAPO and CISPO clip per token and skip
that pass. ``gspo+kl`` is GSPO with a KL penalty (``training.kl_coef``): every micro-step also
runs forward through the frozen reference weights, which each rank holds (``reference_mib``).
One world per objective (its ``RankOptions.objective``, as a run sets it); best of
``--repeats`` steps. The whole live job's step is mostly rollouts: this is the trainer's part,
where the objectives differ. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from split_ratio_cost import make_step  # noqa: E402

from gyre_core.interfaces import OBJECTIVE_CLIPS, OBJECTIVES, ObjectiveConfig  # noqa: E402
from gyre_megatron.launch import World  # noqa: E402
from gyre_megatron.model import ModelSpec  # noqa: E402
from gyre_megatron.runtime import RankOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--executions", type=int, default=32)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--objectives", default=",".join((*OBJECTIVES, "gspo+kl")),
                    help="comma-separated: gspo, grpo, dapo, cispo, gspo+kl")
    a = ap.parse_args()
    spec = ModelSpec(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden,
                     num_attention_heads=8, num_query_groups=4, max_seq_len=a.budget)
    micro = make_step(a.executions, a.rows, a.budget, spec.vocab_size, seed=0)
    out: dict[str, dict] = {}
    for name in a.objectives.split(","):
        kind = name.removesuffix("+kl")
        low, high = OBJECTIVE_CLIPS[kind]
        objective = ObjectiveConfig(kind=kind, clip_low=low, clip_high=high, kl_coef=0.1 if name.endswith("+kl") else 0.0)
        opts = RankOptions(cells=1, pp=1, spec=spec, normalise_by_tokens=False, objective=objective)
        times: list[float] = []
        with World(opts, n_queues=a.repeats) as w:
            core = w.ranks_of(0)
            w.call(core, "save_state")
            param_bytes = sum(v.nbytes for r in w.call(core, "params_numpy") for v in r.values())
            for q in range(a.repeats):
                for m in micro:
                    w.queues[q].put(m)
                w.queues[q].close()
                t0 = time.monotonic()
                info = w.wait(w.submit(core, "run_step", q, q), 600)
                times.append(time.monotonic() - t0)
                w.call(core, "restore_state")
        fig = info[0]["objective"]
        out[name] = {"step_s": round(min(times), 3), "ratio_pass_s": round(fig["ratio_pass_s"], 3),
                     "reference_pass_s": round(fig.get("reference_pass_s", 0.0), 3),
                     "reference_mib": round(param_bytes / 2**20, 2) if objective.kl_coef > 0 else 0.0,
                     "loss": round(fig["loss"], 6), "executions": round(fig["executions"], 3),
                     "clip_fraction": round(fig["clipped"] / fig["executions"], 4),
                     "token_clip_fraction": round(fig["clipped_tokens"] / fig["tokens"], 4)}
    base = out["gspo"]["step_s"] if "gspo" in out else next(iter(out.values()))["step_s"]
    for kind in out:
        out[kind]["vs_gspo"] = round(out[kind]["step_s"] / base, 3)
    print(json.dumps({"benchmark": "objective_step_time", "executions": a.executions, "budget": a.budget,
                      "hidden": a.hidden, "layers": a.layers, "micro_steps": len(micro),
                      "split_executions": len({r.exec_slot for m in micro for p in m.packs for r in p.outside}),
                      "trained_tokens": sum(p.tokens for m in micro for p in m.packs), "objectives": out}))


if __name__ == "__main__":
    main()

"""Race Gyre, Async and Colocate on the same workload, the way the paper compares them.

Every mode runs the same scheduler class with its own (φ, μ) for one target E[d]; Async gets the
best rollout/training split found by trying all of them; ``auto_burst`` lets Gyre pick (φ, μ) by
simulation (:func:`~gyre_core.scheduler.burst.burst_candidates`). Group i draws the same executions in every run (its random stream is seeded by the
seed and the group id), so differences come from scheduling alone.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gyre_core.config import ConfigError, Mode, SchedulerConfig
from gyre_core.scheduler.burst import burst_candidates, expected_staleness, solve_burst
from gyre_core.simulator.engine import SimParams, SimResult, Simulation
from gyre_core.simulator.timeline import write_role_timeline_svg
from gyre_core.simulator.workload import GroupDraw, Workload


class PerGroupSeeded:
    """Wraps a workload so that the i-th dispatched group gets the same draw in every run."""

    def __init__(self, inner: Workload, seed: int) -> None:
        self.inner = inner
        self.seed = seed
        self._count = 0

    def draw_group(self, rng: random.Random, n: int) -> GroupDraw:
        self._count += 1
        own = random.Random(f"{self.seed}:{self._count}:{n}")
        indexed = getattr(self.inner, "draw_indexed", None)  # a live run's groups, in its order
        if indexed is not None:
            return indexed(self._count - 1, own, n)
        return self.inner.draw_group(own, n)


def calibrate_cell_rate(
    workload: Workload, cfg: SchedulerConfig, full_pool_step_s: float, seed: int = 0, samples: int = 256
) -> float:
    """Tokens/s per cell such that all K cells train one mean step in ``full_pool_step_s``.

    A step's work is the tokens of the N valid executions of each of its B groups.
    """
    rng = random.Random(f"calibrate:{seed}")
    per_group = []
    executions = overall_timeouts = 0
    for _ in range(samples):
        draw = workload.draw_group(rng, cfg.executions_per_group)
        executions += len(draw.executions)
        valid = [r.tokens or 0 for r in draw.executions if r.outcome.value != "overall_timeout"]
        overall_timeouts += len(draw.executions) - len(valid)
        mean = sum(valid) / len(valid) if valid else 0.0
        per_group.append(mean * cfg.group_size)
    if overall_timeouts == executions:
        raise ConfigError(
            f"workload: all {executions} executions of {samples} sampled groups are overall timeouts "
            "(discarded before a valid reward): no group would ever have anything to train"
        )
    step_tokens = cfg.groups_per_step * sum(per_group) / len(per_group)
    if step_tokens <= 0:
        raise ConfigError("workload: the valid executions carry no tokens, cannot model training time")
    return step_tokens / (cfg.cells * full_pool_step_s)


@dataclass(frozen=True)
class BurstTrial:
    """One (φ, μ) pair the burst search simulated."""

    phi: float
    mu: int
    end_to_end_s: float
    mean_staleness: float

    def to_json(self) -> dict:
        return {"phi": self.phi, "mu": self.mu, "expected_staleness": expected_staleness(self.phi, self.mu),
                "mean_staleness": round(self.mean_staleness, 4), "end_to_end_s": round(self.end_to_end_s, 1)}


@dataclass
class RaceResult:
    target_staleness: float
    results: dict[str, SimResult]
    async_splits: dict[int, float]
    auto_burst: list[BurstTrial]

    def to_json(self) -> dict:
        modes = {m: r.summary() for m, r in self.results.items()}
        speedup = {}
        g = self.results.get("gyre")
        for other in ("async", "colocate"):
            if g is not None and other in self.results:
                speedup[f"gyre_vs_{other}"] = round(self.results[other].end_to_end_s / g.end_to_end_s, 4)
        out: dict = {"target_staleness": self.target_staleness, "modes": modes, "speedup": speedup}
        if self.async_splits:
            out["async_splits"] = {str(k): round(v, 1) for k, v in self.async_splits.items()}
        if self.auto_burst:
            out["auto_burst"] = [t.to_json() for t in self.auto_burst]
        return out


def race(
    base: SchedulerConfig,
    workload: Workload,
    params: SimParams,
    *,
    modes: Sequence[Mode | str] = ("gyre", "async", "colocate"),
    staleness: float = 1.5,
    gyre_mu: int | None = None,
    gyre_phi: float | None = None,
    auto_burst: bool = False,
    out_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> RaceResult:
    say = progress or (lambda _msg: None)
    parsed = [Mode.parse(m) for m in modes]
    if not parsed:
        raise ConfigError("modes: at least one mode is required")

    def simulate(cfg: SchedulerConfig, label: str, log_path: Path | None = None) -> SimResult:
        wl = PerGroupSeeded(workload, params.seed)
        if log_path is None:
            result = Simulation(cfg, wl, params).run()
        else:
            with open(log_path, "w") as log:
                result = Simulation(cfg, wl, params, event_log=log).run()
        say(f"[{label}] {result.steps} steps in {result.end_to_end_s / 3600:.2f} h, "
            f"mean staleness {result.mean_staleness:.3f}")
        return result

    chosen: dict[str, SchedulerConfig] = {}
    results: dict[str, SimResult] = {}
    splits: dict[int, float] = {}
    bursts: list[BurstTrial] = []
    if auto_burst and gyre_mu is not None:
        raise ConfigError("auto_burst: the search chooses μ; give --phi to fix φ, not --mu")
    for mode in parsed:
        if mode is Mode.GYRE:
            if auto_burst:
                best = None
                for phi, mu in burst_candidates(staleness, gyre_phi):
                    cfg = dataclasses.replace(base, mode=mode, extra_dispatch=phi, steps_per_burst=mu)
                    r = simulate(cfg, f"gyre auto-burst μ={mu} φ={phi:g}")
                    bursts.append(BurstTrial(phi, mu, r.end_to_end_s, r.mean_staleness))
                    if best is None or r.end_to_end_s < best[0]:
                        best = (r.end_to_end_s, cfg, r)
                assert best is not None
                chosen["gyre"], results["gyre"] = best[1], best[2]
                continue
            phi, mu = solve_burst(mode, staleness, mu=gyre_mu, phi=gyre_phi)
        else:
            phi, mu = solve_burst(mode, staleness)
        cfg = dataclasses.replace(base, mode=mode, extra_dispatch=phi, steps_per_burst=mu)
        if mode is Mode.ASYNC:
            best = None
            for m in range(1, base.cells):
                trial = dataclasses.replace(cfg, async_training_cells=m)
                r = simulate(trial, f"async split {m} training / {base.cells - m} rollout")
                splits[m] = r.end_to_end_s
                if best is None or r.end_to_end_s < best[0]:
                    best = (r.end_to_end_s, trial, r)
            assert best is not None
            chosen["async"], results["async"] = best[1], best[2]
        else:
            chosen[mode.value] = cfg
            results[mode.value] = simulate(cfg, mode.value)

    race_result = RaceResult(staleness, results, splits, bursts)
    if out_dir is not None:
        write_outputs(race_result, chosen, simulate, out_dir)
    return race_result


def write_outputs(
    race_result: RaceResult,
    chosen: dict[str, SchedulerConfig],
    simulate: Callable[..., SimResult],
    out_dir: Path,
) -> None:
    """Timeline picture, training shares and event log per mode, plus the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for mode, cfg in chosen.items():
        # deterministic: re-running the chosen configuration reproduces it, now with its event log
        result = simulate(cfg, f"{mode} (event log)", out_dir / f"events_{mode}.jsonl")
        race_result.results[mode] = result
        write_role_timeline_svg(
            out_dir / f"timeline_{mode}.svg",
            result.intervals,
            n_cells=cfg.cells,
            end_s=result.end_to_end_s,
            title=f"{mode}: φ={cfg.extra_dispatch:g}, μ={cfg.steps_per_burst}, "
            f"{result.steps} steps in {result.end_to_end_s / 3600:.2f} h",
        )
        with open(out_dir / f"training_shares_{mode}.csv", "w") as fh:
            fh.write("cell,training_share\n")
            for cell, share in enumerate(result.cell_training_share):
                fh.write(f"{cell},{share:.6f}\n")
    (out_dir / "summary.json").write_text(json.dumps(race_result.to_json(), indent=2) + "\n")

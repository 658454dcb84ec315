"""The orchestrator killed outright (SIGKILL) again and again mid-run, resumed with ``--resume``.

Counts: steps reach the target; no rollout group is trained in two completed steps; every
execution the journal saw finish before any crash is accounted for at the end (trained, dropped,
surplus, excluded or waiting) -- zero lost, none ended twice; executions running at a crash are
started again under the same id and counted once (launched == finished + stopped at the end); a
resume after a publication rebuilds that policy from the checkpoint; the last resume runs at
another pipeline layout (PP 2) from the checkpoints saved at PP 1; ``checkpoint.keep_last`` removes
the older checkpoints from disk; and no process a killed orchestrator started outlives it
(engines, ranks, harnesses die with it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.sglang, pytest.mark.megatron, pytest.mark.timeout(1200)]

SMALL_JOB = Path(__file__).with_name("small-job.toml")  # the embedded job at test sizes
pytest.importorskip("psutil")  # the chain counts what outlives each kill
pytest.importorskip("sglang")
pytest.importorskip("megatron.core")


def test_a_run_killed_again_and_again_resumes_to_its_end(tmp_path: Path) -> None:
    """Two SIGKILLs at seeded random points (after an execution's end, a step, a publication or a
    role switch; torn journal tails among them), each resumed: the same accounting holds at the end.
    ``benchmarks/crash_resume.py`` runs the same with 20 kills."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "crash_resume", Path(__file__).resolve().parents[2] / "benchmarks" / "crash_resume.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # the last resume runs each cell at PP 2: the core's checkpoint (saved at PP 1) loads resharded
    res = mod.crash_chain(tmp_path / "run", kills=2, steps=4, seed=1, config=SMALL_JOB,
                          final_settings=["training.pp=2"])
    print(f"\ncrash chain: {json.dumps(res['points'])}; executions {res['executions']}; {res['wall_s']} s")
    assert res["kills"] >= 2 and any(p["torn_tail"] for p in res["points"])
    assert res["steps"] == 4 and res["groups_trained"] == 4 * 2 and res["groups_trained_twice"] == 0
    assert res["ended_twice"] == 0 and res["accounted"] == res["finished"] > 0
    assert res["lost"] == 0 and res["outlived"] == 0, res["points"]
    ex = res["executions"]
    assert ex["launched"] == ex["finished"] + ex["stopped"] + ex["running"]
    # seed 1 kills right after the first publication once: the next resume rebuilt that policy
    assert res["resumes_rebuilding_a_publication"] >= 1
    # the final export is the PP 2 core's: one weight file per stage
    assert (tmp_path / "run" / "checkpoint" / "model-00002-of-00002.safetensors").exists()
    # checkpoint.keep_last (2): older step checkpoints are gone from disk, not only from the journal
    assert res["checkpoints_on_disk"] == ["step2", "step3"], res["checkpoints_on_disk"]

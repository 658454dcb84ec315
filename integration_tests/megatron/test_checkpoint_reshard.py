"""Training checkpoints in megatron-core's distributed format, resumed at another layout.

A core at TP 2 x PP 1 trains a step and saves; a core at TP 1 x PP 2 loads that folder and trains
the next step: its loss and the weights it ends with equal those of the TP 2 core that went on
without stopping (float tolerance), so the optimizer's moments came across as well as the
weights. The TP 2 core saves while its state is offloaded (as a colocated core does after its
burst): the checkpoint reads the host copies. Twice: a dense Qwen2 with tied embeddings (one matrix on the first and the last stage
at PP 2), and a Qwen3-MoE saved at TP 2 x EP 2 (experts split over two ranks) and resumed with all
experts on each stage's one rank. The folder is megatron-core's own ``torch_dist`` checkpoint: ``dist_checkpointing``'s
metadata reads it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
pytest.importorskip("megatron.core")

from gyre_megatron.testing import make_items, read_weights  # noqa: E402

STEP_SEEDS = (3, 4)


def _train(w, step: int) -> float:
    q = w.queues[step]
    for it in make_items(4, seed=STEP_SEEDS[step]):
        q.put(it)
    q.close()
    infos = w.call(w.ranks_of(0), "run_step", step, step)
    return next(i["objective"]["loss"] for i in infos if "objective" in i)


def _weights(w, version: int, folder: Path) -> dict[str, np.ndarray]:
    folder.mkdir()
    w.call(w.ranks_of(0), "write_part", version, str(folder))
    return {k: v.numpy() for k, v in read_weights(folder).items()}


@pytest.mark.parametrize("family,saved_ep", [("qwen2", 1), ("qwen3_moe", 2)], ids=["dense-tied", "moe-ep2"])
def test_a_checkpoint_saved_at_tp2_resumes_at_pp2_and_the_next_step_matches(tmp_path: Path, family: str,
                                                                            saved_ep: int) -> None:
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import build_checkpoint

    hf = tmp_path / "hf"
    build_checkpoint(hf, tied=family == "qwen2", seed=5, family=family)
    model = {"spec": spec_from_hf_dir(hf), "init_from": str(hf), "heartbeat_s": 0.5}
    ckpt = tmp_path / "step0"
    with World(RankOptions(cells=1, tp=2, pp=1, ep=saved_ep, **model), n_queues=2) as w:
        _train(w, 0)
        # saved while the core's state is offloaded (a colocated core saves after its burst)
        w.call(w.ranks_of(0), "leave_training")
        saved = w.call(w.ranks_of(0), "save_checkpoint", str(ckpt))
        w.call(w.ranks_of(0), "enter_training")
        assert all(s["version"] == 1 for s in saved)
        uninterrupted_loss = _train(w, 1)
        uninterrupted = _weights(w, 2, tmp_path / "a")
    assert (ckpt / "metadata.json").is_file() and (ckpt / "common.pt").is_file()
    assert not (tmp_path / "step0.partial").exists()
    from megatron.core.dist_checkpointing import load_tensors_metadata

    stored = load_tensors_metadata(str(ckpt))
    assert any("optimizer.state.exp_avg." in k for k in stored) and "embedding.word_embeddings.weight" in stored

    with World(RankOptions(cells=1, tp=1, pp=2, **model), n_queues=2) as w:
        loaded = w.call(w.ranks_of(0), "load_checkpoint", str(ckpt))
        assert all(r["version"] == 1 for r in loaded)
        resumed_loss = _train(w, 1)
        resumed = _weights(w, 2, tmp_path / "b")
    assert resumed_loss == pytest.approx(uninterrupted_loss, rel=1e-5, abs=1e-6)
    assert resumed.keys() == uninterrupted.keys() and resumed
    worst = max(float(np.abs(resumed[k] - uninterrupted[k]).max()) for k in resumed)
    assert worst < 1e-5, worst


@pytest.mark.gpu
def test_a_bf16_core_on_a_gpu_resumes_from_its_checkpoint_exactly(tmp_path: Path) -> None:
    """On a GPU, bf16 with float32 master weights (megatron-core's mixed-precision optimizer,
    whose checkpoint holds the master weights too): saved after a step and loaded into fresh
    ranks, the next step ends with the same weights as the run that went on."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import build_checkpoint, gpu_report

    hf = tmp_path / "hf"
    build_checkpoint(hf, seed=5, family="qwen3")
    opts = RankOptions(cells=1, pp=1, precision="bf16", spec=spec_from_hf_dir(hf), init_from=str(hf), heartbeat_s=0.5)
    ckpt = tmp_path / "step0"
    with World(opts, n_queues=2) as w:
        _train(w, 0)
        t0 = time.monotonic()
        w.call(w.ranks_of(0), "save_checkpoint", str(ckpt))
        save_s = time.monotonic() - t0
        _train(w, 1)
        uninterrupted = _weights(w, 2, tmp_path / "a")
    with World(opts, n_queues=2) as w:
        t0 = time.monotonic()
        w.call(w.ranks_of(0), "load_checkpoint", str(ckpt))
        load_s = time.monotonic() - t0
        _train(w, 1)
        resumed = _weights(w, 2, tmp_path / "b")
    worst = max(float(np.abs(resumed[k] - uninterrupted[k]).max()) for k in resumed)
    gpu_report("bf16_checkpoint_resume", max_weight_diff=worst, save_s=round(save_s, 3), load_s=round(load_s, 3))
    assert worst == 0.0, worst

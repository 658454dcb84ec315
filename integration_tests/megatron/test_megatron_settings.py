"""``[training.megatron]``: a team's megatron-core settings, by megatron-core's own names.

The table is checked against the installed release's ``TransformerConfig``,
``DistributedDataParallelConfig`` and ``OptimizerConfig`` and its learning-rate scheduler before
any process starts (one line per wrong key), and what passes reaches every rank: the stage's
configs hold the values, the core's optimizer takes Adam's settings and weight decay, and each
step's learning rate follows megatron-core's schedule over the run's steps, equal to the schedule's
formula in float64.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
pytest.importorskip("megatron.core")

from gyre_megatron.megatron_settings import (  # noqa: E402
    SCHEDULER_DEFAULTS,
    settings_problems,
    signature_keys,
    split_settings,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "embedded-cpu.toml"
TEAM = {"weight_decay": 0.1, "adam_beta2": 0.95, "adam_eps": 1e-6, "hidden_dropout": 0.0,
        "attention_backend": "unfused", "check_for_nan_in_grad": False,
        "lr_warmup_steps": 2, "lr_decay_style": "cosine", "lr_decay_steps": 6, "min_lr": 1e-4, "init_lr": 0.0}
"""A typical recipe's keys: Adam's betas and eps, weight decay, warm-up then cosine decay."""


def test_each_wrong_key_is_one_line_naming_it() -> None:
    problems = settings_problems({
        "weight_decya": 0.1,  # a typo
        "lr_warmup_iters": 10,  # Megatron-LM's argument name
        "hidden_size": 1024,  # the model's shape is the model folder's
        "tensor_model_parallel_size": 2,  # the layout is [training]'s
        "clip_grad": 1.0,
        "overlap_grad_reduce": True,  # Gyre reduces across cells itself
        "adam_beta2": "0.95",  # a string for a float
        "lr_warmup_steps": True,  # a bool for an int
        "lr_wsd_decay_style": "fast",  # not one of the choice's values
        "attention_backend": "fast",  # not a member of the enum
        "init_method": "normal",  # a callable: no file can hold it
        "lr_decay_style": "cosine",  # fine
        "adam_eps": 1,  # an int is a fine float
    })
    assert len(problems) == 11, problems
    text = "\n".join(problems)
    for key in ("weight_decya", "lr_warmup_iters", "hidden_size", "tensor_model_parallel_size", "clip_grad",
                "overlap_grad_reduce", "adam_beta2", "lr_warmup_steps", "lr_wsd_decay_style",
                "attention_backend", "init_method"):
        assert f"training.megatron.{key}:" in text, key
    assert "here: lr_warmup_steps" in text
    assert "set training.tp instead" in text and "set training.clip_grad" in text and "model.dir" in text
    assert "cannot be set from a file" in text
    assert "'cosine'" in text  # the choice's values are listed
    assert settings_problems(TEAM) == []


def test_scheduler_keys_are_megatron_cores_own() -> None:
    assert set(SCHEDULER_DEFAULTS) <= set(signature_keys())


def test_keys_reach_the_configs_they_belong_to() -> None:
    s = split_settings(TEAM)
    assert s.optimizer == {"weight_decay": 0.1, "adam_beta2": 0.95, "adam_eps": 1e-6, "min_lr": 1e-4}  # both have it
    assert s.ddp == {"check_for_nan_in_grad": False}
    assert s.transformer["hidden_dropout"] == 0.0 and s.transformer["attention_backend"].name == "unfused"
    assert s.scheduler == {"lr_warmup_steps": 2, "lr_decay_style": "cosine", "lr_decay_steps": 6,
                           "min_lr": 1e-4, "init_lr": 0.0}
    with pytest.raises(ValueError, match="training.megatron.bogus"):
        split_settings({"bogus": 1})


def test_preflight_refuses_a_wrong_table_before_anything_starts() -> None:
    from gyre_core.orchestrator.embedded import _plugin_manager
    from gyre_core.orchestrator.preflight import preflight
    from gyre_core.orchestrator.run_config import load_run_config

    cfg = load_run_config(EXAMPLE, {"training.megatron": '{weight_decay = "lots", adam_beta2 = 0.95}'})
    problems = preflight(cfg, _plugin_manager())
    assert [p for p in problems if "training.megatron" in p] == [
        "training.megatron.weight_decay: 'lots' does not fit: expected float"]


def test_preflight_refuses_what_megatron_core_refuses_with_the_runs_model() -> None:
    """Keys that each fit but that megatron-core refuses together, or with the run's own model:
    its own message, before any process starts."""
    from gyre_core.orchestrator.embedded import _plugin_manager
    from gyre_core.orchestrator.preflight import preflight
    from gyre_core.orchestrator.run_config import load_run_config

    pm = _plugin_manager()
    cases = {
        '{recompute_granularity = "full"}': "TransformerConfig",  # full recompute without its method
        '{lr_warmup_steps = 5, lr_decay_steps = 3}': "OptimizerParamScheduler",  # warm-up past the decay
        '{min_lr = 1e-3}': "OptimizerParamScheduler",  # above the example's training.lr (1e-4)
        '{adam_beta2 = 0.95, weight_decay = 0.01}': None,
    }
    for table, refused_by in cases.items():
        cfg = load_run_config(EXAMPLE, {"training.megatron": table})
        lines = [p for p in preflight(cfg, pm) if "training.megatron" in p]
        if refused_by is None:
            assert lines == [], (table, lines)
        else:
            assert len(lines) == 1 and refused_by in lines[0] and "refuses these settings: " in lines[0], (table, lines)


def _reference_lr(step: int, peak: float) -> float:
    """Warm-up from ``init_lr`` then cosine to ``min_lr`` (megatron-core's formula), float64."""
    w, d, lo = TEAM["lr_warmup_steps"], TEAM["lr_decay_steps"], TEAM["min_lr"]
    if step <= w:
        return TEAM["init_lr"] + (peak - TEAM["init_lr"]) * step / w
    if step > d:
        return lo
    return lo + (peak - lo) * 0.5 * (math.cos(math.pi * (step - w) / (d - w)) + 1.0)


def test_ranks_run_with_the_teams_settings_and_schedule() -> None:
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import make_items

    peak = 1e-3
    opts = RankOptions(cells=1, pp=2, lr=peak, megatron=dict(TEAM), total_steps=8, heartbeat_s=0.5)
    with World(opts, n_queues=8) as w:
        names = ["hidden_dropout", "attention_backend", "check_for_nan_in_grad", "adam_beta2", "adam_eps",
                 "weight_decay", "grad_reduce_in_fp32"]
        for got in w.call(w.ranks_of(0), "settings_in_effect", names):
            assert got["hidden_dropout"] == 0.0 and got["attention_backend"] == "unfused"
            assert got["check_for_nan_in_grad"] is False and got["grad_reduce_in_fp32"] is True
            assert got["adam_beta2"] == 0.95 and got["adam_eps"] == 1e-6 and got["weight_decay"] == 0.1
        lrs = []
        for step in range(8):
            q = w.queues[step]
            for it in make_items(2, seed=step):
                q.put(it)
            q.close()
            infos = w.call(w.ranks_of(0), "run_step", step, step)
            lrs.append(next(i["lr"] for i in infos if "lr" in i))
            groups = w.call(w.ranks_of(0), "settings_in_effect", [])[0]["param_groups"]
            # megatron-core decays the weights but not the norms and biases (its wd_mult 0)
            assert {g["weight_decay"] for g in groups} <= {0.0, 0.1} and any(g["weight_decay"] == 0.1 for g in groups)
    want = [_reference_lr(s, peak) for s in range(8)]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(lrs, want)), (lrs, want)
    assert lrs[0] == 0.0 and lrs[2] == peak and lrs[-1] == TEAM["min_lr"]


@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "selective"},
], ids=["full", "selective"])
def test_activation_recompute_gives_the_same_gradients(recompute) -> None:
    """Recompute through Gyre's pausable streaming schedule (PP 2): every gradient equals the
    one without it."""
    import numpy as np

    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import make_items

    grads = []
    for table in ({}, recompute):
        with World(RankOptions(cells=1, pp=2, megatron=table, heartbeat_s=0.5), n_queues=1) as w:
            q = w.queues[0]
            for it in make_items(3, seed=7):
                q.put(it)
            q.close()
            out = w.call(w.ranks_of(0), "stream_grads_hf", 0)
            grads.append({k: np.asarray(v) for r in out for k, v in r["grads"].items()})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys() and plain
    worst = max(float(np.abs(plain[k] - recomputed[k]).max()) for k in plain)
    scale = max(float(np.abs(v).max()) for v in plain.values())
    assert worst <= 1e-6 * scale, (worst, scale)


@pytest.mark.gpu
def test_bf16_with_full_recompute_on_a_gpu_gives_the_same_gradients() -> None:
    """On a GPU: megatron-core's own checkpointing (CUDA generator states, bf16 kernels) through
    the streaming schedule; the gradients equal those without recompute to bf16's rounding."""
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from gyre_megatron.launch import World
    from gyre_megatron.model import ModelSpec
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import make_items

    spec = ModelSpec(hidden_size=256, ffn_hidden_size=1024, num_layers=4, num_attention_heads=8, num_query_groups=4,
                     vocab_size=1024, max_seq_len=2048)
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    grads = []
    for table in ({}, full):
        with World(RankOptions(cells=1, pp=1, spec=spec, precision="bf16", megatron=table), n_queues=1) as w:
            q = w.queues[0]
            for it in make_items(2, seq_len=2048, vocab=spec.vocab_size, seed=3):
                q.put(it)
            q.close()
            (r,) = w.call(w.ranks_of(0), "stream_grads_hf", 0)
            grads.append(np.concatenate([np.asarray(v, dtype=np.float64).ravel() for _, v in sorted(r["grads"].items())]))
    a, b = grads
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    from gyre_megatron.testing import gpu_report

    gpu_report("bf16_full_recompute", gradient_cosine=round(cos, 6), seq_len=2048)
    assert cos > 0.999, cos


def test_transformer_engine_is_chosen_only_where_it_runs() -> None:
    """``training.transformer_impl``: ``auto`` builds TE's spec only where TransformerEngine
    imports and CUDA is present (here: the local one); an explicit ``transformer_engine`` where it
    cannot run is refused before anything starts, in one line with the way to install it."""
    import torch

    from gyre_core.orchestrator.embedded import _plugin_manager
    from gyre_core.orchestrator.preflight import preflight
    from gyre_core.orchestrator.run_config import load_run_config
    from gyre_megatron.model import resolve_transformer_impl, transformer_engine_problem

    if transformer_engine_problem() is None:
        pytest.skip("TransformerEngine runs here: the GPU test covers it")
    assert resolve_transformer_impl("auto") == "local" and resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="transformer_engine"):
        resolve_transformer_impl("transformer_engine")
    cfg = load_run_config(EXAMPLE, {"training.transformer_impl": "transformer_engine"})
    lines = [p for p in preflight(cfg, _plugin_manager()) if "transformer_impl" in p]
    assert len(lines) == 1 and ("CUDA" in lines[0] if not torch.cuda.is_available() else "pip install" in lines[0])
    cfg = load_run_config(EXAMPLE, {"training.transformer_impl": "auto"})
    assert not [p for p in preflight(cfg, _plugin_manager()) if "transformer_impl" in p]


@pytest.mark.gpu
def test_transformer_engines_spec_trains_like_the_local_one_on_a_gpu(tmp_path: Path) -> None:
    """On a GPU with TransformerEngine: the same checkpoint built with TE's spec (fused norms in
    the linears, fused kernels, TE's attention) and with the local spec gives the same first
    gradients (fp32, cosine > 0.9999), and each rank says which spec it built."""
    import numpy as np

    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.model import transformer_engine_problem
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import build_checkpoint, make_items

    if (why := transformer_engine_problem()) is not None:
        pytest.skip(why)
    build_checkpoint(tmp_path, seed=3, family="qwen3")
    spec = spec_from_hf_dir(tmp_path)
    import time

    from gyre_megatron.testing import gpu_report

    grads, step_s = [], {}
    for impl in ("local", "transformer_engine"):
        with World(RankOptions(cells=1, pp=1, spec=spec, init_from=str(tmp_path), transformer_impl=impl),
                   n_queues=1) as w:
            got = w.call(w.ranks_of(0), "settings_in_effect", ["apply_rope_fusion", "bias_dropout_fusion"])[0]
            assert got["transformer_impl"] == impl and got["apply_rope_fusion"] == (impl != "local")
            q = w.queues[0]
            for it in make_items(2, vocab=spec.vocab_size, seed=5):
                q.put(it)
            q.close()
            t0 = time.monotonic()
            (r,) = w.call(w.ranks_of(0), "stream_grads_hf", 0)
            step_s[impl] = round(time.monotonic() - t0, 3)  # the first step: kernels load and compile
            grads.append(np.concatenate([np.asarray(v, dtype=np.float64).ravel() for _, v in sorted(r["grads"].items())]))
    a, b = grads
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    gpu_report("transformer_engine_spec", gradient_cosine=round(cos, 8), first_step_s=step_s)
    assert cos > 0.9999, cos

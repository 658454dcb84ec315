"""A cell's role switches on one GPU, measured with NVML: a real model's training state and a real
SGLang engine take turns on the device, over several switches, with nothing growing.

The model is a Qwen2 of ~183 M parameters (hidden 1024, 16 layers, 16 heads, 4 KV groups, FFN
2816), built from its config with a locally trained tokenizer. One Megatron rank (``cuda:0``) and
the cell's SGLang engine (``--enable-memory-saver``) share GPU 0:

* *to training*: the engine releases its KV cache and weights (SGLang's memory saver), then the
  rank brings its parameters, gradient buffer and Adam state back (``enter_training``);
* a training step on GSPO micro-steps;
* *to rollout*: the rank releases its state (``leave_training``), the engine takes its memory back
  and loads the step's published weights.

Asserted per phase, against the model's own sizes: the rank releases and restores at least
``16 B × parameters`` (fp32 parameters 4 + gradients 4 + Adam 8) and NVML sees ≥ 90 % of it go and
come back; the engine's release frees at least its weights' bytes plus 1 GiB of KV pool; the
device memory at each phase of the last switch is within 256 MiB of the first (no growth). Each
phase's time is printed (and appended as JSON to ``$GYRE_GPU_REPORT``) beside the reference
figures of 8.52 s (to training) and 3.46 s (to rollout) for a 32-GPU cell of a 32B model.

Skipped without an NVIDIA GPU and ``nvidia-ml-py``; ``scripts/gpu-check.sh`` runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.sglang, pytest.mark.timeout(900)]

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pynvml = pytest.importorskip("pynvml")

SWITCHES = 3
GIB = 2**30


def _used_bytes() -> int:
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def _report(record: dict) -> None:
    line = json.dumps(record)
    print("\n" + line)
    if os.environ.get("GYRE_GPU_REPORT"):
        with open(os.environ["GYRE_GPU_REPORT"], "a") as f:
            f.write(line + "\n")


def test_role_switches_release_and_restore_a_real_models_state(tmp_path: Path) -> None:
    from gyre_core.interfaces import WeightsRef
    from gyre_core.tiny_model import build_tiny_model
    from gyre_megatron.export import publish
    from gyre_core.interfaces import PublicationOptions
    from gyre_megatron.hf_import import spec_from_hf_dir
    from gyre_megatron.launch import World
    from gyre_megatron.runtime import RankOptions
    from gyre_megatron.testing import feed_in_bursts, make_microsteps
    from gyre_sglang.serving_side import SGLangServingSide
    from gyre_sglang.testing import start_sglang_server

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                                 intermediate_size=2816, max_position_embeddings=4096)
    spec = spec_from_hf_dir(model_dir)
    used_empty = _used_bytes()
    opts = RankOptions(cells=1, pp=1, spec=spec, init_from=str(model_dir), normalise_by_tokens=False, lr=1e-5)
    with World(opts, n_queues=SWITCHES + 1) as w:
        core = w.ranks_of(0)
        assert w.info[0]["device"] == "cuda:0"
        n_params = sum(int(torch.tensor(v.shape).prod()) for v in
                       {k: v for part in w.call(core, "export_hf") for k, v in part.items()}.values())
        expected_state = 16 * n_params  # fp32 params + grads + Adam's two moments

        def step(queue: int) -> None:
            tk = w.submit(core, "run_step", queue, queue)
            feed_in_bursts(w.queues[queue], make_microsteps(4, rows=2, seq_len=512, vocab=spec.vocab_size, seed=queue),
                           burst=4, gap_s=0)
            assert all(i["update_ok"] for i in w.wait(tk, 600))

        step(0)  # Adam allocates its moments at the first step: the state is complete from here
        t0 = time.monotonic()
        left = w.call(core, "leave_training")[0]
        first_leave_s = time.monotonic() - t0
        assert left["released_bytes"] >= expected_state and left["remaining_bytes"] == 0
        used_rank_idle = _used_bytes()
        pub = tmp_path / "weights"
        v = publish(w, PublicationOptions(folder=str(pub)), version=1)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
            if (model_dir / name).exists():
                (Path(v.location) / name).write_bytes((model_dir / name).read_bytes())
        server = start_sglang_server(v.location, tmp_path, "engine", max_total_tokens=2**18, timeout=600,
                                     memory_saver=True, extra_args=["--mem-fraction-static", "0.3"])
        try:
            side = SGLangServingSide(server.url, cell=0, api_key=server.api_key)
            assert side.role_switch_problems(kv_handoff=True) == []  # the memory saver is on, TP 1
            engine_weights = 4 * n_params  # served in the checkpoint's float32
            phases: list[dict] = []

            async def switch(i: int) -> dict:
                async with server.client() as c:
                    await c.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0.0})
                rec: dict = {"switch": i, "used_serving": _used_bytes()}
                t = time.monotonic()
                await side.ato_training(lambda rids: None)
                rec["engine_release_s"] = time.monotonic() - t
                rec["used_engine_released"] = _used_bytes()
                t1 = time.monotonic()
                back = await asyncio.to_thread(w.call, core, "enter_training")
                rec["rank_enter_s"] = time.monotonic() - t1
                rec["to_training_s"] = time.monotonic() - t
                rec["restored_bytes"] = back[0]["restored_bytes"]
                rec["used_training"] = _used_bytes()
                await asyncio.to_thread(step, i)
                t = time.monotonic()
                gone = await asyncio.to_thread(w.call, core, "leave_training")
                rec["rank_leave_s"] = time.monotonic() - t
                rec["released_bytes"] = gone[0]["released_bytes"]
                rec["used_rank_released"] = _used_bytes()
                ref = await asyncio.to_thread(publish, w, PublicationOptions(folder=str(pub)), i + 1)
                t1 = time.monotonic()
                await side.ato_rollout(WeightsRef(version=i + 1, location=ref.location))
                rec["engine_resume_s"] = time.monotonic() - t1
                rec["to_rollout_s"] = rec["rank_leave_s"] + rec["engine_resume_s"]
                rec["used_back"] = _used_bytes()
                return rec

            for i in range(1, SWITCHES + 1):
                phases.append(asyncio.run(switch(i)))
        finally:
            server.stop()

    _report({"check": "gpu_role_switch", "gpu": torch.cuda.get_device_name(0), "params": n_params,
             "training_state_bytes": expected_state, "used_empty": used_empty, "used_rank_idle": used_rank_idle,
             "first_leave_s": first_leave_s, "switches": phases,
             "reference_to_training_s": 8.52, "reference_to_rollout_s": 3.46})
    for rec in phases:
        assert rec["restored_bytes"] >= expected_state and rec["released_bytes"] >= expected_state
        assert rec["used_training"] - rec["used_engine_released"] >= 0.9 * expected_state, rec
        assert rec["used_training"] - rec["used_rank_released"] >= 0.9 * expected_state, rec
        assert rec["used_serving"] - rec["used_engine_released"] >= engine_weights + GIB, rec
    first, last = phases[0], phases[-1]
    for key in ("used_serving", "used_engine_released", "used_training", "used_rank_released", "used_back"):
        assert abs(last[key] - first[key]) <= 256 * 2**20, (key, first[key], last[key])

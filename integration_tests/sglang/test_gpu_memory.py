"""§3 on a GPU: *to training* releases the engine's device memory (NVML) and *to rollout* restores
it, with the engine still generating the same greedy tokens afterwards.

Skipped without an NVIDIA GPU (and without ``nvidia-ml-py``). Real release needs SGLang's
``--enable-memory-saver`` (torch_memory_saver); on the CPU engine release/resume are no-ops.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pynvml = pytest.importorskip("pynvml")

from gyre_sglang.testing import start_sglang_server  # noqa: E402


def _used_bytes() -> int:
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    finally:
        pynvml.nvmlShutdown()


def test_to_training_releases_and_to_rollout_restores_device_memory(tiny_model_dir, tmp_path):
    from gyre_core.interfaces import WeightsRef
    from gyre_sglang.serving_side import SGLangServingSide

    server = start_sglang_server(
        tiny_model_dir, tmp_path, "gpu", max_total_tokens=2**20,
        extra_args=["--enable-memory-saver", "--mem-fraction-static", "0.2"],
    )
    try:
        side = SGLangServingSide(server.url, cell=1, api_key=server.api_key)

        async def go():
            async with server.client() as c:
                before = await c.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0.0})
                used_serving = _used_bytes()
                await side.ato_training(lambda rids: None)
                used_training = _used_bytes()
                await side.ato_rollout(WeightsRef(version=1, location=str(tiny_model_dir)))
                used_back = _used_bytes()
                after = await c.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0.0})
                return before, after, used_serving, used_training, used_back

        before, after, serving, training, back = asyncio.run(go())
        gib = 2**30
        assert serving - training > 1 * gib, (serving, training)  # the KV pool (≥ 20 % of HBM) left
        assert abs(back - serving) < 0.5 * gib, (serving, back)
        assert after.output_ids == before.output_ids
    finally:
        server.stop()

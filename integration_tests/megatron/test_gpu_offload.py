"""§4 on a GPU: leaving training releases device memory (NVML) and entering restores it exactly.

Skipped without an NVIDIA GPU (and without ``nvidia-ml-py``). Uses the same
:class:`~gyre_megatron.offload.Offloader` the training role uses, on CUDA tensors shaped like a
stage's parameters, grad buffer and Adam state.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pynvml = pytest.importorskip("pynvml")

from gyre_megatron.offload import Offloader  # noqa: E402


def _used_bytes() -> int:
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    finally:
        pynvml.nvmlShutdown()


def test_leave_releases_and_enter_restores_device_memory() -> None:
    n = 256 * 2**20 // 4  # 256 MiB per tensor
    params = torch.randn(n, device="cuda")
    grads = torch.randn(n, device="cuda")
    exp_avg = torch.randn(n, device="cuda")
    views = [params[:10], grads[5:]]  # views must survive the round trip
    before = [t.clone().cpu() for t in (params, grads, exp_avg)]
    torch.cuda.synchronize()
    used0 = _used_bytes()
    off = Offloader()
    released = off.offload([params, grads, exp_avg, *views])
    torch.cuda.synchronize()
    used1 = _used_bytes()
    assert released == 3 * n * 4
    assert used0 - used1 >= 0.9 * released, (used0, used1)
    off.restore()
    torch.cuda.synchronize()
    assert _used_bytes() - used1 >= 0.9 * released
    for t, b in zip((params, grads, exp_avg), before):
        assert torch.equal(t.cpu(), b)
    assert torch.equal(views[0].cpu(), before[0][:10])

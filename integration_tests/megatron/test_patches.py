"""§1: the versioned CPU patches select by version, refuse others, redirect only what they name."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")

from gyre_megatron.patching import load_patch_package, megatron_core_version  # noqa: E402


def test_select_matches_installed_version_and_refuses_others() -> None:
    pkg = load_patch_package()
    version = megatron_core_version()
    mod = pkg.select(version)
    assert version in mod.TARGET
    with pytest.raises(LookupError):
        pkg.select("0.12.0")
    with pytest.raises(LookupError):
        pkg.select("0.17.0")
    other = next(n for n in pkg.VERSION_MODULES if n != mod.__name__.rsplit(".", 1)[1])
    import importlib

    with pytest.raises(ValueError):
        importlib.import_module(f"{pkg.__name__}.{other}").apply(version)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU redirection is never applied with CUDA")
def test_redirect_maps_cuda_to_cpu_and_reverts() -> None:
    pkg = load_patch_package()
    version = megatron_core_version()
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    before = schedules.torch
    r = pkg.select(version).apply(version)
    try:
        t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert t.device.type == "cpu"
        assert p2p_communication.torch.cuda.current_device() == torch.device("cpu")
        assert schedules.torch.Tensor is torch.Tensor  # types pass through untouched
        assert schedules.torch.distributed is torch.distributed
        import math

        assert math is not None and torch.zeros(1).device.type == "cpu"  # real torch unchanged
        assert torch.cuda.current_device is not p2p_communication.torch.cuda.current_device
    finally:
        r.revert()
    assert schedules.torch is before or schedules.torch._gyre_cpu_redirect  # reverted (or pre-applied)


def test_never_applied_when_cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = load_patch_package()
    version = megatron_core_version()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="never be applied"):
        pkg.select(version).apply(version)
    import gyre_megatron.patching as patching

    monkeypatch.setattr(patching, "_applied", None)
    assert patching.ensure_cpu_patches() is None

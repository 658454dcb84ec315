"""Gyre's SGLang CPU patch (gyre_sglang/cpu_patches/): version gate, stand-ins, and that it stays off
unless asked for. Each check runs in a fresh interpreter so sys.modules starts clean."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gyre_sglang.server import cpu_patch_site

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(180)]
pytest.importorskip("sglang")


def run_py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("GYRE_SGLANG_CPU_PATCH", "PYTHONPATH")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True, timeout=150)


def test_select_refuses_unsupported_versions():
    r = run_py("""
        import gyre_sglang.cpu_patches as m
        assert m.select("0.5.23").TARGET.contains("0.5.23")
        assert m.select("0.5.22").TARGET.contains("0.5.22")
        for bad in ("0.5.21", "0.5.24", "0.6.0"):
            try:
                m.select(bad)
            except LookupError as e:
                assert "0.5.23" in str(e)
            else:
                raise SystemExit("accepted " + bad)
        try:
            m.select("0.5.23").apply("0.5.24")
        except LookupError:
            print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_site_hook_installs_stand_ins_only_when_asked():
    site = str(cpu_patch_site())
    probe = """
        import importlib.util, sys
        missing = [m for m in ("sgl_kernel",) if importlib.util.find_spec(m) is None]
        print("missing=" + ",".join(missing))
        if not missing:
            import triton, sgl_kernel                      # real triton (xgrammar pulls it) or SGLang's stub
            assert triton.cdiv(7, 2) == 4
            try:
                import sgl_kernel.scalar_type              # left absent: SGLang's fallback runs
            except ImportError:
                print("scalar_type-absent")
            from transformers.utils import import_utils
            print("torchvision-for-transformers=" + str(import_utils.is_torchvision_available()))
            from sglang.srt.layers.quantization.utils import scalar_types
            print("fallback=" + type(scalar_types).__name__)
    """
    off = run_py(probe, PYTHONPATH=site)  # on PYTHONPATH but not enabled: inert
    assert off.returncode == 0, off.stderr
    assert "missing=sgl_kernel" in off.stdout

    on = run_py(probe, PYTHONPATH=site, GYRE_SGLANG_CPU_PATCH="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines()[0] == "missing="
    assert "scalar_type-absent" in on.stdout
    assert "torchvision-for-transformers=False" in on.stdout
    assert "fallback=MockScalarTypes" in on.stdout

    # multiprocessing's resource tracker (one per server) runs no SGLang code: no patch, no torch
    tracker = run_py("from multiprocessing.resource_tracker import main\n"
                     "import sys; print('torch' in sys.modules, 'sgl_kernel' in sys.modules)",
                     PYTHONPATH=site, GYRE_SGLANG_CPU_PATCH="1")
    assert tracker.returncode == 0 and tracker.stdout.split() == ["False", "False"], tracker.stderr


def test_a_cpu_server_forks_its_subprocesses_unless_told_to_spawn():
    """SGLang's launcher asks for ``spawn`` (for CUDA); a CPU server forks instead, so its scheduler
    and detokenizer do not import torch and SGLang again. ``GYRE_SGLANG_CPU_SPAWN=1`` keeps spawn,
    and without the patch nothing changes."""
    site = str(cpu_patch_site())
    probe = ("import multiprocessing as mp\n"
             "mp.set_start_method('spawn', force=True); a = mp.get_start_method()\n"
             "mp.set_start_method('forkserver', force=True); print(a, mp.get_start_method())")
    assert run_py(probe, PYTHONPATH=site, GYRE_SGLANG_CPU_PATCH="1").stdout.split() == ["fork", "forkserver"]
    assert run_py(probe, PYTHONPATH=site, GYRE_SGLANG_CPU_PATCH="1",
                  GYRE_SGLANG_CPU_SPAWN="1").stdout.split() == ["spawn", "forkserver"]
    assert run_py(probe, PYTHONPATH=site).stdout.split() == ["spawn", "forkserver"]

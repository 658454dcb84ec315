"""Shared fixtures for the fast tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny tensors: intra-op threads only add synchronisation latency on a shared 2-core box.
    Only touches torch when a test module already imported it (the scheduler tests do not)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def offline_sandbox(tmp_path):
    """A sandbox spec (as an execution's ``extra["sandbox"]``) whose proxy socket exists but serves
    nothing: for commands that run in the sandbox and never call the policy."""
    from gyre_core.orchestrator.sandbox import SandboxSpec

    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o711)
    (sock_dir / "proxy.sock").touch()
    return SandboxSpec((), str(sock_dir / "proxy.sock"), "127.0.0.1", 8399).as_extra()

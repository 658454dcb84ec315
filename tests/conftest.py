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

"""Test support: start a real SGLang server for a test or a benchmark, logs in a given folder.

Kept in the package (not in a ``conftest.py``) so that test modules in any folder import it under
one unambiguous name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_sglang.server import SGLangServer

__all__ = ["start_sglang_server"]


def start_sglang_server(model_dir: str | Path, log_dir: str | Path, name: str, *, timeout: float = 300.0,
                        **kwargs: Any) -> SGLangServer:
    """Start a real SGLang server (CPU engine where CUDA is absent) with Gyre's plugin; the caller
    stops it (``.stop()``). ``kwargs`` go to :class:`~gyre_sglang.server.SGLangServer`."""
    server = SGLangServer(model_dir, log_path=Path(log_dir) / f"{name}.log", **kwargs)
    server.start(timeout=timeout)
    return server

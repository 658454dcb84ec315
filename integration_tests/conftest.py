"""Session-wide fixtures shared by every integration-test folder.

One tiny model and one SGLang server serve the whole session: an SGLang CPU server takes ~20 s to
start, so tests that only *use* an engine share it (and must leave it as they found it: weights,
pause state). Tests that kill, pause for long, or change the weights of a server start their own
with :func:`gyre_sglang.testing.start_sglang_server`; tests that change a server's weights or
intake and then restore them share the second, changeable one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 model with a locally trained tokenizer and a tool-calling template."""
    pytest.importorskip("transformers")
    from gyre_core.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def sglang_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's shared SGLang server (read-only use: do not change its weights or state)."""
    pytest.importorskip("sglang")
    from gyre_sglang.testing import start_sglang_server

    server = start_sglang_server(tiny_model_dir, tmp_path_factory.mktemp("sglang-logs"), "shared")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def changeable_sglang_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A second session server that tests may change -- close its intake, release its memory, load
    other weights -- as long as each leaves it serving the tiny model's own weights again (its
    role swap and weight publication tests do): one start for both modules, not one each.
    Float16, so that a test can compute the hashes SGLang reports for the weights it loads."""
    pytest.importorskip("sglang")
    from gyre_sglang.testing import start_sglang_server

    server = start_sglang_server(tiny_model_dir, tmp_path_factory.mktemp("changeable-sglang-logs"), "changeable",
                                 extra_args=["--dtype", "float16"])
    try:
        yield server
    finally:
        server.stop()

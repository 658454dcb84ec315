"""Applies Gyre's SGLang CPU patch in every Python process of an SGLang server Gyre starts.

``gyre_sglang.server`` puts this folder first on ``PYTHONPATH`` and sets ``GYRE_SGLANG_CPU_PATCH=1``,
so the server's scheduler and detokenizer subprocesses get the stand-ins too. It does nothing when
that variable is unset or CUDA is present, and in the server's multiprocessing resource tracker,
which runs no SGLang code: applying the patch there (torch, SGLang's stubs, transformers) cost it
3 s of CPU at every engine start.

A CPU server also starts its scheduler and detokenizer by ``fork``, not SGLang's ``spawn``: spawn
is there because a CUDA context cannot cross a fork, and a CPU engine has none, while each spawned
process imports torch and SGLang again (5-7 s of CPU each: an engine starts in ~18 s, 16.5 s of
CPU, spawned, and in ~13.5 s, 10.6 s of CPU, forked; ``benchmarks/sglang_engine_start.py``).
``GYRE_SGLANG_CPU_SPAWN=1`` keeps spawn.
"""

import os
import sys

_HELPERS = ("from multiprocessing.resource_tracker import",)
"""``python -c`` programs that multiprocessing starts beside SGLang's own processes."""


def _is_helper() -> bool:
    argv = sys.orig_argv
    i = argv.index("-c") + 1 if "-c" in argv else len(argv)
    return i < len(argv) and argv[i].startswith(_HELPERS)


def _apply() -> None:
    if not os.environ.get("GYRE_SGLANG_CPU_PATCH") or _is_helper():
        return
    from importlib.metadata import version

    import torch

    if torch.cuda.is_available():
        return
    from gyre_sglang.cpu_patches import select

    v = version("sglang")
    select(v).apply(v)
    if not os.environ.get("GYRE_SGLANG_CPU_SPAWN"):
        _fork_instead_of_spawn()


def _fork_instead_of_spawn() -> None:
    """SGLang's launcher calls ``multiprocessing.set_start_method("spawn", force=True)`` before it
    starts its subprocesses; on CPU that request becomes ``fork`` (other methods pass through)."""
    import multiprocessing

    real = multiprocessing.set_start_method

    def set_start_method(method: "str | None", force: bool = False) -> None:
        real("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = set_start_method


_apply()

"""Applies Gyre's SGLang CPU patch in every Python process of an SGLang server Gyre starts.

``gyre_sglang.server`` puts this folder first on ``PYTHONPATH`` and sets ``GYRE_SGLANG_CPU_PATCH=1``,
so the server's scheduler and detokenizer subprocesses get the stand-ins too. It does nothing when
that variable is unset or CUDA is present, and in the server's multiprocessing resource tracker,
which runs no SGLang code: applying the patch there (torch, SGLang's stubs, transformers) cost it
3 s of CPU at every engine start.
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


_apply()

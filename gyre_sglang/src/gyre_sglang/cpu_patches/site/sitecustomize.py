"""Applies Gyre's SGLang CPU patch in every Python process of an SGLang server Gyre starts.

``gyre_sglang.server`` puts this folder first on ``PYTHONPATH`` and sets ``GYRE_SGLANG_CPU_PATCH=1``,
so the server's scheduler and detokenizer subprocesses get the stand-ins too. It does nothing when
that variable is unset or CUDA is present.
"""

import os


def _apply() -> None:
    if not os.environ.get("GYRE_SGLANG_CPU_PATCH"):
        return
    from importlib.metadata import version

    import torch

    if torch.cuda.is_available():
        return
    from gyre_sglang.cpu_patches import select

    v = version("sglang")
    select(v).apply(v)


_apply()

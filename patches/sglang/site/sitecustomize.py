"""Applies Gyre's SGLang CPU patch in every Python process of an SGLang server Gyre starts.

``gyre_sglang.server`` puts this folder first on ``PYTHONPATH`` and sets ``GYRE_SGLANG_CPU_PATCH``
to the ``patches/`` folder, so the server's scheduler and detokenizer subprocesses get the stand-ins
too. It does nothing when that variable is unset or CUDA is present.
"""

import os


def _apply() -> None:
    root = os.environ.get("GYRE_SGLANG_CPU_PATCH")
    if not root:
        return
    import importlib.util
    import sys
    from importlib.metadata import version

    import torch

    if torch.cuda.is_available():
        return
    name = "gyre_patches_sglang"
    pkg = os.path.join(root, "sglang")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    v = version("sglang")
    mod.select(v).apply(v)


_apply()

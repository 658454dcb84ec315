"""A function of the user's, named ``"path/to/file.py:function"`` in the config: a task's reward
(``task.reward``), a loss (``training.objective``). One loader, so both say what is wrong the
same way, and each file is imported once per process."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

__all__ = ["load_user_function"]


def load_user_function(target: str) -> Callable[..., Any]:
    """``"path/to/file.py:function"`` -> the function; a one-line ``ValueError`` naming what is
    wrong (the form, a missing file, an import that fails, no such function)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{target!r} is not 'path/to/file.py:function'")
    return _load(str(Path(path).resolve()), name)


@lru_cache(maxsize=16)
def _load(path: str, name: str) -> Callable[..., Any]:
    if not Path(path).is_file():
        raise ValueError(f"{path} does not exist")
    spec = importlib.util.spec_from_file_location(f"gyre_user_code_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error is reported, in one line
        raise ValueError(f"{path} fails to load: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {name!r}")
    return fn  # type: ignore[no-any-return]

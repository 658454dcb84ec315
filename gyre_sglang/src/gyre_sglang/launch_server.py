"""``python -m gyre_sglang.launch_server ARGS``: SGLang's ``python -m sglang.launch_server ARGS``
with the engine key taken from the environment (``GYRE_ENGINE_KEY``), never from the command line.

Why: a command line is readable by every local user (``/proc/<pid>/cmdline``, ``ps``), so a key
given as ``--api-key`` belongs to all of them; a process's environment is readable only by its own
user. This wrapper runs SGLang's own ``__main__`` unchanged, with three things in place first:

* ``--api-key`` and ``--admin-api-key`` on the command line are refused;
* the key is set on the parsed ``ServerArgs`` as soon as SGLang has parsed them (wrapping
  ``sglang.srt.server_args.prepare_server_args``, which ``sglang/launch_server.py`` imports and
  calls first thing), so resolution, SGLang's auth middleware and every subprocess (they receive
  the record pickled) see it exactly as if it had come from ``--api-key``;
* the key is redacted from SGLang's logs and reports (:mod:`gyre_sglang.server_plugin.redaction`).

A server started without ``GYRE_ENGINE_KEY`` is refused: an engine Gyre starts is never open.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Any, Callable, Sequence

ENGINE_KEY_ENV = "GYRE_ENGINE_KEY"
SECRET_FLAGS = ("--api-key", "--admin-api-key")
SGLANG_MAIN = "sglang.launch_server"


def secret_flags(argv: Sequence[str]) -> list[str]:
    """The option names in ``argv`` that would put a key on the command line (abbreviations
    included: SGLang's argparse accepts any unambiguous prefix of an option)."""
    found = []
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and any(f.startswith(name) for f in SECRET_FLAGS):
            found.append(name)
    return found


def with_key(prepare: Callable[[list[str]], Any], key: str) -> Callable[[list[str]], Any]:
    """``prepare_server_args`` that sets ``api_key`` on the record it returns."""

    @functools.wraps(prepare)
    def prepare_server_args(argv: list[str]) -> Any:
        server_args = prepare(argv)
        server_args.api_key = key
        return server_args

    prepare_server_args._gyre_key_wrapper = True  # type: ignore[attr-defined]
    return prepare_server_args


def install(key: str) -> None:
    """Redaction and key injection in this process, before SGLang's main runs (idempotent)."""
    from gyre_sglang.server_plugin import redaction

    redaction.install(key)
    import sglang.srt.server_args as server_args_module

    if not getattr(server_args_module.prepare_server_args, "_gyre_key_wrapper", False):
        server_args_module.prepare_server_args = with_key(server_args_module.prepare_server_args, key)


def refusal(argv: Sequence[str], key: str) -> str | None:
    """Why this launch is refused, or ``None``. Names an offending option, never its value."""
    flags = secret_flags(argv)
    if flags:
        return (f"gyre_sglang.launch_server: {flags[0]} would put a key on the command line, which every "
                f"local user can read; give the key in the {ENGINE_KEY_ENV} environment variable instead")
    if not key:
        return (f"gyre_sglang.launch_server: {ENGINE_KEY_ENV} is not set; an engine Gyre starts needs its "
                "key (set it in the environment, never on the command line)")
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    key = os.environ.get(ENGINE_KEY_ENV, "")
    why = refusal(args, key)
    if why:
        raise SystemExit(why)
    install(key)
    sys.argv = [sys.argv[0], *args]
    # SGLang's own entry point, as `python -m sglang.launch_server` runs it (its spawned
    # subprocesses re-import it by this name, as they always did)
    runpy.run_module(SGLANG_MAIN, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

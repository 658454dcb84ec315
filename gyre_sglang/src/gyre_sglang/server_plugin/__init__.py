"""Gyre's plugin *inside* SGLang (entry-point group ``sglang.srt.plugins``).

SGLang loads it in each of its processes (HTTP server, scheduler, detokenizer). ``register()``
adds Gyre's routes under ``/gyre/`` to the HTTP server, installs the scheduler hooks that
KV-cache pinning/hand-off and weight loading need, and keeps the engine key out of the process's
logs (:mod:`~gyre_sglang.server_plugin.redaction`). It is inert unless Gyre launched the server
(``GYRE_SGLANG_PLUGIN=1``, set by :class:`gyre_sglang.server.SGLangServer`) or the user sets that
variable, so installing gyre-sglang never changes a plain SGLang deployment.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get("GYRE_SGLANG_PLUGIN", "0") == "1"


def register() -> None:
    """SGLang's plugin entry point: called once per SGLang process."""
    if not enabled():
        return
    from gyre_sglang.server_plugin import redaction, routes

    try:  # every process of the server, the schedulers included: they serialise the arguments too
        redaction.install(os.environ.get("GYRE_ENGINE_KEY"))
    except Exception:  # the routes must still come up; gyre_sglang.launch_server refuses to start instead
        logger.exception("gyre: could not install the engine key's redaction in this process")
    routes.register()

"""``python -m gyre_megatron.worker``: one training rank of a Gyre run, started by ``torchrun``.

The site's launcher starts the ranks (``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``); each rank connects to the orchestrator's control plane
(``GYRE_CONTROL=host:port``, key in ``GYRE_CONTROL_KEY_FILE``), gets the run's rank options,
joins the gloo world and serves commands exactly like a rank the orchestrator spawned locally.
The first rank of each cell also starts and stops the cell's SGLang server on its own node when
the orchestrator asks (a second thread, so a rank busy in a training step can still do it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import threading
import traceback
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gyre_megatron.control import ADDRESS_ENV, KEY_ENV, ControlClient, read_key

__all__ = ["main"]


def _advertised(url: str, bind_host: str) -> str:
    """The URL the orchestrator can reach: a wildcard bind is advertised under this node's name."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return url
    host = os.environ.get("GYRE_ADVERTISE_HOST") or socket.getfqdn()
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))


def _serve_engines(client: ControlClient) -> None:
    """Start/stop/kill this node's engines on the orchestrator's request (first rank of a cell)."""
    from gyre_core.plugins import plugin_manager

    engines: dict[int, Any] = {}
    pm = None
    while True:
        seq, op, args, _ = client.engine_cmd.get()
        if op == "exit":
            break
        try:
            if op == "start":
                model_dir, options = args
                if options.mooncake is not None and options.mooncake.peer in ("", "0.0.0.0", "::"):
                    # the engine advertises this node's route to the orchestrator
                    options = dataclasses.replace(options, mooncake=dataclasses.replace(options.mooncake,
                                                                                        peer=client.host))
                pm = pm or plugin_manager()
                if options.log_path:
                    os.makedirs(os.path.dirname(options.log_path) or ".", exist_ok=True)
                if "LOCAL_RANK" in os.environ:  # the cell's first rank: its GPUs start at this one
                    options = dataclasses.replace(options, base_gpu_id=int(os.environ["LOCAL_RANK"]))
                engine = pm.hook.gyre_start_engine(model_dir=model_dir, options=options)
                if engine is None:
                    raise RuntimeError("no serving backend on this node: install gyre-sglang (and SGLang)")
                engine_id = len(engines)
                engines[engine_id] = engine
                out: Any = (engine_id, _advertised(engine.url, options.host))
            elif op in ("stop", "kill"):
                getattr(engines.pop(int(args[0])), op)()
                out = None
            else:
                raise ValueError(f"unknown engine command {op!r}")
            client.results.put((client.rank, seq, True, out))
        except BaseException as e:
            client.results.put((client.rank, seq, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    for engine in engines.values():
        try:
            engine.stop()
        except Exception:
            pass


def _lost(rank: int) -> Any:
    def exit_now() -> None:  # the orchestrator is gone: nothing of this run may outlive it
        print(f"gyre-megatron-worker rank {rank}: the orchestrator stopped answering", file=sys.stderr, flush=True)
        os._exit(3)

    return exit_now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-megatron-worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", default=os.environ.get(ADDRESS_ENV), help=f"host:port (default ${ADDRESS_ENV})")
    parser.add_argument("--key-file", default=os.environ.get(KEY_ENV), help=f"per-run key (default ${KEY_ENV})")
    parser.add_argument("--connect-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if not args.control or not args.key_file:
        parser.error(f"the orchestrator's address and key are needed (--control/--key-file or ${ADDRESS_ENV}/${KEY_ENV})")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            parser.error(f"${name} is not set: start this module with torchrun")
    host, _, port = args.control.rpartition(":")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = ControlClient(host, int(port), read_key(args.key_file), rank, world,
                           connect_timeout_s=args.connect_timeout, on_lost=_lost(rank))
    engines = threading.Thread(target=_serve_engines, args=(client,), name="gyre-engines")
    engines.start()  # lives as long as the rank: engines it starts die with it (PR_SET_PDEATHSIG)
    from gyre_megatron.runtime import serve_rank

    try:
        serve_rank(rank, world, "env://", client.opts, client.queues, client.cmd, client.results)
    except (EOFError, ConnectionError, BrokenPipeError) as e:
        print(f"gyre-megatron-worker rank {rank}: lost the orchestrator ({e})", file=sys.stderr)
        os._exit(3)
    # Told to exit: hang up now, so the orchestrator need not wait while this rank stops its engine
    # and tears down, and a connection it then closes is no longer a lost orchestrator.
    client.close()
    engines.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

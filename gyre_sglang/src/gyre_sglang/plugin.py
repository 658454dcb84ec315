"""The ``gyre`` entry point of ``gyre-sglang``.

Implements ``gyre_make_serving_side``: a :class:`gyre_core.interfaces.ServingSide` that drives an
SGLang server over HTTP (:mod:`gyre_sglang.serving_side`). The SGLang server-side plugin lives in
:mod:`gyre_sglang.server_plugin` (entry-point group ``sglang.srt.plugins``). SGLang itself is
never imported here: this module is imported whenever ``gyre-orchestrate`` starts.
"""

from __future__ import annotations

from typing import Any, Mapping

from gyre_core.hookspecs import hookimpl

from gyre_sglang import __version__
from gyre_sglang.client import SUPPORTED_SGLANG


@hookimpl
def gyre_plugin_info() -> dict[str, Any]:
    return {"name": "gyre-sglang", "version": __version__, "seams": ["serving"],
            "supports": {"sglang": SUPPORTED_SGLANG}}


@hookimpl
def gyre_make_serving_side(engine: int, options: Mapping[str, Any]) -> Any:
    """Options: ``url`` of the engine's SGLang server (required; ``None`` without it, so another
    backend may answer), ``on_phase`` callback, ``weight_loader``, ``memory_tags``,
    ``drain_timeout``, ``api_key``, ``version_wait_s`` and ``load_attempts`` (``[publication]``)."""
    url = options.get("url")
    if not url:
        return None
    from gyre_sglang.serving_side import SGLangServingSide

    kwargs = {k: options[k] for k in ("on_phase", "weight_loader", "memory_tags", "drain_timeout", "clock",
                                      "api_key", "version_wait_s", "load_attempts") if k in options}
    return SGLangServingSide(str(url), cell=engine, **kwargs)


def _mooncake_env(endpoint: Mapping[str, Any] | None) -> dict[str, str]:
    """The engine's Mooncake endpoint (weight pulls, KV hand-off) as its environment: the host it
    advertises (this node's, never assumed), the protocol and the RDMA devices."""
    if not endpoint:
        return {}
    from gyre_core.transfer_endpoint import MooncakeEndpoint, advertised_host

    host = str(endpoint.get("host") or advertised_host(endpoint.get("peer")))
    return MooncakeEndpoint(host, str(endpoint.get("protocol") or "tcp"), str(endpoint.get("device") or "")).env()


@hookimpl
def gyre_start_engine(model_dir: str, options: Mapping[str, Any]) -> Any:
    """Start a real SGLang server (CPU engine and Gyre's CPU patch where CUDA is absent)."""
    from gyre_sglang.server import SGLangServer

    server = SGLangServer(
        model_dir,
        host=str(options.get("host", "127.0.0.1")),
        max_total_tokens=int(options.get("max_total_tokens", 16384)),
        extra_args=list(options.get("extra_args", [])),
        log_path=options.get("log_path"),
        api_key=options.get("api_key"),
        env=_mooncake_env(options.get("mooncake")),
        base_gpu_id=None if options.get("base_gpu_id") is None else int(options["base_gpu_id"]),
        tp_size=int(options.get("tp_size", 1)),
        memory_saver=bool(options.get("memory_saver", False)),
    )
    return server.start(timeout=float(options.get("start_timeout_s", 300.0)))


@hookimpl
def gyre_make_engine_client(url: str, options: Mapping[str, Any]) -> Any:
    from gyre_sglang.client import SGLangClient

    return SGLangClient(url, **{k: options[k] for k in ("timeout", "generate_timeout", "api_key") if k in options})


@hookimpl
def gyre_preflight(config: Mapping[str, Any]) -> list[str]:
    """The engines of a run need SGLang importable at the supported release (located, not
    imported: importing it takes seconds and is the engine process's job)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return [f"SGLang: not installed (pip install 'sglang{SUPPORTED_SGLANG}'; on a machine without CUDA "
                "run gyre-sglang-install-cpu)"]
    try:
        found_version = version("sglang")
    except PackageNotFoundError:
        return ["SGLang: importable but not installed as a distribution (reinstall it with pip)"]
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(found_version) in SpecifierSet(SUPPORTED_SGLANG, prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:  # the server plugin reaches into SGLang's scheduler: an untested release is refused here
        return [f"SGLang {found_version}: this gyre-sglang supports 0.5.22 and 0.5.23 "
                f"(pip install 'sglang{SUPPORTED_SGLANG}', or a gyre-sglang release that supports {found_version})"]
    return []

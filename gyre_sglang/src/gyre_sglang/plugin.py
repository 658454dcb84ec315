"""The ``gyre`` entry point of ``gyre-sglang``.

Implements ``gyre_make_serving_side``: a :class:`gyre_core.interfaces.ServingSide` that drives an
SGLang server over HTTP (:mod:`gyre_sglang.serving_side`). The SGLang server-side plugin lives in
:mod:`gyre_sglang.server_plugin` (entry-point group ``sglang.srt.plugins``). SGLang itself is
never imported here: this module is imported whenever ``gyre-orchestrate`` starts.
"""

from __future__ import annotations

from typing import Any, Mapping

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import EngineOptions, MooncakeOptions, ServingOptions

from gyre_sglang import __version__
from gyre_sglang.client import SUPPORTED_SGLANG


@hookimpl
def gyre_plugin_info() -> dict[str, Any]:
    return {"name": "gyre-sglang", "version": __version__, "seams": ["serving"],
            "supports": {"sglang": SUPPORTED_SGLANG}}


@hookimpl
def gyre_make_serving_side(engine: int, options: ServingOptions) -> Any:
    """The side that drives the engine at ``options.url`` (``None`` without a URL, so another
    backend may answer)."""
    if not options.url:
        return None
    from gyre_sglang.serving_side import SGLangServingSide

    return SGLangServingSide(options.url, cell=engine, api_key=options.api_key, version_wait_s=options.version_wait_s,
                             load_attempts=options.load_attempts)


def _mooncake_env(endpoint: MooncakeOptions | None) -> dict[str, str]:
    """The engine's Mooncake endpoint (weight pulls, KV hand-off) as its environment: the host it
    advertises (this node's, never assumed), the protocol and the RDMA devices."""
    if endpoint is None:
        return {}
    from gyre_core.transfer_endpoint import MooncakeEndpoint, advertised_host

    host = endpoint.host or advertised_host(endpoint.peer)
    return MooncakeEndpoint(host, endpoint.protocol, endpoint.device).env()


@hookimpl
def gyre_start_engine(model_dir: str, options: EngineOptions) -> Any:
    """Start a real SGLang server (CPU engine and Gyre's CPU patch where CUDA is absent)."""
    from gyre_sglang.server import SGLangServer

    server = SGLangServer(
        model_dir, host=options.host, max_total_tokens=options.max_total_tokens, extra_args=list(options.extra_args),
        log_path=options.log_path, api_key=options.api_key, env=_mooncake_env(options.mooncake),
        base_gpu_id=options.base_gpu_id, tp_size=options.tp_size, memory_saver=options.memory_saver)
    return server.start(timeout=options.start_timeout_s)


@hookimpl
def gyre_make_engine_client(url: str, options: ServingOptions) -> Any:
    from gyre_sglang.client import SGLangClient

    return SGLangClient(url, api_key=options.api_key)


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

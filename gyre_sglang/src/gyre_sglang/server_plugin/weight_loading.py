"""Engine side of weight publication: SGLang's custom weight loader for Gyre's Mooncake buffers.

Path: SGLang's own ``/update_weights_from_tensor`` with ``load_format`` naming
:func:`load_published_weights` (listed in the server's ``--custom-weight-loader``). The request
carries only the :class:`~gyre_core.interfaces.WeightsRef` location (one small tensor); the loader,
running in the scheduler's model-runner process, pulls the published buffer over Mooncake into a
registered staging buffer, verifies it, checks every name, shape and dtype against the served
checkpoint's layout, and only then calls the model's ``load_weights``. SGLang records the new
``weight_version`` and flushes the cache only when the call returns normally.

Why this path and not SGLang's ``remote_instance`` loader: that one runs at *startup* only, reads
another *engine's* parameters in SGLang's fused layout (same parallelism required) and writes them
straight into the live parameters, so a failed read would leave them half-written. Gyre's
publisher is the trainer, not an engine, and an update must be all-or-nothing. We keep its
conventions (``TransferEngine`` in ``P2PHANDSHAKE`` mode, one-sided reads into registered memory).

SGLang calls a custom loader without a try/except, so an exception would kill the scheduler: the
AROUND hook installed by :func:`register` turns a failure of *this* loader into SGLang's
``(False, message)`` answer. The weights are unchanged then, because every check runs before the
first parameter write.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from gyre_core.transfer_endpoint import ADVERTISE_ENV, HOST_ENV
from gyre_sglang.weight_publication import (
    LOADER,
    REF_TENSOR_NAME,
    ManifestEntry,
    PublicationError,
    WeightPuller,
)

logger = logging.getLogger(__name__)

__all__ = ["LOADER", "checkpoint_layout", "load_published_weights", "register", "validate_layout"]

_HOOK_TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor"

_SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I8": "int8",
    "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}

_puller: WeightPuller | None = None
_layouts: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
_context: dict[str, Any] = {}
"""Set by the hook around each call: ``model_path`` and ``serving_dtype`` of the runner."""


def checkpoint_layout(model_dir: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (dtype, shape)`` of every tensor in the served checkpoint (safetensors headers).

    These are exactly the names and shapes SGLang's ``load_weights`` accepted at startup, which is
    what a publication must match (the model's own loader silently skips unknown names).
    """
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    if not files:
        raise PublicationError(
            f"no safetensors checkpoint under {str(model_dir)!r}: Gyre validates a publication against "
            "the served checkpoint's layout and cannot do so without it")
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
            layout[name] = (dtype, tuple(int(s) for s in meta["shape"]))
    return layout


def validate_layout(
    entries: Iterable[ManifestEntry],
    layout: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    partial: bool = False,
    serving_dtype: str | None = None,
) -> None:
    """Raise :class:`PublicationError` listing every mismatch; return only if all tensors fit.

    A tensor fits when its name is in the checkpoint, its shape is the checkpoint's, and its dtype
    is the checkpoint's or the engine's serving dtype. Unless ``partial``, no checkpoint tensor may
    be missing.
    """
    problems: list[str] = []
    names = set()
    for e in entries:
        names.add(e.name)
        if e.name not in layout:
            problems.append(f"unknown tensor {e.name!r}")
            continue
        dtype, shape = layout[e.name]
        if tuple(e.shape) != shape:
            problems.append(f"{e.name}: shape {list(e.shape)} != {list(shape)}")
        if e.dtype not in (dtype, serving_dtype):
            problems.append(f"{e.name}: dtype {e.dtype} != {dtype}" + (f" (serving {serving_dtype})" if serving_dtype else ""))
    if not partial:
        missing = sorted(set(layout) - names)
        if missing:
            problems.append(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    if problems:
        more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PublicationError("publication does not match the served model: " + "; ".join(problems[:8]) + more)


def _get_puller() -> WeightPuller:
    global _puller
    if _puller is None:
        # the endpoint the orchestrator gave this engine (gyre_core.transfer_endpoint); an engine
        # started by hand without one advertises SGLang's own guess of this node's address
        configured = os.environ.get(HOST_ENV) or os.environ.get(ADVERTISE_ENV) or os.environ.get("MC_TCP_BIND_ADDRESS")
        if configured:
            _puller = WeightPuller()
        else:
            from sglang.srt.utils.network import get_local_ip_auto

            _puller = WeightPuller(get_local_ip_auto())
    return _puller


def _decode_location(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    if len(named_tensors) != 1 or named_tensors[0][0] != REF_TENSOR_NAME:
        raise PublicationError(
            f"{LOADER} expects exactly one tensor named {REF_TENSOR_NAME!r} "
            f"(use gyre_sglang.weight_publication.load_published), got {[n for n, _ in named_tensors][:5]}")
    return named_tensors[0][1].detach().cpu().numpy().tobytes().decode()


def load_published_weights(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: pull, verify, validate, then ``model.load_weights``."""
    location = _decode_location(named_tensors)
    model_path = _context.get("model_path")
    if model_path is None:
        from sglang.srt.runtime_context import get_model

        model_path = get_model().model_path
    layout = _layouts.get(model_path)
    if layout is None:
        layout = _layouts[model_path] = checkpoint_layout(model_path)
    pulled = _get_puller().pull(location)
    validate_layout(pulled.entries, layout, partial=pulled.partial, serving_dtype=_context.get("serving_dtype"))
    logger.info("Gyre: loading published version %s (%d tensors, %d bytes, pulled in %.3f s)",
                pulled.version, len(pulled.entries), pulled.nbytes, pulled.pull_s)
    _context["writing"] = True
    model.load_weights(pulled.tensors())


def _guard(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``WeightUpdater.update_weights_from_tensor``: a failing Gyre load answers
    ``(False, message)`` instead of raising through SGLang's scheduler loop."""
    load_format = kwargs.get("load_format", args[2] if len(args) > 2 else None)
    if load_format != LOADER:
        return original(*args, **kwargs)
    updater = args[0]
    if LOADER not in (updater.custom_weight_loaders or ()):
        return False, f"start the SGLang server with --custom-weight-loader {LOADER} to load Gyre publications"
    dtype = getattr(updater.model_config, "dtype", None)
    _context.update(model_path=str(updater.model_config.model_path),
                    serving_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None)
    try:
        return original(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - answered as SGLang's (False, message)
        state = ("weights MAY BE PARTIALLY UPDATED (load_weights failed after all checks passed); "
                 "weight_version unchanged" if _context.get("writing") else "weights and weight_version unchanged")
        return False, f"Gyre weight load failed, {state}: {type(e).__name__}: {e}"  # SGLang logs it
    finally:
        _context.clear()


def register() -> None:
    """Install the guard hook (applied by SGLang's ``load_plugins`` in each of its processes)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_HOOK_TARGET, _guard, HookType.AROUND)

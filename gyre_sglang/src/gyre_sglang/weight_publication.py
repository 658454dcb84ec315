"""Loading a published policy version into an SGLang engine.

The version's bytes are registered by the processes that hold the model (each pipeline stage of
the core: :mod:`gyre_core.published_weights`, whose names this module also exports); the engine
pulls them with Gyre's custom weight loader (:mod:`gyre_sglang.server_plugin.weight_loading`),
which checks every part before any parameter changes.

:func:`load_published` is what the orchestrator calls: it drives SGLang's own update path
(``/begin_weight_update``, ``/update_weights_from_tensor`` with ``load_format`` naming Gyre's
custom loader, ``/end_weight_update``) so SGLang records the new ``weight_version`` and flushes
its cache only when the load succeeded.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
import time
from typing import TYPE_CHECKING, Mapping

import torch

from gyre_core.interfaces import EngineError, WeightsRef
from gyre_core.published_weights import (
    FORMAT,
    PARTS_FORMAT,
    ManifestEntry,
    PublicationError,
    PulledWeights,
    WeightPublisher,
    WeightPuller,
    compose,
    parse_location,
)

if TYPE_CHECKING:  # pragma: no cover
    from gyre_sglang.client import SGLangClient

log = logging.getLogger("gyre.sglang")

__all__ = [
    "FORMAT",
    "LOADER",
    "PARTS_FORMAT",
    "REF_TENSOR_NAME",
    "ManifestEntry",
    "PublicationError",
    "PulledWeights",
    "VERSION_WAIT_S",
    "WeightPublisher",
    "WeightPuller",
    "await_version",
    "compose",
    "load_published",
    "parse_location",
]

LOADER = "gyre_sglang.server_plugin.weight_loading.load_published_weights"
"""Dotted path of Gyre's custom weight loader; the SGLang server must be started with
``--custom-weight-loader`` naming it (SGLang only dispatches to listed loaders)."""

REF_TENSOR_NAME = "gyre.weights_ref"
"""Name of the one tensor carried by ``/update_weights_from_tensor``: the location's UTF-8 bytes."""


def ref_payload(ref: WeightsRef) -> str:
    """The base64 ``serialized_named_tensors`` entry carrying ``ref.location`` to the loader.

    Plain pickle of one CPU uint8 tensor (bytes inline): SGLang's safe unpickler accepts it, and
    unlike its default ForkingPickler payload it holds no shared-memory handle, so it works from
    another process or host.
    """
    t = torch.frombuffer(bytearray(ref.location.encode()), dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([(REF_TENSOR_NAME, t)])).decode()


FLUSH_REFUSED = "cache was not flushed because requests are still running"
"""SGLang's answer when the new weights are in but the prefix cache could not be flushed."""

VERSION_WAIT_S = 30.0
"""How long a load waits for ``/model_info`` to report the version it loaded (``publication.version_wait_s``)."""


async def await_version(client: "SGLangClient", version: int, wait_s: float = VERSION_WAIT_S) -> str:
    """Poll the engine's ``weight_version`` until it reports ``version``; bounded by ``wait_s``.

    Why a wait and not one read: SGLang records the new version inside its scheduler process, and
    ``/model_info`` is answered by the tokenizer manager, which learns it later. On a loaded
    machine (an engine generating for other executions while it loads) the first read after a
    successful load can still show the previous version. Raises :class:`EngineError` naming the
    last version seen once ``wait_s`` is spent.
    """
    deadline = time.monotonic() + max(0.0, wait_s)
    delay = 0.05
    while True:
        seen = await client.weight_version()
        if seen == str(version) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(1.0, delay * 2)
    if seen != str(version):
        raise EngineError("/model_info", 200,
                          f"engine reports weight_version {seen!r} after loading {version} (waited {wait_s:g} s)")
    return seen


async def load_published(client: "SGLangClient", ref: WeightsRef, *, flush_cache: bool = True,
                         timeout: float | None = None, version_wait_s: float = VERSION_WAIT_S) -> str:
    """Make the engine behind ``client`` pull and load ``ref``; return its new ``weight_version``.

    Runs inside SGLang's begin/end weight-update session (0.5.23 requires it for tensor updates)
    and always closes the session. On failure raises :class:`~gyre_core.interfaces.EngineError`
    with the engine's message; the engine keeps its previous weights and version.

    An engine in rollout keeps generating while a version is published (that is the point of
    bounded staleness), and SGLang refuses to flush its prefix cache with requests running: it
    loads the weights, records the version, then answers with an error. That answer is a
    successful load here (the version check below proves it); the flush is tried once more and
    otherwise skipped, so cached prefixes computed by the previous version may be reused until
    evicted. Token records stay exact either way: the log-probs are those the engine sampled with.

    The new version may reach ``/model_info`` after the update's answer (:func:`await_version`
    waits up to ``version_wait_s`` for it); a load whose version never shows is an error, which
    the serving side retries before it calls the engine failed.
    """
    info = await client.server_info()
    tp = int(info.get("tp_size", 1) or 1)
    body = {
        "serialized_named_tensors": [ref_payload(ref)] * tp,
        "load_format": LOADER,
        "flush_cache": flush_cache,
        "weight_version": str(ref.version),
    }
    flush_refused = False
    await client.begin_weight_update()
    try:
        try:
            ans = await client.post("/update_weights_from_tensor", body, timeout=timeout)
        except EngineError as e:
            if not (flush_cache and FLUSH_REFUSED in str(e)):
                raise
            flush_refused = True
        else:
            if not isinstance(ans, Mapping) or not ans.get("success", False):
                if not (flush_cache and FLUSH_REFUSED in str(ans)):
                    raise EngineError("/update_weights_from_tensor", 200, str(ans))
                flush_refused = True
    except BaseException:
        try:  # close the session, but report the update's own failure, not this one's
            await client.end_weight_update()
        except Exception:  # noqa: BLE001
            pass
        raise
    await client.end_weight_update()
    version = await await_version(client, ref.version, version_wait_s)
    if flush_refused:
        try:
            await client.flush_cache()
        except EngineError:
            log.info("engine %s loaded version %s with requests running; its prefix cache was not flushed",
                     getattr(client, "url", "?"), ref.version)
    return version

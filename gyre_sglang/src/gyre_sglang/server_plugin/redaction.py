"""Keep the engine key out of everything an SGLang server prints or reports about its arguments.

SGLang logs its resolved arguments at start (``server_args={...}`` in ``entrypoints/engine.py``,
built by ``ServerArgs.resolved_dict`` through ``_server_args_for_logging``) and serves the same
dictionary on ``/server_info`` and in its crash-dump config snapshots; its own redaction
(``redact_watermark_secrets``) hides only the watermark keys, so ``api_key`` went into
``engine<N>.log`` in clear. :func:`install` closes this in the process it runs in:

* ``ServerArgs.resolved_dict`` answers ``"<redacted>"`` for ``api_key`` and ``admin_api_key``
  (every serialisation of the arguments goes through it, in the HTTP process and in the
  schedulers, whose internal state readback feeds ``/server_info``);
* ``ServerArgs.__repr__`` shows the same placeholder (``f"{server_args}"`` and ``%r`` in logs);
* every log record whose message contains the key itself has it replaced (what the two above
  miss: another release's log lines, a line nobody foresaw).

The record itself keeps the key: SGLang's auth middleware and Gyre's scheduler channel read
``server_args.api_key``, and the subprocesses receive the record pickled.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

REDACTED = "<redacted>"
SECRET_FIELDS = ("api_key", "admin_api_key")
"""``ServerArgs`` fields whose values are never printed."""

_MARK = "_gyre_redacted"


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a serialised ``ServerArgs``) with every set secret field replaced."""
    return {k: REDACTED if k in SECRET_FIELDS and v else v for k, v in values.items()}


def redacted_text(text: str, server_args: Any) -> str:
    """``text`` (a ``repr`` of ``server_args``) with the reprs of its secret values replaced."""
    for name in SECRET_FIELDS:
        value = getattr(server_args, name, None)
        if isinstance(value, str) and value:
            text = text.replace(repr(value), repr(REDACTED))
    return text


def patch_server_args(cls: Any) -> None:
    """Make ``cls`` (SGLang's ``ServerArgs``) redact its secrets in ``repr`` and ``resolved_dict``;
    idempotent."""
    if cls.__dict__.get(_MARK):
        return
    plain_repr: Callable[[Any], str] = cls.__repr__

    def __repr__(self: Any) -> str:
        return redacted_text(plain_repr(self), self)

    cls.__repr__ = __repr__
    plain_resolved = getattr(cls, "resolved_dict", None)
    if plain_resolved is not None:  # 0.5.23; an older record serialises through its repr

        def resolved_dict(self: Any) -> dict[str, Any]:
            return redacted(plain_resolved(self))

        cls.resolved_dict = resolved_dict
    setattr(cls, _MARK, True)


def scrubbing_factory(inner: Callable[..., logging.LogRecord], secret: str) -> Callable[..., logging.LogRecord]:
    """A log-record factory around ``inner`` whose records never carry ``secret`` in their message."""

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = inner(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is logging's to report, not ours to break
            return record
        if secret in text:
            record.msg, record.args = text.replace(secret, REDACTED), None
        return record

    factory._gyre_scrubs = secret  # type: ignore[attr-defined]
    return factory


def scrub_logs(secret: str) -> None:
    """Replace ``secret`` in every log record this process makes from now on (a record factory,
    not a handler filter: SGLang replaces the root handlers when it configures logging)."""
    current = logging.getLogRecordFactory()
    if not secret or getattr(current, "_gyre_scrubs", None) == secret:
        return
    logging.setLogRecordFactory(scrubbing_factory(current, secret))


def install(secret: str | None) -> bool:
    """Redact the engine key in this SGLang process; ``False`` where SGLang cannot be imported."""
    if secret:
        scrub_logs(secret)
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return False
    patch_server_args(ServerArgs)
    return True

"""Messages and tools -> text with the model's own chat template; text <-> token ids.

The proxy never hand-writes a prompt format: whatever template the served model ships is the
format, so the same code serves any chat model whose tokenizer has a template. Rendering is a
string operation; *encoding* is what the incremental encoder keeps proportional to the new
content (see ``context_index``).

Tail rendering
--------------
Rendering a whole conversation costs O(context) per call, so a call that continues a recorded path
renders only the messages after it (:meth:`ChatRenderer.render_tail`): the template is applied to an
*anchor* (the leading system message, if any, and the two messages before the tail) followed by the
tail, and the anchor's own rendering is cut off the front. That reproduces the full render's suffix
exactly for templates whose output for a message depends only on its neighbours, the first message
and ``tools`` -- every ChatML/Hermes/Qwen2.5-style template. It is *not* exact for templates with
global state (Qwen3's "drop the thinking of turns before the last user query", turn numbering), so:

* the tail is refused (``None``) unless the anchor's rendering is a prefix of anchor + tail (the
  prefix property, locally) and, when the caller knows the stored canonical text that ends at the
  boundary, unless the anchor renders the boundary message exactly as that text ends;
* :meth:`ChatRenderer.supports_tail_rendering` probes the template once with conversations of
  every shape (system/no system, tools, tool calls and grouped tool results, reasoning, mid-turn
  system messages) and disables tail rendering for good if any tail it would *accept* differs
  from the full render's suffix; the caller then renders in full (and counts it).

The context window before the encoding
--------------------------------------
Encoding costs about a second per megabyte, so a prompt that cannot fit is refused before it is
encoded whole (:meth:`ChatRenderer.encode_within`): first by a bound that costs nothing (no token
stands for more than :meth:`ChatRenderer.max_token_chars` characters, so a text of ``n``
characters has at least ``n / max`` tokens), then, for a text much longer than the room left
(more than :data:`PIECEWISE_CHARS_PER_TOKEN` characters per token of room), by encoding it piece
by piece and stopping as soon as the pieces hold more tokens than the room. Only a text that may
fit is encoded whole, exactly as before.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from gyre_core.proxy.types import ChatMessage, ProxyError

__all__ = ["ChatRenderer", "ContextTooLong", "message_to_template", "tools_key"]

PIECE_CHARS = 64 * 1024
"""Size of the pieces a long text is encoded in to find out early that it cannot fit."""
PIECEWISE_CHARS_PER_TOKEN = 8
"""A text longer than this many characters per token of room is encoded piece by piece first
(English and code average about 4; a text that would fit at more than 8 is rare, and only costs
its encoding twice)."""
PIECE_SLACK = 2
"""Tokens a cut between two pieces may add at most (cuts are made before whitespace, where the
pre-tokenizers of GPT-, Llama- and Qwen-style tokenizers cut anyway)."""

_LOSSLESS_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation", "Sequence"})
_BOUNDED_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Sequence"})
NORMALIZER_FACTOR = 4
"""How many input characters one normalised character can stand for at most (Unicode composition
turns at most three characters into one: Hangul jamo)."""


class ContextTooLong(Exception):
    """A text has at least ``at_least`` tokens, more than the room it was given."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """A string that is equal for two tool lists exactly when the template sees the same tools."""
    if not tools:
        return ""
    try:
        return json.dumps(list(tools), ensure_ascii=False, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):  # pragma: no cover - validated tools are JSON
        return repr(list(tools))


def message_to_template(m: ChatMessage) -> dict[str, Any]:
    """The dict shape HF chat templates expect (OpenAI-like, arguments kept as the exact string)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


class ChatRenderer:
    """A tokenizer with a chat template, reduced to the four operations the proxy needs."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the proxy cannot render requests")
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token
        self.eos_text: str = eos if isinstance(eos, str) else ""
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.context_window: int | None = None
        limit = getattr(tokenizer, "model_max_length", None)
        if isinstance(limit, int) and 0 < limit < 10**9:
            self.context_window = limit
        self._tail_supported: bool | None = None
        self.tail_unsupported_reason: str | None = None
        self._cache: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self._cache_size = 64
        self._lock = threading.Lock()
        """Calls are prepared in several threads: the cache and the one-time probes are shared."""
        self._probe_lock = threading.Lock()
        self._max_token_chars: int | None | bool = False  # False: not computed yet

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ChatRenderer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        add_generation_prompt: bool,
    ) -> str:
        """The template's text for ``messages``; a template error is the request's fault (400)."""
        try:
            text = self.tokenizer.apply_chat_template(
                [message_to_template(m) for m in messages],
                tools=[dict(t) for t in tools] or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # jinja raises TemplateError, TypeError, ... on odd input
            raise ProxyError(400, "invalid_request", f"the chat template cannot render this request: {exc}") from None
        if not isinstance(text, str):  # pragma: no cover - transformers returns str with tokenize=False
            raise ProxyError(400, "invalid_request", "the chat template did not render text")
        return text

    def _render_small(
        self, messages: tuple[ChatMessage, ...], tools: Sequence[Mapping[str, Any]], tkey: str, gen: bool
    ) -> str | None:
        """A render of a few messages (cached: consecutive calls render the same anchors); None on a
        template error."""
        try:
            key = (tkey, gen, messages)
            hit = self._cache.get(key)
        except TypeError:  # an unhashable field: no caching
            key, hit = None, None
        if hit is not None:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
            return hit
        try:
            text = self.render(messages, tools, add_generation_prompt=gen)
        except ProxyError:
            return None
        if key is not None:
            with self._lock:
                self._cache[key] = text
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return text

    @staticmethod
    def anchor_of(messages: Sequence[ChatMessage], start: int) -> tuple[ChatMessage, ...]:
        """The messages rendered in front of a tail that starts at ``start`` (see module docstring)."""
        lo = max(start - 2, 0)
        if lo > 0 and messages[0].role == "system":
            return (messages[0],) + tuple(messages[lo:start])
        return tuple(messages[lo:start])

    def render_tail(
        self,
        messages: Sequence[ChatMessage],
        start: int,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        add_generation_prompt: bool,
        boundary: str | None = None,
        tkey: str | None = None,
    ) -> str | None:
        """The full render's text after ``render(messages[:start], add_generation_prompt=False)``,
        rendering only the tail; None when that cannot be guaranteed (render in full instead).

        ``boundary``: stored canonical text that ends with ``messages[start - 1]`` as the full
        render renders it (a tree node's segment); the anchor must render that message the same.
        ``start == 0`` is a full render. Template errors give None (the full render reports them).
        """
        tkey = tools_key(tools) if tkey is None else tkey
        msgs = tuple(messages)
        if start <= 0:
            try:
                return self.render(msgs, tools, add_generation_prompt=add_generation_prompt)
            except ProxyError:
                return None
        if start > len(msgs):
            return None
        anchor = self.anchor_of(msgs, start)
        head = self._render_small(anchor, tools, tkey, False)
        if head is None:
            return None
        if boundary is not None:
            before = self._render_small(anchor[:-1], tools, tkey, False) if len(anchor) > 1 else None
            if before is None or not head.startswith(before) or not boundary.endswith(head[len(before):]):
                return None
        whole = self._render_small(anchor + msgs[start:], tools, tkey, add_generation_prompt) if start < len(msgs) \
            else self._render_small(anchor, tools, tkey, add_generation_prompt)
        if whole is None or not whole.startswith(head):
            return None
        return whole[len(head):]

    def supports_tail_rendering(self) -> bool:
        """Whether :meth:`render_tail` is exact for this template (probed once; see module docstring)."""
        if self._tail_supported is None:
            with self._probe_lock:
                if self._tail_supported is None:
                    self._tail_supported, self.tail_unsupported_reason = _probe_tail_rendering(self)
        return self._tail_supported

    def disable_tail_rendering(self, reason: str) -> None:
        self._tail_supported, self.tail_unsupported_reason = False, reason

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token markup in it becomes the special tokens."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def max_token_chars(self) -> int | None:
        """Most characters of the input text one token can stand for; None when the tokenizer can
        drop text (a pre-tokenizer that removes whitespace, an unknown-word token, a normaliser
        that strips): then no count of characters bounds its tokens. Computed once, from the
        vocabulary (a token spelled in ``k`` UTF-8 bytes stands for at most ``k`` bytes of text:
        byte-level alphabets spell one byte as one character, SentencePiece spells a space as
        three bytes), times :data:`NORMALIZER_FACTOR` when a normaliser may contract text."""
        if self._max_token_chars is False:
            with self._probe_lock:
                if self._max_token_chars is False:
                    self._max_token_chars = _max_token_chars(self.tokenizer)
        return self._max_token_chars  # type: ignore[return-value]

    def encode_within(self, text: str, limit: int | None) -> list[int]:
        """:meth:`encode`, or :class:`ContextTooLong` once ``text`` is known to have more than
        ``limit`` tokens -- before it is encoded whole (see the module docstring)."""
        if limit is None:
            return self.encode(text)
        limit = max(limit, 0)
        most = self.max_token_chars()
        if most:
            floor = -(-len(text) // most)
            if floor > limit:
                raise ContextTooLong(floor)
        if len(text) > PIECEWISE_CHARS_PER_TOKEN * max(limit, 1) and len(text) > PIECE_CHARS:
            counted, cuts, start = 0, 0, 0
            while start < len(text):
                end = _cut(text, start + PIECE_CHARS)
                counted += len(self.encode(text[start:end]))
                start = end
                if start < len(text):
                    cuts += 1
                if counted - PIECE_SLACK * cuts > limit:
                    raise ContextTooLong(counted - PIECE_SLACK * cuts)
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (``<tool_call>``, ``<think>``, the EOS)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _cut(text: str, at: int) -> int:
    """A cut at or before ``at``, just before a whitespace character (``len(text)`` past the end)."""
    if at >= len(text):
        return len(text)
    lo = max(at - 4096, 0)
    for ws in (" ", "\n"):
        i = text.rfind(ws, lo, at)
        if i > lo:
            return i
    return at


def _types(node: Any, key: str) -> list[str]:
    """The component types of a tokenizer's JSON ``normalizer`` / ``pre_tokenizer`` (Sequences flattened)."""
    if not node:
        return []
    out = [str(node.get("type"))]
    for child in node.get(key, []) or []:
        out.extend(_types(child, key))
    return out


def _max_token_chars(tokenizer: Any) -> int | None:
    """See :meth:`ChatRenderer.max_token_chars`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - an exotic tokenizer: no bound, the piecewise check still applies
        return None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    norm = spec.get("normalizer")
    if model.get("type") != "BPE" or (model.get("unk_token") and not model.get("byte_fallback")
                                      and "ByteLevel" not in _types(pre, "pretokenizers")):
        return None
    if any(t not in _LOSSLESS_PRE_TOKENIZERS for t in _types(pre, "pretokenizers")):
        return None
    if pre and "Removed" in json.dumps(pre):
        return None
    norms = _types(norm, "normalizers")
    if any(t not in _BOUNDED_NORMALIZERS for t in norms):
        return None
    most = max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=1)
    return max(1, most) * (NORMALIZER_FACTOR if norms else 1)


def _probe_conversations() -> list[tuple[ChatMessage, ...]]:
    from gyre_core.proxy.types import ToolCall

    S = ChatMessage("system", "You are a careful agent.")
    u = [ChatMessage("user", f"user turn {i}: do the thing") for i in range(6)]
    tc = lambda i, n=1: ChatMessage(  # noqa: E731
        "assistant", "" if i % 2 else f"calling {i}", f"think {i}" if i % 3 == 0 else None,
        tuple(ToolCall(f"call_{i}_{j}", "Bash", f'{{"command": "ls {i}{j}"}}') for j in range(n)),
    )
    tr = lambda i, j=0: ChatMessage("tool", f"result {i}.{j}", tool_call_id=f"call_{i}_{j}")  # noqa: E731
    a = lambda i, r=False: ChatMessage("assistant", f"answer {i}", f"reasoning {i}" if r else None)  # noqa: E731
    convs = [
        (S, u[0], a(0), u[1], a(1), u[2], a(2), u[3]),
        (u[0], a(0), u[1], a(1), u[2], a(2), u[3]),
        (S, u[0], tc(0), tr(0), tc(1, 2), tr(1, 0), tr(1, 1), a(2), u[1], tc(3), tr(3), a(4), u[2]),
        (u[0], tc(1, 3), tr(1, 0), tr(1, 1), tr(1, 2), tc(2), tr(2), u[1], a(3), u[2]),
        (S, u[0], a(0, True), u[1], a(1, True), u[2], tc(3), tr(3), a(4, True), u[3]),
        (S, u[0], tc(0), tr(0), tc(3), tr(3), a(5), u[1], a(6, True), u[2], a(7), u[3]),
        (S, u[0], a(0), ChatMessage("system", "mid-turn note"), u[1], a(1), u[2], a(2), ChatMessage("system", "x"), u[3]),
        (S, u[0], a(0), u[1], a(1), u[2], a(2), u[3], a(3), u[4], a(4), u[5]),
    ]
    return convs


def _probe_tail_rendering(r: ChatRenderer) -> tuple[bool, str | None]:
    """Every tail :meth:`ChatRenderer.render_tail` accepts must equal the full render's suffix."""
    tools_sets: list[tuple[Mapping[str, Any], ...]] = [
        (),
        ({"type": "function", "function": {"name": "Bash", "description": "run a command", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},),
    ]
    checked = 0
    for conv in _probe_conversations():
        for tools in tools_sets:
            for end in range(1, len(conv) + 1):
                msgs = conv[:end]
                for k in range(1, end + 1):
                    if msgs[k - 1].role != "assistant":
                        continue
                    for gen in (True, False):
                        try:
                            full = r.render(msgs, tools, add_generation_prompt=gen)
                            head = r.render(msgs[:k], tools, add_generation_prompt=False)
                        except ProxyError:
                            continue
                        tail = r.render_tail(msgs, k, tools, add_generation_prompt=gen, boundary=head)
                        if tail is None:
                            continue
                        checked += 1
                        if full != head + tail:
                            return False, (f"tail render differs from the full render ({len(msgs)} messages, "
                                           f"split at {k}, tools={bool(tools)}, generation prompt={gen})")
    if not checked:
        return False, "the template accepted no tail render in the probe"
    return True, None

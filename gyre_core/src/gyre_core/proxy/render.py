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
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

from gyre_core.proxy.types import ChatMessage, ProxyError

__all__ = ["ChatRenderer", "message_to_template", "tools_key"]


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
            self._cache.move_to_end(key)
            return hit
        try:
            text = self.render(messages, tools, add_generation_prompt=gen)
        except ProxyError:
            return None
        if key is not None:
            self._cache[key] = text
            if len(self._cache) > self._cache_size:
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
            self._tail_supported, self.tail_unsupported_reason = _probe_tail_rendering(self)
        return self._tail_supported

    def disable_tail_rendering(self, reason: str) -> None:
        self._tail_supported, self.tail_unsupported_reason = False, reason

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token markup in it becomes the special tokens."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (``<tool_call>``, ``<think>``, the EOS)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


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

"""Messages and tools -> text with the model's own chat template; text <-> token ids.

The proxy never hand-writes a prompt format: whatever template the served model ships is the
format, so the same code serves any chat model whose tokenizer has a template. Rendering is a
string operation (cheap); *encoding* is what the incremental encoder keeps proportional to the new
content (see ``context_index``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from gyre_core.proxy.types import ChatMessage, ProxyError

__all__ = ["ChatRenderer", "message_to_template"]


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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token markup in it becomes the special tokens."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (``<tool_call>``, ``<think>``, the EOS)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

"""Incremental encoding: match a request's rendered context against an execution's tree.

Every tree node remembers the *canonical text* it stands for: the chat template's rendering of
the conversation up to and including the node's answer, as the harness will send it back. A node
stores only its ``segment`` (the canonical text it adds after its parent's) and its ``tail``: the
canonical text that follows its stored tokens but was never fed (typically the newline after the
EOS, or ``<|im_end|>`` after a length-truncated answer). A new request is rendered once (a string
operation), its text is walked down the tree comparing segments in place -- O(context characters),
no tokenization -- and only ``tail + unmatched rest`` is tokenized. The matched path's stored token
ids (exactly what was fed and sampled) are reused as they are.

* A request that continues a path matches that path's deepest node: its new node is a child.
* A request that rewrites history (compaction) matches only a shorter prefix: a new branch.
* A request that matches nothing (a sub-agent's own conversation) attaches to the root.

Why canonical text and not the decoded tokens: a harness sends back what the proxy *answered*
(content, reasoning, tool calls with restored payloads), which the template renders in its own
way -- e.g. without the ``<think>`` block, or with different whitespace around tool calls. Keying
the match on that rendering while keeping the sampled tokens means the next prompt holds the
policy's own tokens verbatim (what TITO is for), and the match does not depend on the template
re-rendering an answer byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ContextIndex", "Match", "answer_tail"]


@dataclass(frozen=True)
class Match:
    """Where a request's rendered text leaves the tree."""

    node_id: int | None
    """Deepest node whose canonical text is a prefix of the request's; None: attach to the root."""
    matched_chars: int
    """Length of that prefix in the request's text."""
    tail: str
    """Canonical text after the node's stored tokens that still has to be fed."""


@dataclass
class _Entry:
    parent: int | None
    segment: str | None
    tail: str
    children: list[int] = field(default_factory=list)


def answer_tail(canonical_answer: str, sampled_text: str, eos_text: str) -> str:
    """The part of the template's rendering of an answer that its sampled tokens do not cover.

    ``canonical_answer`` is the template's text for the answer turn after the generation prompt
    (e.g. ``"hi<|im_end|>\\n"``); ``sampled_text`` the decoded sampled tokens. When the sampled
    text is a prefix of the rendering, the rest is the tail. Otherwise (the template dropped the
    thinking block, or spaced a tool call differently) the tail is what the rendering has after
    its last EOS (if the model sampled the EOS) or from its last EOS on (if it did not).
    """
    if canonical_answer.startswith(sampled_text):
        return canonical_answer[len(sampled_text):]
    if not eos_text:
        return ""
    at = canonical_answer.rfind(eos_text)
    if at < 0:
        return ""
    if sampled_text.endswith(eos_text):
        return canonical_answer[at + len(eos_text):]
    return canonical_answer[at:]


class ContextIndex:
    """The text side of one execution's trajectory tree (the tree itself holds the tokens)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._roots: list[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, node_id: int, parent: int | None, segment: str | None, tail: str) -> None:
        """Register a node. ``segment=None`` makes it a node no request can continue (a leaf for
        good) -- used when the template's rendering of its answer does not extend its prompt."""
        if node_id in self._entries:
            raise ValueError(f"node {node_id} indexed twice")
        if parent is not None and parent not in self._entries:
            raise ValueError(f"node {node_id}: unknown parent {parent}")
        self._entries[node_id] = _Entry(parent, segment, tail)
        (self._entries[parent].children if parent is not None else self._roots).append(node_id)

    def match(self, text: str) -> Match:
        """The deepest stored path whose canonical text is a prefix of ``text``."""
        node: int | None = None
        pos = 0
        candidates = self._roots
        while candidates:
            best: int | None = None
            best_len = -1
            for child in candidates:
                seg = self._entries[child].segment
                if seg and len(seg) > best_len and text.startswith(seg, pos):
                    best, best_len = child, len(seg)
            if best is None:
                break
            node, pos = best, pos + best_len
            candidates = self._entries[best].children
        tail = self._entries[node].tail if node is not None else ""
        return Match(node, pos, tail)

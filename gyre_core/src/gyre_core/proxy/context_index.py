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

Matching by messages (the fast path)
------------------------------------
Rendering and walking the whole text is O(context) per call. So the index also keeps a *message
trie* per tool list: every continuable node ends at the trie position of the messages its
canonical text renders (its request's messages, payloads restored, then its answer as the proxy
gave it). A request is walked down the trie one message at a time -- a dict lookup per message,
so identical retries and branches cost nothing extra -- and the deepest node is chosen exactly as
the text walk chooses it (greedy: the deepest matching child at every level). Equal messages
render equally, so this finds the node the text walk finds; a message that differs but renders
the same in place (a harness that drops the reasoning the template does not show anyway) is
recognised by an ``equivalent`` callback that renders just that message, and remembered as an
alias edge. Only the messages after the matched node are then rendered (``render.render_tail``).
:meth:`ContextIndex.match` (the text walk) remains the fallback for templates where rendering a
tail alone is not exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
    matched_messages: int = 0
    """Messages of the request the matched node's canonical text covers (message matching only)."""
    trie: Any = field(default=None, compare=False, repr=False)
    """Where the request's messages left the message trie (opaque; lets ``add`` insert from there)."""


class _Pos:
    """A message-trie position: the messages from the root of one tool list's trie to here."""

    __slots__ = ("depth", "message", "edges", "ends")

    def __init__(self, depth: int, message: Any) -> None:
        self.depth = depth
        self.message = message
        self.edges: dict[Any, _Pos] = {}
        self.ends: list[tuple[int, int | None, int]] = []
        """(node id, parent id, segment length) of the nodes whose canonical text ends here."""


@dataclass(frozen=True)
class _TriePoint:
    tools_key: str
    pos: _Pos


@dataclass
class _Entry:
    parent: int | None
    segment: str | None
    tail: str
    children: list[int] = field(default_factory=list)
    chars: int = 0
    """Length of the canonical text from the root through this node."""
    messages: int = 0
    """Messages that canonical text covers (0: not in the message trie)."""


Equivalent = Callable[[Sequence[Any], int, Any], bool]
"""``equivalent(messages, i, stored)``: does ``stored`` render like ``messages[i]`` after ``messages[:i]``?"""

MAX_EQUIVALENCE_CHECKS = 8
"""Differing messages compared by rendering at one trie position, at most."""


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
        self._tries: dict[str, _Pos] = {}
        self.aliases = 0
        """Alias edges added (messages recognised as rendering like a stored one)."""

    def __len__(self) -> int:
        return len(self._entries)

    def add(
        self,
        node_id: int,
        parent: int | None,
        segment: str | None,
        tail: str,
        *,
        messages: Sequence[Any] | None = None,
        tools_key: str = "",
        start: Match | None = None,
    ) -> None:
        """Register a node. ``segment=None`` makes it a node no request can continue (a leaf for
        good) -- used when the template's rendering of its answer does not extend its prompt.

        ``messages``: the messages ``segment`` ends with the rendering of (the request's, then the
        answer), under ``tools_key``; with them the node is also found by :meth:`match_messages`.
        ``start``: the request's match, to insert from where its walk left the trie."""
        if node_id in self._entries:
            raise ValueError(f"node {node_id} indexed twice")
        if parent is not None and parent not in self._entries:
            raise ValueError(f"node {node_id}: unknown parent {parent}")
        base = self._entries[parent].chars if parent is not None else 0
        entry = _Entry(parent, segment, tail, chars=base + len(segment or ""))
        self._entries[node_id] = entry
        (self._entries[parent].children if parent is not None else self._roots).append(node_id)
        if messages is None or not segment:
            return
        if parent is not None and self._entries[parent].messages >= len(messages):
            return  # cannot end deeper than its parent: leave it to the text walk
        point = start.trie if start is not None else None
        if isinstance(point, _TriePoint) and point.tools_key == tools_key and point.pos.depth <= len(messages):
            pos = point.pos
        else:
            pos = self._tries.setdefault(tools_key, _Pos(0, None))
        try:
            for i in range(pos.depth, len(messages)):
                m = messages[i]
                nxt = pos.edges.get(m)
                if nxt is None:
                    nxt = pos.edges[m] = _Pos(i + 1, m)
                pos = nxt
        except TypeError:  # an unhashable message: this node is found by the text walk only
            return
        pos.ends.append((node_id, parent, len(segment)))
        entry.messages = len(messages)

    def segment(self, node_id: int) -> str | None:
        return self._entries[node_id].segment

    def path_text(self, node_id: int | None) -> str:
        """The canonical text from the root through ``node_id`` (O(context); for checks)."""
        parts: list[str] = []
        while node_id is not None:
            e = self._entries[node_id]
            parts.append(e.segment or "")
            node_id = e.parent
        return "".join(reversed(parts))

    def match_messages(
        self, tools_key: str, messages: Sequence[Any], equivalent: Equivalent | None = None
    ) -> Match:
        """The node the text walk would find for ``messages`` rendered under ``tools_key``,
        found message by message (see module docstring). ``matched_chars`` is the length of the
        matched node's canonical text, ``matched_messages`` how many messages it covers."""
        pos = self._tries.setdefault(tools_key, _Pos(0, None))
        ends: list[_Pos] = []
        try:
            for i, m in enumerate(messages):
                nxt = pos.edges.get(m)
                if nxt is None and equivalent is not None and pos.edges:
                    nxt = self._equivalent_edge(pos, messages, i, equivalent)
                if nxt is None:
                    break
                pos = nxt
                if pos.ends:
                    ends.append(pos)
        except TypeError:  # an unhashable message
            pass
        node = self._greedy(ends)
        if node is None:
            return Match(None, 0, "", 0, _TriePoint(tools_key, pos))
        e = self._entries[node]
        return Match(node, e.chars, e.tail, e.messages, _TriePoint(tools_key, pos))

    def _equivalent_edge(self, pos: _Pos, messages: Sequence[Any], i: int, equivalent: Equivalent) -> _Pos | None:
        m = messages[i]
        role = getattr(m, "role", None)
        seen: set[int] = set()
        checks = 0
        for child in pos.edges.values():
            if id(child) in seen or getattr(child.message, "role", None) != role:
                continue
            seen.add(id(child))
            checks += 1
            if checks > MAX_EQUIVALENCE_CHECKS:
                break
            if equivalent(messages, i, child.message):
                pos.edges[m] = child
                self.aliases += 1
                return child
        return None

    def _greedy(self, ends: list[_Pos]) -> int | None:
        """The text walk's choice among the nodes that end on the request's path: from the root,
        repeatedly the deepest child (the longest segment; the first added on a tie)."""
        if not ends:
            return None
        # fast path, a linear conversation: one node per end, each the child of the one before
        node: int | None = None
        for p in ends:
            if len(p.ends) != 1 or p.ends[0][1] != node:
                break
            node = p.ends[0][0]
        else:
            return node
        best: dict[int | None, tuple[int, int]] = {}
        for p in ends:  # in increasing depth
            for n, parent, seg_len in p.ends:
                have = best.get(parent)
                if have is None or seg_len > have[0]:
                    best[parent] = (seg_len, n)
        node = None
        while True:
            nxt = best.get(node)
            if nxt is None:
                return node
            node = nxt[1]

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

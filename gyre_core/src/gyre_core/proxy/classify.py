"""Role classes of trajectory-tree leaves, as Claude Code marks them.

Selection draws trajectories class by class -- main agent task-driving, main agent summary,
sub-agent task-driving, sub-agent summary -- so every leaf needs a class. Harnesses mark
sub-agents and summaries differently; this module knows Claude Code's marks (observed with
2.1.197, ``notes/claude-code-harness.md``) and is the default classifier other harness plugins
can override:

* **Sub-agent**: Claude Code sends ``x-claude-code-agent-id`` (and, when nested,
  ``x-claude-code-parent-agent-id``) on every call a sub-agent makes; the main agent's calls carry
  neither. Sub-agents run in their own conversation, so their calls form a separate root path.
  The header is the harness's claim, and the harness runs the policy's code: Gyre honours it only
  off the execution's first conversation (:data:`ON_MAIN_PATH_KEY`), which is the main agent's by
  construction.
* **Summary**: compaction re-sends the history with an instruction appended to the last user
  message asking for a text-only answer inside ``<summary>`` tags; the answer is the summary and
  the conversation restarts from it (a new branch). A leaf whose last call was such a request is
  a summary trajectory.

The hook only sees a leaf's metadata, not its text, so the facts come from what the proxy core
records with each node: the request's headers and ``agent_id``/``parent_agent_id``, and the tail
of the last user turn (``last_user_text``); :func:`request_role_metadata` computes an explicit
``summary_request`` flag for recorders that prefer it. :class:`DefaultRoleClassifier` reads them
back; it is registered ``trylast`` so that any harness plugin that recognises its own leaves
answers first, and it always answers (selection needs a class for every leaf): without marks a
leaf is main-agent task-driving, the class the reward is about.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pluggy

from gyre_core.hookspecs import hookimpl
from gyre_core.interfaces import RoleClass, TrajectoryLeaf
from gyre_core.proxy.types import ChatMessage, ChatRequest

__all__ = [
    "AGENT_ID_HEADER",
    "DEFAULT_CLASSIFIER",
    "PARENT_AGENT_ID_HEADER",
    "DefaultRoleClassifier",
    "classify_metadata",
    "is_summary_request",
    "is_summary_text",
    "register_default_classifier",
    "request_role_metadata",
]

AGENT_ID_HEADER = "x-claude-code-agent-id"
PARENT_AGENT_ID_HEADER = "x-claude-code-parent-agent-id"

# Metadata keys written by request_role_metadata (and read back by the classifier).
AGENT_ID_KEY = "agent_id"
PARENT_AGENT_ID_KEY = "parent_agent_id"
SUMMARY_KEY = "summary_request"
LAST_USER_TEXT_KEY = "last_user_text"
ROLE_CLASS_KEY = "role_class"
"""A plugin that knows a leaf's role can state it outright (a :class:`RoleClass` name or value);
nothing a harness sends reaches this key."""
ON_MAIN_PATH_KEY = "gyre_on_main_path"
"""Set by Gyre, never by a request: whether the leaf descends from the execution's first
conversation (the one its task prompt started), i.e. is the main agent's by construction."""

# Phrases of Claude Code's compaction instruction (2.1.197). Two independent marks must both be
# present, so a user who merely mentions a summary is not mistaken for a compaction request.
_SUMMARY_TAG = "<summary>"
_SUMMARY_PHRASES = (
    "create a detailed summary of the conversation",
    "summary of the conversation so far",
    "respond with text only",
    "respond with plain text only",
    "do not call any tools",
)


def is_summary_text(text: str) -> bool:
    """Whether a user turn's text (or its tail: the instruction repeats its marks at the end) asks
    for a compaction summary."""
    low = text.lower()
    return _SUMMARY_TAG in low and any(p in low for p in _SUMMARY_PHRASES)


def is_summary_request(messages: Sequence[ChatMessage]) -> bool:
    """Whether the last user turn carries a compaction instruction (text-only ``<summary>`` answer).

    Only the trailing user-side messages are inspected (a tool result and the instruction can
    share Claude Code's last user message, which the Anthropic face splits into ``tool`` and
    ``user`` messages): an old summary further back in the history does not make every later
    call a summary request.
    """
    for msg in reversed(messages):
        if msg.role == "assistant":
            return False
        if msg.role != "user":
            continue
        if is_summary_text(msg.content):
            return True
    return False


def request_role_metadata(request: ChatRequest) -> dict[str, Any]:
    """What classification needs to know about one call, for the proxy to store in its node."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    out: dict[str, Any] = {SUMMARY_KEY: is_summary_request(request.messages)}
    if headers.get(AGENT_ID_HEADER):
        out[AGENT_ID_KEY] = headers[AGENT_ID_HEADER]
    if headers.get(PARENT_AGENT_ID_HEADER):
        out[PARENT_AGENT_ID_KEY] = headers[PARENT_AGENT_ID_HEADER]
    return out


def on_main_path(tree: Any, leaf_id: int) -> bool:
    """Whether ``leaf_id`` descends from the first root of ``tree`` (a
    :class:`~gyre_core.trajectory.TrajectoryTree`): the conversation the execution's first call
    started."""
    first = next(iter(tree), None)
    return first is not None and tree.path(leaf_id)[0].node_id == first.node_id


def _explicit(value: Any) -> RoleClass | None:
    if isinstance(value, RoleClass):
        return value
    if isinstance(value, str) and value.upper() in RoleClass.__members__:
        return RoleClass[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return RoleClass(value)
        except ValueError:
            return None
    return None


def classify_metadata(metadata: Mapping[str, Any]) -> RoleClass:
    """The role class of a leaf from its recorded metadata (see module doc); never fails."""
    explicit = _explicit(metadata.get(ROLE_CLASS_KEY))
    if explicit is not None:
        return explicit
    headers = metadata.get("headers")
    headers = {str(k).lower(): v for k, v in headers.items()} if isinstance(headers, Mapping) else {}
    claimed = bool(
        metadata.get(AGENT_ID_KEY)
        or metadata.get(PARENT_AGENT_ID_KEY)
        or headers.get(AGENT_ID_HEADER)
        or headers.get(PARENT_AGENT_ID_HEADER)
    )
    # a harness's agent-id header is a claim: the calls that continue the execution's first
    # conversation are the main agent's whatever they claim (a policy cannot move its own task
    # trajectories into another class); only a conversation of its own can be a sub-agent's
    sub_agent = claimed and metadata.get(ON_MAIN_PATH_KEY) is not True
    flag = metadata.get(SUMMARY_KEY)
    if isinstance(flag, bool):
        summary = flag
    else:  # the proxy core records the tail of the last user turn's text
        last = metadata.get(LAST_USER_TEXT_KEY)
        summary = isinstance(last, str) and is_summary_text(last)
    if sub_agent:
        return RoleClass.SUB_AGENT_SUMMARY if summary else RoleClass.SUB_AGENT_TASK
    return RoleClass.MAIN_AGENT_SUMMARY if summary else RoleClass.MAIN_AGENT_TASK


class DefaultRoleClassifier:
    """The default ``gyre_classify_role`` implementation: Claude Code's marks, else main-agent task."""

    @hookimpl
    def gyre_plugin_info(self) -> dict[str, Any]:
        return {"name": "claude-code-roles", "version": "1", "seams": ["classification"]}

    @hookimpl(trylast=True)
    def gyre_classify_role(self, leaf: TrajectoryLeaf) -> RoleClass | None:
        return classify_metadata(leaf.metadata)


DEFAULT_PLUGIN_NAME = "gyre-default-classifier"
DEFAULT_CLASSIFIER = DefaultRoleClassifier()
"""Module-level instance, so an entry point (``gyre_core.proxy.classify:DEFAULT_CLASSIFIER``) can
register it."""


def register_default_classifier(pm: pluggy.PluginManager) -> DefaultRoleClassifier:
    """Register the default classifier on ``pm`` once (idempotent); returns the registered one."""
    existing = pm.get_plugin(DEFAULT_PLUGIN_NAME)
    if existing is not None:
        return existing
    if pm.is_registered(DEFAULT_CLASSIFIER):  # e.g. already loaded through an entry point
        return DEFAULT_CLASSIFIER
    pm.register(DEFAULT_CLASSIFIER, name=DEFAULT_PLUGIN_NAME)
    return DEFAULT_CLASSIFIER

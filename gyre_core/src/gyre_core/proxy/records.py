"""Per-execution records: the TITO record of every model call, and the trajectory tree they form.

One :class:`ExecutionRecords` per execution holds everything the proxy learned from it: the tree
(token segments with provenance and behaviour log-probs), the text index that lets the next call
reuse stored tokens, the tool-call payload cache, and one :class:`CallRecord` per call. A call's
input ids are not copied into its record: they are the tree path to the node's parent plus the
node's own input segment, so a long context is stored once however many calls share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from gyre_core.proxy.context_index import ContextIndex, Match
from gyre_core.proxy.payloads import ToolPayloadCache
from gyre_core.trajectory import Provenance, TrajectoryTree, TreeNode

__all__ = ["CallRecord", "ExecutionRecords", "json_logprobs"]


@dataclass(frozen=True)
class CallRecord:
    """The TITO record of one model call: exact tokens plus where they came from."""

    call_id: str
    execution_id: int
    node_id: int
    parent_id: int | None
    input_len: int
    """Total prompt length fed to the engine (reused path tokens + new input tokens)."""
    new_input_ids: tuple[int, ...]
    """The input tokens this call encoded (everything before them was reused from the tree)."""
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """As the engine returned them; for constrained output these are *not* behaviour log-probs."""
    output_provenance: Provenance
    """``SAMPLED`` when the tokens are trainable; ``EXTERNAL`` when they were forced (constrained
    decoding) and so must never be targets."""
    finish_reason: str
    engine: str
    weight_version: str
    policy_version: int | None
    agent_id: str | None
    api: str
    model: str
    constrained: bool
    attempts: int
    """Engine calls made (1 + invisible retries after an engine abort or disappearance)."""
    started_at: float
    finished_at: float
    engine_s: float
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self, input_ids: Sequence[int] | None = None) -> dict[str, Any]:
        out = {
            "call_id": self.call_id,
            "execution_id": self.execution_id,
            "node_id": self.node_id,
            "parent_id": self.parent_id,
            "input_len": self.input_len,
            "new_input_ids": list(self.new_input_ids),
            "output_ids": list(self.output_ids),
            "logprobs": json_logprobs(self.logprobs),
            "output_provenance": self.output_provenance.name,
            "finish_reason": self.finish_reason,
            "engine": self.engine,
            "weight_version": self.weight_version,
            "policy_version": self.policy_version,
            "agent_id": self.agent_id,
            "api": self.api,
            "model": self.model,
            "constrained": self.constrained,
            "attempts": self.attempts,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "engine_s": self.engine_s,
            "metadata": dict(self.metadata),
        }
        if input_ids is not None:
            out["input_ids"] = list(input_ids)
        return out


class ExecutionRecords:
    """Everything recorded for one execution. Mutated only by the proxy service."""

    def __init__(self, execution_id: int) -> None:
        self.execution_id = execution_id
        self.tree = TrajectoryTree(execution_id)
        self.index = ContextIndex()
        self.payloads = ToolPayloadCache()
        self.calls: list[CallRecord] = []
        self._next_node = 0
        self._path_cache: tuple[int, list[int]] | None = None

    def path_ids(self, node_id: int | None) -> list[int]:
        """Token ids from the root down to ``node_id`` inclusive ([] for the root)."""
        if node_id is None:
            return []
        cached = self._path_cache
        if cached is not None and cached[0] == node_id:
            return list(cached[1])
        ids: list[int] = []
        for node in self.tree.path(node_id):
            ids.extend(node.token_ids.tolist())
        return ids

    def input_ids(self, record: CallRecord) -> list[int]:
        """The exact prompt of a recorded call, rebuilt from the tree."""
        return self.path_ids(record.parent_id) + list(record.new_input_ids)

    def add_call(
        self,
        *,
        parent: int | None,
        new_input_ids: Sequence[int],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        output_provenance: Provenance,
        segment: str | None,
        tail: str,
        node_metadata: Mapping[str, Any],
        make_record: Any,
        messages: Sequence[Any] | None = None,
        tools_key: str = "",
        match: Match | None = None,
        temperature: float = 1.0,
    ) -> CallRecord | None:
        """Append one call's node (input segment + output) and its record; None if it added no token.

        ``messages`` (the request's, payloads restored, then the answer), ``tools_key`` and the
        request's ``match`` put the node into the index's message trie (``context_index``)."""
        if not new_input_ids and not output_ids:
            return None
        node_id = self._next_node
        n_in, n_out = len(new_input_ids), len(output_ids)
        prov = torch.empty(n_in + n_out, dtype=torch.int8)
        prov[:n_in] = int(Provenance.EXTERNAL)
        prov[n_in:] = int(output_provenance)
        lp = torch.zeros(n_in + n_out, dtype=torch.float32)
        if output_provenance is Provenance.SAMPLED and n_out:
            lp[n_in:] = torch.tensor([min(x, 0.0) for x in logprobs], dtype=torch.float32)
        tokens = torch.tensor(list(new_input_ids) + list(output_ids), dtype=torch.int64)
        node = TreeNode(node_id, parent, tokens, prov, lp, dict(node_metadata), temperature)
        self.tree.add(node)
        self.index.add(node_id, parent, segment, tail, messages=messages, tools_key=tools_key, start=match)
        self._next_node += 1
        record: CallRecord = make_record(node_id)
        self.calls.append(record)
        # the next call of a linear conversation asks for exactly this path: keep it
        base = self.path_ids(parent) if self._path_cache is None or self._path_cache[0] != parent else self._path_cache[1]
        self._path_cache = (node_id, base + tokens.tolist())
        return record

    def tree_json(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "leaves": self.tree.leaves(),
            "nodes": [
                {
                    "node_id": n.node_id,
                    "parent": n.parent,
                    "token_ids": n.token_ids.tolist(),
                    "provenance": n.provenance.tolist(),
                    "logprobs": json_logprobs(n.logprobs.tolist()),
                    "metadata": dict(n.metadata),
                }
                for n in self.tree
            ],
        }


def json_logprobs(values: Sequence[float]) -> list[float | None]:
    """Log-probs for a JSON answer: a NaN or infinite one (an engine's numerical failure, kept in
    the record as returned) becomes ``null``, since JSON has no such numbers."""
    return [float(v) if math.isfinite(v) else None for v in values]


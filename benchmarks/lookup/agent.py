"""The ``lookup`` task's harness (``harness.kind = "command"``): two model calls through Gyre's proxy.

Turn 1 sends the task's prompt; the first table entry the reply names is looked up in
``table.json`` (in the workspace; the model never sees the table). Turn 2 sends the tool's
result (``lookup <name> = <code>``, or ``lookup: no such entry``) as the next user message; its
reply is the answer, written to ``answer.txt`` for the task's reward (:mod:`reward`). Exit 0 when
both calls ran, whatever the answer.

    python benchmarks/lookup/agent.py "{task}"
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


def tool_result(reply: str, table: dict[str, int]) -> str:
    """What the lookup tool answers to the model's first reply."""
    for word in re.findall(r"[a-z]+", reply.lower()):
        if word in table and word != "lookup":
            return f"lookup {word} = {table[word]}"
    return "lookup: no such entry"


def main() -> None:
    from openai import OpenAI

    prompt = sys.argv[1]
    table = json.loads(Path("table.json").read_text())
    client = OpenAI(max_retries=0)
    model = os.environ["GYRE_MODEL"]
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model=model, max_tokens=16, messages=messages)
    reply = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(reply, table)}]
    second = client.chat.completions.create(model=model, max_tokens=8, messages=messages)
    Path("answer.txt").write_text(second.choices[0].message.content or "")


if __name__ == "__main__":
    main()

"""The ``lookup`` task's harness (``harness.kind = "command"``): two model calls through Gyre's proxy.

Turn 1 sends the task's prompt; the first table entry the reply names is looked up in
``table.json`` (in the workspace; the model never sees the table). Turn 2 sends the tool's
result (``lookup <name> = <code>``, or ``lookup: no such entry``) as the next user message; its
reply is the answer, written to ``answer.txt`` for the task's reward (:mod:`reward`). Exit 0 when
both calls ran, whatever the answer.

In a paced run (``harness.paced = true``) the tool takes the time the run gives the execution
(``GYRE_PACE_S``, a recorded agent execution's duration): the second call comes when that time is
up, so the run has the trace's long tail with this task's tokens and rewards.

    python benchmarks/lookup/agent.py "{task}"
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path


def tool_result(reply: str, table: dict[str, int]) -> str:
    """What the lookup tool answers to the model's first reply."""
    for word in re.findall(r"[a-z]+", reply.lower()):
        if word in table and word != "lookup":
            return f"lookup {word} = {table[word]}"
    return "lookup: no such entry"


def chat(messages: list[dict[str, str]], max_tokens: int) -> str:
    """One call of the proxy's OpenAI face (``/v1/chat/completions``), with the execution's key.
    The standard library, not the OpenAI SDK: importing the SDK costs ~0.4 s of CPU per process,
    and with it a step of 32 executions took 31 s on a 2-core machine, against 8 s without."""
    body = json.dumps({"model": os.environ["GYRE_MODEL"], "max_tokens": max_tokens, "messages": messages}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"] or ""


def main() -> None:
    start = time.monotonic()
    prompt = sys.argv[1]
    table = json.loads(Path("table.json").read_text())
    messages = [{"role": "user", "content": prompt}]
    reply = chat(messages, 16)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(reply, table)}]
    pace = float(os.environ.get("GYRE_PACE_S") or 0.0)
    time.sleep(max(0.0, pace - (time.monotonic() - start)))  # the tool's time (0 unless paced)
    Path("answer.txt").write_text(chat(messages, 8))


if __name__ == "__main__":
    main()

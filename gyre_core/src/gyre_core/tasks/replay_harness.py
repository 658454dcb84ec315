"""The ``replay`` harness: one recorded execution, replayed through the proxy as a real agent would.

    python -m gyre_core.tasks.replay_harness PROMPT --duration-s 14.2 --outcome completed [--calls 3]

It makes ``--calls`` model calls with the official OpenAI SDK, the context growing each time (the
policy's own replies fed back, then a tool result), and spends the time between them as tool time
so that the execution ends at ``--duration-s`` (the recorded duration, already scaled by the run's
``harness.time_scale``). How it ends is the recorded outcome:

- ``completed``: the last reply in ``reply.txt``, exit 0 -- the task's evaluator scores it (a
  replay that the engines slow past the run's harness timeout is killed and scored from its
  latest reply, as a real agent's workspace would be);
- ``failed``: an empty ``reply.txt`` and exit 1 -- a complete failure, which the evaluator scores 0;
- ``harness_timeout``: the last reply in ``reply.txt``, then it keeps working until the run's
  harness timeout kills it -- the workspace is assessed and scored, as for a real timeout;
- ``overall_timeout``: nothing written, then killed at the harness timeout -- nothing to assess,
  so the execution is discarded (never a zero).

The replies are the policy's own samples, so the run still trains on real tokens and rewards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

OUTCOMES = ("completed", "failed", "harness_timeout", "overall_timeout")
REPLY_FILE = "reply.txt"


def _write_reply(text: str) -> None:
    with open(REPLY_FILE + ".tmp", "w") as f:
        f.write(text)
    os.replace(REPLY_FILE + ".tmp", REPLY_FILE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument("--outcome", choices=OUTCOMES, required=True)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    start = time.monotonic()
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=float(os.environ.get("GYRE_CALL_TIMEOUT_S", "600")))
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    messages: list[dict[str, str]] = [{"role": "user", "content": a.prompt}]
    calls = max(1, a.calls)
    for i in range(calls):
        answer = client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        reply = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        if a.outcome in ("completed", "harness_timeout"):
            _write_reply(reply)  # the work so far: what a timeout's assessment finds, as with a real agent
        # tool time: the next call starts where the recording's pace puts it
        time.sleep(max(0.0, start + a.duration_s * (i + 1) / calls - time.monotonic()))
        if i + 1 < calls:
            messages.append({"role": "user", "content": f"Tool result {i + 1}: ok. Continue with the same request."})
    if a.outcome == "completed":
        return 0
    if a.outcome == "failed":
        _write_reply("")
        return 1
    while True:  # both timeouts: still working when the run's harness timeout ends it
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())

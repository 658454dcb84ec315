"""The ``replay`` harness: one recorded execution, replayed through the proxy as a real agent would.

    python -m gyre_core.tasks.replay_harness PROMPT --duration-s 14.2 --outcome completed [--calls 3]
        [--context-tokens 900 --tokens-per-word 2.1]

It makes ``--calls`` model calls with the official OpenAI SDK, the context growing each time (the
policy's own replies fed back, then a tool result), and spends the time between them as tool time
so that the execution ends at ``--duration-s`` (the recorded duration, already scaled by the run's
``harness.time_scale``). With ``--context-tokens`` the tool results carry output (a listing of the
kind a coding agent reads) sized so that the last call's context holds about that many tokens: an
agent's context is mostly what its tools returned, which the engines prefill once (cached prefixes)
but training reads in full, so this is what makes a replayed step cost what the recording's would.
The sizing starts from ``--tokens-per-word`` (the run measures it with its tokenizer) and corrects
itself from each reply's ``usage.prompt_tokens``. How it ends is the recorded outcome:

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


def tool_output(words: int, part: int) -> str:
    """``words`` words of a deterministic directory listing (tool part ``part``), as an agent's
    ``ls``/``grep`` would return; the run measures its tokens per word with the same function."""
    lines, n, i = [], 0, 0
    while n < words:
        k = part * 7919 + i
        line = f"src/pkg{k % 13}/mod{k % 97}.py:{k % 211 + 1}: def f{k % 89}(x): return x + {k % 101}"
        lines.append(line)
        n += len(line.split())
        i += 1
    return "\n".join(lines)


def tool_words(target: int, context: int, results_left: int, tokens_per_word: float) -> int:
    """Words for the next tool result: an equal share of the tokens still missing from the context
    target, over the tool results left (0 once the target is reached)."""
    if target <= 0 or results_left <= 0 or context >= target:
        return 0
    return int((target - context) / results_left / max(tokens_per_word, 0.05))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument("--outcome", choices=OUTCOMES, required=True)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=0, help="the last call's context, in tokens (0: short tool results)")
    ap.add_argument("--tokens-per-word", type=float, default=1.0, help="the tokenizer's tokens per tool-output word")
    a = ap.parse_args(argv)
    start = time.monotonic()
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=float(os.environ.get("GYRE_CALL_TIMEOUT_S", "600")))
    model = os.environ.get("GYRE_MODEL", "gyre-policy")
    messages: list[dict[str, str]] = [{"role": "user", "content": a.prompt}]
    calls = max(1, a.calls)
    rate, padded, before = a.tokens_per_word, 0, 0  # the last tool result's words and the context before it
    for i in range(calls):
        answer = client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        reply = answer.choices[0].message.content or ""
        usage = answer.usage
        context = (usage.prompt_tokens + usage.completion_tokens) if usage is not None else 0
        if padded and usage is not None and usage.prompt_tokens > before:  # what the last tool result cost
            rate = max(0.05, (usage.prompt_tokens - before) / padded)
        messages.append({"role": "assistant", "content": reply})
        if a.outcome in ("completed", "harness_timeout"):
            _write_reply(reply)  # the work so far: what a timeout's assessment finds, as with a real agent
        # tool time: the next call starts where the recording's pace puts it
        time.sleep(max(0.0, start + a.duration_s * (i + 1) / calls - time.monotonic()))
        if i + 1 < calls:
            # sized from the proxy's usage counts; without them the context is unknown: no padding
            padded = tool_words(a.context_tokens, context, calls - 1 - i, rate) if usage is not None else 0
            output = ("\n" + tool_output(padded, i)) if padded else ""
            before = context
            messages.append({"role": "user", "content": f"Tool result {i + 1}: ok.{output}\nContinue with the same request."})
    if a.outcome == "completed":
        return 0
    if a.outcome == "failed":
        _write_reply("")
        return 1
    while True:  # both timeouts: still working when the run's harness timeout ends it
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())

"""The ``number-guess`` harness: an agent loop that talks to Gyre's proxy with the official
OpenAI SDK, exactly as an external black-box harness would.

    python -m gyre_core.tasks.number_guess_harness --secret 42 [--turns 3] [--low 0 --high 99]

Reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (the execution's own key) and ``GYRE_MODEL`` from
the environment; writes ``answer.json`` in the current directory. Exit code 0 when the loop ran
to its end (whatever the score), non-zero when the proxy could not be used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the secret number; the answer is higher, lower or correct.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}
_INT = re.compile(r"-?\d+")


def _verdict(guess: int, secret: int) -> str:
    return "correct" if guess == secret else ("higher" if secret > guess else "lower")


def _guess_from_call(arguments: str) -> int | None:
    try:
        n = json.loads(arguments).get("number")
    except (ValueError, AttributeError):
        m = _INT.search(arguments)
        return int(m.group()) if m else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def play(client: Any, model: str, secret: int, low: int, high: int, turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent. Use the tools you are given."},
        {"role": "user", "content": (f"I am thinking of an integer between {low} and {high}. Find it with the "
                                     f"guess tool; after each guess I say higher, lower or correct. "
                                     f"You have {turns} guesses.")},
    ]
    guesses: list[int] = []
    for _ in range(turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[GUESS_TOOL])
        msg = reply.choices[0].message
        entry: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in msg.tool_calls]
        messages.append(entry)
        if msg.tool_calls:
            for call in msg.tool_calls:
                g = _guess_from_call(call.function.arguments) if call.function.name == "guess" else None
                if g is None:
                    answer = "error: guess needs an integer 'number'"
                else:
                    guesses.append(g)
                    answer = _verdict(g, secret)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        else:
            m = _INT.search(msg.content or "")
            if m is None:
                messages.append({"role": "user", "content": "Please guess a number."})
            else:
                guesses.append(int(m.group()))
                messages.append({"role": "user", "content": _verdict(guesses[-1], secret)})
        if guesses and guesses[-1] == secret:
            break
    return {"final_guess": guesses[-1] if guesses else None, "guesses": guesses, "turns": len(messages)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secret", type=int, default=None,
                    help="default: $GYRE_NUMBER_GUESS_SECRET (how Gyre passes it: never on argv)")
    ap.add_argument("--low", type=int, default=0)
    ap.add_argument("--high", type=int, default=99)
    ap.add_argument("--turns", type=int, default=3)
    a = ap.parse_args(argv)
    if a.secret is None:
        a.secret = int(os.environ["GYRE_NUMBER_GUESS_SECRET"])
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=float(os.environ.get("GYRE_CALL_TIMEOUT_S", "600")))
    result = play(client, os.environ.get("GYRE_MODEL", "gyre-policy"), a.secret, a.low, a.high, a.turns)
    with open("answer.json.tmp", "w") as f:
        json.dump(result, f)
    os.replace("answer.json.tmp", "answer.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

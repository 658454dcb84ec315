"""The ``reply`` harness: one chat call with the task's prompt, the reply written to ``reply.txt``.

The smallest black-box agent: it talks to Gyre's proxy over HTTP with the official OpenAI SDK,
like any harness, and leaves its artifact in the working directory for the task's evaluator.
Exits 0 when it wrote the reply; any failure (the proxy unreachable, a crash) exits non-zero
without a ``reply.txt``, which the evaluator reports as unresolved, never as a zero.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    a = ap.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(max_retries=2, timeout=float(os.environ.get("GYRE_CALL_TIMEOUT_S", "600")))
    reply = client.chat.completions.create(model=os.environ.get("GYRE_MODEL", "gyre-policy"),
                                           messages=[{"role": "user", "content": a.prompt}])
    with open("reply.txt.tmp", "w") as f:
        f.write(reply.choices[0].message.content or "")
    os.replace("reply.txt.tmp", "reply.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

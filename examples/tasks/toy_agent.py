"""A minimal coding agent for the example tasks (``harness.kind = "command"``).

It reads the repository in its working directory, asks the policy (through Gyre's proxy, with the
OpenAI SDK: the base URL and key come from the environment) for the fixed module, and writes what
comes back. Replace it with your own agent, or use Claude Code (``claude-code.toml``).
"""

import re
import sys
from pathlib import Path

from openai import OpenAI

task = sys.argv[1]
files = {p.name: p.read_text() for p in sorted(Path(".").glob("*.py"))}
listing = "\n\n".join(f"### {name}\n```python\n{text}```" for name, text in files.items())
module = next(n for n in files if not n.startswith("test_"))
reply = OpenAI(max_retries=0).chat.completions.create(
    model=__import__("os").environ["GYRE_MODEL"], max_tokens=256,
    messages=[{"role": "user", "content": f"{task}\n\n{listing}\n\nAnswer with the whole fixed {module} "
                                          "in one ```python block."}],
)
text = reply.choices[0].message.content or ""
m = re.search(r"```python\n(.*?)```", text, re.DOTALL)
if m:
    Path(module).write_text(m.group(1))

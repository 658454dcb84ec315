"""KV hand-off in a live run: calls a role change cuts short, with the hand-off on and off.

Runs the embedded job (``gyre-orchestrate run``) once per setting of ``proxy.kv_handoff``, in its
own child process, with long answers (``--max-new-tokens``, so calls are still decoding when a
cell leaves rollout) and reports the summary's ``interrupted_calls``: calls cut short, continued
on the KV they handed off, re-prefilled (with reasons), generated again, prefill tokens saved and
bytes moved, plus the run's wall time. Whether a call is in flight at a role change depends on
timing, so the counts vary from run to run; the reasons say why a hand-off fell back.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _run(kv_handoff: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / ("on" if kv_handoff else "off")
    cmd = [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--json-summary",
           "--steps", str(args.steps), "--set", f"sampling.max_new_tokens={args.max_new_tokens}",
           "--set", f"proxy.kv_handoff={'true' if kv_handoff else 'false'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    switches = [w for w in s["role_switches"] if w["transition"] == "to_training"]
    return {**s["interrupted_calls"], "to_training_switches": len(switches),
            "hand_off_phase_s": [round(w["phases"].get("hand_off", 0.0), 3) for w in switches],
            "wall_s": s["wall_s"], "steps": s["steps"], "status": s["status"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=400)
    ap.add_argument("--settings", default="on,off", help="which runs: on, off or both (on,off)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-kvh-") as tmp:
        res = {w: _run(w == "on", args, Path(tmp)) for w in args.settings.split(",")}
    print(json.dumps({"steps": args.steps, "max_new_tokens": args.max_new_tokens, **res}))


if __name__ == "__main__":
    main()

"""Weight publication in a live run: Mooncake (the default) against disk files, same job.

Runs the embedded job (``gyre-orchestrate run``) once per transport, in its own child process,
with ``--steps`` steps (one publication per step, μ = 1), and reports from each run's summary the
per-publication times the orchestrator measured: ``export_s`` (core weights gathered and, for
Mooncake, copied into the registered buffer; for disk, written as safetensors) and ``load_s``
(every rollout engine pulled or read the version and switched to it), plus the bytes the run
left under ``<out>/weights`` and the run's wall time. Model size: ``--hidden`` / ``--layers``
(the tiny model by default; the absolute times on a 2-core CPU machine say little, the ratio and
the files written say more).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any


def _run(transport: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / transport
    cmd = [sys.executable, "-m", "gyre_core.cli", "run", "--out", str(out), "--json-summary",
           "--steps", str(args.steps), "--set", f'publication.transport="{transport}"',
           "--set", f"model.hidden_size={args.hidden}", "--set", f"model.num_layers={args.layers}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    pubs = s["publications"]
    files = [p for p in (out / "weights").rglob("*") if p.is_file()]
    return {"publications": len(pubs), "mean_export_s": round(mean(p["export_s"] for p in pubs), 4),
            "mean_load_s": round(mean(p["load_s"] for p in pubs), 4),
            "weight_dirs": sorted(d.name for d in (out / "weights").iterdir()),
            "weight_bytes_written": sum(p.stat().st_size for p in files), "wall_s": s["wall_s"], "steps": s["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-pub-") as tmp:
        res = {t: _run(t, args, Path(tmp)) for t in ("mooncake", "disk")}
    print(json.dumps({"steps": args.steps, "hidden": args.hidden, "layers": args.layers, **res}))


if __name__ == "__main__":
    main()

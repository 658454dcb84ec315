"""The example tasks' evaluator: run the task's own tests against what the agent left.

Run by Gyre in the execution's workspace, inside its sandbox (``[task] evaluator``). The tests are
written afresh from the task record (``GYRE_TASK_RECORD``), so an agent that edited or deleted
them gains nothing; then ``python3 -m unittest`` decides: exit 0 (all pass) is a reward of 1,
exit 1 (a failure or an error) is 0. Anything else (this script crashing) is unresolved. Bytecode
the agent left is removed first and none is written.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

record = json.loads(os.environ["GYRE_TASK_RECORD"])
for name, content in record["workspace"].items():
    if Path(name).name.startswith("test_"):
        Path(name).write_text(content)
# no bytecode from before: an agent could leave a .pyc the import would prefer to its source
shutil.rmtree("__pycache__", ignore_errors=True)
proc = subprocess.run([sys.executable, "-B", "-m", "unittest", "-q"], capture_output=True, text=True, timeout=60)
sys.exit(0 if proc.returncode == 0 else 1)

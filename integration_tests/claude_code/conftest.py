"""Fixtures of the Claude Code tests; they live in :mod:`cc_proxy` with the helpers the tests import."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cc_proxy import claude_cli, served_proxy  # noqa: E402,F401

"""The linter configured in pyproject.toml (``[tool.ruff]``: pyflakes, pycodestyle at the repository's line length,
import order) passes on the whole tree, so a change that breaks it fails the suite, not a later review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_passes_on_the_whole_tree():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

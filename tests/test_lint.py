"""The code passes ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade rules as
configured in pyproject.toml): unused imports, undefined names and likely bugs fail the build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

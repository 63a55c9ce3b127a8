"""The tree stays lint-clean under the project's ruff config (pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed (it is in the dev extras: pip install -e '.[dev]')")
    return [exe]


def test_ruff_check_passes_on_the_whole_tree():
    out = subprocess.run(
        [*_ruff(), "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr

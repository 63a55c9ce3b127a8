"""The distribution ships every module, and ``operator/`` never shadows the stdlib."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "engine": "kvship/engine",
    "prefill": "kvship/prefill",
    "decode": "kvship/decode",
    "router": "kvship/router",
    "operator": "kvship/operator",
    "common": "kvship/common",
    "app": "kvship/app",
}


def test_operator_folder_has_no_top_level_init():
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_stdlib_operator_and_json_import_from_repo_root():
    out = subprocess.run(
        [sys.executable, "-c", "import operator, json; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert str(ROOT / "operator") not in out.stdout


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "--help"], cwd="/", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for cmd in ("serve", "router", "local", "operator"):
        assert cmd in out.stdout


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wheels = list(tmp_path.glob("kvship-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    missing = []
    for folder, pkg in FOLDERS.items():
        for dirpath, dirnames, filenames in os.walk(ROOT / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py") or f.endswith(".yaml"):
                    rel = Path(dirpath, f).relative_to(ROOT / folder)
                    if f"{pkg}/{rel.as_posix()}" not in names:
                        missing.append(f"{folder}/{rel.as_posix()}")
    assert not missing, f"modules missing from the wheel: {missing}"
    assert "kvship/operator/__init__.py" not in names

"""Print kvship's requirements from pyproject.toml, one per line: the base list plus the named extras.

    python deps.py pyproject.toml gpu > requirements.txt

Standard library only: the worker image runs it before kvship's sources are copied, so the
dependency layer is rebuilt only when pyproject.toml changes.
"""

from __future__ import annotations

import sys

import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    out = list(project["dependencies"])
    for extra in extras:
        out += project["optional-dependencies"][extra]
    return out


if __name__ == "__main__":
    sys.stdout.write("".join(r + "\n" for r in requirements(sys.argv[1], sys.argv[2:])))

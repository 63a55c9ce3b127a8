"""Maps the top-level folders onto ``kvship.*`` subpackages.

Every folder under a root that holds a ``.py`` file becomes a package, so a
plain ``pip install .`` ships all of them (tests/test_packaging.py builds the
wheel and checks).  ``operator/`` has no ``__init__.py`` on purpose: see
docs/architecture.md — it must never shadow the standard library's ``operator``.
"""

import os

from setuptools import setup

ROOTS = {
    "engine": "kvship.engine",
    "prefill": "kvship.prefill",
    "decode": "kvship.decode",
    "router": "kvship.router",
    "operator": "kvship.operator",
    "common": "kvship.common",
    "app": "kvship.app",
}


def _packages() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for folder, name in ROOTS.items():
        base = os.path.join(here, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            if any(f.endswith(".py") for f in filenames) or dirpath == base:
                rel = os.path.relpath(dirpath, base)
                found.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return sorted(found)


setup(
    packages=_packages(),
    package_dir={name: folder for folder, name in ROOTS.items()},
    package_data={"kvship.operator": ["*.yaml", "**/*.yaml"], "kvship.engine.layers.moe": ["configs/*.json"]},
    include_package_data=True,
)

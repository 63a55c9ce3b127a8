"""Run a built image's entrypoint without a container runtime: ``podman image mount`` + ``chroot``.

    python3 images/run_chroot.py [-v HOST:PATH[:ro]]... [-e KEY=VALUE]... [--entrypoint PROG] IMAGE [ARG...]

Where ``podman run`` is refused (no rlimits for crun on these machines: docs/operator.md, "Images") this
runs the image the way a pod would: its Env, User, WorkingDir and Entrypoint from ``podman image inspect``,
the ARGs in place of its Cmd (as with ``docker run IMAGE ARG...``), on the host network, with the image's
files read-only and fresh tmpfs mounts on /tmp, /dev/shm and /cache (when the image has it), the writable
volumes the operator gives its pods. The mounts live in a private mount namespace (``unshare --mount``) and
disappear with the process; this process becomes the entrypoint (exec), so its pid is the server's. The
image itself stays mounted (podman counts mounts): ``podman image unmount --force IMAGE`` when done.
Standard library only; needs root, podman and util-linux's ``unshare``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

WRITABLE = ("/tmp", "/dev/shm", "/cache")


def inspect(image: str) -> dict:
    out = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run_chroot: no image {image!r}: {out.stderr.strip()}")
    return json.loads(out.stdout)[0]


def mount_image(image: str) -> str:
    out = subprocess.run(["podman", "image", "mount", image], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"run_chroot: podman image mount {image}: {out.stderr.strip()}")
    return out.stdout.strip()


def script(root: str, config: dict, binds: list[tuple[str, str, bool]], env: dict[str, str], argv: list[str]) -> str:
    """The shell program run in the new mount namespace: mounts, then exec chroot."""
    q = shlex.quote
    lines = ["set -e", f"R={q(root)}"]
    # a writable layer over the read-only image mount would hide nothing the image needs, but kubelet's pods see
    # the image read-only too (readOnlyRootFilesystem): keep it that way, with the same writable volumes
    lines.append('mount --rbind /dev "$R/dev"')
    lines.append('mount -t proc proc "$R/proc"')
    for path in WRITABLE:
        # mount points of the image only: a tmpfs cannot be mounted on a folder the image lacks (read-only root)
        lines.append(f'if [ -d "$R{path}" ]; then mount -t tmpfs -o mode=1777 tmpfs "$R{path}"; fi')
    lines.append(
        'if [ -f /etc/resolv.conf ] && [ -f "$R/etc/resolv.conf" ]; then mount --bind /etc/resolv.conf "$R/etc/resolv.conf"; fi'
    )
    for host, path, ro in binds:
        # under a tmpfs above (e.g. /tmp/x) the mount point can be made; elsewhere the read-only image must have it
        missing = f"run_chroot: {path}: no such folder in the image, whose root is read-only (use one under /tmp)"
        lines.append(
            f'[ -e "$R"{q(path)} ] || mkdir -p "$R"{q(path)} 2>/dev/null || {{ echo {q(missing)} >&2; exit 1; }}'
        )
        lines.append(f'mount --bind {q(host)} "$R"{q(path)}')
        if ro:
            lines.append(f'mount -o remount,bind,ro "$R"{q(path)}')
    user = config.get("User") or "0:0"
    if ":" not in user:
        user += ":" + user
    workdir = config.get("WorkingDir") or "/"
    envs = [f"{k}={v}" for k, v in env.items()]
    cmd = ["chroot", f"--userspec={user}", "--groups=", root, "/usr/bin/env", "-i", f"--chdir={workdir}", *envs, *argv]
    lines.append("exec " + " ".join(q(c) for c in cmd))
    return "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "-v",
        "--volume",
        action="append",
        default=[],
        help="HOST:PATH[:ro] bind mount (PATH in the image, or under /tmp)",
    )
    ap.add_argument("-e", "--env", action="append", default=[], help="KEY=VALUE added to the image's Env")
    ap.add_argument(
        "--entrypoint", help="run PROG instead of the image's Entrypoint (then ARGs are its only arguments)"
    )
    ap.add_argument("--print", action="store_true", help="print the namespace's shell program instead of running it")
    ap.add_argument("image")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="replace the image's Cmd")
    ns = ap.parse_args(args)
    if os.geteuid() != 0:
        raise SystemExit("run_chroot: needs root (mount, chroot)")
    for tool in ("podman", "unshare", "chroot"):
        if shutil.which(tool) is None:
            raise SystemExit(f"run_chroot: {tool} not found")
    binds = []
    for item in ns.volume:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/") or parts[2:] not in ([], ["ro"]):
            raise SystemExit(f"run_chroot: -v wants HOST:/PATH[:ro], not {item!r}")
        if not os.path.exists(parts[0]):
            raise SystemExit(f"run_chroot: -v {item}: {parts[0]} does not exist")
        binds.append((os.path.abspath(parts[0]), parts[1], parts[2:] == ["ro"]))
    extra_env = {}
    for item in ns.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"run_chroot: -e wants KEY=VALUE, not {item!r}")
        extra_env[key] = value
    config = inspect(ns.image).get("Config") or {}
    env = {**dict(e.split("=", 1) for e in config.get("Env") or []), **extra_env}
    if ns.entrypoint is not None:
        argv = [ns.entrypoint, *ns.args]
    else:
        argv = list(config.get("Entrypoint") or []) + (list(ns.args) if ns.args else list(config.get("Cmd") or []))
    if not argv:
        raise SystemExit(f"run_chroot: {ns.image} has neither Entrypoint nor Cmd and no ARG was given")
    root = mount_image(ns.image)
    program = script(root, config, binds, env, argv)
    if ns.print:
        print(program)
        return
    sys.stdout.flush()
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", program])


if __name__ == "__main__":
    main()

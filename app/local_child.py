"""One child process of ``kvship local`` (a worker node or the router): started in its own session with its log
file, health-checked over HTTP, signalled as a process group, and SIGTERMed by Linux if ``kvship local`` dies;
``WorkerNodes``: the node processes of one worker (one, or one per node of a multi-node worker)."""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional


def _parent_death_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM this child when its parent dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


class Child:
    """One child process (a worker or the router) with its log file.

    ``env`` is added to this process's environment (API keys travel there, not
    on the command line); ``health_key`` is sent as a Bearer token on health checks.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        url: str,
        log_path: str,
        health_path: str,
        env: Optional[dict[str, str]] = None,
        health_key: Optional[str] = None,
    ):
        self.name = name
        self.argv = argv
        self.url = url
        self.log_path = log_path
        self.health_path = health_path
        self.env = env or {}
        self.health_key = health_key
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self.port_retries = 0
        self._log_start = 0  # the log's size when the current process started

    def start(self) -> None:
        with contextlib.suppress(OSError):
            self._log_start = os.path.getsize(self.log_path)
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvship.app.cli", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_parent_death_signal if sys.platform.startswith("linux") else None,
            )

    def exited(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        req = urllib.request.Request(self.url + self.health_path)
        if self.health_key:
            req.add_header("Authorization", f"Bearer {self.health_key}")
        try:
            with urllib.request.urlopen(req, timeout=2.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            # no listener yet, or another one on the port (a data-plane socket that took it first answers
            # with its own framing): not healthy; a child that lost its port exits and is retried elsewhere
            return False

    def log_since_start(self) -> str:
        """What the current process wrote to the log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class ChildFailed(RuntimeError):
    """A child exited or did not become healthy in time."""


class WorkerNodes:
    """The node processes of one worker of ``kvship local``.

    A worker spanning ``--nnodes`` N runs as N ``kvship serve`` process trees on this machine, each in its own
    session, as N hosts would: node 0 (``head``: HTTP, tokenizer, the URL the router knows) and nodes 1..N-1
    (launchers of their ranks that answer ``/health``; docs/parallel.md, "Several nodes").  At N = 1 it is
    the one worker process.  Every node's argv carries ``--nnodes N --node-rank r --dist-init-addr
    127.0.0.1:P``; ``new_rendezvous()`` gives them all a fresh P (before a restart: the old store's port may
    still be held).  The worker is down as soon as one node exited (the others then exit by themselves: their
    collectives fail); it is started again only as a whole.
    """

    def __init__(self, name: str, nodes: list[Child]):
        if not nodes:
            raise ValueError(f"worker {name} has no node")
        self.name = name
        self.nodes = nodes

    @property
    def head(self) -> Child:
        return self.nodes[0]

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    def new_rendezvous(self, port: int) -> None:
        """Point every node's ``--dist-init-addr`` at 127.0.0.1:``port`` (no-op for a one-node worker)."""
        for c in self.nodes:
            for i, arg in enumerate(c.argv[:-1]):
                if arg == "--dist-init-addr":
                    c.argv[i + 1] = f"127.0.0.1:{port}"

    def down(self) -> bool:
        """True once any node exited (or was never started)."""
        return any(c.proc is None or c.proc.poll() is not None for c in self.nodes)

    def alive(self) -> list[Child]:
        return [c for c in self.nodes if c.proc is not None and c.proc.poll() is None]

    def start(self) -> None:
        for c in self.nodes:
            c.start()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the nodes still running, SIGKILL those that outlive ``grace_s``; wait for all of them."""
        live = self.alive()
        for c in live:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in live:
            assert c.proc is not None
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(10)

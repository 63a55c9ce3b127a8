"""Start real ``kvship`` processes on loopback for tests (importable helper, not a test module).

Usage::

    from server_fixtures import start_server

    with start_server(["--model-path", tiny_llama_dir]) as srv:
        httpx.get(srv.url + "/health")

API:

* ``free_port() -> int``: a TCP port that was free a moment ago (bind to 0).
* ``start_kvship(subcommand, args, *, timeout=180, env=None, health_path="/health", port=None,
  keep_log=False)``:
  context manager running ``python -m kvship.app.cli <subcommand> <args>
  --host 127.0.0.1 --port <free port>`` (``--host`` / ``--port`` are added
  only when ``args`` lacks them), waiting until ``GET <health_path>`` answers
  200, and yielding a ``ServerHandle``.  On exit (also on errors) the
  process group gets SIGTERM, then SIGKILL after 10 s: nothing is left
  running.  If the process exits or the timeout passes before it is healthy,
  ``ServerStartError`` carries the tail of its log.
* ``start_server(args, **kw)``: ``start_kvship("serve", args, **kw)`` (a worker).
* ``ServerHandle``: ``url`` (``http://127.0.0.1:<port>``), ``port``, ``proc``
  (``subprocess.Popen``), ``log_path``, ``log_tail(n)``, ``alive()``,
  ``get(path, **kw)`` / ``post(path, json=..., **kw)`` (``httpx`` calls
  against ``url``, 60 s timeout by default), ``stop()``.

The process's stdout and stderr go to ``log_path`` (a temporary file), never
to a pipe that could fill up.  The log is deleted when the ``with`` block
ends cleanly and kept (for post-mortems) when it raised, or with
``keep_log=True``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import httpx

from kvship.common.ports import free_port  # below the ephemeral range: no race with bind(0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerStartError(RuntimeError):
    """The process died or did not become healthy in time (message holds its log tail)."""


def run_ranks(target, world: int, args: tuple, timeout: float):
    """Spawn ``world`` processes ``target(rank, init_method, *args, queue)`` (a torch.distributed group's
    ranks); rank 0 puts ``("ok", payload)`` or ``("error", text)`` on the queue.  Returns the payload once
    every rank exited 0; kills any rank left alive."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, init, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, payload = q.get(timeout=timeout)
        assert status == "ok", payload
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return payload


def rank_body(rank: int, init_method: str, server_args, body, out) -> None:
    """One rank of a ``run_ranks`` group: join the group ``server_args`` describes (its tp/pp sizes), run
    ``body(groups)`` -> a picklable result, gather every rank's result on rank 0, which puts ``("ok", [results])``
    on ``out``; a failure puts ``("error", traceback)``.  Exits without the process group's teardown (it waits
    for the other ranks)."""
    import traceback

    import torch

    from kvship.engine.distributed.launch import join
    from kvship.engine.distributed.topology import Topology

    torch.set_num_threads(1)
    try:
        topo = Topology(tp_size=server_args.tp_size, pp_size=server_args.pp_size, rank=rank)
        groups = join(server_args, topo, init_method)
        everyone = groups.world.all_gather_object(body(groups))
        if rank == 0:
            out.put(("ok", everyone))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


@dataclass
class ServerHandle:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def get(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("timeout", 60.0)
        return httpx.get(self.url + path, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("timeout", 60.0)
        return httpx.post(self.url + path, **kw)

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process was started in its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


@contextlib.contextmanager
def start_kvship(
    subcommand: str,
    args: Sequence[str],
    *,
    timeout: float = 180.0,
    env: Optional[dict[str, str]] = None,
    health_path: str = "/health",
    port: Optional[int] = None,
    keep_log: bool = False,
) -> Iterator[ServerHandle]:
    """Run ``kvship <subcommand> <args>`` until healthy; always stop it on exit."""
    args = list(args)
    if not _has_flag(args, "--host"):
        args += ["--host", "127.0.0.1"]
    if _has_flag(args, "--port"):
        i = next(i for i, a in enumerate(args) if a == "--port" or a.startswith("--port="))
        port = int(args[i + 1] if args[i] == "--port" else args[i].split("=", 1)[1])
    else:
        port = port or free_port()
        args += ["--port", str(port)]
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.update(env or {})
    log = tempfile.NamedTemporaryFile(prefix=f"kvship-{subcommand}-{port}-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "kvship.app.cli", subcommand, *args]
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        cwd=ROOT,
        start_new_session=True,
    )
    log.close()
    handle = ServerHandle(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log.name)
    failed = True
    try:
        _wait_healthy(handle, health_path, timeout, cmd)
        yield handle
        failed = False
    finally:
        handle.stop()
        if not failed and not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(log.name)


def start_server(args: Sequence[str], **kw: Any) -> contextlib.AbstractContextManager[ServerHandle]:
    """A ``kvship serve`` worker; see ``start_kvship`` for the keyword arguments."""
    return start_kvship("serve", args, **kw)


def _wait_healthy(handle: ServerHandle, health_path: str, timeout: float, cmd: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if handle.proc.poll() is not None:
            raise ServerStartError(
                f"{' '.join(cmd)} exited with {handle.proc.returncode} before it was healthy:\n{handle.log_tail()}"
            )
        try:
            if httpx.get(handle.url + health_path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"{' '.join(cmd)} was not healthy after {timeout:.0f} s:\n{handle.log_tail()}")
        time.sleep(0.2)


def enter_together(stack: contextlib.ExitStack, managers: Sequence[Any]) -> list:
    """Enter context managers (e.g. several ``start_server``) at once, so start-ups overlap; ``stack`` exits
    every one that started.  Raises the first start-up error after the others are registered."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
    handles, error = [], None
    for m, f in zip(managers, futures):
        try:
            handles.append(f.result())
            stack.push(m.__exit__)
        except Exception as e:  # noqa: BLE001 - raised below
            error = error or e
    if error is not None:
        raise error
    return handles

"""The Mooncake Store master of the shared KV tier (``--hicache-storage mooncake``; docs/cache.md, "Mooncake
Store"): the one ``kvship local`` starts, and ``kvship mooncake-master``, the command of the master pod the
operator runs (docs/operator.md, "Shared KV tier").

When the workers are asked for the Mooncake shared tier and no ``--hicache-storage-master`` is given,
``kvship local`` runs one ``mooncake_master`` (the binary the ``mooncake`` package ships) with its RPC and
metrics servers on 127.0.0.1 and no HTTP metadata server (that one binds every interface whatever its host
flag says), gives every worker ``--hicache-storage-master 127.0.0.1:<rpc port>`` and
``--hicache-storage-metadata P2PHANDSHAKE`` (the store's clients exchange their segment descriptors
directly), waits for its RPC port before the workers start, and stops it after them.  Its log is ``mooncake-master.log`` in the run's log folder.  A master that
dies later costs the workers only recompute (a store failure is a miss, docs/cache.md).

``kvship mooncake-master --host H --port P`` replaces itself with that binary, RPC server on ``H:P``, the
HTTP metrics/admin server on 127.0.0.1 only, no HTTP metadata server (the workers use the P2P handshake).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from kvship.app.local_child import ChildFailed, _parent_death_signal


def mooncake_master_binary() -> str:
    """The ``mooncake_master`` executable: the one in the ``mooncake`` package's folder, else on ``PATH``.
    Raises ``RuntimeError`` saying why there is none."""
    path = ""
    try:
        import mooncake

        path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    except (ImportError, OSError):
        pass
    if not (path and os.access(path, os.X_OK)):
        path = shutil.which("mooncake_master") or ""
    if not path:
        raise RuntimeError(
            "no mooncake_master is installed here (the mooncake package ships it: pip install "
            "mooncake-transfer-engine-non-cuda, or the CUDA worker image); or give the workers "
            "--hicache-storage-master HOST:PORT of a running one"
        )
    return path


# where the master's HTTP metrics/admin server listens: never beyond the machine or pod (docs/security.md)
METRICS_HOST = "127.0.0.1"
DEFAULT_RPC_PORT = 50051
DEFAULT_METRICS_PORT = 9003


def master_argv(binary: str, host: str, rpc_port: int, metrics_port: int = DEFAULT_METRICS_PORT) -> list[str]:
    """``mooncake_master``'s command line: its RPC server on ``host:rpc_port``, metrics on 127.0.0.1."""
    return [
        binary,
        f"--rpc_port={rpc_port}",
        f"--rpc_address={host}",
        f"--metrics_host={METRICS_HOST}",  # its HTTP metrics/admin server defaults to 0.0.0.0
        f"--metrics_port={metrics_port}",
        "--enable_metric_reporting=false",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """One ``mooncake_master`` child: ``start`` (returns once its RPC port accepts), ``stop``."""

    def __init__(self, binary: str):
        self.binary = binary
        self.log_path = ""
        self.rpc_port, self.metrics_port = _free_port(), _free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def rpc_address(self) -> str:
        """``--hicache-storage-master`` of the workers."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """``--hicache-storage-metadata`` of the workers: no metadata service, the clients' P2P handshake."""
        return "P2PHANDSHAKE"

    def argv(self) -> list[str]:
        return master_argv(self.binary, "127.0.0.1", self.rpc_port, self.metrics_port)

    def start(self, log_path: str, timeout: float = 30.0) -> None:
        """Start it (output to ``log_path``) and wait until its RPC port accepts; ``ChildFailed`` (with its
        log's end) otherwise."""
        self.log_path = log_path
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_parent_death_signal if sys.platform.startswith("linux") else None,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), 0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    status = self.proc.poll()
                    self.stop()
                    raise ChildFailed(
                        f"mooncake_master did not start (status {status}); its log ({self.log_path}) ends with:\n"
                        f"{self.log_tail()}"
                    ) from None
                time.sleep(0.1)

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: pgid == pid
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1-65535)")
    return port


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "mooncake-master",
        help="run the Mooncake Store master of the shared KV tier",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address the RPC server binds (a pod: 0.0.0.0)")
    p.add_argument(
        "--port", type=_port, default=DEFAULT_RPC_PORT, help="the RPC port (the workers' --hicache-storage-master)"
    )
    p.add_argument(
        "--metrics-port", type=_port, default=DEFAULT_METRICS_PORT, help=f"its HTTP metrics server, on {METRICS_HOST}"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        binary = mooncake_master_binary()
    except RuntimeError as e:
        print(f"kvship mooncake-master: {e}", file=sys.stderr)
        return 2
    argv = master_argv(binary, args.host, args.port, args.metrics_port)
    sys.stdout.flush()
    os.execv(binary, argv)  # the pod's process is the master itself: signals and exit status are its own
    return 0  # pragma: no cover (execv does not return)

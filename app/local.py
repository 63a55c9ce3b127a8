"""``kvship local``: a whole PD deployment on this machine (router + N prefill + M decode workers).

What it does, in order:

1. picks the KV transfer backend (``--transfer-backend``, default ``auto``, see
   ``resolve_transfer_backend``) and fails at once if the one asked for cannot load;
2. starts every worker as a ``kvship serve --mode prefill|decode`` child process on
   127.0.0.1 (free HTTP and bootstrap ports), with every worker flag given to
   ``kvship local`` (``--model-path``, ``--device``, ``--page-size``, ...) passed
   through unchanged; ``--prefill-tp-size`` / ``--decode-tp-size`` give each role
   its own ``--tp-size`` (docs/parallel.md, PD with tensor parallelism).  On CUDA
   each worker gets its own ``--base-gpu-id`` (``--gpu-placement``, see
   ``kvship.app.gpu_placement``: consecutive GPUs from ``--base-gpu-id`` on,
   shared once every GPU is taken).  The
   speculative flags go to the decode workers, and to the prefill workers only
   for ``eagle`` / ``eagle3`` (they compute the prompt's features that decode's
   drafter starts from, docs/speculative.md "PD"; ``role_worker_args``);
3. waits until each answers ``/health``; if a child exits or misses
   ``--startup-timeout``, it prints that child's log tail, stops the others and
   exits 1;
4. starts ``kvship router --pd`` on ``--host``/``--port`` and waits for its
   ``/readiness``, then prints the URL (``serving on http://...``);
5. watches the children: Ctrl-C / SIGTERM stops them all (router first, then the
   workers; SIGKILL after a grace period) and exits 0.  A worker that dies on
   its own is logged (name, status, log path) and, with ``--restart-workers``
   (the default), started again on the same ports, so the deployment heals as a
   Deployment would; the router routes around it meanwhile and resumes its
   broken streams elsewhere (``--max-resumes``).  When the router dies, or
   without restarts a role has no live worker left, the rest is stopped and the
   exit status is 1.

Credentials (docs/router.md, "Authentication"): ``--api-key`` is the client key,
required by the router only; the workers require the worker key
(``--worker-api-key``, default a random ``secrets.token_urlsafe(32)`` made for
this run), which the router sends them and this process's own checks use; the
router gets an admin key (``POST``/``DELETE /workers``) only when
``--admin-api-key`` is given.  The prefill and decode workers share a KV
transfer secret made for this run (``secrets.token_bytes(32)``, hex; docs/pd.md,
"KV plane authentication").  Keys reach the children through their
environment, never their argv.

Children run in their own sessions (a terminal's Ctrl-C reaches only this
process, which then stops them in order) and get SIGTERM if this process dies
without cleaning up (Linux parent-death signal).  Their output goes to one log
file each under ``--log-dir`` (default: a new temporary folder, printed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

from kvship.app.gpu_placement import worker_gpus, worker_layout
from kvship.app.local_child import Child, ChildFailed, WorkerNodes
from kvship.app.mooncake_master import MooncakeMaster, mooncake_master_binary
from kvship.common.cli_args import add_dataclass_arguments, dataclass_from_namespace, opt
from kvship.common.envs import ENV
from kvship.common.policies import DEFAULT_POLICY, POLICY_NAMES
from kvship.common.ports import MOONCAKE_PORTS, free_port
from kvship.engine.config import TRANSFER_BACKENDS, ServerArgs

logger = logging.getLogger("kvship.local")

# ServerArgs fields `kvship local` sets itself for every worker (all others pass through).
_OWN_WORKER_FIELDS = frozenset(
    {
        "host",
        "port",
        "mode",
        "disaggregation_bootstrap_port",
        "disaggregation_transfer_backend",
        "api_key",
        "node_rank",  # each node of a multi-node worker gets its own (WorkerNodes)
        "dist_init_addr",
    }
)


@dataclass(frozen=True)
class LocalConfig:
    """Flags of ``kvship local`` itself (worker flags come from ``ServerArgs``)."""

    host: str = opt("127.0.0.1", "Address the router binds (workers always bind 127.0.0.1)")
    port: int = opt(8000, "Router HTTP port: the URL clients use")
    prefill: int = opt(1, "Number of prefill workers")
    decode: int = opt(1, "Number of decode workers")
    transfer_backend: str = opt(
        "auto",
        "KV transfer backend (auto: tcp on CPU; with CUDA nixl if it loads, else "
        "mooncake with --disaggregation-ib-device, else tcp)",
        choices=("auto",) + TRANSFER_BACKENDS,
    )
    policy: str = opt(DEFAULT_POLICY, "Router policy for both roles", choices=POLICY_NAMES)
    startup_timeout: float = opt(600.0, "Seconds every child may take to become healthy")
    shutdown_grace: float = opt(15.0, "Seconds children get to exit after SIGTERM before SIGKILL")
    log_dir: Optional[str] = opt(None, "Folder for the children's logs (default: a new temporary folder)")
    api_key: Optional[str] = opt(
        None,
        "Client key(s) the router requires ('Authorization: Bearer <key>'; comma-separated for several) "
        "(default: env KVSHIP_API_KEY; none = open router). Never given to the workers",
    )
    worker_api_key: Optional[str] = opt(
        None,
        "Key the workers require and the router sends them (default: env KVSHIP_WORKER_API_KEY, else a random "
        "key made for this run)",
    )
    admin_api_key: Optional[str] = opt(
        None, "Admin key of the router's POST/DELETE /workers (default: env KVSHIP_ADMIN_API_KEY; none = admin API off)"
    )
    debug_headers: bool = opt(
        False, "Router: give clients the x-kvship-* response headers (worker URLs, traces; for debugging)"
    )
    restart_workers: bool = opt(True, "Restart a worker that exits (the router takes it back once it is healthy)")
    prefill_tp_size: int = opt(0, "Tensor-parallel size of each prefill worker (0: --tp-size)")
    decode_tp_size: int = opt(0, "Tensor-parallel size of each decode worker (0: --tp-size)")
    prefill_pp_size: int = opt(
        0, "Pipeline stages of each prefill worker (0: --pp-size); a PP prefill feeds a decode of any TP size"
    )
    prefill_nnodes: int = opt(
        0,
        "Nodes each prefill worker spans (0: --nnodes): its ranks run as that many `kvship serve --node-rank R` "
        "process trees on this machine, as on separate hosts (docs/parallel.md)",
    )
    decode_nnodes: int = opt(0, "Nodes each decode worker spans (0: --nnodes), like --prefill-nnodes")
    max_resumes: int = opt(2, "Router: resumes of one broken stream on another worker (0 = off)")
    pd_first_token: bool = opt(
        True, "Router: streamed /generate and /v1/completions requests get their first token from the prefill worker"
    )
    pd_selective: bool = opt(
        False, "Router --pd-selective: short prompts (or mostly cached ones) are served by a decode worker alone"
    )
    pd_selective_max_tokens: int = opt(256, "Router --pd-selective-max-tokens (prompt tokens left to prefill)")
    gpu_placement: str = opt(
        "spread",
        "CUDA: spread = each worker on the next free GPUs from --base-gpu-id on (prefill workers first), sharing "
        "them again from --base-gpu-id once every visible GPU is taken; shared = every worker from --base-gpu-id",
        choices=("spread", "shared"),
    )

    def validate(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.startup_timeout <= 0 or self.shutdown_grace < 0:
            raise ValueError("--startup-timeout must be > 0 and --shutdown-grace >= 0")
        if self.max_resumes < 0:
            raise ValueError("--max-resumes must be >= 0")
        if self.prefill_pp_size < 0:
            raise ValueError("--prefill-pp-size must be >= 0 (0: --pp-size)")
        if self.prefill_tp_size < 0 or self.decode_tp_size < 0:
            raise ValueError("--prefill-tp-size and --decode-tp-size must be >= 0 (0: --tp-size)")
        if self.prefill_nnodes < 0 or self.decode_nnodes < 0:
            raise ValueError("--prefill-nnodes and --decode-nnodes must be >= 0 (0: --nnodes)")
        clients = {k.strip() for k in (self.api_key or "").split(",") if k.strip()}
        if self.worker_api_key in clients or self.admin_api_key in clients:
            raise ValueError("--worker-api-key and --admin-api-key must differ from the client key (--api-key)")
        if self.admin_api_key and self.admin_api_key == self.worker_api_key:
            raise ValueError("--admin-api-key must differ from --worker-api-key")


def _worker_flags_class() -> type:
    """A frozen dataclass of the ServerArgs fields that pass through to the workers."""
    hints = typing.get_type_hints(ServerArgs)
    specs = []
    for f in dataclasses.fields(ServerArgs):
        if f.name in _OWN_WORKER_FIELDS:
            continue
        default: Any = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        kw: dict[str, Any] = {"metadata": f.metadata}
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            kw["default_factory"] = f.default_factory  # type: ignore[misc]
        else:
            kw["default"] = default
        specs.append((f.name, hints[f.name], dataclasses.field(**kw)))
    return dataclasses.make_dataclass("WorkerFlags", specs, frozen=True)


WorkerFlags = _worker_flags_class()


def worker_argv(flags: Any) -> list[str]:
    """``kvship serve`` arguments for the pass-through flags that differ from ServerArgs' defaults."""
    defaults = ServerArgs()
    out: list[str] = []
    for f in dataclasses.fields(flags):
        value = getattr(flags, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def resolve_transfer_backend(choice: str, device: str, ib_device: Optional[str] = None) -> str:
    """The backend ``--transfer-backend`` names; ``auto`` picks the fastest for one machine.

    ``auto`` (every worker of ``kvship local`` runs on this host): ``tcp`` on
    CPU; on CUDA ``nixl`` when it loads, else ``mooncake`` when an RDMA device
    is given (``--disaggregation-ib-device``), else ``tcp``.  The measurements
    behind this order are in docs/benchmarks.md ("KV transfer").

    Raises ``RuntimeError`` when an explicitly named backend cannot load.
    """
    from kvship.engine.disagg import BackendUnavailableError, available_transfer_backends, get_transfer_backend

    if choice != "auto":
        try:
            get_transfer_backend(choice)
        except BackendUnavailableError as e:
            raise RuntimeError(str(e)) from None
        return choice
    if device == "cpu":
        return "tcp"
    usable = available_transfer_backends()
    if "nixl" in usable:
        return "nixl"
    if ib_device and "mooncake" in usable:
        return "mooncake"
    return "tcp"


def _resolved_device(device: str) -> str:
    if device != "auto":
        return device
    return ServerArgs(device="auto").resolved_device


def _flag_int(argv: Sequence[str], flag: str, default: int) -> int:
    """The value of ``flag`` in ``argv`` (its last occurrence), or ``default``."""
    value = default
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            value = int(argv[i + 1])
    return value


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    """Set every occurrence of ``flag``'s value in ``argv`` (in place)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            argv[i + 1] = value


TRACING_FLAGS = ("--otlp-traces-endpoint", "--otlp-traces-sample-ratio")


def router_tracing_argv(worker_args: Sequence[str]) -> list[str]:
    """The router's share of the OpenTelemetry flags (docs/observability.md): the workers' own, so the whole
    deployment exports to one collector."""
    out: list[str] = []
    for i, arg in enumerate(worker_args[:-1]):
        if arg in TRACING_FLAGS:
            out += [arg, worker_args[i + 1]]
    return out


SPECULATIVE_FLAGS = (
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)


def role_worker_args(worker_args: Sequence[str], role: str) -> list[str]:
    """The pass-through flags for a worker of ``role``: all of them, except that a prefill worker gets the
    speculative flags only for ``eagle`` / ``eagle3`` (it refuses ngram and draft, which need nothing from it)."""
    out = list(worker_args)
    algo = None
    for i, arg in enumerate(out[:-1]):
        if arg == "--speculative-algorithm":
            algo = out[i + 1]
    if role != "prefill" or algo in (None, "eagle", "eagle3"):
        return out
    kept: list[str] = []
    i = 0
    while i < len(out):
        if out[i] in SPECULATIVE_FLAGS:  # every one takes a value (worker_argv writes "--flag value")
            i += 2
            continue
        kept.append(out[i])
        i += 1
    return kept


def free_port_run(n: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all free (rank r of a tensor-parallel prefill binds ``p + r``) and
    none in ``avoid`` (ports already handed to children that have not bound them yet)."""
    for _ in range(100):
        base = free_port(host)
        if base + n > 65536 or any(port in MOONCAKE_PORTS or port in avoid for port in range(base, base + n)):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports found")


class _Stop(Exception):
    """SIGINT / SIGTERM arrived."""


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


class LocalDeployment:
    """The children of one ``kvship local`` run; ``start`` / ``watch`` / ``stop``."""

    def __init__(
        self,
        cfg: LocalConfig,
        worker_args: list[str],
        backend: str,
        log_dir: str,
        gpus: Optional[Sequence[int]] = None,
    ):
        """``gpus``: each worker node's ``--base-gpu-id`` in start order (``worker_gpus``); None adds none."""
        self.cfg = cfg
        self.backend = backend
        self.log_dir = log_dir
        self.nodes: list[WorkerNodes] = []  # every worker's node processes, in start order
        self.workers: list[Child] = []  # every worker's node 0 (its HTTP server: the URL the router knows)
        self.gpus_of: dict[str, list[int]] = {}  # worker name -> its GPUs (CUDA only)
        # every port this run hands out, the router's first: a child binds its own seconds after the pick, so
        # a later pick must not land on one still unbound (CI once saw the router's port taken by a prefill
        # rank's bootstrap server)
        self.ports_given: set[int] = {cfg.port}
        api_key = cfg.api_key or ENV.API_KEY
        admin_key = cfg.admin_api_key or ENV.ADMIN_API_KEY
        # the workers' key is never the client key (docs/router.md, "Authentication")
        self.worker_key = worker_key = cfg.worker_api_key or ENV.WORKER_API_KEY or secrets.token_urlsafe(32)
        # Keys go through the environment (never argv, which `ps` shows); each child gets exactly its own.
        worker_env = {"KVSHIP_API_KEY": worker_key, "KVSHIP_WORKER_API_KEY": "", "KVSHIP_ADMIN_API_KEY": ""}
        # the KV transfer secret of this run's prefill and decode workers (docs/pd.md, "KV plane authentication")
        worker_env["KVSHIP_KV_TRANSFER_SECRET"] = secrets.token_bytes(32).hex()
        router_env = {
            "KVSHIP_API_KEY": api_key or "",
            "KVSHIP_WORKER_API_KEY": worker_key,
            "KVSHIP_ADMIN_API_KEY": admin_key or "",
        }
        gpu_list = list(gpus) if gpus is not None else None
        for role, count in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            pp_size = _flag_int(worker_args, "--pp-size", 1)
            if role == "prefill" and cfg.prefill_pp_size:
                pp_size = cfg.prefill_pp_size
            tp_size, nnodes = worker_layout(
                cfg, role, _flag_int(worker_args, "--tp-size", 1), _flag_int(worker_args, "--nnodes", 1), pp_size
            )
            ranks = tp_size * pp_size
            base = [
                "serve",
                "--mode",
                role,
                "--host",
                "127.0.0.1",
                "--disaggregation-transfer-backend",
                backend,
                *role_worker_args(worker_args, role),
            ]
            if cfg.policy == "kv_events" and "--enable-kv-events" not in worker_args:
                base.append("--enable-kv-events")  # the router's prefix index reads the workers' KV events
            if tp_size != _flag_int(worker_args, "--tp-size", 1):  # after the pass-through flags: it overrides
                base += ["--tp-size", str(tp_size)]
            if pp_size != _flag_int(worker_args, "--pp-size", 1):
                base += ["--pp-size", str(pp_size)]
            if nnodes == 1 and _flag_int(worker_args, "--nnodes", 1) != 1:  # (several nodes: set per node below)
                base += ["--nnodes", "1"]
            for i in range(count):
                name = f"{role}-{i}"
                argv = list(base)
                if role == "prefill":  # every node of the worker gets the same one: rank r binds port + r
                    argv += ["--disaggregation-bootstrap-port", str(self.pick_ports(ranks))]
                rendezvous = ["--dist-init-addr", f"127.0.0.1:{self.pick_ports()}"] if nnodes > 1 else []
                nodes = []
                for r in range(nnodes):
                    port = self.pick_ports()
                    node_argv = argv + ["--port", str(port)]
                    if nnodes > 1:
                        node_argv += ["--nnodes", str(nnodes), "--node-rank", str(r), *rendezvous]
                    if gpu_list is not None:  # after the pass-through flags: it overrides --base-gpu-id
                        first = gpu_list[sum(w.nnodes for w in self.nodes) + r]
                        node_argv += ["--base-gpu-id", str(first)]
                        self.gpus_of.setdefault(name, []).extend(range(first, first + ranks // nnodes))
                    node_name = name if r == 0 else f"{name}-node{r}"
                    nodes.append(
                        Child(
                            node_name,
                            node_argv,
                            f"http://127.0.0.1:{port}",
                            os.path.join(log_dir, f"{node_name}.log"),
                            "/health",
                            env=worker_env,
                            health_key=worker_key,
                        )
                    )
                self.nodes.append(WorkerNodes(name, nodes))
                self.workers.append(nodes[0])
        prefill_urls = [w.url for w in self.workers if w.name.startswith("prefill")]
        decode_urls = [w.url for w in self.workers if w.name.startswith("decode")]
        router_argv = [
            "router",
            "--pd",
            "--host",
            cfg.host,
            "--port",
            str(cfg.port),
            "--policy",
            cfg.policy,
            "--shutdown-timeout",
            str(min(cfg.shutdown_grace, 5.0)),
            "--max-resumes",
            str(cfg.max_resumes),
            "--pd-first-token" if cfg.pd_first_token else "--no-pd-first-token",
            "--pd-selective" if cfg.pd_selective else "--no-pd-selective",
            "--pd-selective-max-tokens",
            str(cfg.pd_selective_max_tokens),
            "--debug-headers" if cfg.debug_headers else "--no-debug-headers",
            # a restarted worker rejoins after one passed check, a dead one leaves after two failed ones
            "--health-check-interval",
            "1",
            "--health-failure-threshold",
            "2",
            "--prefill",
            *prefill_urls,
            "--decode",
            *decode_urls,
            *router_tracing_argv(worker_args),
        ]
        connect_host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        self.router = Child(
            "router",
            router_argv,
            f"http://{connect_host}:{cfg.port}",
            os.path.join(log_dir, "router.log"),
            "/readiness",
            env=router_env,
            health_key=worker_key,  # /readiness takes any of the router's keys
        )

    @property
    def children(self) -> list[Child]:
        return [self.router, *(c for w in self.nodes for c in w.nodes)]

    def start(self) -> None:
        """Start workers, then the router; raises ``ChildFailed`` (the others keep running: call ``stop``)."""
        from tqdm import tqdm

        for w in self.nodes:
            w.start()
        deadline = time.monotonic() + self.cfg.startup_timeout
        with tqdm(
            total=len(self.nodes) + 1, desc="starting kvship local", unit="worker", disable=not sys.stderr.isatty()
        ) as bar:
            self._wait_healthy(self.nodes, deadline, bar)
            self.router.start()
            self._wait_healthy([WorkerNodes("router", [self.router])], deadline, bar)

    def pick_ports(self, n: int = 1) -> int:
        """The first of ``n`` consecutive free ports for a child, none handed out before in this run."""
        base = free_port_run(n, avoid=self.ports_given)
        self.ports_given.update(range(base, base + n))
        return base

    def _retry_taken_port(self, w: WorkerNodes) -> bool:
        """A worker that exited at start because a port was taken: the ports are picked free here and bound
        by the child seconds later, and another process may bind one in between.  Pick another port (HTTP or
        bootstrap, from the message ``kvship serve`` exits with), point the router at it and start the worker
        (all its nodes) again, at most 3 times; False when the exit had another cause."""
        if w.head is self.router or w.head.port_retries >= 3:
            return False
        fixed = False
        for c in w.nodes:
            said = c.log_since_start()
            if "cannot listen on" in said:
                old = c.url
                port = self.pick_ports()
                _set_flag(c.argv, "--port", str(port))
                c.url = f"http://127.0.0.1:{port}"
                self.router.argv = [c.url if a == old else a for a in self.router.argv]
                fixed = True
            elif "cannot bind the KV bootstrap server" in said:
                first = str(self.pick_ports(_flag_int(c.argv, "--tp-size", 1) * _flag_int(c.argv, "--pp-size", 1)))
                for n in w.nodes:  # every node's ranks bind from the same port on
                    _set_flag(n.argv, "--disaggregation-bootstrap-port", first)
                fixed = True
        if not fixed:
            return False
        w.head.port_retries += 1
        logger.warning("%s: a port was taken before it could bind it; starting it again on another", w.name)
        self._restart(w)
        return True

    def _restart(self, w: WorkerNodes) -> None:
        """Start every node of ``w`` again (those still running are stopped first: a multi-node worker's nodes
        start together, at a new rendezvous port)."""
        w.stop(self.cfg.shutdown_grace)
        if w.nnodes > 1:
            w.new_rendezvous(self.pick_ports())
        w.start()

    def _wait_healthy(self, workers: Sequence[WorkerNodes], deadline: float, bar: Any) -> None:
        pending = list(workers)
        while pending:
            for w in list(pending):
                gone = next((c for c in w.nodes if c.exited() is not None), None)
                if gone is not None and self._retry_taken_port(w):
                    continue
                if gone is not None:
                    raise ChildFailed(
                        f"{gone.name} exited with status {gone.exited()} while starting; its log "
                        f"({gone.log_path}) ends with:\n{gone.log_tail()}"
                    )
                if all(c.healthy() for c in w.nodes):
                    pending.remove(w)
                    bar.update(1)
                    logger.info("%s ready at %s", w.name, w.head.url)
            if pending and time.monotonic() > deadline:
                c = next((c for c in pending[0].nodes if not c.healthy()), pending[0].head)
                raise ChildFailed(
                    f"{c.name} was not healthy after --startup-timeout "
                    f"{self.cfg.startup_timeout:g} s; its log ({c.log_path}) ends with:\n{c.log_tail()}"
                )
            if pending:
                time.sleep(0.25)

    def watch(self) -> None:
        """Serve until a signal arrives (``_Stop``).

        A worker node that exits is logged (name, status, log path and tail); its worker is down (a
        multi-node worker's other nodes exit by themselves once their collectives fail).  With
        ``--restart-workers`` the worker is started again on the same ports (every node, at a new rendezvous;
        a node still running gets ``--shutdown-grace`` to exit by itself, then it is stopped), after a delay
        that doubles while it keeps dying within a minute of its start (1 s up to 30 s, like a Deployment's
        crash-loop back-off); the router takes it back once its health checks
        pass.  Without it the router routes around it.  ``ChildFailed`` is raised when the router dies or,
        without restarts, a role has no live worker left.
        """
        reported: set[str] = set()  # nodes whose exit was logged
        down: set[str] = set()  # workers with an exited node (not restarted yet)
        due: dict[str, float] = {}  # worker name -> monotonic time of its restart
        started: dict[str, float] = {w.name: time.monotonic() for w in self.nodes}
        delay: dict[str, float] = {}
        went_down: dict[str, float] = {}  # worker name -> when its first node exited
        while True:
            code = self.router.exited()
            if code is not None:
                raise ChildFailed(
                    f"the router exited with status {code}; its log ({self.router.log_path}) "
                    f"ends with:\n{self.router.log_tail()}"
                )
            now = time.monotonic()
            for w in self.nodes:
                for c in w.nodes:
                    code = c.exited()
                    if code is None or c.name in reported:
                        continue
                    reported.add(c.name)
                    if w.name in down:
                        action = f"worker {w.name} is down already"
                    elif self.cfg.restart_workers:
                        down.add(w.name)
                        went_down[w.name] = now
                        quick = now - started.get(w.name, now) < 60.0
                        delay[w.name] = min(30.0, 2 * delay.get(w.name, 0.5)) if quick else 1.0
                        due[w.name] = now + delay[w.name]
                        what = "it" if w.nnodes == 1 else f"worker {w.name} (its {w.nnodes} nodes)"
                        action = f"restarting {what} in {delay[w.name]:g} s"
                    else:
                        down.add(w.name)
                        action = "the router routes around it"
                    logger.error(
                        "%s (%s) exited with status %s; %s. Its log (%s) ends with:\n%s",
                        c.name,
                        c.url,
                        code,
                        action,
                        c.log_path,
                        c.log_tail(20),
                    )
            for w in self.nodes:
                # its other nodes get --shutdown-grace to exit by themselves (their collectives fail) first
                grace_left = w.alive() and now < went_down.get(w.name, now) + self.cfg.shutdown_grace
                if w.name in due and now >= due[w.name] and not grace_left:
                    del due[w.name]
                    down.discard(w.name)
                    reported.difference_update(c.name for c in w.nodes)
                    w.head.restarts += 1
                    started[w.name] = now
                    self._restart(w)
                    logger.info("%s restarted (restart %d); log %s", w.name, w.head.restarts, w.head.log_path)
            if not self.cfg.restart_workers:
                for role in ("prefill", "decode"):
                    if all(w.down() for w in self.nodes if w.name.startswith(role)):
                        raise ChildFailed(f"every {role} worker has exited; stopping")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM the router, then the workers; SIGKILL whatever outlives ``--shutdown-grace``."""
        for group in ([self.router], [c for w in self.nodes for c in w.nodes]):
            live = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for c in live:
                c.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.shutdown_grace
            for c in live:
                assert c.proc is not None
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not exit within %g s; killing it", c.name, self.cfg.shutdown_grace)
                    c.signal(signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(10)


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "local",
        allow_abbrev=False,
        help="run router + prefill + decode workers on this machine",
        description="Start a PD deployment on this machine: `kvship router --pd` on --port plus --prefill "
        "prefill and --decode decode workers (`kvship serve --mode ...`). Every worker flag below "
        "is passed to each worker. Ctrl-C stops everything.",
    )
    add_dataclass_arguments(parser, LocalConfig)
    group = parser.add_argument_group("worker flags (passed to every worker)")
    add_dataclass_arguments(group, WorkerFlags)  # type: ignore[arg-type]
    parser.set_defaults(func=run, _local_parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from kvship.app.serve import setup_logging

    cfg: LocalConfig = dataclass_from_namespace(LocalConfig, args)
    flags = dataclass_from_namespace(WorkerFlags, args)
    setup_logging(flags.log_level)
    master: Optional[MooncakeMaster] = None
    try:
        cfg.validate()
        if flags.hicache_storage == "mooncake" and not flags.hicache_storage_master:
            # the shared tier's master, run here (kvship.app.mooncake_master; docs/cache.md, "Mooncake Store")
            master = MooncakeMaster(mooncake_master_binary())
            flags = dataclasses.replace(
                flags,
                hicache_storage_master=master.rpc_address,
                hicache_storage_metadata=flags.hicache_storage_metadata or master.metadata_url,
            )
        ServerArgs(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}).validate()
        device = _resolved_device(flags.device)
        backend = resolve_transfer_backend(cfg.transfer_backend, device, flags.disaggregation_ib_device)
        pp_size = _flag_int(worker_argv(flags), "--pp-size", 1)
        for role in ("prefill", "decode"):
            worker_layout(cfg, role, flags.tp_size, flags.nnodes, pp_size)
        gpus = worker_gpus(cfg, flags, device, pp_size=pp_size)
    except (ValueError, RuntimeError) as e:
        logger.error("invalid settings: %s", e)
        return 2
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="kvship-local-")
    os.makedirs(log_dir, exist_ok=True)
    deployment = LocalDeployment(cfg, worker_argv(flags), backend, log_dir, gpus)
    logger.info(
        "starting %d prefill + %d decode workers (transfer backend %s); logs in %s",
        cfg.prefill,
        cfg.decode,
        backend,
        log_dir,
    )
    for name, ids in deployment.gpus_of.items():
        logger.info("%s on GPU%s %s", name, "s" if len(ids) > 1 else "", ",".join(map(str, ids)))
    old = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        if master is not None:
            master.start(os.path.join(log_dir, "mooncake-master.log"))
            logger.info("mooncake_master on %s (metadata %s)", master.rpc_address, master.metadata_url)
        deployment.start()
        print(
            f"kvship local: serving on {deployment.router.url} ({cfg.prefill} prefill + {cfg.decode} decode "
            f"workers, KV transfer {backend}; logs in {log_dir}); Ctrl-C stops",
            flush=True,
        )
        deployment.watch()
    except _Stop as e:
        logger.info("%s received: stopping every child", e)
    except ChildFailed as e:
        logger.error("%s", e)
        code = 1
    finally:
        # A second Ctrl-C must not interrupt the shutdown itself.
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        deployment.stop()
        if master is not None:
            master.stop(cfg.shutdown_grace)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    logger.info("kvship local stopped")
    return code

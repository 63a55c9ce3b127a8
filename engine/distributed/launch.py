"""Starting a node's rank processes, joining the groups, and the loop of a rank that is not the leader.

``RankProcesses.start(target, server_args, topology, url)`` spawns this
node's ranks that do not run in the calling process (multiprocessing
``spawn``; no torchrun): on node 0 every rank but 0 (the calling process is
rank 0: HTTP, tokenizer, its own scheduler thread), on another node all of
them (the calling process only watches them and answers ``/health``).  Each
runs ``target(rank, server_args, topology.for_rank(rank), url)``.
``failure()`` reports a rank that exited unexpectedly; ``stop()`` waits for
the ranks after the leader told them to stop, and kills what is left.

``join(server_args, topology, url)`` puts the process on its GPU
(``cuda:<base_gpu_id + local rank>``) and joins the groups
(``init_distributed``).  ``run_rank(server_args, groups, scheduler_factory)``
is the body of every rank but the leader: build the model runner (this rank's
shard) and the same scheduler as the leader (its output goes nowhere), then
run the loop until the leader says stop.  Such a rank ignores SIGINT and
SIGTERM (the leader, or its node's launcher, receives them) and exits by
itself when its launcher process disappears.

``wait_for_rendezvous(host, port, timeout_s)``: a node other than 0 first
checks that node 0's rendezvous accepts connections, within a bounded time.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.groups import ProcessGroups, init_distributed
from kvship.engine.distributed.topology import Topology

logger = logging.getLogger(__name__)

RankTarget = Callable[[int, ServerArgs, Topology, str], None]
PARENT_POLL_S = 1.0


class RankProcesses:
    """The ranks of this node that run as child processes of the calling one."""

    def __init__(self, procs: dict[int, Any]):
        self.procs = procs  # global rank -> process
        self._stopping = False

    @classmethod
    def start(cls, target: RankTarget, server_args: ServerArgs, topology: Topology, url: str) -> "RankProcesses":
        ranks = [r for r in topology.node_ranks if r != topology.rank or not topology.is_leader]
        ctx = mp.get_context("spawn")
        procs = {
            r: ctx.Process(target=target, args=(r, server_args, topology.for_rank(r), url), name=f"kvship-rank{r}")
            for r in ranks
        }
        for p in procs.values():
            p.start()
        if procs:
            logger.info(
                "node %d started ranks %s (pids %s)", topology.node_rank, ranks, [p.pid for p in procs.values()]
            )
        return cls(procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def states(self) -> list[dict[str, Any]]:
        """Each rank's pid, liveness and exit code (a node's ``/health``)."""
        return [{"rank": r, "pid": p.pid, "alive": p.is_alive(), "exitcode": p.exitcode} for r, p in self.procs.items()]

    def failure(self) -> Optional[str]:
        """Why the worker cannot go on (a rank exited), or None."""
        for rank, p in self.procs.items():
            code = p.exitcode
            if code is None or (code == 0 and self._stopping):
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"
        return None

    def all_exited(self) -> bool:
        return all(p.exitcode is not None for p in self.procs.values())

    def exit_on_failure_while_starting(self) -> threading.Event:
        """Until the returned event is set, exit this process (status 1) as soon as a rank fails:
        the leader may be blocked in a collective with it meanwhile."""
        started = threading.Event()

        def watch() -> None:
            while not started.wait(0.2):
                message = self.failure()
                if message is not None:
                    logger.error("%s while the worker was starting: exiting", message)
                    logging.shutdown()
                    os._exit(1)

        threading.Thread(target=watch, name="kvship-rank-watch", daemon=True).start()
        return started

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for the ranks to leave (the leader has told them), then kill the rest."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for rank, p in self.procs.items():
            if p.is_alive():
                logger.warning("rank %d did not stop; killing it", rank)
                p.kill()
                p.join(5.0)


def wait_for_rendezvous(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ConnectionError (one line) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Optional[Exception] = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return
        except OSError as e:
            last = e
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    why = f"{type(last).__name__}: {last}" if last is not None else "timed out"
    raise ConnectionError(f"cannot reach --dist-init-addr {host}:{port} within {timeout_s:g} s ({why})")


def watch_launcher() -> None:
    """Exit this process (status 1) once the process that started it is gone: kvship's own launcher, or torchrun's
    agent (it stops its ranks itself when it exits cleanly, but a SIGKILLed agent leaves them running, in sessions
    of their own)."""
    threading.Thread(target=_exit_when_parent_dies, args=(os.getppid(),), daemon=True).start()


def _exit_when_parent_dies(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("the launcher (pid %d) is gone: exiting", parent_pid)
            os._exit(1)


def join(server_args: ServerArgs, topology: Topology, url: str) -> ProcessGroups:
    """Join this worker's groups as ``topology.rank`` on the device the model will use."""
    import torch

    device = torch.device(server_args.resolved_device)
    if device.type == "cuda":
        device = torch.device("cuda", topology.gpu_id)
        torch.cuda.set_device(device)
    return init_distributed(topology, url, device, server_args.dist_timeout)


def run_rank(server_args: ServerArgs, groups: ProcessGroups, scheduler_factory: Callable[..., Any]) -> int:
    """The loop of a rank other than the leader (see the module docstring); returns the exit status."""
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler.io import scheduler_io
    from kvship.engine.tokenizer import load_tokenizer

    rank = groups.topology.rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not groups.topology.torchrun:  # under torchrun app/serve.py watches the agent
        watch_launcher()
    runner = ModelRunner(server_args, groups=groups)
    # stop strings are checked by the scheduler: every rank needs the tokenizer to decide alike
    tokenizer = load_tokenizer(
        server_args.tokenizer_path or runner.model_path, trust_remote_code=server_args.trust_remote_code
    )
    stop = threading.Event()
    io = scheduler_io(groups.tp, stop.set, link=runner.pipeline)
    scheduler = scheduler_factory(server_args, runner, tokenizer, lambda chunks: None, io=io)
    try:
        scheduler.run_forever(stop)
    except BaseException as e:  # noqa: BLE001 - a rank that fails takes the worker down
        logger.error("tensor-parallel rank %d failed: %s: %s", rank, type(e).__name__, e)
        return 1
    logger.info("tensor-parallel rank %d stopped", rank)
    return 0

"""Starting a tensor-parallel worker's ranks 1..N-1 from rank 0's process, and running one.

``RankProcesses.start(target, server_args)`` spawns ``tp_size - 1``
processes (multiprocessing ``spawn``: no torchrun) that run
``target(rank, server_args, init_method)``; rank 0 is the calling process
(HTTP, tokenizer, its own scheduler thread).  ``failure()`` reports a rank
that exited unexpectedly; ``stop()`` waits for the ranks after rank 0 told
them to stop, and kills what is left.

``run_rank(server_args, tp, scheduler_factory)`` is the body of ranks 1..N-1:
build the model runner (this rank's shard) and the same scheduler as rank 0
(its output goes nowhere), then run the loop until rank 0 says stop.  Such a
rank ignores SIGINT and SIGTERM (rank 0 receives them and stops it) and
exits by itself when rank 0's process disappears.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable, Optional

from kvship.common.ports import free_port
from kvship.engine.config import ServerArgs
from kvship.engine.parallel.group import TPGroup, init_tp_group

logger = logging.getLogger(__name__)

RankTarget = Callable[[int, ServerArgs, str], None]
PARENT_POLL_S = 1.0


class RankProcesses:
    """Ranks 1..N-1 of this worker, as child processes of rank 0."""

    def __init__(self, procs: list[Any], init_method: str):
        self.procs = procs
        self.init_method = init_method
        self._stopping = False

    @classmethod
    def start(cls, target: RankTarget, server_args: ServerArgs) -> "RankProcesses":
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=target, args=(rank, server_args, init_method), name=f"kvship-tp-rank{rank}")
            for rank in range(1, server_args.tp_size)
        ]
        for p in procs:
            p.start()
        logger.info("started tensor-parallel ranks 1..%d (pids %s)", len(procs), [p.pid for p in procs])
        return cls(procs, init_method)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def failure(self) -> Optional[str]:
        """Why the worker cannot go on (a rank exited), or None."""
        for rank, p in enumerate(self.procs, start=1):
            code = p.exitcode
            if code is None or (code == 0 and self._stopping):
                continue
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return f"tensor-parallel rank {rank} (pid {p.pid}) {how}"
        return None

    def exit_on_failure_while_starting(self) -> threading.Event:
        """Until the returned event is set, exit this process (status 1) as soon as a rank fails:
        rank 0 may be blocked in a collective with it meanwhile."""
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
        """Wait up to ``timeout_s`` for the ranks to leave (rank 0 has told them), then kill the rest."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for rank, p in enumerate(self.procs, start=1):
            if p.is_alive():
                logger.warning("tensor-parallel rank %d did not stop; killing it", rank)
                p.kill()
                p.join(5.0)


def _exit_when_parent_dies(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) is gone: exiting", parent_pid)
            os._exit(1)


def join_tp_group(server_args: ServerArgs, rank: int, init_method: str) -> TPGroup:
    """Join this worker's group as ``rank`` on the device the model will use."""
    import torch

    device = torch.device(server_args.resolved_device)
    if device.type == "cuda":
        device = torch.device("cuda", server_args.base_gpu_id + rank)
        torch.cuda.set_device(device)
    return init_tp_group(rank, server_args.tp_size, init_method, device, server_args.dist_timeout)


def run_rank(server_args: ServerArgs, tp: TPGroup, scheduler_factory: Callable[..., Any]) -> int:
    """The loop of rank ``tp.rank`` >= 1 (see the module docstring); returns the exit status."""
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.parallel.scheduling import make_scheduler_tensor_parallel
    from kvship.engine.tokenizer import load_tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_parent_dies, args=(os.getppid(),), daemon=True).start()
    runner = ModelRunner(server_args, tp=tp)
    # stop strings are checked by the scheduler: every rank needs the tokenizer to decide alike
    tokenizer = load_tokenizer(
        server_args.tokenizer_path or runner.model_path, trust_remote_code=server_args.trust_remote_code
    )
    stop = threading.Event()
    scheduler = scheduler_factory(server_args, runner, tokenizer, lambda chunks: None)
    make_scheduler_tensor_parallel(scheduler, tp, stop.set)
    try:
        scheduler.run_forever(stop)
    except BaseException as e:  # noqa: BLE001 - a rank that fails takes the worker down
        logger.error("tensor-parallel rank %d failed: %s: %s", tp.rank, type(e).__name__, e)
        return 1
    logger.info("tensor-parallel rank %d stopped", tp.rank)
    return 0

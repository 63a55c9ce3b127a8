"""The pipeline loop's order of launches, result sends and processing on the last stage, and its failure path
(engine/scheduler/pipeline.py), with a scripted scheduler and stage link in one process.  The real stages (rank
processes over gloo) are tests/test_pipeline_parallel.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest

from kvship.engine.scheduler.launch import Pending
from kvship.engine.scheduler.pipeline import PipelineLoop

EXTEND = SimpleNamespace(is_decode=lambda: False)


class ScriptedScheduler:
    """Hands out the scripted batches one per step (None when the script is done); logs what the loop does."""

    def __init__(self, names: list[str], log: list[str], fail_launch: Optional[str] = None):
        self.script = list(names)
        self.log = log
        self.fail_launch = fail_launch
        self.speculator = None
        self.kv = SimpleNamespace(fits_decode=lambda running: True)
        self.running: list[Any] = []
        self.failed: list[Any] = []

    def recv(self, block_s: float) -> None:
        """The script is the inbox: nothing arrives from outside."""

    def schedule(self, busy: dict, parts: int) -> Any:
        if not self.script:
            return None
        name = self.script.pop(0)
        return SimpleNamespace(name=name, reqs=[SimpleNamespace(rid=name)], forward_mode=EXTEND)

    def launch(self, batch: Any, after: Optional[Pending] = None) -> Pending:
        if batch.name == self.fail_launch:
            raise RuntimeError(f"launch of {batch.name} failed")
        self.log.append(f"launch {batch.name}")
        return Pending(batch=batch, next_ids=None, host=None, top_nums=[], event=None, index={})

    def process(self, p: Pending) -> None:
        self.log.append(f"process {p.batch.name}")

    def fail_step(self, e: Exception, reqs: Any) -> None:
        self.log.append(f"fail {sorted(r.rid for r in reqs or [])}")

    def end_step(self) -> None:
        """No per-step bookkeeping in the script."""


class ScriptedLink:
    def __init__(self, log: list[str], is_last: bool, results: Optional[list[Any]] = None):
        self.log = log
        self.is_last = is_last
        self.pp_size = 2
        self.stopped = False
        self.results = list(results or [])

    def send_results(self, results: Any) -> None:
        self.log.append(f"send {results!r}")

    def recv_results(self) -> Any:
        self.log.append("recv")
        return self.results.pop(0)


def run(loop: PipelineLoop, steps: int) -> None:
    for _ in range(steps):
        loop.step()


def test_the_last_stage_sends_a_steps_results_after_launching_the_next_micro_batch():
    """Two stages, three micro-batches: the last stage queues B before it waits for A's ids, and sends each
    result once, in launch order, before processing it."""
    log: list[str] = []
    loop = PipelineLoop(ScriptedScheduler(["A", "B", "C"], log), ScriptedLink(log, is_last=True))
    run(loop, 5)
    empty = repr(([], None, None))
    assert log == [
        "launch A",
        "launch B",
        f"send {empty}",
        "process A",
        "launch C",
        f"send {empty}",
        "process B",
        f"send {empty}",
        "process C",
    ]
    assert loop.max_in_flight == 2 and not loop.has_pending()


def test_an_earlier_stage_receives_one_result_per_processed_micro_batch_in_launch_order():
    log: list[str] = []
    link = ScriptedLink(log, is_last=False, results=["rA", "rB"])
    sched = ScriptedScheduler(["A", "B"], log)
    original = sched.launch

    def remote_launch(batch: Any, after: Optional[Pending] = None) -> Pending:
        p = original(batch, after)
        p.remote = True
        return p

    sched.launch = remote_launch  # type: ignore[method-assign]
    loop = PipelineLoop(sched, link)
    run(loop, 4)
    assert log == ["launch A", "launch B", "recv", "process A", "recv", "process B"]


@pytest.mark.parametrize("results_fail", [False, True])
def test_a_failed_step_on_the_last_stage_still_sends_the_dropped_micro_batches_results(results_fail):
    """A launches, B's launch fails: A is dropped with the step's requests failed, and the earlier stages (which
    wait for one result per dropped batch) get A's results, or a placeholder where reading them fails too."""
    log: list[str] = []
    loop = PipelineLoop(ScriptedScheduler(["A", "B"], log, fail_launch="B"), ScriptedLink(log, is_last=True))
    loop.step()
    if results_fail:
        pending = loop.inflight[0]
        pending.sampling = object()  # results() raises: "not sampled yet"
    loop.step()
    assert log == ["launch A", f"send {([], None, None)!r}", "fail ['A', 'B']"]
    assert not loop.has_pending() and not loop.busy

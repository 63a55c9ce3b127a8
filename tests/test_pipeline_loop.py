"""The pipeline loop's order of launches, result sends and processing on the last stage, and its failure path
(engine/scheduler/pipeline.py), with a scripted scheduler and stage link in one process.  The real stages (rank
processes over gloo) are tests/test_pipeline_parallel.py's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

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
        self.chain = True  # as every rank agreed (StageLink.chain)
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


# --- chained decodes (KVSHIP_PP_CHAIN) ----------------------------------------------------------------------------
DECODE = SimpleNamespace(is_decode=lambda: True)


def _req(rid: str, out: int = 1, max_new: int = 100, grammar: Any = None) -> Any:
    params = SimpleNamespace(seed=None, is_greedy=True, frequency_penalty=0.0, presence_penalty=0.0,
                             repetition_penalty=1.0)  # fmt: skip
    return SimpleNamespace(rid=rid, finished=False, output_ids=[0] * out, max_new_tokens=max_new, grammar=grammar,
                           sampling_params=params)  # fmt: skip


class DecodingScheduler:
    """A decode of the running requests not in ``busy``, at most ceil(running / parts) of them (as the real
    decoder), for ``launches`` launches; logs launches (with the batch they chain on) and processing."""

    def __init__(self, running: list[Any], log: list[str], launches: int, remote: bool):
        self.running = running
        self.log = log
        self.left = launches
        self.remote = remote
        self.speculator = None
        self.kv = SimpleNamespace(fits_decode=lambda running: True)
        self.launcher = SimpleNamespace(device="cpu")
        self.n = 0

    def recv(self, block_s: float) -> None:
        """Nothing arrives from outside."""

    def schedule(self, busy: dict, parts: int) -> Any:
        free = [r for r in self.running if id(r) not in busy]
        if self.left <= 0 or not free:
            return None
        self.left -= 1
        reqs = free[: -(-len(self.running) // parts)]
        return SimpleNamespace(reqs=reqs, forward_mode=DECODE)

    def launch(self, batch: Any, after: Optional[Pending] = None) -> Pending:
        self.n += 1
        batch.name = f"D{self.n}"
        on = "" if after is None else f" after {after.batch.name}"
        self.log.append(f"launch {batch.name} {[r.rid for r in batch.reqs]}{on}")
        index = {id(r): j for j, r in enumerate(batch.reqs)}
        ids = None if self.remote else torch.arange(len(batch.reqs))
        return Pending(batch=batch, next_ids=ids, host=None, top_nums=[], event=None, index=index, remote=self.remote)

    def process(self, p: Pending) -> None:
        self.log.append(f"process {p.batch.name}")

    def fail_step(self, e: Exception, reqs: Any) -> None:
        raise AssertionError(f"step failed: {e!r}")

    def end_step(self) -> None:
        """No per-step bookkeeping."""


class IdsLink(ScriptedLink):
    """A stage link that also logs the device ids channel (the last stage's sends, stage 0's receives)."""

    def __init__(self, log: list[str], is_last: bool, results: Optional[list[Any]] = None):
        super().__init__(log, is_last, results)
        self.is_first = not is_last

    def send_ids(self, ids: Any) -> None:
        self.log.append(f"send_ids {len(ids)}")

    def recv_ids(self, n: int, device: Any) -> tuple[Any, Any]:
        self.log.append(f"recv_ids {n}")
        log = self.log
        return torch.full((n,), 7), SimpleNamespace(wait=lambda: log.append("ids wait"))


def test_the_last_stage_chains_the_oldest_decode_before_processing_it_and_sends_every_decodes_ids():
    log: list[str] = []
    a, b = _req("a"), _req("b")
    loop = PipelineLoop(DecodingScheduler([a, b], log, launches=3, remote=False), IdsLink(log, is_last=True), True)
    run(loop, 2)
    empty = repr(([], None, None))
    assert log == [
        "launch D1 ['a']",
        "send_ids 1",
        "launch D2 ['b']",
        "send_ids 1",
        "launch D3 ['a'] after D1",  # a's next step before D1 is processed
        "send_ids 1",
        f"send {empty}",
        "process D1",
    ]
    assert loop.chained == 1 and [p.batch.name for p in loop.inflight] == ["D2", "D3"]
    assert set(loop.busy) == {id(a), id(b)} and loop._refs[id(a)] == 1


def test_stage_0_posts_a_receive_per_decode_and_its_chained_launch_waits_for_it():
    log: list[str] = []
    a, b = _req("a"), _req("b")
    link = IdsLink(log, is_last=False, results=["rD1", "rD2"])
    loop = PipelineLoop(DecodingScheduler([a, b], log, launches=3, remote=True), link, True)
    run(loop, 2)
    assert log == [
        "launch D1 ['a']",
        "recv_ids 1",
        "launch D2 ['b']",
        "recv_ids 1",
        "ids wait",  # the chained launch reads D1's ids: its stream waits for them first
        "launch D3 ['a'] after D1",
        "recv_ids 1",
        "recv",
        "process D1",
    ]
    assert loop.inflight[1].next_ids.tolist() == [7]  # the buffer the receive fills, read by D3's successor


def test_a_request_that_stops_by_length_is_left_out_of_the_chained_step():
    log: list[str] = []
    a, b = _req("a", out=4, max_new=5), _req("b")  # a's token of D1 is its last
    loop = PipelineLoop(DecodingScheduler([a, b], log, launches=3, remote=False), IdsLink(log, is_last=True), True)
    run(loop, 2)
    assert "launch D3 ['a'] after D1" not in log and loop.chained == 0
    assert log[-1] == "process D1" and id(a) not in loop.busy


def test_a_decode_with_a_grammar_or_with_chaining_off_is_processed_before_its_next_step():
    for reqs, chain in (([_req("a", grammar=object()), _req("b", grammar=object())], True), (None, False)):
        log: list[str] = []
        reqs = reqs or [_req("a"), _req("b")]
        link = IdsLink(log, is_last=True)
        loop = PipelineLoop(DecodingScheduler(reqs, log, launches=3, remote=False), link, chain)
        run(loop, 3)
        assert loop.chained == 0
        assert log.index("process D1") < log.index("launch D3 ['a']"), log
        assert ("send_ids 1" in log) == chain  # no device ids without chaining

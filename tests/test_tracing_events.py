"""Per-step phase timings (``StepPhase``) on the event bus: opt-in, in loop order, nothing built without a
subscriber; what bench/decode_latency.py times the scheduler with (no method replaced)."""

from __future__ import annotations

from test_scheduler import greedy, make, prompt, run

from kvship.common.events import EventBus, RequestQueued, StepPhase
from kvship.engine.io_struct import GenerateRequest


def test_step_phases_reach_only_subscribers_that_name_the_kind():
    bus = EventBus()
    assert not bus.phases and not bus.wants(StepPhase)
    every, phases = [], []
    bus.subscribe(every.append)  # tracing and metrics subscribe this way: they never see the phases
    assert bus.active and not bus.phases and not bus.wants(StepPhase)
    stop = bus.subscribe(phases.append, (StepPhase,))
    assert bus.phases and bus.wants(StepPhase)
    bus.emit(StepPhase(phase="recv", start=1.0, end=2.0))
    bus.emit(RequestQueued(rid="a", prompt_tokens=1))
    assert [type(e) for e in every] == [RequestQueued] and [e.phase for e in phases] == ["recv"]
    stop()
    assert not bus.phases


def test_the_scheduler_times_its_steps_through_the_bus_only_when_asked():
    sched, _, out = make()
    sched.submit(GenerateRequest("quiet", prompt(8, 1), greedy(3)))
    run(sched)  # nobody asked: no phase event (a subscriber of every event does not count)
    got: list[StepPhase] = []
    stop = sched.events.subscribe(got.append, (StepPhase,))
    sched.submit(GenerateRequest("timed", prompt(8, 2), greedy(3)))
    run(sched)
    stop()
    steps: list[list[str]] = [[]]
    for ev in got:
        assert ev.start <= ev.end
        steps[-1].append(ev.phase)
        if ev.phase == "end_step":
            steps.append([])
    steps.pop()
    # the prompt's forward, then its decode steps: each a full step in loop order; idle steps recv and end
    assert ["recv", "schedule", "launch", "process", "end_step"] in steps
    assert all(s[0] == "recv" and s[-1] == "end_step" for s in steps)
    forwards = [s for s in steps if "launch" in s]
    assert len(forwards) == 3  # prefill (first token) + 2 decode steps
    for a, b in zip(got, got[1:]):  # phases follow one another on the scheduler thread
        assert a.end <= b.start + 1e-9
    assert len(out.tokens("timed")) == 3 and out.final("timed").finished


def test_the_overlapped_loop_times_its_chained_steps(monkeypatch):
    from kvship.engine.scheduler.overlap import FORCE_ENV

    monkeypatch.setenv(FORCE_ENV, "1")  # the overlapped loop on CPU
    sched, _, out = make()
    assert sched.overlap is not None
    got: list[StepPhase] = []
    stop = sched.events.subscribe(got.append, (StepPhase,))
    for i in range(2):
        sched.submit(GenerateRequest(f"r{i}", prompt(8, 10 + i), greedy(6)))
    run(sched)
    stop()
    names = [ev.phase for ev in got]
    assert names[0] == "recv" and names[-1] == "end_step"
    assert names.count("recv") == names.count("end_step") == names.count("schedule")
    # chained decode steps: step N+1 launched before step N is processed
    assert any(a == "launch" and b == "process" for a, b in zip(names, names[1:]))
    assert names.count("launch") >= 5 and names.count("process") >= names.count("launch") - 1
    assert all(ev.start <= ev.end for ev in got)
    assert all(len(out.tokens(f"r{i}")) == 6 for i in range(2))


def test_step_timing_totals_reach_the_stats_and_metrics_only_with_the_flag():
    """``--enable-step-timing``: the scheduler's own subscriber sums host seconds and calls per phase into its
    stats (/get_server_info) and /metrics; without the flag neither has them and no phase is timed."""
    from kvship.engine.metrics import EngineMetrics

    plain, _, _ = make()
    plain.submit(GenerateRequest("a", prompt(8, 1), greedy(3)))
    run(plain)
    assert not plain.events.phases and "step_phase_s" not in plain.get_stats()
    assert "scheduler_phase" not in EngineMetrics("m", plain.get_stats).render().decode()

    sched, _, out = make(enable_step_timing=True)
    assert sched.events.phases
    sched.submit(GenerateRequest("b", prompt(8, 2), greedy(3)))
    run(sched)
    st = sched.get_stats()
    secs, calls = st["step_phase_s"], st["step_phase_calls"]
    assert calls["launch"] == 3 and calls["process"] == 3  # the prompt's forward and 2 decode steps
    assert calls["recv"] >= 3 and calls["end_step"] == calls["recv"] - 1  # the snapshot is taken inside end_step
    assert all(v >= 0.0 for v in secs.values()) and set(secs) == set(calls)
    text = EngineMetrics("m", sched.get_stats).render().decode()
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('kvship:scheduler_phase_seconds_total{model_name="m",phase="launch"}')
    )
    assert float(line.split()[-1]) == secs["launch"]
    assert len(out.tokens("b")) == 3

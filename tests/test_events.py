"""The engine's event bus: what the scheduler and the PD roles emit, in which order, and who may listen."""

from __future__ import annotations

import pytest
from pd_fixtures import InProcessPD, make_prompts
from prometheus_client.parser import text_string_to_metric_families
from test_scheduler import greedy, make, prompt, run

from kvship.common.events import (
    EventBus,
    KVTransferFinished,
    KVTransferStarted,
    RequestFinished,
    RequestQueued,
    failure_kind,
)
from kvship.engine.io_struct import GenerateRequest
from kvship.engine.metrics import EngineMetrics


def _samples(metrics: EngineMetrics) -> dict:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _life(events: list, rid: str) -> list[str]:
    """The kinds of ``rid``'s events in order (forwards included when ``rid`` is in them)."""
    out = []
    for ev in events:
        rids = getattr(ev, "rids", None)
        if getattr(ev, "rid", None) == rid or (rids is not None and rid in rids):
            name = type(ev).__name__
            out.append(f"{name}:{ev.mode}" if rids is not None else name)
    return out


def test_bus_delivers_to_every_subscriber_survives_a_broken_one_and_filters_by_kind():
    bus = EventBus()
    assert not bus.active and not bus.wants(RequestQueued)
    got, kv_only = [], []

    def broken(ev):
        raise RuntimeError("listener bug")

    bus.subscribe(broken)
    stop = bus.subscribe(got.append)
    stop_kv = bus.subscribe(kv_only.append, kinds=(KVTransferFinished,))
    bus.emit(RequestQueued(rid="a", prompt_tokens=3))
    bus.emit(KVTransferFinished(rid="a", role="decode", backend="tcp", ok=True, bytes=10, seconds=0.1))
    assert [type(e) for e in got] == [RequestQueued, KVTransferFinished]
    assert [type(e) for e in kv_only] == [KVTransferFinished]
    stop()
    bus.emit(RequestQueued(rid="b", prompt_tokens=1))
    assert len(got) == 2
    stop_kv()
    assert bus.active  # ``broken`` still takes everything
    with pytest.raises(AttributeError, match="fixed at construction"):
        sched, _, _ = make()
        sched.events = EventBus()


def test_unified_scheduler_emits_each_requests_life_in_order():
    sched, _, out = make(chunked_prefill_size=8)
    assert not sched.events.active  # nobody listens by default: the emit points build nothing
    events: list = []
    sched.events.subscribe(events.append)
    sched.submit(GenerateRequest("long", prompt(20, 1), greedy(4)))  # 3 chunks of at most 8 tokens
    sched.submit(GenerateRequest("short", prompt(5, 2), greedy(3)))
    sched.submit(GenerateRequest("bad", [10**6], greedy(3)))  # outside the vocabulary: rejected
    run(sched)
    life = _life(events, "long")
    assert life[:3] == ["RequestQueued", "RequestAdmitted", "ForwardStarted:extend"], life
    assert life.count("RequestAdmitted") == 1 and life.count("FirstToken") == 1
    last_extend = max(i for i, e in enumerate(life) if e == "ForwardFinished:extend")
    assert life.index("FirstToken") == last_extend + 1  # sampled by the forward of its last chunk
    assert life.count("ForwardStarted:extend") == 3 == life.count("ForwardFinished:extend")
    assert life[-1] == "RequestFinished"
    fin = [e for e in events if isinstance(e, RequestFinished) and e.rid == "long"]
    assert fin[0].reason == "length" and fin[0].completion_tokens == 4
    short = _life(events, "short")
    assert short[0] == "RequestQueued" and short[-1] == "RequestFinished" and "FirstToken" in short
    [bad] = [e for e in events if getattr(e, "rid", None) == "bad"]
    assert isinstance(bad, RequestFinished) and bad.reason == "abort" and "[0, " in bad.message
    times = [e.at for e in events]
    assert times == sorted(times)  # wall clock, emitted in order


def test_an_aborted_request_finishes_with_an_abort_event():
    sched, _, _ = make()
    events: list = []
    sched.events.subscribe(events.append)
    sched.submit(GenerateRequest("a", prompt(6, 3), greedy(50)))
    for _ in range(3):
        sched.step()
    sched.abort("a")
    run(sched)
    [fin] = [e for e in events if isinstance(e, RequestFinished)]
    assert fin.rid == "a" and fin.reason == "abort" and fin.message


@pytest.mark.timeout(120)
def test_pd_roles_emit_kv_transfers_with_bytes_and_the_metrics_count_them(tiny_llama_dir):
    with InProcessPD(tiny_llama_dir, page_size=16) as pd:
        p_events: list = []
        d_events: list = []
        pd.prefill.events.subscribe(p_events.append)
        pd.decode.events.subscribe(d_events.append)
        metrics = EngineMetrics("tiny", lambda: {})
        metrics.observe_kv_transfers(pd.prefill.events)
        metrics.observe_kv_transfers(pd.decode.events)
        [ids] = make_prompts(1, seed=7, lo=40, hi=41)
        pd.submit("r", ids, max_new=5)
        pd.wait(["r"])
        pd.wait(["r"], side="prefill")
    p_kv = [e for e in p_events if isinstance(e, KVTransferFinished)]
    d_kv = [e for e in d_events if isinstance(e, KVTransferFinished)]
    assert len(p_kv) == 1 and len(d_kv) == 1
    assert p_kv[0].ok and d_kv[0].ok and p_kv[0].role == "prefill" and d_kv[0].role == "decode"
    layout = pd.decode.kv_manager.layout
    pages = -(-len(ids) // 16)
    assert p_kv[0].bytes == d_kv[0].bytes == pages * layout.page_bytes * layout.num_buffers
    assert p_kv[0].backend == "tcp" and p_kv[0].seconds >= 0
    # prefill: the prompt computes, its first token is sampled, then the KV goes
    p_life = _life(p_events, "r")
    assert p_life.index("FirstToken") < p_life.index("KVTransferStarted") < p_life.index("KVTransferFinished")
    # decode: the KV arrives, then the request joins the running batch with prefill's first token
    d_life = _life(d_events, "r")
    assert d_life[0] == "RequestQueued" and d_life[-1] == "RequestFinished"
    assert d_life.index("KVTransferFinished") < d_life.index("RequestAdmitted") < d_life.index("FirstToken")
    assert "ForwardStarted:extend" not in d_life and "ForwardStarted:decode" in d_life
    assert any(isinstance(e, KVTransferStarted) for e in d_events)
    samples = _samples(metrics)
    for role in ("prefill", "decode"):
        labels = (("backend", "tcp"), ("model_name", "tiny"), ("role", role))
        assert samples[("kvship:kv_transfer_bytes_count", labels)] == 1.0
        assert samples[("kvship:kv_transfer_bytes_sum", labels)] == float(p_kv[0].bytes)
        assert samples[("kvship:kv_transfer_duration_seconds_count", labels)] == 1.0


def test_failed_transfers_are_counted_by_a_bounded_reason():
    assert failure_kind("KV transfer failed: bootstrap timed out after 30 s") == "timeout"
    assert failure_kind("aborted by the client") == "aborted"
    assert failure_kind("KV checksum mismatch on layer 3") == "corrupted"
    assert failure_kind("prefill heartbeat lost") == "peer_lost"
    assert failure_kind("something odd") == "other"
    metrics = EngineMetrics("m", lambda: {})
    metrics.observe_kv_transfer(
        KVTransferFinished(rid="x", role="decode", backend="nixl", ok=False, reason="timeout", message="timed out")
    )
    samples = _samples(metrics)
    labels = (("backend", "nixl"), ("model_name", "m"), ("reason", "timeout"), ("role", "decode"))
    assert samples[("kvship:kv_transfer_failures_total", labels)] == 1.0
    assert not any(name == "kvship:kv_transfer_bytes_count" for name, _ in samples)  # no bytes of a failure

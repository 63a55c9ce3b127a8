"""PD latency traces (``return_trace``) and the event-driven wake of the scheduler loop (docs/pd.md).

The stages of one request must all be stamped, in causal order, on one wall clock (``time.time()``) shared by
the router, the prefill worker and the decode worker; tracing must not change the tokens.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from pd_fixtures import InProcessPD, make_prompts, start_local, unified_greedy

pytestmark = pytest.mark.timeout(300)

PREFILL_CHAIN = [
    "scheduled",
    "admitted",
    "forward_done",
    "kv_send_end",
    "transfer_done",
]
DECODE_CHAIN = [
    "scheduled",
    "room_registered",
    "kv_arrived",
    "kv_verified",
    "admitted",
    "first_token_flush",
]


def _assert_chain(stamps: dict[str, float], chain: list[str], who: str) -> None:
    missing = [k for k in chain if k not in stamps]
    assert not missing, f"{who}: stages {missing} not stamped: {stamps}"
    times = [stamps[k] for k in chain]
    assert times == sorted(times), f"{who}: stages out of order: {[(k, stamps[k]) for k in chain]}"


def _assert_cross(p: dict[str, float], d: dict[str, float]) -> None:
    """Stamps of the two processes that are causally ordered, compared on the shared clock."""
    assert d["room_registered"] <= p["room_registered"], "prefill saw the registration before decode sent it"
    # the prompt computes beside decode's registration; the transfer waits for both
    assert p["scheduled"] <= p["admitted"] <= p["forward_done"]
    if "kv_layers_first" in p:  # layer-wise (docs/pd.md): the send starts with the forward of the last chunk
        _assert_chain(p, ["admitted", "kv_send_start", "kv_layers_first", "kv_layers_last", "kv_tail_start"], "p")
        assert p["room_registered"] <= p["kv_send_start"], "KV sent before it had a place"
        assert p["forward_done"] <= p["kv_tail_start"] <= p["kv_send_end"], "aux record before the first token"
    else:
        assert max(p["room_registered"], p["forward_done"]) <= p["kv_send_start"], "KV sent before it had a place"
    assert p["kv_send_start"] <= p["kv_send_end"]
    # Started travels on the control link, the data on the backend's own: it may be seen after the data (or,
    # once the room is done, not at all)
    if "kv_started" in d:
        assert p["kv_send_start"] <= d["kv_started"], "decode saw Started before prefill began the transfer"
    assert p["kv_send_start"] <= d["kv_arrived"], "the KV arrived before prefill began sending it"
    assert p["forward_done"] <= d["kv_arrived"], "the KV arrived before prefill computed it"


def test_inbox_wake_ends_a_blocking_drain_and_keeps_real_messages():
    from kvship.engine.scheduler.inbox import Abort, Inbox

    inbox = Inbox()
    inbox.wake()
    inbox.wake()  # collapses into one
    assert inbox.empty(), "a pending wake alone is not a message"
    assert inbox.drain(0.0) == []
    timer = threading.Timer(0.05, inbox.wake)
    timer.start()
    t0 = time.monotonic()
    assert inbox.drain(30.0) == []
    assert time.monotonic() - t0 < 10.0, "wake() did not end the blocking drain"
    inbox.wake()
    inbox.put(Abort("r1"))
    assert not inbox.empty()
    assert inbox.drain(1.0) == [Abort("r1")], "a message queued behind a wake must still arrive"
    inbox.wake()
    assert inbox.drain(0.0) == [] and inbox.empty()


def test_pd_trace_stamps_every_stage_in_order_in_process(tiny_llama_dir):
    prompts = make_prompts(3, seed=41, lo=20, hi=90)
    with InProcessPD(tiny_llama_dir, page_size=16, disable_radix_cache=True) as pd:
        traces = []
        for i, ids in enumerate(prompts):
            p_trace, d_trace = {}, {}
            room = pd.submit(f"t{i}", ids, max_new=6, to="decode", trace=d_trace)
            pd.submit(f"t{i}", ids, max_new=6, to="prefill", room=room, trace=p_trace)
            traces.append((p_trace, d_trace))
        rids = [f"t{i}" for i in range(len(prompts))]
        pd.wait(rids)
        pd.wait(rids, side="prefill")
        assert [pd.tokens(r) for r in rids] == unified_greedy(
            tiny_llama_dir, prompts, 6, page_size=16, disable_radix_cache=True
        )
        for p_trace, d_trace in traces:
            _assert_chain(p_trace, PREFILL_CHAIN, "prefill")
            _assert_chain(d_trace, DECODE_CHAIN, "decode")
            _assert_cross(p_trace, d_trace)
        pd.wait_idle()


@pytest.fixture(scope="module")
def tcp_1x1(tiny_llama_dir):
    args = ["--transfer-backend", "tcp", "--model-path", tiny_llama_dir, "--device", "cpu", "--page-size", "16"]
    with start_local(args) as cluster:
        yield cluster


def test_trace_through_router_and_both_workers_is_on_one_clock_and_keeps_the_tokens(tcp_1x1):
    ids = make_prompts(1, seed=42, lo=60, hi=60)[0]
    plain = tcp_1x1.generate(ids, max_new=5)
    assert plain.status_code == 200, plain.text
    assert "trace" not in plain.json()["meta_info"] and "x-kvship-trace" not in plain.headers
    ids2 = make_prompts(1, seed=43, lo=60, hi=60)[0]
    t0 = time.time()
    traced = tcp_1x1.generate(ids2, max_new=5, return_trace=True)
    t1 = time.time()
    assert traced.status_code == 200, traced.text
    again = tcp_1x1.generate(ids2, max_new=5)
    assert traced.json()["output_ids"] == again.json()["output_ids"], "tracing changed the tokens"

    d = traced.json()["meta_info"]["trace"]
    head = json.loads(traced.headers["x-kvship-trace"])
    assert head["clock"] == "time.time"
    r, p = head["router"], head["prefill"]
    _assert_chain(p, ["http_received"] + PREFILL_CHAIN + ["http_respond"], "prefill")
    _assert_chain(d, ["http_received"] + DECODE_CHAIN + ["http_respond"], "decode")
    _assert_chain(r, ["received", "sent", "decode_first_byte", "prefill_reply"], "router")
    _assert_cross(p, d)
    assert t0 <= r["received"] and r["prefill_reply"] <= t1, "router stamps outside the client's call"
    assert r["sent"] <= min(p["http_received"], d["http_received"])
    assert d["http_respond"] <= r["decode_first_byte"]
    assert p["http_respond"] <= r["prefill_reply"]


def test_bad_return_trace_is_a_client_error(tcp_1x1):
    resp = tcp_1x1.generate([5, 6, 7], max_new=2, return_trace="yes")
    assert 400 <= resp.status_code < 500, resp.text
    assert "return_trace" in resp.text

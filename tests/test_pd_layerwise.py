"""Layer-wise KV transfer (docs/pd.md, "Layer-wise transfer"): a prefill worker writes each layer's KV while
later layers compute, when decode registered the room before the prompt's last chunk runs.

PrefillScheduler + DecodeScheduler in one process over the real transfer layer (tiny random model, 2 layers):

* greedy tokens equal the unified scheduler's, every backend, page sizes 1 and 16, prompts shorter and
  longer than the chunk, every room layer-wise (``kv_transfers_layerwise``);
* the transfer overlaps the forward: with the last layer's attention held, layer 0's KV is already in
  decode's pool, and the trace's ``kv_layers_first`` comes before ``forward_done``;
* fallbacks to the whole-request send: layer-wise off, a checksum asked for, decode registering only
  after the forward started;
* failures mid-forward: decode aborting, decode's transfer layer dying, the forward raising; every KV
  slot comes back on both sides, and the next request is served.
"""

from __future__ import annotations

import time

import pytest
from pd_fixtures import HeldLayer, InProcessPD, layer0_on_decode, make_prompts, unified_greedy

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 8
CHUNK = 32
LAST = 1  # the tiny models' last layer (2 layers)


def _layerwise_count(pd: InProcessPD) -> int:
    return pd.prefill.get_stats()["kv_transfers_layerwise"]


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_layerwise_pd_greedy_output_equals_unified(tiny_llama_dir, backend, page_size):
    prompts = make_prompts(10, seed=40 + page_size, lo=1, hi=100)  # 1..3 chunks of 32
    kw = dict(page_size=page_size, chunked_prefill_size=CHUNK)
    threads = dict(transfer_threads=len(prompts) + 1)  # a thread for every room: all can go layer-wise
    with InProcessPD(tiny_llama_dir, backend=backend, prefill_kv=threads, **kw) as pd:
        rids = pd.run_registered_first(prompts, MAX_NEW)
        expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW, **kw)
        for rid, want in zip(rids, expected):
            assert pd.finish(rid, "prefill") == {"type": "length", "length": 0}
            assert pd.tokens(rid) == want, rid
        assert _layerwise_count(pd) == len(prompts)
        pd.wait_idle()


def test_prompts_below_the_layerwise_minimum_send_the_whole_request(tiny_llama_dir):
    """``--disaggregation-layerwise-min-tokens``: a prompt shorter than it goes whole after the forward, a
    longer one layer-wise; both give unified's tokens."""
    short, long = make_prompts(1, seed=45, lo=20, hi=30) + make_prompts(1, seed=46, lo=70, hi=90)
    kw = dict(page_size=16, chunked_prefill_size=CHUNK)
    expected = unified_greedy(tiny_llama_dir, [short, long], MAX_NEW, **kw)
    threads = dict(transfer_threads=3)
    with InProcessPD(
        tiny_llama_dir, prefill_kv=threads, prefill_args=dict(disaggregation_layerwise_min_tokens=50), **kw
    ) as pd:
        rids = pd.run_registered_first([short, long], MAX_NEW)
        assert [pd.tokens(r) for r in rids] == expected
        assert _layerwise_count(pd) == 1  # the long one
        pd.wait_idle()


def test_layerwise_off_and_checksum_send_the_whole_request_a_late_registration_goes_layerwise(tiny_llama_dir):
    prompts = make_prompts(3, seed=44, lo=40, hi=90)
    kw = dict(page_size=16, chunked_prefill_size=CHUNK)
    expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW, **kw)
    off = dict(disaggregation_layerwise=False)
    with InProcessPD(tiny_llama_dir, prefill_args=off, **kw) as pd:
        rids = pd.run_registered_first(prompts, MAX_NEW)
        assert [pd.tokens(r) for r in rids] == expected
        assert _layerwise_count(pd) == 0
        pd.wait_idle()
    with InProcessPD(tiny_llama_dir, decode_kv=dict(checksum=True), **kw) as pd:
        rids = pd.run_registered_first(prompts, MAX_NEW)
        assert [pd.tokens(r) for r in rids] == expected
        assert _layerwise_count(pd) == 0
        pd.wait_idle()
    with InProcessPD(tiny_llama_dir, **kw) as pd:  # prefill computes before decode registers
        rooms = [pd.submit(f"r{i}", p, MAX_NEW, to="prefill") for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 30
        while pd.prefill.get_stats()["inflight_queue"] != len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        for i, (p, room) in enumerate(zip(prompts, rooms)):
            pd.submit(f"r{i}", p, MAX_NEW, to="decode", room=room)
        rids = [f"r{i}" for i in range(len(prompts))]
        pd.wait(rids)
        assert [pd.tokens(r) for r in rids] == expected
        # the first room went layer-wise once registered (every layer at once: its forward was over); it held
        # the one layer-wise transfer thread meanwhile, so the other two went whole
        assert _layerwise_count(pd) == 1
        pd.wait_idle()


def test_layerwise_transfer_writes_early_layers_while_later_layers_compute(tiny_llama_dir):
    prompt = make_prompts(1, seed=45, lo=70, hi=70)[0]
    kw = dict(page_size=16, chunked_prefill_size=CHUNK)
    with InProcessPD(tiny_llama_dir, **kw) as pd:
        with HeldLayer(pd, LAST, while_held=lambda: layer0_on_decode(pd, "x", len(prompt))) as hold:
            hold.release.set()  # the check itself is the hold
            p_trace, d_trace = {}, {}
            room = pd.submit("x", prompt, MAX_NEW, to="decode", trace=d_trace)
            pd.wait_registered(1)
            pd.submit("x", prompt, MAX_NEW, to="prefill", room=room, trace=p_trace)
            pd.wait(["x"])
            pd.wait(["x"], side="prefill")
        assert hold.held.is_set()
        assert hold.result is True, "layer 0's KV had not reached decode while the last layer waited"
        assert p_trace["kv_send_start"] <= p_trace["kv_layers_first"] < hold.done_at < p_trace["forward_done"]
        assert p_trace["kv_layers_last"] <= p_trace["kv_tail_start"] <= p_trace["kv_send_end"]
        assert pd.tokens("x") == unified_greedy(tiny_llama_dir, [prompt], MAX_NEW, **kw)[0]
        assert _layerwise_count(pd) == 1
        pd.wait_idle()


def _held_layerwise_request(pd: InProcessPD, prompt: list[int], hold: HeldLayer) -> None:
    room = pd.submit("mid", prompt, MAX_NEW, to="decode")
    pd.wait_registered(1)
    pd.submit("mid", prompt, MAX_NEW, to="prefill", room=room)
    assert hold.held.wait(30), "the last layer never ran"
    m = pd.prefill.kv_manager
    with m.lock:
        assert m.layerwise_rooms() == 1


def _serves_the_next_request(pd: InProcessPD, model_dir: str, **kw) -> None:
    prompt = make_prompts(1, seed=46, lo=50, hi=50)[0]
    pd.submit("next", prompt, MAX_NEW)
    pd.wait(["next"])
    assert pd.tokens("next") == unified_greedy(model_dir, [prompt], MAX_NEW, **kw)[0]


def test_decode_aborting_during_a_layerwise_send_frees_every_slot(tiny_llama_dir):
    prompt = make_prompts(1, seed=47, lo=70, hi=70)[0]
    kw = dict(page_size=16, chunked_prefill_size=CHUNK)
    with InProcessPD(tiny_llama_dir, **kw) as pd:
        with HeldLayer(pd, LAST) as hold:
            _held_layerwise_request(pd, prompt, hold)
            pd.decode.abort("mid")
            pd.wait(["mid"])  # decode finishes once prefill acknowledged: its thread let go while the forward waits
            assert pd.finish("mid")["type"] == "abort"
            hold.release.set()
            pd.wait(["mid"], side="prefill")
        assert "aborted by decode" in pd.finish("mid", "prefill")["message"], pd.finish("mid", "prefill")
        pd.wait_idle()
        _serves_the_next_request(pd, tiny_llama_dir, **kw)
        pd.wait_idle()


def test_decode_dying_during_a_layerwise_send_frees_every_slot(tiny_llama_dir):
    prompt = make_prompts(1, seed=48, lo=70, hi=70)[0]
    with InProcessPD(tiny_llama_dir, page_size=16, chunked_prefill_size=CHUNK) as pd:
        with HeldLayer(pd, LAST) as hold:
            _held_layerwise_request(pd, prompt, hold)
            pd.decode.kv_manager.close()  # decode's transfer layer goes away while prefill's forward runs
            deadline = time.monotonic() + 30
            m = pd.prefill.kv_manager
            while m._senders and time.monotonic() < deadline:  # the transfer thread let go before the forward ended
                time.sleep(0.01)
            assert not m._senders
            hold.release.set()
            pd.wait(["mid"], side="prefill")
        assert "decode" in pd.finish("mid", "prefill")["message"], pd.finish("mid", "prefill")
        pd.wait(["mid"])
        assert pd.finish("mid")["type"] == "abort"
        pd.wait_idle()


def test_a_forward_failing_during_a_layerwise_send_fails_both_sides_and_frees_every_slot(tiny_llama_dir):
    prompt = make_prompts(1, seed=49, lo=70, hi=70)[0]  # 3 chunks: the failure hits the last one
    kw = dict(page_size=16, chunked_prefill_size=CHUNK)
    with InProcessPD(tiny_llama_dir, **kw) as pd:
        with HeldLayer(pd, LAST, fail=True) as hold:
            _held_layerwise_request(pd, prompt, hold)
            hold.release.set()
            pd.wait(["mid"], side="prefill")
        assert "injected failure" in pd.finish("mid", "prefill")["message"], pd.finish("mid", "prefill")
        pd.wait(["mid"])
        assert pd.finish("mid")["type"] == "abort"
        message = pd.finish("mid")["message"]  # the sender's own verdict, or the scheduler's abort if that came first
        assert "prefill forward failed" in message or "injected failure" in message, message
        pd.wait_idle()
        _serves_the_next_request(pd, tiny_llama_dir, **kw)
        pd.wait_idle()

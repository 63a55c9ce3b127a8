"""PrefillScheduler + DecodeScheduler in one process over the real transfer layer (tiny random model).

Checks PD against the unified scheduler token for token, the stage queues
(pre-allocation under memory pressure), and that every failure path (abort in
each stage, timeouts, peer death, corrupted KV, layout mismatch) ends with a
clear reason and every KV slot free on both sides.
"""

from __future__ import annotations

import time

import pytest
from pd_fixtures import InProcessPD, make_prompts, unified_greedy

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 16


def _run_and_compare(pd: InProcessPD, model_dir: str, prompts: list[list[int]], **unified_kw) -> None:
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        pd.submit(rid, p, MAX_NEW)
    pd.wait(rids)
    pd.wait(rids, side="prefill")
    expected = unified_greedy(model_dir, prompts, MAX_NEW, **unified_kw)
    for rid, want in zip(rids, expected):
        assert pd.finish(rid)["type"] in ("stop", "length"), pd.finish(rid)
        assert pd.finish(rid, "prefill") == {"type": "length", "length": 0}
        assert pd.tokens(rid) == want, rid
    pd.wait_idle()


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pd_greedy_output_equals_unified_for_each_backend_and_page_size(tiny_llama_dir, backend, page_size):
    prompts = make_prompts(32, seed=page_size, lo=1, hi=100)
    kw = dict(page_size=page_size, chunked_prefill_size=32)  # prompts longer than a chunk are common here
    with InProcessPD(tiny_llama_dir, backend=backend, **kw) as pd:
        _run_and_compare(pd, tiny_llama_dir, prompts, **kw)
        stats = pd.prefill.get_stats()
        assert stats["kv_transfers_ok"] == len(prompts) and stats["kv_transfers_failed"] == 0
        assert pd.decode.get_stats()["kv_transfers_ok"] == len(prompts)


@pytest.fixture(scope="module")
def smollm2_runners(smollm2_path):
    from pd_fixtures import _server_args

    from kvship.engine.model_runner import ModelRunner

    kw = dict(max_total_tokens=4096, page_size=16, disable_radix_cache=True)
    return ModelRunner(_server_args(smollm2_path, mode="prefill", **kw)), ModelRunner(
        _server_args(smollm2_path, mode="decode", **kw)
    )


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_pd_smollm2_greedy_output_equals_unified_for_each_backend(smollm2_path, smollm2_runners, backend):
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits."]
    prompts = [tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    kw = dict(max_total_tokens=4096, page_size=16, disable_radix_cache=True, chunked_prefill_size=16)
    with InProcessPD(smollm2_path, backend=backend, runners=smollm2_runners, **kw) as pd:
        _run_and_compare(pd, smollm2_path, prompts, **kw)
    assert "Paris" in tok.decode(unified_greedy(smollm2_path, prompts, MAX_NEW, **kw)[0])


def test_prefill_radix_cache_serves_repeated_prefix_and_output_still_matches(tiny_llama_dir):
    base = make_prompts(1, seed=7, lo=64, hi=64)[0]
    prompts = [base + tail for tail in make_prompts(6, seed=8, lo=3, hi=20)]
    with InProcessPD(tiny_llama_dir, page_size=16) as pd:
        _run_and_compare(pd, tiny_llama_dir, prompts[:1], page_size=16)
        before = pd.prefill.get_stats()["cached_tokens"]
        pd.submit("again", prompts[1], MAX_NEW)
        pd.wait(["again"])
        assert pd.prefill.get_stats()["cached_tokens"] - before >= 64
        assert pd.tokens("again") == unified_greedy(tiny_llama_dir, prompts[1:2], MAX_NEW, page_size=16)[0]
        pd.wait_idle()


def test_decode_queues_requests_in_prealloc_when_its_kv_pool_is_small(tiny_llama_dir):
    prompts = make_prompts(24, seed=3, lo=40, hi=90)
    with InProcessPD(tiny_llama_dir, decode_args=dict(max_total_tokens=256)) as pd:
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, MAX_NEW)
        peak = 0
        deadline = time.monotonic() + 60
        while not all(pd.d_out.finished(r) for r in rids) and time.monotonic() < deadline:
            peak = max(peak, pd.decode.get_stats()["prealloc_queue"])
            time.sleep(0.005)
        pd.wait(rids)
        assert peak > 0, "the small decode pool never made a request wait for memory"
        expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW)
        assert [pd.tokens(r) for r in rids] == expected
        pd.wait_idle()


def test_requests_without_bootstrap_fields_are_rejected_with_a_clear_reason(tiny_llama_dir):
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    with InProcessPD(tiny_llama_dir) as pd:
        sp = SamplingParams(max_new_tokens=4, temperature=0.0)
        pd.prefill.submit(GenerateRequest(rid="p", input_ids=[5, 6, 7], sampling_params=sp))
        pd.decode.submit(GenerateRequest(rid="d", input_ids=[5, 6, 7], sampling_params=sp, bootstrap_room=5))
        pd.wait(["p"], side="prefill")
        pd.wait(["d"])
        assert "bootstrap_room" in pd.finish("p", "prefill")["message"]
        assert "bootstrap_host" in pd.finish("d")["message"]
        pd.wait_idle()


def test_a_room_used_twice_on_prefill_fails_the_second_request(tiny_llama_dir):
    with InProcessPD(tiny_llama_dir) as pd:
        room = pd.submit("a", [5, 6, 7], to="prefill")
        pd.submit("b", [5, 6, 7], to="prefill", room=room)
        pd.wait(["b"], side="prefill")
        assert "already" in pd.finish("b", "prefill")["message"]
        pd.prefill.abort("a")
        pd.wait(["a"], side="prefill")
        pd.wait_idle()


def test_abort_in_every_stage_frees_every_slot_on_both_sides(tiny_llama_dir):
    prompt = make_prompts(1, seed=1, lo=50, hi=50)[0]
    with InProcessPD(tiny_llama_dir, page_size=16) as pd:
        # prefill bootstrap stage: decode never registers
        pd.submit("pb", prompt, to="prefill")
        # decode transfer stage: slots allocated and registered, prefill never gets the request
        pd.submit("dt", prompt, to="decode")
        time.sleep(0.5)
        assert pd.prefill.get_stats()["bootstrap_queue"] == 1
        assert pd.decode.get_stats()["transfer_queue"] == 1
        assert pd.decode.get_stats()["free_slots"] < pd.decode.get_stats()["total_slots"]
        pd.prefill.abort("pb")
        pd.decode.abort("dt")
        # running on decode: a long generation aborted mid-way
        pd.submit("run", prompt, max_new=400)
        deadline = time.monotonic() + 30
        while len(pd.tokens("run")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        pd.decode.abort("run")
        pd.prefill.abort("run")
        pd.wait(["pb", "run"], side="prefill")
        pd.wait(["dt", "run"])
        assert pd.finish("pb", "prefill")["type"] == "abort"
        assert pd.finish("dt")["type"] == "abort"
        assert pd.finish("run")["type"] == "abort"
        pd.wait_idle()


def test_prefill_computes_before_decode_registers_and_sends_once_it_does(tiny_llama_dir):
    prompt = make_prompts(1, seed=11, lo=70, hi=70)[0]
    with InProcessPD(tiny_llama_dir, page_size=16) as pd:
        room = pd.submit("early", prompt, to="prefill")
        deadline = time.monotonic() + 30
        while pd.prefill.get_stats()["inflight_queue"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = pd.prefill.get_stats()
        # computed and handed to the sender, which waits for decode's registration
        assert (st["inflight_queue"], st["prefill_waiting_queue"], st["bootstrap_queue"]) == (1, 0, 1), st
        pd.submit("early", prompt, to="decode", room=room)
        pd.wait(["early"])
        pd.wait(["early"], side="prefill")
        assert pd.finish("early", "prefill") == {"type": "length", "length": 0}
        assert pd.tokens("early") == unified_greedy(tiny_llama_dir, [prompt], MAX_NEW, page_size=16)[0]
        pd.wait_idle()


def test_wait_for_room_flag_keeps_the_prompt_waiting_until_decode_registers(tiny_llama_dir):
    prompt = make_prompts(1, seed=12, lo=40, hi=40)[0]
    flag = dict(disaggregation_prefill_wait_for_room=True)
    with InProcessPD(tiny_llama_dir, page_size=16, prefill_args=flag) as pd:
        room = pd.submit("held", prompt, to="prefill")
        time.sleep(0.5)
        st = pd.prefill.get_stats()
        assert (st["bootstrap_queue"], st["inflight_queue"], st["free_slots"]) == (1, 0, st["total_slots"]), st
        pd.submit("held", prompt, to="decode", room=room)
        pd.wait(["held"])
        assert pd.tokens("held") == unified_greedy(tiny_llama_dir, [prompt], MAX_NEW, page_size=16)[0]
        pd.wait_idle()


def test_a_room_that_fails_while_its_prompt_waits_for_memory_aborts_the_prompt(tiny_llama_dir):
    a, b = make_prompts(2, seed=13, lo=100, hi=100)
    with InProcessPD(tiny_llama_dir, prefill_args=dict(max_total_tokens=160)) as pd:
        pd.submit("pinned", a, to="prefill")  # computed; its KV stays pinned until decode registers the room
        deadline = time.monotonic() + 30
        while pd.prefill.get_stats()["inflight_queue"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        pd.submit("starved", b)  # no room for its whole prompt on prefill; decode registers it
        # "starved" computes (or waits) and prefill saw its registration: only "pinned" is unregistered
        st = pd.prefill.get_stats()
        while (st["prefill_waiting_queue"], st["bootstrap_queue"]) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
            st = pd.prefill.get_stats()
        assert (st["prefill_waiting_queue"], st["bootstrap_queue"]) == (1, 1), st
        pd.decode.abort("starved")  # prefill's sender fails while the prompt waits: the prompt is aborted
        pd.wait(["starved"], side="prefill")
        assert "aborted by decode" in pd.finish("starved", "prefill")["message"], pd.finish("starved", "prefill")
        assert pd.prefill.get_stats()["prefill_waiting_queue"] == 0
        pd.prefill.abort("pinned")
        pd.wait(["pinned"], side="prefill")
        pd.wait(["starved"])
        pd.wait_idle()


def test_transfer_timeouts_fail_the_request_and_free_its_slots(tiny_llama_dir):
    kv = dict(bootstrap_timeout=1.0, waiting_timeout=1.0)
    with InProcessPD(tiny_llama_dir, prefill_kv=kv, decode_kv=kv) as pd:
        pd.submit("lonely-prefill", [5, 6, 7, 8], to="prefill")
        pd.submit("lonely-decode", [5, 6, 7, 8], to="decode")
        pd.wait(["lonely-prefill"], side="prefill", timeout=20)
        pd.wait(["lonely-decode"], timeout=20)
        assert "bootstrap timeout" in pd.finish("lonely-prefill", "prefill")["message"]
        assert "timeout" in pd.finish("lonely-decode")["message"]
        pd.wait_idle()


def test_corrupted_page_is_caught_by_the_kv_checksum(tiny_llama_dir):
    from kv_faults import corrupting_prefill_managers

    with (
        corrupting_prefill_managers(every=2),
        InProcessPD(tiny_llama_dir, page_size=16, decode_kv=dict(checksum=True)) as pd,
    ):
        prompts = make_prompts(4, seed=5, lo=40, hi=60)
        rids = [f"c{i}" for i in range(4)]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, MAX_NEW)
        pd.wait(rids)
        pd.wait(rids, side="prefill")
        reasons = [pd.finish(r) for r in rids]
        bad = [r for r in reasons if r["type"] == "abort"]
        assert len(bad) == 2, reasons
        assert all("checksum mismatch" in r["message"] for r in bad)
        good = [i for i, r in enumerate(reasons) if r["type"] != "abort"]
        expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW, page_size=16)
        assert all(pd.tokens(rids[i]) == expected[i] for i in good)
        pd.wait_idle()


def test_decode_frees_its_slots_when_the_prefill_side_goes_away(tiny_llama_dir):
    prompt = make_prompts(1, seed=2, lo=30, hi=30)[0]
    with InProcessPD(tiny_llama_dir) as pd:
        pd.submit("orphan", prompt, to="decode")
        time.sleep(0.5)
        assert pd.decode.get_stats()["transfer_queue"] == 1
        pd.p_thread.stop()  # the prefill loop exits: its transfer layer closes every connection
        pd.wait(["orphan"], timeout=20)
        assert "prefill" in pd.finish("orphan")["message"]
        st = pd.decode.get_stats()
        deadline = time.monotonic() + 10
        while st["free_slots"] != st["total_slots"] and time.monotonic() < deadline:
            time.sleep(0.05)
            st = pd.decode.get_stats()
        assert st["free_slots"] == st["total_slots"]
        assert not pd.decode.reqs


def test_layout_mismatch_between_workers_is_refused_clearly(tiny_llama_dir):
    with InProcessPD(tiny_llama_dir, prefill_args=dict(page_size=16), decode_args=dict(page_size=1)) as pd:
        pd.submit("m", [5, 6, 7, 8, 9], to="decode")
        pd.wait(["m"], timeout=20)
        assert "page_size" in pd.finish("m")["message"]
        pd.wait_idle()


# --- a peer dying in the middle of a transfer -------------------------------------------------


def _stalling_backend():
    """A test double of the tcp backend whose KV write stops halfway until ``gate`` is set."""
    import threading

    import numpy as np

    from kvship.engine.disagg.base import TransferDescs, register_transfer_backend
    from kvship.engine.disagg.tcp import TcpBackend

    class StallingTcp(TcpBackend):
        started = threading.Event()
        gate = threading.Event()

        def write(self, peer_id, room, descs, done=False):
            if done or len(descs) < 2:  # the aux record goes through untouched
                return super().write(peer_id, room, descs, done)
            h = len(descs) // 2
            part = lambda sl: TransferDescs(
                *(
                    np.ascontiguousarray(a[sl])
                    for a in (descs.src_region, descs.src_off, descs.dst_region, descs.dst_off, descs.length)  # noqa: E731
                )
            )
            super().write(peer_id, room, part(slice(0, h)))
            type(self).started.set()
            type(self).gate.wait(30)
            super().write(peer_id, room, part(slice(h, None)))

    register_transfer_backend("stalling_tcp")(StallingTcp)
    StallingTcp.started.clear()
    StallingTcp.gate.clear()
    return StallingTcp


def test_prefill_dying_mid_transfer_frees_the_slots_on_both_sides(tiny_llama_dir):
    backend = _stalling_backend()
    prompt = make_prompts(1, seed=4, lo=70, hi=70)[0]
    with InProcessPD(tiny_llama_dir, backend="stalling_tcp", page_size=16) as pd:
        pd.submit("mid", prompt, MAX_NEW)
        assert backend.started.wait(30), "the transfer never started"
        assert pd.decode.get_stats()["transfer_queue"] == 1
        # the prefill side vanishes: control and data connections drop with half the pages written
        pd.prefill.kv_manager.server.close()
        pd.prefill.kv_manager.backend.close()
        pd.wait(["mid"], timeout=30)
        assert "disconnected" in pd.finish("mid")["message"], pd.finish("mid")
        backend.gate.set()  # the stalled write resumes into a closed socket and fails
        pd.wait(["mid"], side="prefill", timeout=30)
        assert pd.finish("mid", "prefill")["type"] == "abort"
        pd.wait_idle()


def test_decode_dying_mid_transfer_frees_the_slots_on_both_sides(tiny_llama_dir):
    backend = _stalling_backend()
    prompt = make_prompts(1, seed=5, lo=70, hi=70)[0]
    with InProcessPD(tiny_llama_dir, backend="stalling_tcp", page_size=16) as pd:
        pd.submit("mid", prompt, MAX_NEW)
        assert backend.started.wait(30), "the transfer never started"
        pd.decode.kv_manager.close()  # decode's transfer layer goes away with the write in flight
        backend.gate.set()
        pd.wait(["mid"], side="prefill", timeout=30)
        assert "decode" in pd.finish("mid", "prefill")["message"], pd.finish("mid", "prefill")
        pd.wait(["mid"], timeout=30)
        assert pd.finish("mid")["type"] == "abort"
        pd.wait_idle()

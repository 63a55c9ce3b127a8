"""PD with tensor parallelism: a prefill worker at TP=a feeds a decode worker at TP=b (docs/parallel.md).

* The head-slice plan (``kvship.engine.disagg.tp_slices``): every decode rank's
  KV heads come from exactly one prefill rank that holds them, for split and
  replicated heads, and the descriptors it yields move exactly those bytes
  (executed here with numpy, as a backend would).
* The lock-step verdict of ``tp_sync.agree``.
* Real managers on every backend (tcp, mooncake, nixl): ``a`` prefill ranks and
  ``b`` decode ranks, each with its own pool holding its heads of one global KV,
  transfer a room (2->1, 1->2, 2->2 with replicated heads) with checksums on,
  and again layer-wise;
  each decode rank ends with exactly its heads; aborts on one rank end every
  rank's transfer; no room or aux slot is left behind.
* ``kvship local --prefill-tp-size a --decode-tp-size b`` (2 -> 1 and 1 -> 2 over tcp,
  2 -> 1 over nixl, 1 -> 2 over mooncake): greedy tokens equal to unified TP=1,
  every rank's KV slots back to full.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from pd_fixtures import KV_SECRET, make_prompts, room_token, start_local, unified_greedy
from transfer_scenario import run_scenario

from kvship.engine.disagg.base import BackendUnavailableError, KVPoll, get_transfer_backend
from kvship.engine.disagg.descriptors import page_runs
from kvship.engine.disagg.tp_slices import head_slice, plan_head_slices, rank_kv_heads, slice_kv_descs
from kvship.engine.disagg.tp_sync import agree
from kvship.engine.parallel.layers import head_split

os.environ.setdefault("UCX_MODULES", "^ib")  # as tests/test_kv_transfer.py: Debian's ibverbs provider crashes UCX

# (model KV heads, prefill tp, decode tp) combinations the plan must serve
COMBOS = [
    (k, a, b)
    for k in (1, 2, 3, 4, 6, 8)
    for a in (1, 2, 3, 4, 6, 8)
    for b in (1, 2, 3, 4, 6, 8)
    if (a <= k and k % a == 0 or a > k and a % k == 0) and (b <= k and k % b == 0 or b > k and b % k == 0)
]


# --- the plan ---------------------------------------------------------------------------------
def test_rank_kv_heads_is_the_model_layers_head_split():
    for k, tp, _ in COMBOS:
        for rank in range(tp):
            split = head_split(k * tp, k, tp, rank)
            assert rank_kv_heads(k, tp, rank) == (split.kv_head_start, split.num_kv_heads)


@pytest.mark.parametrize("k,a,b", COMBOS)
def test_every_decode_head_comes_from_exactly_one_prefill_rank_that_holds_it(k, a, b):
    for d in range(b):
        d0, dn = rank_kv_heads(k, b, d)
        got = []
        for s in plan_head_slices(k, a, b, d):
            p0, pn = rank_kv_heads(k, a, s.src_rank)
            assert 0 <= s.src_head and s.src_head + s.num_heads <= pn  # the prefill rank holds them
            got += [(p0 + s.src_head + i, s.dst_head + i) for i in range(s.num_heads)]
            assert head_slice(k, a, s.src_rank, b, d) == s
        assert got == [(d0 + i, i) for i in range(dn)]
    if a == b:  # same layout: rank r feeds rank r whole pages
        assert all(plan_head_slices(k, a, b, r)[0].src_rank == r for r in range(b))


def _execute(descs, src_bufs: list[np.ndarray], dst_bufs: list[np.ndarray]) -> None:
    """What every backend does with descriptors: copy bytes region to region."""
    for sr, so, dr, do, n in zip(descs.src_region, descs.src_off, descs.dst_region, descs.dst_off, descs.length):
        dst_bufs[dr].view(np.uint8).reshape(-1)[do : do + n] = src_bufs[sr].view(np.uint8).reshape(-1)[so : so + n]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("k,a,b", [(4, 2, 1), (4, 1, 2), (4, 4, 2), (2, 4, 1), (1, 2, 2), (6, 3, 2), (2, 1, 4)])
def test_slice_descriptors_move_exactly_each_decode_ranks_heads(k, a, b, page_size):
    rng = np.random.default_rng(k * 100 + a * 10 + b)
    layers, hd, pages = 2, 3, 12
    rows = (pages + 1) * page_size
    full = [rng.standard_normal((rows, k, hd)).astype(np.float32) for _ in range(2 * layers)]
    src_pages = np.array([3, 4, 5, 9, 1], dtype=np.int64)
    dst_pages = np.array([7, 2, 8, 10, 11], dtype=np.int64)
    runs = page_runs(src_pages, dst_pages)
    for d in range(b):
        d0, dn = rank_kv_heads(k, b, d)
        dst = [np.zeros((rows, dn, hd), dtype=np.float32) for _ in full]
        for p in range(a):
            s = head_slice(k, a, p, b, d)
            if s is None:
                continue
            p0, pn = rank_kv_heads(k, a, p)
            src = [np.ascontiguousarray(buf[:, p0 : p0 + pn]) for buf in full]
            _execute(slice_kv_descs(runs, len(full), page_size, hd * 4, pn, dn, s), src, dst)
        for got, want in zip(dst, full):
            for sp, dp in zip(src_pages, dst_pages):
                rows_src, rows_dst = (
                    slice(sp * page_size, (sp + 1) * page_size),
                    slice(dp * page_size, (dp + 1) * page_size),
                )
                assert np.array_equal(got[rows_dst], want[rows_src, d0 : d0 + dn])
            untouched = np.ones(rows, dtype=bool)
            for dp in dst_pages:
                untouched[dp * page_size : (dp + 1) * page_size] = False
            assert not got[untouched].any()


def test_ranks_agree_on_the_slowest_state_and_fail_together():
    S, W, T, F, B = KVPoll.Success, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed, KVPoll.Bootstrapping
    assert agree([(S, None), (S, None)]) == (S, None, None)
    assert agree([(S, None), (T, None)]) == (T, None, None)
    assert agree([(W, None), (B, None)]) == (B, None, None)
    state, _, why = agree([(F, "peer gone"), (T, None)])  # rank 1 must abort; not terminal until it is
    assert state == T and "rank 0: peer gone" in why
    state, reason, _ = agree([(S, None), (F, "checksum mismatch")])
    assert state == F and reason == "tensor-parallel rank 1: checksum mismatch"


# --- real managers on every backend ---------------------------------------------------------
LAYERS, HEAD_DIM, SLOTS, PAGE = 2, 8, 256, 4


def _global_kv(k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn((SLOTS + PAGE, k, HEAD_DIM), generator=g) for _ in range(2 * LAYERS)]


def _pool(heads: int):
    from kvship.engine.mem.pools import KVPool

    return KVPool(SLOTS, PAGE, torch.float32, heads, HEAD_DIM, LAYERS, "cpu")


def _scenario(backend: str, k: int, a: int, b: int, abort_rank, kill_prefill, layerwise) -> dict:
    """``a`` prefill and ``b`` decode rank managers in this process move one room; returns what happened.
    ``layerwise``: every prefill rank sends it layer by layer (no checksum then), its first 2 pages ready."""
    from kvship.engine.disagg import AuxInfo, KVTransferConfig, create_kv_manager
    from kvship.engine.disagg.layerwise import LayerProgress

    full = _global_kv(k)
    common = dict(
        backend=backend,
        bootstrap_port=0,
        heartbeat_interval=0.5,
        heartbeat_timeout=5.0,
        total_kv_heads=k,
        secret=KV_SECRET,
    )
    prefill, decode, dpools = [], [], []
    for p in range(a):
        p0, pn = rank_kv_heads(k, a, p)
        pool = _pool(pn)
        for buf, src in zip(pool.buffers(), full):
            buf.copy_(src[:, p0 : p0 + pn])
        prefill.append(create_kv_manager("prefill", pool, KVTransferConfig(tp_size=a, tp_rank=p, **common)))
    addresses = [m.rank_addresses[0] for m in prefill]  # what TPKVManager gathers over the ranks
    for m in prefill:
        m.rank_addresses = addresses
    for d in range(b):
        pool = _pool(rank_kv_heads(k, b, d)[1])
        dpools.append(pool)
        cfg = KVTransferConfig(tp_size=b, tp_rank=d, checksum=not layerwise, **common)
        decode.append(create_kv_manager("decode", pool, cfg))
    try:
        room = 4242
        src_pages, dst_pages = [3, 4, 5, 9, 1], [7, 2, 8, 10, 11]
        senders = [m.create_sender(room, room_token(room)) for m in prefill]
        receivers = [m.create_receiver("127.0.0.1", prefill[0].bootstrap_port, room, room_token(room)) for m in decode]
        for r in receivers:
            r.init(dst_pages)
        if abort_rank is not None or kill_prefill is not None or layerwise:
            deadline = time.monotonic() + 20
            while any(s.poll() == KVPoll.Bootstrapping for s in senders) and time.monotonic() < deadline:
                time.sleep(0.01)
        if abort_rank is not None:
            receivers[abort_rank].abort("client went away")
            # the abort travels to the prefill ranks on its own: let it arrive before the pages are sent (CI once
            # saw a tiny CPU send finish first, the other decode rank then complete and the sender succeed)
            deadline = time.monotonic() + 10
            while not all(s.poll() == KVPoll.Failed for s in senders) and time.monotonic() < deadline:
                time.sleep(0.01)
        if kill_prefill is not None:  # that rank's process is gone: its connections close
            prefill[kill_prefill].close()
        if layerwise:
            progress = [LayerProgress(LAYERS, "cpu") for _ in senders]
            assert all(s.send_layerwise(src_pages, 2, lp) for s, lp in zip(senders, progress))
            for lp in progress:
                lp.layer_done(0)
                lp.layer_done(1)
        for s in senders:
            s.send(src_pages, AuxInfo(first_token_id=42, first_token_logprob=-0.5, prompt_len=18))
        deadline = time.monotonic() + 30
        transfers = senders + receivers
        while not all(t.poll().is_terminal for t in transfers) and time.monotonic() < deadline:
            time.sleep(0.01)
        out = {
            "senders": [s.poll().name for s in senders],
            "receivers": [r.poll().name for r in receivers],
            "reasons": [r.failure_reason for r in receivers],
            "first_tokens": [r.aux.first_token_id if r.aux else None for r in receivers],
            "heads_ok": [],
        }
        for d, pool in enumerate(dpools):
            d0, dn = rank_kv_heads(k, b, d)
            ok = all(
                torch.equal(got[dp * PAGE : (dp + 1) * PAGE], want[sp * PAGE : (sp + 1) * PAGE, d0 : d0 + dn])
                for got, want in zip(pool.buffers(), full)
                for sp, dp in zip(src_pages, dst_pages)
            )
            out["heads_ok"].append(ok)
        time.sleep(0.2)
        out["leftover"] = [len(m.active) for m in decode] + [len(m._senders) + len(m._pending) for m in prefill]
        out["aux_free"] = [len(m.aux_free) == m.num_aux_slots for m in decode]
        return out
    finally:
        for m in decode + prefill:
            m.close()


def _run_scenario(backend: str, k: int, a: int, b: int, abort_rank=None, kill_prefill=None, layerwise=False) -> dict:
    return run_scenario(_scenario, backend, k, a, b, abort_rank, kill_prefill, layerwise)


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
@pytest.mark.parametrize("k,a,b", [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_each_decode_rank_receives_exactly_its_heads_from_the_prefill_ranks(backend, k, a, b):
    out = _run_scenario(backend, k, a, b)
    assert out["senders"] == ["Success"] * a and out["receivers"] == ["Success"] * b, out
    assert out["first_tokens"] == [42] * b and out["heads_ok"] == [True] * b
    assert out["leftover"] == [0] * (a + b) and all(out["aux_free"])


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
@pytest.mark.parametrize("k,a,b", [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_layerwise_sends_give_each_decode_rank_exactly_its_heads(backend, k, a, b):
    """docs/pd.md, "Layer-wise transfer": the head slices, page by page and layer by layer."""
    out = _run_scenario(backend, k, a, b, layerwise=True)
    assert out["senders"] == ["Success"] * a and out["receivers"] == ["Success"] * b, out
    assert out["first_tokens"] == [42] * b and out["heads_ok"] == [True] * b
    assert out["leftover"] == [0] * (a + b) and all(out["aux_free"])


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_an_abort_on_one_decode_rank_ends_every_ranks_transfer_and_frees_everything(backend):
    out = _run_scenario(backend, 2, 1, 2, abort_rank=1)
    assert out["senders"] == ["Failed"] and out["receivers"] == ["Failed", "Failed"], out
    assert "client went away" in out["reasons"][1]
    assert out["leftover"] == [0, 0, 0] and all(out["aux_free"])


def test_a_prefill_rank_that_dies_fails_the_room_on_every_rank_and_frees_everything():
    """2 -> 2: prefill rank 1 goes away after both decode ranks registered; both receivers fail (the one
    that still had rank 0 writing waits for its acknowledgement), rank 0's sender fails, nothing is left."""
    out = _run_scenario("tcp", 2, 2, 2, kill_prefill=1)
    assert out["senders"][0] == "Failed" and out["receivers"] == ["Failed", "Failed"], out
    assert out["leftover"] == [0, 0, 0, 0] and all(out["aux_free"])


# --- kvship local with tensor-parallel workers -------------------------------------------------
PROMPTS = make_prompts(4, seed=12, lo=3, hi=40)
MAX_NEW = 6


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,backend", [(2, 1, "tcp"), (1, 2, "tcp"), (2, 1, "nixl"), (1, 2, "mooncake")]
)
def test_kvship_local_with_tensor_parallel_workers_equals_unified_tp1(tiny_llama_dir, prefill_tp, decode_tp, backend):
    """4 heads / 2 KV heads: 2 -> 1 gathers both ranks' heads, 1 -> 2 splits them; tokens equal unified TP=1,
    and every rank of both workers has all its KV slots back afterwards."""
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    want = unified_greedy(tiny_llama_dir, PROMPTS, MAX_NEW)
    args = [
        "--model-path",
        tiny_llama_dir,
        "--device",
        "cpu",
        "--max-total-tokens",
        "2048",
        "--page-size",
        "4",
        "--prefill-tp-size",
        str(prefill_tp),
        "--decode-tp-size",
        str(decode_tp),
        "--transfer-backend",
        backend,
    ]
    with start_local(args) as cluster:
        for ids, expected in zip(PROMPTS, want):
            r = cluster.generate(ids, MAX_NEW)
            assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text
        urls = cluster.workers("prefill") + cluster.workers("decode")
        cluster.wait_free(urls)
        for url, tp in zip(urls, (prefill_tp, decode_tp)):
            info = cluster.info(url)
            assert info["tp_size"] == tp
            if tp > 1:
                assert info["free_slots_per_rank"] == [info["total_slots"]] * tp, info

"""PD with pipeline parallelism: a PP prefill feeds a TP decode (docs/parallel.md, "PD with pipeline parallelism").

* The layer plan (``kvship.engine.disagg.tp_slices.map_layers``): a prefill stage's descriptors keep the layers
  the decode rank holds and land in that rank's buffers of the same model layers; ``KVLayout.mismatch`` accepts
  stages and refuses a pairing whose model layers (or a stage's range) do not fit, in one line.
* Real managers on every backend (tcp, mooncake, nixl): prefill PP=2 (x TP 1 or 2, stages of 1 and 3 layers)
  and decode TP=1 or 2, each rank with its own pool holding its layers' and heads' share of one global KV,
  move a room with checksums on, and again layer-wise; every decode rank ends with exactly its heads of every
  layer; an abort mid-transfer (decode side) and a prefill stage that dies fail the room on every rank and
  leave no room or aux slot behind.
* ``kvship local --prefill-pp-size 2 --decode-tp-size 2|1`` on tcp, nixl and mooncake: greedy tokens equal to
  unified, every rank of both workers has all its KV slots back afterwards.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from pd_fixtures import KV_SECRET, make_prompts, room_token, start_local, unified_greedy
from transfer_scenario import run_scenario

from kvship.engine.disagg.base import BackendUnavailableError, KVPoll, TransferDescs, get_transfer_backend
from kvship.engine.disagg.tp_slices import layer_buffers, map_layers, rank_kv_heads, shared_layers
from kvship.engine.disagg.wire import KVLayout

os.environ.setdefault("UCX_MODULES", "^ib")  # as tests/test_kv_transfer.py: Debian's ibverbs provider crashes UCX

LAYERS, HEAD_DIM, SLOTS, PAGE = 4, 8, 256, 4
PARTITION = ((0, 1), (1, 4))  # stage 0 holds layer 0, stage 1 layers 1..3


def _layout(layers: int, start: int = 0, model: int = LAYERS, pp: int = 1, pp_rank: int = 0, **kw) -> KVLayout:
    base = dict(page_size=PAGE, kv_dtype="float32", num_kv_heads=2, head_dim=HEAD_DIM, total_kv_heads=2)
    return KVLayout(
        num_layers=layers, layer_start=start, model_layers=model, pp_size=pp, pp_rank=pp_rank, **{**base, **kw}
    )


# --- the layer plan ---------------------------------------------------------------------------
def test_a_stage_writes_the_layers_it_holds_into_the_decode_buffers_of_those_layers():
    stage1, whole = _layout(3, start=1, pp=2, pp_rank=1), _layout(LAYERS)
    n = 3  # stage 1's K buffers are its regions 0..2 (layers 1..3), V buffers 3..5
    descs = TransferDescs(
        src_region=np.arange(2 * n, dtype=np.int64),
        src_off=np.arange(2 * n, dtype=np.int64) * 10,
        dst_region=np.arange(2 * n, dtype=np.int64),
        dst_off=np.arange(2 * n, dtype=np.int64) * 100,
        length=np.full(2 * n, 7, dtype=np.int64),
    )
    got = map_layers(descs, stage1, whole)
    assert got.src_region.tolist() == [0, 1, 2, 3, 4, 5]
    assert got.dst_region.tolist() == [1, 2, 3, 5, 6, 7]  # K of layers 1..3, then V (decode's V base is 4)
    assert got.dst_off.tolist() == descs.dst_off.tolist() and got.length.tolist() == [7] * 6
    # the other way round (a decode stage fed by a whole-model prefill): only the layers that stage holds
    back = map_layers(_descs_of(LAYERS), whole, stage1)
    assert back.src_region.tolist() == [1, 2, 3, 5, 6, 7] and back.dst_region.tolist() == [0, 1, 2, 3, 4, 5]
    assert map_layers(descs, _layout(1, pp=2), stage1) is None  # no layer in common: nothing to write
    assert shared_layers(stage1, whole) == (1, 4) and shared_layers(_layout(1, pp=2), stage1) is None
    bufs = [torch.full((2,), float(i)) for i in range(2 * LAYERS)]
    assert [int(b[0]) for b in layer_buffers(bufs, whole, 1, 4)] == [1, 2, 3, 5, 6, 7]


def _descs_of(layers: int) -> TransferDescs:
    r = np.arange(2 * layers, dtype=np.int64)
    return TransferDescs(src_region=r, src_off=r * 0, dst_region=r.copy(), dst_off=r * 0, length=r * 0 + 1)


def test_the_layout_check_accepts_stages_and_refuses_what_cannot_pair_in_one_line():
    stage0, stage1, whole = _layout(1, pp=2), _layout(3, start=1, pp=2, pp_rank=1), _layout(LAYERS)
    assert stage0.mismatch(whole) is None and stage1.mismatch(whole) is None
    other_model = _layout(LAYERS + 2, model=LAYERS + 2)
    problem = stage1.mismatch(other_model)
    assert problem == "num_layers 4 != 6", problem
    bad_stage = _layout(3, start=2, pp=2, pp_rank=1)  # claims layers 2..4 of a 4-layer model
    assert "pipeline stage 1 of 2 holds layers [2, 5) of 4" in bad_stage.mismatch(whole)
    # FP8 scales are compared on the layers both hold: the stage's own scales against decode's of those layers
    fp8 = dict(kv_dtype="float8_e4m3fn")
    s1 = _layout(3, start=1, pp=2, pp_rank=1, kv_scales=(2.0, 3.0, 4.0, 0.5, 0.6, 0.7), **fp8)
    w = _layout(LAYERS, kv_scales=(1.0, 2.0, 3.0, 4.0, 0.4, 0.5, 0.6, 0.7), **fp8)
    assert s1.mismatch(w) is None
    w_bad = _layout(LAYERS, kv_scales=(1.0, 2.0, 3.0, 9.0, 0.4, 0.5, 0.6, 0.7), **fp8)
    assert "FP8 KV scales" in s1.mismatch(w_bad)
    assert KVLayout.from_dict(__import__("dataclasses").asdict(stage1)) == stage1


# --- real managers on every backend -------------------------------------------------------------
def _global_kv(k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn((SLOTS + PAGE, k, HEAD_DIM), generator=g) for _ in range(2 * LAYERS)]


def _scenario(backend: str, k: int, tp: int, b: int, abort_rank, kill_stage, layerwise) -> dict:
    """Prefill ranks (2 stages x ``tp``) and ``b`` decode ranks in this process move one room."""
    from kvship.engine.disagg import AuxInfo, KVTransferConfig, create_kv_manager
    from kvship.engine.disagg.layerwise import LayerProgress
    from kvship.engine.mem.pools import KVPool

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
    for stage, (lo, hi) in enumerate(PARTITION):  # stage-major: rank = stage * tp + tp_rank
        for p in range(tp):
            p0, pn = rank_kv_heads(k, tp, p)
            pool = KVPool(SLOTS, PAGE, torch.float32, pn, HEAD_DIM, hi - lo, "cpu")
            mine = full[lo:hi] + full[LAYERS + lo : LAYERS + hi]
            for buf, src in zip(pool.buffers(), mine):
                buf.copy_(src[:, p0 : p0 + pn])
            cfg = KVTransferConfig(
                tp_size=tp, tp_rank=p, pp_size=2, pp_rank=stage, layer_start=lo, model_layers=LAYERS, **common
            )
            prefill.append(create_kv_manager("prefill", pool, cfg))
    addresses = [m.rank_addresses[0] for m in prefill]  # what TPKVManager gathers over the worker's ranks
    for m in prefill:
        m.rank_addresses = addresses
    for d in range(b):
        pool = KVPool(SLOTS, PAGE, torch.float32, rank_kv_heads(k, b, d)[1], HEAD_DIM, LAYERS, "cpu")
        dpools.append(pool)
        cfg = KVTransferConfig(tp_size=b, tp_rank=d, checksum=not layerwise, **common)
        decode.append(create_kv_manager("decode", pool, cfg))
    try:
        room = 5151
        src_pages, dst_pages = [3, 4, 5, 9, 1], [7, 2, 8, 10, 11]
        senders = [m.create_sender(room, room_token(room)) for m in prefill]
        receivers = [m.create_receiver("127.0.0.1", prefill[0].bootstrap_port, room, room_token(room)) for m in decode]
        for r in receivers:
            r.init(dst_pages)
        if abort_rank is not None or kill_stage is not None or layerwise:
            deadline = time.monotonic() + 20
            while any(s.poll() == KVPoll.Bootstrapping for s in senders) and time.monotonic() < deadline:
                time.sleep(0.01)
        if abort_rank is not None:  # mid-transfer: every stage registered, nothing sent yet
            receivers[abort_rank].abort("client went away")
        if kill_stage is not None:  # that stage's processes are gone: their connections close
            for m in prefill[kill_stage * tp : (kill_stage + 1) * tp]:
                m.close()
        if layerwise:
            progress = [LayerProgress(hi - lo, "cpu") for lo, hi in PARTITION for _ in range(tp)]
            assert all(s.send_layerwise(src_pages, 2, lp) for s, lp in zip(senders, progress))
            for lp in progress:
                for i in range(lp.num_layers):
                    lp.layer_done(i)
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
            "layers_ok": [],
        }
        for d, pool in enumerate(dpools):
            d0, dn = rank_kv_heads(k, b, d)
            out["layers_ok"].append(
                [
                    all(
                        torch.equal(got[dp * PAGE : (dp + 1) * PAGE], want[sp * PAGE : (sp + 1) * PAGE, d0 : d0 + dn])
                        for sp, dp in zip(src_pages, dst_pages)
                    )
                    for got, want in zip(pool.buffers(), full)
                ]
            )
        time.sleep(0.2)
        out["leftover"] = [len(m.active) for m in decode] + [len(m._senders) + len(m._pending) for m in prefill]
        out["aux_free"] = [len(m.aux_free) == m.num_aux_slots for m in decode]
        return out
    finally:
        for m in decode + prefill:
            m.close()


def _run(backend: str, k: int, tp: int, b: int, abort_rank=None, kill_stage=None, layerwise=False) -> dict:
    return run_scenario(_scenario, backend, k, tp, b, abort_rank, kill_stage, layerwise)


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
@pytest.mark.parametrize("tp,b", [(1, 2), (1, 1), (2, 2)])
def test_each_decode_rank_receives_every_layer_from_the_stage_that_holds_it(backend, tp, b):
    out = _run(backend, 2, tp, b)
    n = 2 * tp
    assert out["senders"] == ["Success"] * n and out["receivers"] == ["Success"] * b, out
    assert out["first_tokens"] == [42] * b and out["layers_ok"] == [[True] * 2 * LAYERS] * b, out
    assert out["leftover"] == [0] * (n + b) and all(out["aux_free"])


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_layerwise_sends_from_every_stage_give_each_decode_rank_every_layer(backend):
    out = _run(backend, 2, 1, 2, layerwise=True)
    assert out["senders"] == ["Success"] * 2 and out["receivers"] == ["Success"] * 2, out
    assert out["layers_ok"] == [[True] * 2 * LAYERS] * 2, out
    assert out["leftover"] == [0] * 4 and all(out["aux_free"])


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_an_abort_mid_transfer_fails_the_room_on_every_stage_and_frees_everything(backend):
    out = _run(backend, 2, 1, 2, abort_rank=0)
    assert out["senders"] == ["Failed", "Failed"] and out["receivers"] == ["Failed", "Failed"], out
    assert "client went away" in out["reasons"][0]
    assert out["leftover"] == [0] * 4 and all(out["aux_free"])


def test_a_prefill_stage_that_dies_fails_the_room_on_every_rank_and_frees_everything():
    out = _run("tcp", 2, 1, 2, kill_stage=1)
    assert out["senders"][0] == "Failed" and out["receivers"] == ["Failed", "Failed"], out
    assert out["leftover"] == [0] * 4 and all(out["aux_free"])


# --- kvship local with a pipeline-parallel prefill ---------------------------------------------
PROMPTS = make_prompts(3, seed=12, lo=3, hi=40)
MAX_NEW = 6


def test_a_pipeline_parallel_decode_worker_is_refused_with_one_clear_line(tiny_llama_dir):
    from kvship.engine.config import ServerArgs

    with pytest.raises(ValueError, match="pipeline-parallel decode worker is not built yet"):
        ServerArgs(model_path=tiny_llama_dir, device="cpu", mode="decode", pp_size=2).validate()
    ServerArgs(model_path=tiny_llama_dir, device="cpu", mode="prefill", pp_size=2).validate()


@pytest.mark.parametrize("decode_tp,backend", [(2, "tcp"), (1, "nixl"), (2, "mooncake")])
def test_kvship_local_with_a_pp_prefill_equals_unified(tiny_llama_dir, decode_tp, backend):
    """Prefill PP=2 (one layer per stage) -> decode TP=2 / TP=1: tokens equal unified, every rank's slots back."""
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
        "--prefill-pp-size",
        "2",
        "--decode-tp-size",
        str(decode_tp),
        "--transfer-backend",
        backend,
    ]
    with start_local(args) as cluster:
        for ids, expected in zip(PROMPTS, want):
            r = cluster.generate(ids, MAX_NEW)
            assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text
        prefill, decode = cluster.workers("prefill"), cluster.workers("decode")
        cluster.wait_free(prefill + decode)
        p, d = cluster.info(prefill[0]), cluster.info(decode[0])
        assert (p["pp_size"], p["tp_size"], d["tp_size"]) == (2, 1, decode_tp)
        assert p["free_slots_per_rank"] == [p["total_slots"]] * 2, p
        if decode_tp > 1:
            assert d["free_slots_per_rank"] == [d["total_slots"]] * decode_tp, d


def test_kvship_local_places_a_pp_prefill_on_one_gpu_per_rank():
    import argparse

    from kvship.app import local
    from kvship.app.gpu_placement import worker_gpus
    from kvship.engine.config import dataclass_from_namespace

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["local", "--prefill-pp-size", "2", "--decode-tp-size", "2"])
    cfg, flags = dataclass_from_namespace(local.LocalConfig, ns), dataclass_from_namespace(local.WorkerFlags, ns)
    assert worker_gpus(cfg, flags, "cuda", num_gpus=4) == [0, 2]  # prefill ranks on GPUs 0-1, decode on 2-3

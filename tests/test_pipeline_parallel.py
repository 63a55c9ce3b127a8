"""Pipeline parallelism on CPU (gloo, real rank processes) against the single process.

The rank-level tests start one gloo group (``--pp-size 2``: 2 ranks; ``--pp-size 2 --tp-size 2``: 4) in which
every rank builds its stage's ``ModelRunner`` and the replicated scheduler (``PipelineIO``) for several
scenarios in turn; the leader submits requests and steps until idle, the others follow until it stops them.
Every rank reports its greedy tokens, its KV pool, the parameters it holds and the scheduler's pipeline
counters.  The server test runs ``kvship serve --pp-size 2`` and talks HTTP.
"""

from __future__ import annotations

import os

import pytest
from conftest import build_tiny_model
from moe_fixtures import build_tiny_moe
from pd_fixtures import Collector, run_until_idle, unified_greedy
from server_fixtures import rank_body, run_ranks, start_server

from kvship.engine.config import ServerArgs

RANK_TIMEOUT_S = 240
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77], [9, 8, 7, 6, 5, 4, 3], [11, 12, 13]]
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # a prefix the second wave reuses (radix cache)
RADIX_WAVES = [[SHARED + [7]], [SHARED + [8, 9], SHARED + [10]]]
MAX_NEW = 10
BASE = dict(device="cpu", max_total_tokens=2048, max_running_requests=16, attention_backend="torch_native")

# scenario -> (model, ServerArgs overrides, prompt waves, rid to abort)
SCENARIOS = {
    "even": ("llama4", {}, [PROMPTS], None),
    "partition_1_3": ("llama4", {"pp_layer_partition": "1,3"}, [PROMPTS], None),
    "tied_3_1": ("tied4", {"pp_layer_partition": "3,1"}, [PROMPTS], None),
    "chunked_radix": ("llama4", {"chunked_prefill_size": 4}, RADIX_WAVES, None),
    "abort": ("llama4", {}, [PROMPTS + [[20, 21, 22]]], "long"),
    "moe": ("moe", {}, [PROMPTS], None),
}
PP_TP_SCENARIOS = ("even", "chunked_radix")


def _sa(path: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, **{**BASE, **kw})


def _rids(waves: list) -> list[str]:
    return [f"w{w}r{i}" for w, wave in enumerate(waves) for i in range(len(wave))]


def _run_scenario(groups, sa: ServerArgs, waves: list, abort) -> dict:
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler
    from kvship.engine.scheduler.io import scheduler_io

    runner = ModelRunner(sa, groups=groups)
    stopped: list = []
    io = scheduler_io(groups.tp, lambda: stopped.append(True), link=runner.pipeline)
    sink = Collector()
    sched = Scheduler(sa, runner, None, sink, io=io)
    rids = _rids(waves)
    if groups.is_leader:
        for w, wave in enumerate(waves):
            for i, prompt in enumerate(wave):
                long = abort is not None and i == len(wave) - 1
                rid = "long" if long else f"w{w}r{i}"
                sp = SamplingParams(max_new_tokens=400 if long else MAX_NEW, temperature=0, ignore_eos=long)
                sched.submit(GenerateRequest(rid, list(prompt), sp))
            if abort is not None:
                for _ in range(12):
                    sched.step()
                sched.abort(abort)
            run_until_idle(sched)
        sched.inbox.close("scenario done")
    else:
        while not stopped:
            sched.step(block_s=0.01)
    st = sched.get_stats()
    if abort is not None:
        rids = [r for r in rids if r != f"w0r{len(waves[0]) - 1}"] + ["long"]
    names = {n.split(".")[2] if n.startswith("model.layers.") else n for n, _ in runner.model.named_parameters()}
    return {
        "tokens": {rid: sink.tokens(rid) for rid in rids},
        "finish": {rid: [c.finish_reason["type"] for c in sink.finished(rid)] for rid in rids},
        "free": (st["free_slots"], st["total_slots"]),
        "open": len(sched.reqs),
        "layers": (runner.pipeline.layers.start, runner.pipeline.layers.end),
        "pool_layers": runner.kv_pool.num_layers,
        "params": sorted(names),
        "stats": {
            k: st.get(k) for k in ("pp_max_in_flight", "pp_overlapped_launches", "pp_chained_launches", "cached_tokens")
        },
    }


def _rank_main(rank: int, init_method: str, tp: int, pp: int, paths: dict, scenarios: tuple, out) -> None:
    def body(groups) -> dict:
        results = {}
        for name in scenarios:
            model, kw, waves, abort = SCENARIOS[name]
            results[name] = _run_scenario(groups, _sa(paths[model], tp_size=tp, pp_size=pp, **kw), waves, abort)
        return results

    rank_body(rank, init_method, _sa("", tp_size=tp, pp_size=pp), body, out)


def _rank_main_unchained(rank: int, init_method: str, paths: dict, off_ranks: tuple, out) -> None:
    if rank in off_ranks:  # stage 0 waits for the results on its host (the old loop)
        os.environ["KVSHIP_PP_CHAIN"] = "0"
    _rank_main(rank, init_method, 1, 2, paths, ("even",), out)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return {
        "llama4": build_tiny_model(str(tmp_path_factory.mktemp("pp_llama4")), "llama", seed=11, num_hidden_layers=4),
        "tied4": build_tiny_model(
            str(tmp_path_factory.mktemp("pp_tied4")), "qwen3", seed=12, num_hidden_layers=4, tie_word_embeddings=True
        ),
        "moe": build_tiny_moe(str(tmp_path_factory.mktemp("pp_moe")), "qwen3_moe", seed=13),
    }


@pytest.fixture(scope="module")
def pp2(paths) -> list[dict]:
    """Per rank of a --pp-size 2 worker: {scenario: results}."""
    return run_ranks(_rank_main, 2, (1, 2, paths, tuple(SCENARIOS)), RANK_TIMEOUT_S)


def _reference(paths: dict, name: str) -> dict[str, list[int]]:
    """The single process's greedy tokens, wave by wave, with the scenario's settings."""
    model, kw, waves, abort = SCENARIOS[name]
    kw = {k: v for k, v in kw.items() if k != "pp_layer_partition"}
    out = {}
    for w, wave in enumerate(waves):
        prompts = wave[:-1] if abort is not None else wave
        toks = unified_greedy(paths[model], prompts, MAX_NEW, **{**BASE, **kw})
        out.update({f"w{w}r{i}": t for i, t in enumerate(toks)})
    return out


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "abort"])
def test_pp2_greedy_tokens_equal_the_single_process_on_every_stage(pp2, paths, name):
    ref = _reference(paths, name)
    for rank, res in enumerate(pp2):
        got = res[name]
        assert {r: got["tokens"][r] for r in ref} == ref, f"rank {rank}"
        assert all(got["finish"][r] == ["length"] or got["finish"][r] == ["stop"] for r in ref)


def test_each_stage_holds_only_its_layers_and_their_kv(pp2):
    expect = {"even": [(0, 2), (2, 4)], "partition_1_3": [(0, 1), (1, 4)], "tied_3_1": [(0, 3), (3, 4)]}
    for name, ranges in expect.items():
        for rank, (start, end) in enumerate(ranges):
            got = pp2[rank][name]
            assert got["layers"] == (start, end) and got["pool_layers"] == end - start
            layer_ids = {int(p) for p in got["params"] if p.isdigit()}
            assert layer_ids == set(range(start, end))
    first, last = pp2[0]["even"]["params"], pp2[1]["even"]["params"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert "model.embed_tokens.weight" not in last and {"lm_head.weight", "model.norm.weight"} <= set(last)
    # tied embeddings: the last stage holds the matrix its LM head reads
    assert "model.embed_tokens.weight" in pp2[1]["tied_3_1"]["params"]


def test_micro_batches_overlap_and_kv_is_back_to_full_on_every_stage(pp2):
    for rank, res in enumerate(pp2):
        st = res["even"]["stats"]
        assert st["pp_max_in_flight"] >= 2 and st["pp_overlapped_launches"] > 0, (rank, st)
        assert st["pp_chained_launches"] > 0, (rank, st)  # decodes started on the last stage's device ids
        for name, got in res.items():
            free, total = got["free"]
            assert free == total and got["open"] == 0, (rank, name, got["free"])


def test_chunked_prefill_reuses_the_radix_cache_under_pp(pp2):
    for res in pp2:
        assert res["chunked_radix"]["stats"]["cached_tokens"] >= 2 * len(SHARED)


def test_abort_frees_the_kv_of_every_stage(pp2, paths):
    ref = _reference(paths, "abort")
    for res in pp2:
        got = res["abort"]
        assert got["finish"]["long"] == ["abort"]
        assert 0 < len(got["tokens"]["long"]) < 400
        assert {r: got["tokens"][r] for r in ref} == ref
        assert got["free"][0] == got["free"][1] and got["open"] == 0


@pytest.mark.parametrize("off_ranks", [(0, 1), (1,)], ids=["every-rank", "one-rank"])
def test_pp2_without_chaining_equals_the_single_process(paths, off_ranks):
    """``KVSHIP_PP_CHAIN=0``: every decode forms after its predecessor's results reached stage 0's host; set on
    one rank only, the ranks agree to chain nowhere (no stage 0 waits for ids nobody sends)."""
    ref = _reference(paths, "even")
    for rank, r in enumerate(run_ranks(_rank_main_unchained, 2, (paths, off_ranks), RANK_TIMEOUT_S)):
        got = r["even"]
        assert {k: got["tokens"][k] for k in ref} == ref, rank
        assert got["stats"]["pp_chained_launches"] == 0 and got["stats"]["pp_max_in_flight"] >= 2, got["stats"]
        assert got["free"][0] == got["free"][1]


def test_pp3_with_a_middle_stage_equals_the_single_process(paths):
    """Three stages (layers 2, 1, 1): the middle stage neither embeds nor samples; chained decodes give it
    placeholder input ids (it reads the hidden states), and every stage's KV is back to full."""
    ref = _reference(paths, "even")
    res = run_ranks(_rank_main, 3, (1, 3, paths, ("even",)), RANK_TIMEOUT_S)
    assert [r["even"]["layers"] for r in res] == [(0, 2), (2, 3), (3, 4)]
    for rank, r in enumerate(res):
        got = r["even"]
        assert {k: got["tokens"][k] for k in ref} == ref, rank
        assert got["stats"]["pp_chained_launches"] > 0 and got["free"][0] == got["free"][1], (rank, got)


def test_pp2_tp2_greedy_tokens_equal_the_single_process(paths):
    res = run_ranks(_rank_main, 4, (2, 2, paths, PP_TP_SCENARIOS), RANK_TIMEOUT_S)
    for name in PP_TP_SCENARIOS:
        ref = _reference(paths, name)
        for rank, r in enumerate(res):
            assert {k: r[name]["tokens"][k] for k in ref} == ref, (name, rank)
            assert r[name]["free"][0] == r[name]["free"][1]
        assert [r[name]["layers"] for r in res] == [(0, 2), (0, 2), (2, 4), (2, 4)]


# --- startup checks ---------------------------------------------------------------------------
def test_stage_split_is_even_with_the_remainder_on_the_first_stages():
    from kvship.engine.distributed.pipeline import stage_layers

    assert [(r.start, r.end) for r in stage_layers(30, 4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [(r.start, r.end) for r in stage_layers(4, 2, [1, 3])] == [(0, 1), (1, 4)]
    assert stage_layers(4, 2)[0].first and stage_layers(4, 2)[1].last


@pytest.mark.parametrize(
    "pp, partition, match",
    [
        (3, None, "--pp-size 3 is more than the model's 2 layers"),
        (2, [1, 2], "sums to 3 layers, the model has 2"),
    ],
)
def test_bad_stage_splits_are_one_clear_line(pp, partition, match):
    from kvship.engine.distributed.pipeline import stage_layers

    with pytest.raises(ValueError, match=match):
        stage_layers(2, pp, partition)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(pp_size=2, pp_layer_partition="1,x"), "comma-separated layer counts"),
        (dict(pp_size=2, pp_layer_partition="2"), "must give 2 positive layer counts"),
        (dict(pp_size=2, mode="decode"), "a pipeline-parallel decode worker is not built yet"),
        (dict(pp_size=0), "--pp-size must be >= 1"),
    ],
)
def test_bad_pp_flags_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kw).validate()


def test_serve_refuses_a_pp_size_beyond_the_layers_before_starting_ranks(tiny_llama_dir):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", tiny_llama_dir, "--device", "cpu"]
    for extra, match in (
        (["--pp-size", "3"], "--pp-size 3 is more than the model's 2 layers"),
        (["--pp-size", "2", "--pp-layer-partition", "1,2"], "sums to 3 layers, the model has 2"),
    ):
        r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and match in r.stderr, r.stderr[-2000:]


# --- kvship serve --pp-size 2 -----------------------------------------------------------------
def test_serve_pp2_over_http_matches_the_single_process(paths):
    model = paths["llama4"]
    ref = unified_greedy(model, PROMPTS, MAX_NEW, **BASE)
    args = ["--model-path", model, "--device", "cpu", "--max-total-tokens", "2048", "--pp-size", "2"]
    with start_server(args, keep_log=True) as srv:
        greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
        r = srv.post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == ref
        info = srv.get("/get_server_info").json()
        assert info["server_args"]["pp_size"] == 2 and info["pp_size"] == 2
        assert info["pp_max_in_flight"] >= 2 and info["free_slots"] == info["total_slots"]

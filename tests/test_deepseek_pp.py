"""DeepSeek (MLA + DeepSeekMoE) under ``--pp-size 2`` on CPU: 2 gloo rank processes vs one (docs/deepseek.md,
"Pipeline parallelism").

One group of 2 real rank processes (``run_ranks``) runs, in turn, the tiny V3 model of
tests/deepseek_fixtures.py (3 layers, the first dense) split ``1,2`` (stage 0 holds the embedding and the dense
layer only), ``2,1``, chunked prefill over the radix cache with a shared prompt prefix, and
``--speculative-algorithm ngram`` (the stages verify drafts).  Each stage holds only its layers' parameters and
a latent pool of its layers; the greedy tokens equal the single process's and every KV slot is free again at
the end.  A ``kvship local`` cluster then runs a ``--pp-size 2`` DeepSeek prefill worker feeding a decode
worker.  A second group of 4 (``--tp-size 2 --pp-size 2``: each stage's heads and experts split over its 2 TP
ranks, the latent pool replicated on both) runs the split and the chunked radix scenarios.  About 25 s on 2
cores, 40 s more for the group of 4.
"""

from __future__ import annotations

import pytest
from deepseek_fixtures import build_tiny_deepseek
from pd_fixtures import Collector, run_until_idle, unified_greedy
from server_fixtures import rank_body, run_ranks

from kvship.engine.config import ServerArgs

RANK_TIMEOUT_S = 180
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77], [8, 9]]
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
MAX_NEW = 6
BASE = dict(device="cpu", max_total_tokens=512, max_running_requests=8)
# scenario -> (ServerArgs overrides, prompt waves)
SCENARIOS = {
    "split_1_2": ({"pp_layer_partition": "1,2"}, [PROMPTS]),
    "split_2_1": ({"pp_layer_partition": "2,1"}, [PROMPTS]),
    "chunked_radix": ({"chunked_prefill_size": 4}, [[SHARED + [7]], [SHARED + [8, 9], SHARED + [10]]]),
    # prompts that repeat a pattern, so prompt lookup drafts and the stages verify (absorbed MLA extends)
    "ngram": ({"speculative_algorithm": "ngram"}, [[[5, 17, 33] * 5, [40, 41, 42, 43] * 4]]),
}


def _sa(path: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, **{**BASE, **kw})


def _run_scenario(groups, sa: ServerArgs, waves: list) -> dict:
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler.io import scheduler_io

    runner = ModelRunner(sa, groups=groups)
    stopped: list = []
    io = scheduler_io(groups.tp, lambda: stopped.append(True), link=runner.pipeline)
    sink = Collector()
    sched = scheduler_for_mode("unified")(sa, runner, None, sink, io=io)  # the speculative one with ngram
    rids = [f"w{w}r{i}" for w, wave in enumerate(waves) for i in range(len(wave))]
    if groups.is_leader:
        for w, wave in enumerate(waves):
            for i, prompt in enumerate(wave):
                sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
                sched.submit(GenerateRequest(f"w{w}r{i}", list(prompt), sp))
            run_until_idle(sched)
        sched.inbox.close("scenario done")
    else:
        while not stopped:
            sched.step(block_s=0.01)
    st = sched.get_stats()
    names = {n.split(".")[2] if n.startswith("model.layers.") else n for n, _ in runner.model.named_parameters()}
    return {
        "tokens": {rid: sink.tokens(rid) for rid in rids},
        "free": (st["free_slots"], st["total_slots"]),
        "layers": (runner.pipeline.layers.start, runner.pipeline.layers.end),
        "pool_layers": (runner.kv_pool.num_layers, len(runner.kv_pool.buffers())),
        "params": sorted(names),
        "cached_tokens": st.get("cached_tokens"),
        "spec": {k: st.get(k) for k in ("spec_rounds", "spec_accept_length")},
    }


# the scenarios the --tp-size 2 --pp-size 2 group (4 rank processes) runs
TP_PP_SCENARIOS = ("split_1_2", "chunked_radix")


def _rank_main(rank: int, init_method: str, path: str, out, tp: int = 1, scenarios: tuple = tuple(SCENARIOS)) -> None:
    def body(groups) -> dict:
        return {
            name: _run_scenario(groups, _sa(path, tp_size=tp, pp_size=2, **SCENARIOS[name][0]), SCENARIOS[name][1])
            for name in scenarios
        }

    rank_body(rank, init_method, _sa("", tp_size=tp, pp_size=2), body, out)


def _tp_pp_rank_main(rank: int, init_method: str, path: str, out) -> None:
    _rank_main(rank, init_method, path, out, tp=2, scenarios=TP_PP_SCENARIOS)


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    return build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_pp")), "v3_yarn_grouped", seed=52)


@pytest.fixture(scope="module")
def pp2(ds_path) -> list[dict]:
    """Per rank of a --pp-size 2 DeepSeek worker: {scenario: results}."""
    return run_ranks(_rank_main, 2, (ds_path,), RANK_TIMEOUT_S)


def _reference(path: str, name: str) -> dict[str, list[int]]:
    kw, waves = SCENARIOS[name]
    kw = {k: v for k, v in kw.items() if k not in ("pp_layer_partition", "speculative_algorithm")}
    out = {}
    for w, wave in enumerate(waves):  # wave by wave: a later wave may reuse an earlier one's prefix
        for i, toks in enumerate(unified_greedy(path, wave, MAX_NEW, **{**BASE, **kw})):
            out[f"w{w}r{i}"] = toks
    return out


@pytest.mark.timeout(RANK_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_deepseek_pp2_greedy_tokens_equal_the_single_process(pp2, ds_path, name):
    ref = _reference(ds_path, name)
    for rank in pp2:
        assert rank[name]["tokens"] == ref
        free, total = rank[name]["free"]
        assert free == total


@pytest.mark.timeout(RANK_TIMEOUT_S + 60)
def test_each_deepseek_stage_holds_only_its_layers_and_their_latent_rows(pp2):
    first, last = pp2[0]["split_1_2"], pp2[1]["split_1_2"]
    assert first["layers"] == (0, 1) and last["layers"] == (1, 3)
    assert first["pool_layers"] == (1, 1) and last["pool_layers"] == (2, 2)  # one latent buffer per layer
    assert "model.embed_tokens.weight" in first["params"] and "lm_head.weight" not in first["params"]
    assert "lm_head.weight" in last["params"] and "model.embed_tokens.weight" not in last["params"]
    layer_params = lambda ps: {p for p in ps if p.isdigit()}  # noqa: E731
    assert layer_params(first["params"]) == {"0"} and layer_params(last["params"]) == {"1", "2"}
    assert pp2[0]["split_2_1"]["pool_layers"] == (2, 2) and pp2[1]["split_2_1"]["pool_layers"] == (1, 1)
    assert pp2[0]["chunked_radix"]["cached_tokens"] > 0
    spec = pp2[0]["ngram"]["spec"]
    assert spec["spec_rounds"] > 0 and pp2[1]["ngram"]["spec"] == spec, spec  # the same rounds on both stages


@pytest.mark.timeout(RANK_TIMEOUT_S)
def test_kvship_local_with_a_deepseek_pp2_prefill_equals_unified(ds_path):
    """Prefill --pp-size 2 (stages of 2 and 1 layers, each shipping its latent rows) -> decode TP=1 over tcp:
    greedy tokens equal unified, both prefill ranks and the decode worker have all their KV slots back."""
    from pd_fixtures import start_local

    want = unified_greedy(ds_path, PROMPTS, MAX_NEW, **BASE)
    args = ["--model-path", ds_path, "--device", "cpu", "--max-total-tokens", "512", "--page-size", "4"]
    args += ["--prefill-pp-size", "2", "--decode-tp-size", "1", "--transfer-backend", "tcp"]
    with start_local(args) as cluster:
        for ids, expected in zip(PROMPTS, want):
            r = cluster.generate(ids, MAX_NEW)
            assert r.status_code == 200 and r.json()["output_ids"] == expected, r.text
        prefill, decode = cluster.workers("prefill"), cluster.workers("decode")
        cluster.wait_free(prefill + decode)
        p = cluster.info(prefill[0])
        assert p["pp_size"] == 2 and p["free_slots_per_rank"] == [p["total_slots"]] * 2, p


@pytest.fixture(scope="module")
def tp2_pp2(ds_path) -> list[dict]:
    """Per rank of a --tp-size 2 --pp-size 2 DeepSeek worker (4 processes): {scenario: results}."""
    return run_ranks(_tp_pp_rank_main, 4, (ds_path,), RANK_TIMEOUT_S)


@pytest.mark.timeout(RANK_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", TP_PP_SCENARIOS)
def test_deepseek_tp2_pp2_greedy_tokens_equal_the_single_process_on_every_rank(tp2_pp2, ds_path, name):
    ref = _reference(ds_path, name)
    assert len(tp2_pp2) == 4
    for rank, res in enumerate(tp2_pp2):
        assert res[name]["tokens"] == ref, f"rank {rank}"
        free, total = res[name]["free"]
        assert free == total, f"rank {rank}"
    # stage by stage: both TP ranks of a stage hold the same layers, and each stage only its own
    layers = sorted({res["split_1_2"]["layers"] for res in tp2_pp2})
    assert layers == [(0, 1), (1, 3)], layers
    if name == "chunked_radix":
        assert tp2_pp2[0][name]["cached_tokens"] > 0

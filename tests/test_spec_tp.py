"""Speculative decoding at ``--tp-size 2`` (CPU, gloo, real rank processes): lossless and in lock step.

One group of two rank processes runs each algorithm (ngram, a draft model,
an EAGLE head that repeats the target's pick, a random EAGLE-3 head with its own
draft vocabulary) in turn: every rank builds its shard of a tiny Llama and a
unified scheduler with the TP scheduler I/O (``BroadcastIO``) and the
speculator, exactly as ``kvship serve --tp-size 2`` does; rank 0 submits the
requests (greedy ones, a sampled one, a seeded one and one aborted
mid-stream) and steps until idle, the other rank steps until rank 0 tells it
to stop.  Every rank reports its tokens, counters and pools.  Greedy tokens
must equal plain TP=1 decoding and the TP=1 speculative path; every rank must
emit the same tokens (acceptances are rank 0's: rank 1 samples from another
random stream) and leave its target and
draft pools full.  A served ``--tp-size 2`` ngram worker checks the path
through ``kvship serve`` (the refusal is gone, every rank builds its
speculator), and ``kvship local`` with a TP=2 EAGLE decode worker behind a TP=1
prefill checks PD.
"""

from __future__ import annotations

import pytest
from pd_fixtures import Collector, _server_args, run_until_idle, unified_greedy
from server_fixtures import rank_body, run_ranks, start_server
from test_spec_decode import _prompts  # prompts that repeat a pattern: prompt lookup finds drafts
from test_spec_eagle import write_random_head
from test_spec_eagle_pd import write_repeat_head

from kvship.app.roles import scheduler_for_mode
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(400)

MAX_NEW = 20
ALGOS = ["ngram", "draft", "eagle", "eagle3"]
RANK_TIMEOUT_S = 300


PROMPTS = _prompts(3, seed=31)
EXTRA = _prompts(3, seed=32)  # the sampled, seeded and aborted requests


def _spec_kw(algo: str, paths: dict) -> dict:
    if algo == "ngram":
        return dict(speculative_algorithm="ngram")
    if algo == "draft":  # the target drafting for itself: nearly every draft is accepted
        return dict(
            speculative_algorithm="draft", speculative_draft_model_path=paths["target"], speculative_num_draft_tokens=4
        )
    return dict(speculative_algorithm=algo, speculative_draft_model_path=paths[algo])


def _submit(sched, with_extra: bool) -> None:
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        sched.submit(GenerateRequest(f"g{i}", list(p), greedy))
    if with_extra:
        sched.submit(GenerateRequest("hot", EXTRA[0], SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9)))
        sched.submit(GenerateRequest("seeded", EXTRA[1], SamplingParams(max_new_tokens=8, temperature=0.7, seed=5)))
        sched.submit(GenerateRequest("gone", EXTRA[2], SamplingParams(max_new_tokens=200, temperature=0.0)))


def _drafter_pool(drafter) -> tuple[int, int]:
    """(free, total) of the drafter's own KV pool after it released every request; (0, 0) when it has none."""
    drafter.release_missing(set())
    if hasattr(drafter, "free_slots"):  # EAGLE
        return drafter.free_slots()
    runner = getattr(drafter, "runner", None)
    return (0, 0) if runner is None else (runner.allocator.available_size(), runner.allocator.total_slots)


def _rank_main(rank: int, init_method: str, paths: dict, out) -> None:
    from kvship.engine.scheduler.io import BroadcastIO

    def body(groups) -> dict:
        results = {}
        for algo in ALGOS:
            sa = _server_args(paths["target"], attention_backend="torch_native", tp_size=2, **_spec_kw(algo, paths))
            sink, stopped = Collector(), []
            io = BroadcastIO(groups.tp, lambda: stopped.append(True))
            sched = scheduler_for_mode("unified")(sa, ModelRunner(sa, groups=groups), None, sink, io=io)
            if rank == 1:  # another random stream than rank 0's: a sampled request's acceptance must be rank 0's
                sched.launcher.sampler.generator.manual_seed(999)
            if rank == 0:
                _submit(sched, with_extra=True)
                for _ in range(4):
                    sched.step()
                sched.abort("gone")
                run_until_idle(sched)
                sched.inbox.close("test done")  # StopRanks: the other rank leaves its loop
            else:
                while not stopped:
                    sched.step(block_s=0.01)
            st = sched.get_stats()
            rids = [f"g{i}" for i in range(len(PROMPTS))] + ["hot", "seeded", "gone"]
            results[algo] = {
                "tokens": {rid: sink.tokens(rid) for rid in rids},
                "gone": [c.finish_reason["type"] for c in sink.finished("gone")],
                "stats": {
                    k: st[k]
                    for k in ("free_slots", "total_slots", "spec_rounds", "spec_draft_tokens", "spec_accept_length")
                },
                "draft_pool": _drafter_pool(sched.speculator.drafter),
                "open": len(sched.reqs),
            }
        return results

    rank_body(rank, init_method, _server_args("", tp_size=2), body, out)


@pytest.fixture(scope="module")
def paths(tiny_llama_dir, tmp_path_factory) -> dict:
    # EAGLE: a head that drafts the target's own next pick through the target's (sharded) LM head, so its
    # drafts are accepted only if every rank's features and draft steps are right
    head = write_repeat_head(str(tmp_path_factory.mktemp("eagle_tp")), tiny_llama_dir, "eagle")
    # EAGLE-3 with its own (replicated) LM head over a reduced draft vocabulary
    head3 = write_random_head(
        str(tmp_path_factory.mktemp("eagle3_tp")),
        tiny_llama_dir,
        "eagle3",
        seed=2,
        draft_vocab_size=64,
        eagle_aux_hidden_state_layer_ids=[0, 1],
    )
    return {"target": tiny_llama_dir, "eagle": head, "eagle3": head3}


@pytest.fixture(scope="module")
def tp2(paths) -> list[dict]:
    """Per rank: {algorithm: tokens, stats, pools} from one group of two rank processes."""
    return run_ranks(_rank_main, 2, (paths,), RANK_TIMEOUT_S)


def _tp1_spec(paths: dict, algo: str) -> tuple[dict, dict]:
    sa = _server_args(paths["target"], attention_backend="torch_native", **_spec_kw(algo, paths))
    sink = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, sink)
    _submit(sched, with_extra=False)
    run_until_idle(sched)
    return {f"g{i}": sink.tokens(f"g{i}") for i in range(len(PROMPTS))}, sched.get_stats()


@pytest.mark.parametrize("algo", ALGOS)
def test_speculation_at_tp2_gives_plain_tp1_greedy_tokens_on_every_rank(tp2, paths, algo):
    plain = unified_greedy(paths["target"], PROMPTS, MAX_NEW, attention_backend="torch_native")
    spec1, st1 = _tp1_spec(paths, algo)
    want = {f"g{i}": toks for i, toks in enumerate(plain)}
    assert spec1 == want
    rank0, rank1 = tp2[0][algo], tp2[1][algo]
    for rid, toks in want.items():
        assert rank0["tokens"][rid] == toks, rid
    # every rank emitted rank 0's tokens, sampled and seeded requests included (acceptances are rank 0's)
    assert rank1["tokens"] == rank0["tokens"]
    assert len(rank0["tokens"]["hot"]) == 16 and len(rank0["tokens"]["seeded"]) == 8
    assert rank0["gone"] == rank1["gone"] == ["abort"]
    assert rank0["stats"]["spec_rounds"] > 0 and rank0["stats"]["spec_draft_tokens"] > 0
    assert rank0["stats"]["spec_rounds"] == rank1["stats"]["spec_rounds"]
    if algo == "draft":  # the sharded draft model drafts what the target picks
        assert rank0["stats"]["spec_accept_length"] > 3.0
    if algo == "eagle":  # the repeat head's drafts are accepted on loops
        assert rank0["stats"]["spec_accept_length"] > 1.2


@pytest.mark.parametrize("algo", ALGOS)
def test_speculation_at_tp2_leaves_target_and_draft_pools_full_on_every_rank(tp2, algo):
    for rank, results in enumerate(tp2):
        r = results[algo]
        assert r["open"] == 0, rank
        assert r["stats"]["free_slots"] == r["stats"]["total_slots"], (rank, r["stats"])
        free, total = r["draft_pool"]
        assert free == total, (rank, algo, r["draft_pool"])
        if algo != "ngram":
            assert total > 0
    assert tp2[0][algo]["draft_pool"] == tp2[1][algo]["draft_pool"]


def test_served_ngram_worker_at_tp2_matches_tp1_greedy_tokens(paths):
    plain = unified_greedy(paths["target"], PROMPTS, MAX_NEW, attention_backend="torch_native")
    args = ["--model-path", paths["target"], "--tp-size", "2", "--device", "cpu", "--attention-backend",
            "torch_native", "--max-total-tokens", "8192", "--speculative-algorithm", "ngram"]  # fmt: skip
    with start_server(args, keep_log=True) as srv:
        for p, want in zip(PROMPTS, plain):
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
            r = srv.post("/generate", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want
        info = srv.get("/get_server_info").json()
        assert info["tp_size"] == 2 and info["spec_rounds"] > 0


def test_a_draft_model_that_does_not_split_over_tp_is_refused_before_ranks_start(tiny_llama_dir, tmp_path):
    from conftest import build_tiny_model

    from kvship.app.serve import check_tensor_parallel

    draft = build_tiny_model(
        str(tmp_path), "llama", seed=9, num_attention_heads=6, num_key_value_heads=3, hidden_size=96
    )
    sa = _server_args(tiny_llama_dir, tp_size=2, speculative_algorithm="draft", speculative_draft_model_path=draft)
    with pytest.raises(ValueError, match="--speculative-draft-model-path .*--tp-size 2"):
        check_tensor_parallel(sa)
    check_tensor_parallel(_server_args(tiny_llama_dir, tp_size=2, speculative_algorithm="ngram"))


def test_kvship_local_tp1_prefill_feeds_a_tp2_eagle_decode_with_tp1_tokens(paths):
    """PD: the prompt's features reach both decode ranks; the decode worker drafts at TP=2, tokens equal TP=1."""
    from pd_fixtures import start_local

    plain = unified_greedy(paths["target"], PROMPTS, MAX_NEW, attention_backend="torch_native")
    args = ["--model-path", paths["target"], "--device", "cpu", "--max-total-tokens", "2048", "--decode-tp-size",
            "2", "--attention-backend", "torch_native", "--transfer-backend", "tcp", "--speculative-algorithm",
            "eagle", "--speculative-draft-model-path", paths["eagle"]]  # fmt: skip
    with start_local(args) as cluster:
        for ids, want in zip(PROMPTS, plain):
            r = cluster.generate(ids, MAX_NEW)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want
        decode = cluster.workers("decode")
        assert cluster.info(decode[0])["tp_size"] == 2 and cluster.info(decode[0])["spec_rounds"] > 0
        cluster.wait_free(cluster.workers("prefill") + decode)

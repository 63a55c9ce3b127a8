"""PD with EAGLE: the prefill worker ships the prompt's features, so decode drafts as a unified worker does.

A decode worker's EAGLE drafter reads one feature per KV slot; in PD the
prompt's slots are filled by the KV transfer, so a prefill worker started
with the same ``--speculative-algorithm eagle|eagle3`` head computes the
prompt's features and the transfer layer ships them with the K/V pages
(docs/speculative.md, "PD").  With EAGLE and EAGLE-3 heads on a tiny random
target (CPU, torch_native) these tests check, on every transfer backend, that
PD gives the unified worker's greedy tokens *and the same draft trees, round
by round, and acceptance per request* (drafts depend on the features: without
them the first round's trees differ).  Two heads of each variant: a random
one, and a "repeat" head built to pass the target's own prediction through
(it drafts the root token again), which a greedy loop of the tiny target
accepts, so acceptance is well above 1 and lower without the prompt's
features (its first round then drafts from zeros); the transfer-layer
tests check the feature pages land on the right slots between
tensor-parallel ranks (2 -> 1, 1 -> 2, 2 -> 2), and that workers whose
features disagree fall back to K/V alone; KV and draft slots end full.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from pd_fixtures import KV_SECRET, Collector, InProcessPD, _server_args, room_token, run_until_idle, unified_greedy
from test_spec_eagle import write_random_head

from kvship.app.roles import scheduler_for_mode
from kvship.engine.disagg.base import BackendUnavailableError, KVPoll, SlotFeatures, get_transfer_backend
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_runner import ModelRunner

os.environ.setdefault("UCX_MODULES", "^ib")  # as tests/test_kv_transfer.py: Debian's ibverbs provider crashes UCX

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
# no radix cache: every prompt is computed whole, in one forward of the same shape on both workers, so the
# features (and the draft trees' scores, which have near ties) are bit for bit the unified worker's
COMMON = dict(attention_backend="torch_native", disable_radix_cache=True)
BACKENDS = ["tcp", "mooncake", "nixl"]


def _available(backend: str) -> None:
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"transfer backend {backend} not installed here: {e}")


def write_repeat_head(path: str, target_dir: str, variant: str) -> str:
    """A head whose output is its input feature, read through the target's own final norm and LM head: it
    drafts the token the target picked at the feature's position, i.e. the root again (and again, deeper).

    Attention and MLP add nothing (``o_proj`` and ``down_proj`` are zero).  EAGLE: ``fc`` passes the feature
    (the target's final normed hidden state) through and the target's LM head gives the logits.  EAGLE-3 over
    layers 0 and 1 of the 2-layer target: ``fc`` keeps layer 1's output (the final hidden state before the
    norm), and the head's ``norm`` and ``lm_head`` are the target's."""
    from safetensors.torch import load_file

    from kvship.decode.spec.eagle_head import head_config, head_tensor_shapes, save_head
    from kvship.engine.model_config import ModelConfig

    target = ModelConfig.from_pretrained(target_dir)
    assert target.num_hidden_layers == 2
    extra = {"eagle_aux_hidden_state_layer_ids": [0, 1]} if variant == "eagle3" else {}
    cfg = head_config(variant, target, **extra)
    g = torch.Generator().manual_seed(5)
    h = target.hidden_size
    tensors = {}
    for name, shape in head_tensor_shapes(cfg, 2).items():
        if "norm" in name:
            tensors[name] = torch.ones(shape)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "fc.bias")):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = 0.2 * torch.randn(shape, generator=g)
    tensors["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    if variant == "eagle3":
        w = load_file(f"{target_dir}/model.safetensors")
        tensors["norm.weight"] = w["model.norm.weight"]
        tensors["lm_head.weight"] = w["lm_head.weight"]
    save_head(path, cfg, tensors)
    return path


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    def tmp(name: str) -> str:
        return str(tmp_path_factory.mktemp(name))

    return {
        ("eagle", "random"): write_random_head(tmp("eagle"), tiny_llama_dir, "eagle", seed=11),
        ("eagle3", "random"): write_random_head(
            tmp("eagle3"),
            tiny_llama_dir,
            "eagle3",
            seed=12,
            draft_vocab_size=96,
            eagle_aux_hidden_state_layer_ids=[0, 1],
        ),
        ("eagle", "repeat"): write_repeat_head(tmp("eagle_repeat"), tiny_llama_dir, "eagle"),
        ("eagle3", "repeat"): write_repeat_head(tmp("eagle3_repeat"), tiny_llama_dir, "eagle3"),
    }


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    """Three prompts; the first ends inside the greedy loop the second runs into, so the first token of its
    answer already repeats (a repeat head's first round, drafted from the prompt's features, is accepted).
    It comes first: a later request would reuse the slots the second left, whose stale features are its own."""
    g = torch.Generator().manual_seed(40)
    base = [
        torch.randint(3, 200, (int(torch.randint(6, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(2)
    ]
    loop = unified_greedy(tiny_llama_dir, [base[0]], 8, attention_backend="torch_native")[0]
    return [base[0] + loop, base[0], base[1]]


def _spec(variant: str, head: str) -> dict:
    return dict(
        speculative_algorithm=variant,
        speculative_draft_model_path=head,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    )


def _record_trees(drafter) -> dict[str, list]:
    """Wrap ``drafter.draft_trees``: every round's tree per request id, as (tokens, parents)."""
    seen: dict[str, list] = {}
    inner = drafter.draft_trees

    def draft_trees(reqs):
        trees = inner(reqs)
        for r, t in zip(reqs, trees):
            seen.setdefault(r.rid, []).append((tuple(t.tokens), tuple(t.parents)))
        return trees

    drafter.draft_trees = draft_trees
    return seen


def _accept_length(out: Collector, rid: str) -> float:
    return out.finished(rid)[0].spec_accept_length


_UNIFIED: dict = {}


def _unified(model_dir: str, prompts, spec: dict):
    """Tokens, draft trees and acceptance per prompt of a unified EAGLE worker, one request at a time (cached)."""
    key = (model_dir, repr(prompts), repr(sorted(spec.items())))
    if key not in _UNIFIED:
        _UNIFIED[key] = _unified_run(model_dir, prompts, spec)
    return _UNIFIED[key]


def _unified_run(model_dir: str, prompts, spec: dict):
    sa = _server_args(model_dir, **COMMON, **spec)
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    trees = _record_trees(sched.speculator.drafter)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"u{i}", list(p), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
        run_until_idle(sched)
    rids = [f"u{i}" for i in range(len(prompts))]
    return [out.tokens(r) for r in rids], [trees.get(r, []) for r in rids], [_accept_length(out, r) for r in rids]


def _pd(model_dir: str, prompts, spec: dict, backend: str, prefill_spec: bool = True):
    """The same through an in-process prefill + decode pair (the prefill given the head unless told not)."""
    with InProcessPD(
        model_dir,
        backend=backend,
        **COMMON,
        prefill_args=spec if prefill_spec else None,
        decode_args=spec,
    ) as pd:
        drafter = pd.decode.speculator.drafter
        trees = _record_trees(drafter)
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):  # one at a time: each request's rounds batch as in the unified run
            pd.submit(rid, p, MAX_NEW)
            pd.wait([rid])
            pd.wait([rid], side="prefill")
        pd.wait_idle()
        assert pd.prefill.get_stats()["kv_transfers_ok"] == len(prompts)
        drafter.release_missing(set())
        free, total = drafter.free_slots()
        assert free == total and not drafter.rows
        return (
            [pd.tokens(r) for r in rids],
            [trees.get(r, []) for r in rids],
            [_accept_length(pd.d_out, r) for r in rids],
        )


# repeat heads (acceptance well above 1) on every backend; random heads (any weights) over tcp
PARITY = [(v, "repeat", b) for v in ("eagle", "eagle3") for b in BACKENDS] + [
    (v, "random", "tcp") for v in ("eagle", "eagle3")
]


@pytest.mark.parametrize("variant,head,backend", PARITY)
def test_pd_decode_drafts_from_prefills_features_like_unified(tiny_llama_dir, heads, prompts, variant, head, backend):
    """Same tokens, same draft trees every round, same acceptance per request as the unified worker."""
    _available(backend)
    spec = _spec(variant, heads[variant, head])
    want_tokens, want_trees, want_accept = _unified(tiny_llama_dir, prompts, spec)
    tokens, trees, accept = _pd(tiny_llama_dir, prompts, spec, backend)
    assert tokens == want_tokens
    assert all(want_trees) and trees == want_trees  # drafts depend on the prompt's features: they arrived
    assert accept == want_accept
    if head == "repeat":  # the loop is accepted, from the first round on for the first prompt
        assert want_accept[0] > want_accept[1] > 1.5
        assert want_trees[0][0][0][0] == want_tokens[0][0]  # its first tree's best node repeats the root


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_pd_without_prefill_features_stays_lossless_with_lower_acceptance(tiny_llama_dir, heads, prompts, variant):
    """A prefill worker without the head ships K/V alone (decode logs why): the tokens are still the unified
    ones, but the first round drafts from zeros, so the request whose first round a unified worker accepts
    accepts less (what the parity test above would see if a transfer lost the features)."""
    spec = _spec(variant, heads[variant, "repeat"])
    want_tokens, want_trees, want_accept = _unified(tiny_llama_dir, prompts, spec)
    tokens, trees, accept = _pd(tiny_llama_dir, prompts, spec, "tcp", prefill_spec=False)
    assert tokens == want_tokens
    assert [t[0] for t in trees] != [t[0] for t in want_trees]
    assert accept[0] < want_accept[0]


def test_prefill_worker_refuses_token_only_speculation(tiny_llama_dir):
    sa = _server_args(tiny_llama_dir, mode="prefill", speculative_algorithm="ngram")
    with pytest.raises(ValueError, match="needs nothing from a prefill worker"):
        scheduler_for_mode("prefill")(sa, None, None, Collector())


def test_prefill_worker_takes_eagle_flags_at_any_page_and_tp_size(tiny_llama_dir, heads):
    spec = _spec("eagle3", heads["eagle3", "random"])
    _server_args(tiny_llama_dir, mode="prefill", page_size=16, tp_size=2, **spec).validate()
    with pytest.raises(ValueError, match="page-size 1"):
        _server_args(tiny_llama_dir, mode="decode", page_size=16, **spec).validate()


# --- the transfer layer: feature pages between tensor-parallel ranks ------------------------------
LAYERS, HEAD_DIM, SLOTS, DIM = 2, 8, 64, 24


def _managers(backend: str, a: int, b: int, kinds: tuple[str, str] = ("k", "k"), dims: tuple[int, int] = (DIM, DIM)):
    from kvship.engine.disagg import KVTransferConfig, create_kv_manager
    from kvship.engine.disagg.tp_slices import rank_kv_heads
    from kvship.engine.mem.pools import KVPool

    common = dict(backend=backend, bootstrap_port=0, total_kv_heads=2, checksum=True, secret=KV_SECRET)
    g = torch.Generator().manual_seed(3)
    want = torch.randn((SLOTS + 1, dims[0]), generator=g)
    prefill, decode, dfeats = [], [], []
    for p in range(a):
        pool = KVPool(SLOTS, 1, torch.float32, rank_kv_heads(2, a, p)[1], HEAD_DIM, LAYERS, "cpu")
        feats = SlotFeatures(kinds[0], want.clone()) if kinds[0] else None
        cfg = KVTransferConfig(tp_size=a, tp_rank=p, **common)
        prefill.append(create_kv_manager("prefill", pool, cfg, feats))
    addresses = [m.rank_addresses[0] for m in prefill]  # what TPKVManager gathers over the ranks
    for m in prefill:
        m.rank_addresses = addresses
    for d in range(b):
        pool = KVPool(SLOTS, 1, torch.float32, rank_kv_heads(2, b, d)[1], HEAD_DIM, LAYERS, "cpu")
        buf = torch.zeros((SLOTS + 1, dims[1]))
        dfeats.append(buf)
        cfg = KVTransferConfig(tp_size=b, tp_rank=d, **common)
        decode.append(create_kv_manager("decode", pool, cfg, SlotFeatures(kinds[1], buf) if kinds[1] else None))
    return prefill, decode, want, dfeats


def _move_room(prefill, decode) -> tuple[list, list]:
    from kvship.engine.disagg import AuxInfo

    # scattered pages: one run per page, enough descriptors for tcp's page-wise packing too
    rng = np.random.default_rng(5)
    src, dst = (rng.permutation(np.arange(1, SLOTS + 1))[:40].tolist() for _ in range(2))
    room = 77
    senders = [m.create_sender(room, room_token(room)) for m in prefill]
    receivers = [m.create_receiver("127.0.0.1", prefill[0].bootstrap_port, room, room_token(room)) for m in decode]
    for r in receivers:
        r.init(dst)
    for s in senders:
        s.send(src, AuxInfo(first_token_id=5, first_token_logprob=-0.1, prompt_len=len(src)))
    deadline = time.monotonic() + 30
    while not all(t.poll().is_terminal for t in senders + receivers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.poll() for s in senders + receivers] == [KVPoll.Success] * (len(senders) + len(receivers))
    return src, dst


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a,b", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_feature_pages_land_on_every_decode_ranks_slots(backend, a, b):
    _available(backend)
    prefill, decode, want, dfeats = _managers(backend, a, b)
    try:
        src, dst = _move_room(prefill, decode)
        for buf in dfeats:
            assert torch.equal(buf[dst], want[src])  # whole vectors on every decode rank
            untouched = np.setdiff1d(np.arange(SLOTS + 1), dst)
            assert not buf[untouched].any()
    finally:
        for m in decode + prefill:
            m.close()


@pytest.mark.parametrize(
    "kinds,dims",
    [(("k", ""), (DIM, DIM)), (("", "k"), (DIM, DIM)), (("k", "other"), (DIM, DIM)), (("k", "k"), (DIM, DIM + 8))],
    ids=["decode-has-none", "prefill-has-none", "other-kind", "other-width"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_whose_features_disagree_move_the_kv_alone(backend, kinds, dims, caplog):
    _available(backend)
    prefill, decode, _, dfeats = _managers(backend, 1, 1, kinds, dims)
    try:
        _move_room(prefill, decode)  # the K/V (checksummed) arrives; no feature byte moves
        assert not dfeats[0].any()
        if kinds[1]:  # a decode worker that wanted features says why it has none
            assert any(f"sends no {kinds[1]} features" in r.getMessage() for r in caplog.records)
    finally:
        for m in decode + prefill:
            m.close()


# --- kvship local: the flags reach the right workers; a TP=2 prefill feeds a TP=1 EAGLE decode ---------------
def test_kvship_local_gives_prefill_workers_the_speculative_flags_only_for_eagle():
    from kvship.app.local import role_worker_args

    base = ["--model-path", "/m", "--page-size", "1"]
    eagle = [*base, "--speculative-algorithm", "eagle3", "--speculative-draft-model-path", "/h"]
    assert role_worker_args(eagle, "prefill") == eagle == role_worker_args(eagle, "decode")
    ngram = [*base, "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4", "--disable-radix-cache"]
    assert role_worker_args(ngram, "prefill") == [*base, "--disable-radix-cache"]
    assert role_worker_args(ngram, "decode") == ngram


def test_kvship_local_tp2_prefill_ships_eagle_features_to_a_tp1_decode(tiny_llama_dir, heads, prompts):
    """Processes, HTTP and tensor parallelism: a 2-rank prefill computes the features (rank 0 ships them);
    the decode worker's tokens and per-request acceptance equal the unified worker's."""
    from pd_fixtures import start_local

    spec = _spec("eagle", heads["eagle", "repeat"])
    want_tokens, _, want_accept = _unified(tiny_llama_dir, prompts, spec)
    args = ["--model-path", tiny_llama_dir, "--device", "cpu", "--max-total-tokens", "2048"]
    args += ["--attention-backend", "torch_native", "--disable-radix-cache", "--prefill-tp-size", "2"]
    args += ["--transfer-backend", "tcp"]
    for key, value in spec.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    with start_local(args) as cluster:
        for ids, tokens, accept in zip(prompts, want_tokens, want_accept):
            r = cluster.generate(ids, MAX_NEW)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["output_ids"] == tokens
            assert body["meta_info"]["spec_accept_length"] == pytest.approx(accept, abs=1e-4)  # served rounded
        urls = cluster.workers("prefill") + cluster.workers("decode")
        cluster.wait_free(urls)
        assert "sends no" not in cluster.log("decode-0", 400)

"""EAGLE drafting on CUDA: rounds whose verify replays CUDA graphs (which also capture the target's hidden
states for the head) give the tokens and the drafts of eager rounds; the draft steps replayed from their own
CUDA graphs (``graphs.DraftGraphs``) draft exactly the trees of eager draft steps, and greedy decoding with
both graphs gives plain decoding's tokens.

(As in test_gpu_spec.py, speculative vs plain decoding is compared token for token on CPU,
tests/test_spec_eagle.py; on the GPU the two run different kernels, so here a difference is allowed only
where the target's two candidates are tied to within the kernels' rounding.)  The draft steps over the Triton kernels
are checked against the host-driven reference (tests/test_spec_eagle_tree.py) on CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import HAS_CUDA, NO_CUDA_REASON, interpreter_mode

pytestmark = [pytest.mark.gpu]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)


def _target(tmp_path) -> str:
    from conftest import build_tiny_model

    return build_tiny_model(
        str(tmp_path / "target"),
        "llama",
        seed=11,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )


def _head(tmp_path, model_dir: str, variant: str) -> str:
    from test_spec_eagle import write_random_head

    extra = dict(draft_vocab_size=64, eagle_aux_hidden_state_layer_ids=[0, 1, 3]) if variant == "eagle3" else {}
    return write_random_head(str(tmp_path / "head"), model_dir, variant, seed=3, **extra)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (6 + 2 * i,), generator=g).tolist() for i in range(n)]


def _pairs(trees) -> list[tuple]:
    return [(t.root, t.tokens, t.parents) for t in trees]


@requires_cuda
@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_gpu_eagle_rounds_with_verify_graphs_equal_eager_rounds(tmp_path, variant):
    from pd_fixtures import Collector, _server_args, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    model_dir = _target(tmp_path)
    head = _head(tmp_path, model_dir, variant)
    prompts = _prompts(8)

    def run(graphs: bool):
        sa = _server_args(
            model_dir,
            device="cuda",
            attention_backend="triton",
            dtype="float32",
            speculative_algorithm=variant,
            speculative_draft_model_path=head,
            disable_cuda_graph=not graphs,
            cuda_graph_bs=[8],
        )
        out = Collector()
        sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
        assert (sched.speculator.graphs is not None) == graphs
        drafts = []
        real = sched.speculator.drafter.draft_trees

        def recording(reqs):
            trees = real(reqs)
            drafts.append([t.tokens for t in trees])
            return trees

        sched.speculator.drafter.draft_trees = recording
        for i, p in enumerate(prompts):
            sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0)))
        run_until_idle(sched)
        st = sched.get_stats()
        assert st["free_slots"] == st["total_slots"] and st["spec_rounds"] > 0
        if graphs:
            assert sched.speculator.graphs.replays > 0 and sched.speculator.drafter.graphs.replays > 0
        return [out.tokens(f"r{i}") for i in range(len(prompts))], drafts

    tokens_g, drafts_g = run(graphs=True)
    tokens_e, drafts_e = run(graphs=False)
    assert tokens_g == tokens_e
    # the first rounds draft from the same features: the prompt's (eager prefill), then those the verify graphs
    # captured; a replay that lost them would draft from zeros and agree on almost nothing.  (TF32 dots and the
    # padded graph trees may flip a near-tied candidate, hence not all.)
    assert drafts_g[0] == drafts_e[0] and any(drafts_g[0])
    same = sum(a == b for rg, re in zip(drafts_g[1:4], drafts_e[1:4]) for a, b in zip(rg, re))
    total = sum(len(r) for r in drafts_g[1:4])
    assert total and same >= 0.75 * total, f"{same} of {total} trees equal"


def _eagle_scheduler(model_dir: str, head: str, variant: str, **kw):
    from pd_fixtures import Collector, _server_args

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.model_runner import ModelRunner

    sa = _server_args(
        model_dir,
        device="cuda",
        attention_backend="triton",
        dtype="float32",
        speculative_algorithm=variant,
        speculative_draft_model_path=head,
        **kw,
    )
    out = Collector()
    return scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out), out


@requires_cuda
@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)],
    ids=["tree-5x4-8", "chain-3"],
)
def test_gpu_eagle_draft_graphs_replay_the_eager_draft_trees(tmp_path, variant, shape):
    """The same drafter state drafted by replaying the draft graphs and by running the draft steps eagerly:
    the same trees, for batches of a captured size and batches padded up to one."""
    from pd_fixtures import run_until_idle

    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    model_dir = _target(tmp_path)
    head = _head(tmp_path, model_dir, variant)
    sched, _ = _eagle_scheduler(model_dir, head, variant, cuda_graph_bs=[1, 4, 8], **shape)
    drafter = sched.speculator.drafter
    graphs = drafter.graphs
    assert graphs is not None and graphs.sizes == [1, 4, 8]
    for i, p in enumerate(_prompts(8)):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=40, temperature=0.0)))
    while len(sched.running) < 8:  # prefill: the prompts' features
        sched.step()
    for _ in range(4):
        reqs = [sched.reqs[f"r{i}"] for i in range(8) if f"r{i}" in sched.reqs]
        for part in (reqs, reqs[:3], reqs[:1]):
            drafter.draft_trees(part)  # computes the entries the rows lack; later calls recompute the root only
            before = graphs.replays
            replayed = drafter.draft_trees(part)
            assert graphs.replays == before + 1
            drafter.graphs = None
            try:
                eager = drafter.draft_trees(part)
            finally:
                drafter.graphs = graphs
            assert _pairs(replayed) == _pairs(eager)
            assert all(len(t.tokens) == drafter.k for t in replayed)
        sched.step()  # a real round: verify, accept, the sequences move on
    run_until_idle(sched)
    drafter.release_missing(set())
    assert drafter.free_slots()[0] == drafter.free_slots()[1]


def _same_up_to_ties(model_dir: str, prompts, got, want, rel: float = 1e-2) -> int:
    """Checks that requests' tokens differ only after a position where the target's two choices are tied to
    ``rel`` of the largest logit (float64 transformers forward of the common prefix: the Triton kernels' TF32
    dots err by about 1e-3 of it, a wrong acceptance picks a token far below the argmax); returns how many
    requests differ at all."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    differ = 0
    for p, a, b in zip(prompts, got, want):
        if a == b:
            continue
        differ += 1
        i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
        with torch.no_grad():
            logits = model(torch.tensor([p + a[:i]])).logits[0, -1]
        gap = float((logits[a[i]] - logits[b[i]]).abs())
        assert gap <= rel * float(logits.abs().max()), f"token {i}: {a[i]} vs {b[i]}, logit gap {gap}"
    return differ


@requires_cuda
@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_gpu_eagle_with_draft_graphs_gives_eager_drafts_and_plain_greedy_tokens(tmp_path, variant):
    """Greedy decoding with the verify and draft graphs: every round drafts the trees of eager draft steps
    (the same tokens follow), and the tokens are plain decoding's (up to near ties of the target's logits)."""
    from pd_fixtures import Collector, _server_args, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    model_dir = _target(tmp_path)
    head = _head(tmp_path, model_dir, variant)
    prompts = _prompts(8)

    def run(draft_graphs: bool):
        sched, out = _eagle_scheduler(model_dir, head, variant, cuda_graph_bs=[1, 2, 4, 8])
        drafter = sched.speculator.drafter
        graphs = drafter.graphs
        assert graphs is not None and sched.speculator.graphs is not None
        if not draft_graphs:
            drafter.graphs = None  # the verify graphs stay: only the draft steps run eagerly
        drafts = []
        real = drafter.draft_trees

        def recording(reqs):
            trees = real(reqs)
            drafts.append(_pairs(trees))
            return trees

        drafter.draft_trees = recording
        for i, p in enumerate(prompts):
            sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=32, temperature=0.0)))
        run_until_idle(sched)
        st = sched.get_stats()
        assert st["free_slots"] == st["total_slots"] and st["spec_rounds"] > 0
        assert (graphs.replays > 0) == draft_graphs
        return [out.tokens(f"r{i}") for i in range(len(prompts))], drafts

    tokens_g, drafts_g = run(draft_graphs=True)
    tokens_e, drafts_e = run(draft_graphs=False)
    assert drafts_g == drafts_e and tokens_g == tokens_e

    sa = _server_args(model_dir, device="cuda", attention_backend="triton", dtype="float32", cuda_graph_bs=[8])
    out = Collector()
    plain = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    for i, p in enumerate(prompts):
        plain.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=32, temperature=0.0)))
    run_until_idle(plain)
    want = [out.tokens(f"r{i}") for i in range(len(prompts))]
    assert _same_up_to_ties(model_dir, prompts, tokens_g, want) <= 2


@pytest.mark.skipif(
    not interpreter_mode(), reason="the Triton draft path on CPU: TRITON_INTERPRET=1 on a machine without CUDA"
)
@pytest.mark.parametrize("shape", ["tree-3x2-5", "tree-5x4-8", "chain-4"])
def test_triton_draft_steps_draft_the_trees_of_the_host_reference(tiny_llama_dir, tmp_path, shape):
    """The drafter over the Triton kernels (the entries' extend and the draft steps' decode attention, as on
    CUDA), its batches padded to graph sizes as on CUDA, drafts the host reference's trees (float32, CPU)."""
    from pd_fixtures import Collector, _server_args, run_until_idle
    from test_spec_eagle import write_random_head
    from test_spec_eagle_tree import SHAPES, _prompts, _ReferenceDrafter

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.attention.base import AttentionContext, create_attention_backend
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    head = write_random_head(str(tmp_path / "head"), tiny_llama_dir, "eagle", seed=21)
    sa = _server_args(
        tiny_llama_dir,
        attention_backend="torch_native",
        speculative_algorithm="eagle",
        speculative_draft_model_path=head,
        **SHAPES[shape],
    )
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, Collector())
    d = sched.speculator.drafter
    mc = d.head.cfg.model
    sizes = [2, 4, 8]
    ctx = AttentionContext(
        device=d.device,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        page_size=1,
        req_to_token_pool=d.r2t,
        max_running_requests=d.max_running * d.topk,
        cuda_graph_bs=tuple(b * d.topk for b in sizes),
    )
    # what attach builds on CUDA, here on CPU: the triton backend and the graph sizes batches pad to
    d.backend = d.tree.backend = create_attention_backend("triton", ctx)
    d.graph_sizes = sizes
    ref = _ReferenceDrafter(d)
    inner = d.draft_trees
    rounds = []

    def compared(reqs):
        ref.release_missing(set(sched.reqs))
        want = ref.draft_trees(reqs)
        got = inner(reqs)
        assert _pairs(got) == _pairs(want), f"round {len(rounds)}"
        rounds.append(len(reqs))
        return got

    d.draft_trees = compared
    for i, p in enumerate(_prompts(3, seed=5)):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=6, temperature=0.0)))
    run_until_idle(sched)
    assert len(rounds) >= 3

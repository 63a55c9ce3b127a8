"""The EAGLE draft steps as a fixed-shape device loop (``decode/spec/eagle_tree.py``) draft exactly the trees of
the host-driven tree expansion it replaced.

``_ReferenceDrafter`` below is that expansion, kept here as the reference: per step it runs every node
expanded so far as one extend with its tree mask over the committed entries (scratch slots taken and freed
per step), scores the children of the deepest nodes by cumulative log-probability on the host and expands
the best ``topk``; the tree is the best ``nodes`` candidates (parents first).  It keeps its own draft pool and
rows and shares only the head and the per-slot features with the drafter under test, so both draft from
the same state.  A random head checks the attention (entries, branch rows, positions, features: float
rounding is all that differs); a "repeat" head (tests/test_spec_eagle_pd.py: every node's output is its
input feature) gets drafts accepted, so rounds reuse entries after accepts and rejects, and has exact score
ties between branches, which both must break the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pd_fixtures import Collector, _server_args, run_until_idle, unified_greedy
from test_spec_eagle import write_random_head
from test_spec_eagle_pd import write_repeat_head

from kvship.app.roles import scheduler_for_mode
from kvship.decode.spec.tree import DraftTree
from kvship.engine.attention.base import AttentionContext, create_attention_backend
from kvship.engine.forward_batch import ForwardMode, build_forward_batch
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)


@dataclass
class _Cand:
    token: int
    parent: int  # index into the request's candidates, -1 = the root
    depth: int
    score: float  # cumulative log-probability


@dataclass
class _Work:
    row: int
    tokens: list[int]
    n_entries: int
    cands: list[_Cand] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    root_hidden: Any = None
    root_out: Any = None


class _ReferenceDrafter:
    """The host-driven EAGLE tree expansion, over its own draft pool, for the head of drafter ``d``."""

    def __init__(self, d: Any):
        self.d = d
        self.steps, self.topk, self.k = d.steps, d.topk, d.k
        pool = d.pool
        self.pool = KVPool(pool.num_slots, 1, pool.dtype, pool.num_kv_heads, pool.head_dim, 1, d.device)
        self.allocator = TokenToKVPoolAllocator(self.pool.num_slots, 1)
        self.r2t = ReqToTokenPool(d.max_running + 16, d.r2t.max_context_len + 8 * self.steps * self.topk, d.device)
        mc = d.head.cfg.model
        ctx = AttentionContext(
            device=d.device,
            dtype=d.target.dtype,
            kv_dtype=pool.dtype,
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            page_size=1,
            req_to_token_pool=self.r2t,
            max_running_requests=d.max_running,
        )
        self.backend = create_attention_backend("torch_native", ctx)
        self.rows: dict[str, tuple[int, list[int], list[int]]] = {}  # rid -> (row, entry tokens, entry slots)

    def release_missing(self, open_rids: set[str]) -> None:
        for rid in [r for r in self.rows if r not in open_rids]:
            idx, _, slots = self.rows.pop(rid)
            self.allocator.free(slots)
            self.r2t.free(idx)

    def draft_trees(self, reqs: list[Any]) -> list[DraftTree]:
        works: list[_Work | None] = []
        batch = []
        for req in reqs:
            seq = req.fill_ids
            n = len(seq) - 1
            if n < 1:
                works.append(None)
                continue
            if req.rid not in self.rows:
                self.rows[req.rid] = (self.r2t.alloc(), [], [])
            idx, tokens, slots = self.rows[req.rid]
            want = seq[1:]
            common = 0
            for a, b in zip(tokens, want):
                if a != b:
                    break
                common += 1
            common = min(common, n - 1)
            if common < len(tokens):
                self.allocator.free(slots[common:])
                del slots[common:], tokens[common:]
            w = _Work(idx, tokens, n)
            works.append(w)
            batch.append((w, slots, want[common:], common, req.req_pool_idx))
        if batch:
            self._extend_entries(batch)
        live = [w for w in works if w is not None and w.root_hidden is not None]
        if live:
            ids, lps = self._topk(torch.stack([w.root_out for w in live]))
            for w, toks, vals in zip(live, ids, lps):
                w.cands = [_Cand(t, -1, 1, v) for t, v in zip(toks, vals)]
                w.expanded = list(range(len(w.cands)))
        for step in range(2, self.steps + 1):
            if live:
                self._tree_step(live, step)
        return [self._tree(req.fill_ids[-1], w) for req, w in zip(reqs, works)]

    def _extend_entries(self, batch) -> None:
        locs = self.allocator.alloc(sum(len(toks) for _, _, toks, _, _ in batch))
        assert locs is not None
        t_r2t = self.d.target.req_to_token_pool.req_to_token
        off = 0
        ids, pos, rows, prefix, ext, tslots = [], [], [], [], [], []
        for w, slots, toks, start, target_row in batch:
            mine = locs[off : off + len(toks)]
            off += len(toks)
            self.r2t.write(w.row, start, mine)
            slots += mine.tolist()
            w.tokens += toks
            ids += toks
            pos += range(start, start + len(toks))
            rows.append(w.row)
            prefix.append(start)
            ext.append(len(toks))
            tslots.append(t_r2t[target_row, start : start + len(toks)].to(torch.int64))
        feats = self.d.features[torch.cat(tslots).to(self.d.device)]
        out, nxt = self._run(ids, feats, pos, rows, prefix, ext, locs, None)
        ends = (torch.tensor(ext).cumsum(0) - 1).tolist()
        for (w, *_), e in zip(batch, ends):
            w.root_hidden = nxt[e]
            w.root_out = out[e]

    def _run(self, ids, feats, pos, rows, prefix, ext, locs, masks):
        fb = build_forward_batch(
            ForwardMode.DRAFT_EXTEND,
            device=self.d.device,
            input_ids=ids,
            positions=pos,
            req_pool_indices=rows,
            seq_lens=[p + e for p, e in zip(prefix, ext)],
            seq_lens_cpu=[p + e for p, e in zip(prefix, ext)],
            out_cache_loc=locs,
            req_to_token_pool=self.r2t,
            kv_pool=self.pool,
            attn_backend=self.backend,
            extend_lens=ext,
            prefix_lens=prefix,
            tree_masks=masks,
        )
        with torch.inference_mode():
            self.backend.init_forward_metadata(fb)
            return self.d.head(fb.input_ids, feats, fb.positions, fb)

    def _topk(self, hidden):
        head = self.d.head
        with torch.inference_mode():
            logits = head.logits(hidden)
            if not head.eagle3:
                logits = logits[:, : self.d.vocab]
            lp = torch.log_softmax(logits.float(), dim=-1)
            v, ix = torch.topk(lp, min(self.topk, lp.shape[-1]), dim=-1)
            ix = head.to_target_ids(ix)
        return ix.tolist(), v.tolist()

    def _tree_step(self, live: list[_Work], step: int) -> None:
        ids, feats, pos, rows, prefix, ext, masks, runs = [], [], [], [], [], [], [], []
        locs = self.allocator.alloc(sum(len(w.expanded) for w in live))
        assert locs is not None
        off = 0
        for w in live:
            nodes = w.expanded
            index = {c: i for i, c in enumerate(nodes)}
            m = torch.zeros((len(nodes), len(nodes)), dtype=torch.bool)
            for i, c in enumerate(nodes):
                j = c
                while j != -1:
                    m[i, index[j]] = True
                    j = w.cands[j].parent
            mine = locs[off : off + len(nodes)]
            off += len(nodes)
            self.r2t.write(w.row, w.n_entries, mine)
            for c in nodes:
                cand = w.cands[c]
                ids.append(cand.token)
                feats.append(w.root_hidden if cand.parent == -1 else w.hidden[cand.parent])
                pos.append(w.n_entries - 1 + cand.depth)
            rows.append(w.row)
            prefix.append(w.n_entries)
            ext.append(len(nodes))
            masks.append(m)
            runs.append(nodes)
        try:
            out, nxt = self._run(ids, torch.stack(feats), pos, rows, prefix, ext, locs, masks)
        finally:
            self.allocator.free(locs)
        off = 0
        deepest_rows, owners = [], []
        for w, nodes in zip(live, runs):
            for i, c in enumerate(nodes):
                w.hidden[c] = nxt[off + i]
                if w.cands[c].depth == step - 1:
                    deepest_rows.append(off + i)
                    owners.append((w, c))
            off += len(nodes)
        ids_k, lps_k = self._topk(out[torch.tensor(deepest_rows)])
        fresh: dict[int, list[int]] = {}
        for (w, parent), toks, vals in zip(owners, ids_k, lps_k):
            base = w.cands[parent].score
            for t, v in zip(toks, vals):
                w.cands.append(_Cand(t, parent, step, base + v))
                fresh.setdefault(id(w), []).append(len(w.cands) - 1)
        for w in live:
            new = sorted(fresh.get(id(w), []), key=lambda c: -w.cands[c].score)[: self.topk]
            w.expanded = w.expanded + sorted(new)

    def _tree(self, root: int, w: _Work | None) -> DraftTree:
        if w is None or not w.cands:
            return DraftTree(root)
        order = sorted(range(len(w.cands)), key=lambda c: (-w.cands[c].score, w.cands[c].depth, c))
        picked: set[int] = set()
        for c in order:
            if len(picked) == self.k:
                break
            p = w.cands[c].parent
            if p == -1 or p in picked:
                picked.add(c)
        nodes = sorted(picked, key=lambda c: (w.cands[c].depth, -w.cands[c].score, c))
        slot = {c: i + 1 for i, c in enumerate(nodes)}
        return DraftTree(
            root,
            [w.cands[c].token for c in nodes],
            [0 if w.cands[c].parent == -1 else slot[w.cands[c].parent] for c in nodes],
        )


def _as_pairs(trees: list[DraftTree]) -> list[tuple[int, list[int], list[int]]]:
    return [(t.root, t.tokens, t.parents) for t in trees]


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 200, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


_LOOPS: dict = {}


def _loop_prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """Prompts followed by their own greedy answer: the tiny target then mostly repeats itself, which a repeat
    head drafts."""
    key = (model_dir, n, seed)
    if key not in _LOOPS:
        base = _prompts(n, seed)
        answers = unified_greedy(model_dir, base, 12, attention_backend="torch_native")
        _LOOPS[key] = [p + a for p, a in zip(base, answers)]
    return _LOOPS[key]


@pytest.fixture(scope="module")
def heads(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    return {
        "random": write_random_head(str(tmp_path_factory.mktemp("tree_random")), tiny_llama_dir, "eagle", seed=21),
        "repeat": write_repeat_head(str(tmp_path_factory.mktemp("tree_repeat")), tiny_llama_dir, "eagle"),
        "random3": write_random_head(
            str(tmp_path_factory.mktemp("tree_random3")),
            tiny_llama_dir,
            "eagle3",
            seed=22,
            draft_vocab_size=64,
            eagle_aux_hidden_state_layer_ids=[0, 1],
        ),
    }


SHAPES = {
    "tree-3x2-5": dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
    "tree-5x4-8": dict(),
    "tree-4x3-12": dict(speculative_num_steps=4, speculative_eagle_topk=3, speculative_num_draft_tokens=12),
    "chain-4": dict(speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5),
    "one-step": dict(speculative_num_steps=1, speculative_eagle_topk=3, speculative_num_draft_tokens=3),
}


def _scheduler(model_dir: str, head: str, variant: str, shape: dict):
    sa = _server_args(
        model_dir,
        attention_backend="torch_native",
        speculative_algorithm=variant,
        speculative_draft_model_path=head,
        **shape,
    )
    out = Collector()
    return scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out), out


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("head", ["random", "repeat", "random3"])
@pytest.mark.parametrize("batch", [1, 5])
def test_device_tree_expansion_drafts_the_trees_of_the_host_reference(tiny_llama_dir, heads, head, shape, batch):
    variant = "eagle3" if head == "random3" else "eagle"
    sched, out = _scheduler(tiny_llama_dir, heads[head], variant, SHAPES[shape])
    drafter = sched.speculator.drafter
    ref = _ReferenceDrafter(drafter)
    inner = drafter.draft_trees
    rounds = []

    def compared(reqs):
        ref.release_missing(set(sched.reqs))
        want = ref.draft_trees(reqs)
        got = inner(reqs)
        assert _as_pairs(got) == _as_pairs(want), f"round {len(rounds)}"
        rounds.append(len(reqs))
        return got

    drafter.draft_trees = compared
    for i, p in enumerate(_loop_prompts(tiny_llama_dir, batch, seed=batch + 3)):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=16, temperature=0.0)))
    run_until_idle(sched)
    assert len(rounds) >= 3
    st = sched.get_stats()
    if head == "repeat":
        assert st["spec_accepted_tokens"] > 0, st  # accepted drafts: later rounds keep and extend entries
    drafter.release_missing(set())
    assert drafter.free_slots()[0] == drafter.free_slots()[1] and not drafter.rows


@pytest.mark.parametrize("shape", ["tree-3x2-5", "chain-4"])
def test_batches_padded_to_a_graph_size_draft_the_same_trees(tiny_llama_dir, heads, shape):
    """As on CUDA, where a batch runs at the graph size it pads to: padding rows change no live row's tree."""
    sched, _ = _scheduler(tiny_llama_dir, heads["random"], "eagle", SHAPES[shape])
    drafter = sched.speculator.drafter
    drafter.graph_sizes = [2, 8]  # what attach sets on CUDA; 3..5 requests run as 8 rows
    ref = _ReferenceDrafter(drafter)
    inner = drafter.draft_trees
    rounds = []

    def checked(reqs):
        ref.release_missing(set(sched.reqs))
        want = ref.draft_trees(reqs)
        got = inner(reqs)
        assert _as_pairs(got) == _as_pairs(want), f"round {len(rounds)}"
        rounds.append(len(reqs))
        return got

    drafter.draft_trees = checked
    for i, p in enumerate(_prompts(5, seed=9)):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=6 + 2 * i, temperature=0.0)))
    run_until_idle(sched)
    assert len(rounds) >= 3 and any(n > 2 for n in rounds)


@pytest.mark.parametrize("shape", ["tree-3x2-5", "chain-4"])
def test_requests_without_a_row_get_empty_trees_beside_drafted_ones(tiny_llama_dir, heads, shape):
    sched, _ = _scheduler(tiny_llama_dir, heads["random"], "eagle", SHAPES[shape])
    drafter = sched.speculator.drafter
    ref = _ReferenceDrafter(drafter)
    for i, p in enumerate(_prompts(3, seed=8)):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0)))
    sched.step()  # prefill: the prompts' features
    reqs = [sched.reqs[f"r{i}"] for i in range(3)]
    solo = SimpleNamespace(rid="solo", fill_ids=[17], req_pool_idx=0)  # a one-token sequence: no entries
    mixed = [solo, reqs[0], reqs[1], solo, reqs[2]]
    got, want = drafter.draft_trees(mixed), ref.draft_trees(mixed)
    assert _as_pairs(got) == _as_pairs(want)
    assert [len(t.tokens) for t in got] == [0, drafter.k, drafter.k, 0, drafter.k]
    assert got[0].root == 17 and "solo" not in drafter.rows


def test_selection_takes_the_best_scores_and_breaks_ties_by_the_lower_index():
    """The device loop's selection (frontier and tree) equals Python's stable sort by descending score."""
    from kvship.decode.spec.eagle_tree import _best, _set_columns

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-4, 1, (50, 16), generator=g).double()  # many exact ties
    for n in (1, 3, 7, 16):
        got = _set_columns(_best(scores, n), n).tolist()
        want = [sorted(sorted(range(16), key=lambda c: -row[c])[:n]) for row in scores.tolist()]
        assert got == want

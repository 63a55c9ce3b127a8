"""``EagleDrafter``: an EAGLE / EAGLE-3 head drafts a top-k tree from the target's hidden states.

Features.  The target's ``ModelRunner`` gets a ``HiddenCapture``: every eager
target forward (prefill chunks, verify rounds) stores, per KV slot it writes,
the feature the head drafts from (``EagleHead.project``: the final hidden
state, or fc over the EAGLE-3 auxiliary layers) in ``features[slot]``.  A
feature is a function of the token prefix exactly like that slot's K/V, so it
follows the slot through prefix caching and the speculator's slot remapping,
and freed slots need no cleanup.

Entries.  The head keeps K/V in its own one-layer pool (``draft_pool``), one
row per request: entry ``j`` holds ``(t_{j+1}, f_j)`` (see ``eagle_head``).
A request whose sequence is ``t_0 .. t_{L-1}`` (``t_{L-1}`` = the root, not
yet in the target's cache) needs entries ``0 .. L-2``; a round:

1. keeps the row's entries whose tokens still match the sequence (the longest
   common prefix; rejected drafts of earlier rounds are never entries) and
   computes the others in one batched extend over all requests (the first
   round computes the whole prompt; later rounds the accepted tokens and the
   new root, with the target's features of the verified positions);
2. the root entry's output gives the depth-1 candidates (top-k, scored by
   log-probability);
3. each further step (``steps - 1`` of them) runs the nodes expanded so far as
   one extend with their tree mask over the committed entries (scratch slots,
   freed after the step) and scores the children of the deepest expanded
   nodes: cumulative log-probability; the best ``topk`` are expanded next;
4. the best ``nodes`` candidates of all depths (parents before children) form
   the ``DraftTree``.

Drafts are deterministic candidates, so the verify rules of ``verify`` keep
the output lossless whatever the head predicts.  A request with no draft row
or pool left (or a one-token sequence) gets an empty tree: one plain token.

PD.  A decode worker never runs the prompt: its ``features`` buffer is
registered with the KV transfer layer (``transfer_features``, a
``SlotFeatures`` of kind ``eagle_head.feature_kind``), and a prefill worker
started with the same head computes the prompt's features during its own
forwards (``prompt_features.PromptFeatures``: the same ``project``) and ships
them with the prompt's K/V pages, so the first round drafts from exactly what
a unified worker's would.  From a prefill worker without them (or with
another head) the prompt's slots read whatever they hold (zeros, or a feature
left by an earlier user of the slot): still lossless, lower acceptance until
the context is mostly decoded tokens; the transfer layer logs that case.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvship.decode.spec.drafter import Drafter
from kvship.decode.spec.eagle_head import build_head, feature_kind
from kvship.decode.spec.tree import DraftTree
from kvship.engine.attention.base import AttentionContext, create_attention_backend
from kvship.engine.disagg.base import SlotFeatures
from kvship.engine.forward_batch import ForwardBatch, ForwardMode, HiddenCapture
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    idx: int
    tokens: list[int] = field(default_factory=list)  # t_{j+1} of each committed entry j
    slots: list[int] = field(default_factory=list)


@dataclass
class _Cand:
    token: int
    parent: int  # index into the request's candidates, -1 = the root
    depth: int
    score: float  # cumulative log-probability


@dataclass
class _Work:
    """One request's draft in progress."""

    row: _Row
    n_entries: int  # committed entries (= L - 1): the root entry is entries[-1]
    cands: list[_Cand] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)  # candidates run through the head, depth order
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate -> its output (next input feature)
    root_hidden: Any = None  # the root entry's output: the depth-1 nodes' input feature
    root_out: Any = None  # the root entry's hidden for logits


class EagleDrafter(Drafter):
    def __init__(self, server_args: Any):
        self.variant = server_args.speculative_algorithm
        self.path = server_args.speculative_draft_model_path
        self.steps, self.topk, self.k = server_args.speculative_shape
        self.max_running = server_args.max_running_requests
        self.rows: dict[str, _Row] = {}
        self.rounds = 0
        self.target: Any = None

    # --- setup ---------------------------------------------------------------
    def _load(self, r: Any) -> None:
        """The head and the per-slot features buffer for target runner ``r`` (once)."""
        if self.target is not None:
            if self.target is not r:
                raise ValueError("an EagleDrafter drafts for one target model runner")
            return
        self.target = r
        self.device = r.device
        self.head = build_head(self.path, self.variant, r.model, r.model_config, r.device)
        # one feature per target KV slot (slot 0 and unwritten slots read zeros)
        self.features = torch.zeros(
            (r.kv_pool.num_slots + r.page_size, self.head.cfg.model.hidden_size), dtype=r.dtype, device=r.device
        )
        self.feature_kind = feature_kind(self.head.cfg, self.head.fc if self.head.eagle3 else None)

    def transfer_features(self, target_runner: Any) -> SlotFeatures:
        """The per-slot features buffer, for a decode worker's KV transfer layer to fill for prompt slots."""
        self._load(target_runner)
        return SlotFeatures(self.feature_kind, self.features)

    def attach(self, target_runner: Any) -> None:
        r = target_runner
        mc = r.model_config
        self._load(r)
        dmc = self.head.cfg.model
        self.vocab = mc.vocab_size
        r.hidden_capture = HiddenCapture(layers=self.head.cfg.aux_layer_ids, sink=self._store)
        scratch = self.steps * max(self.topk, 1) + 8  # expanded nodes of one request's tree, with room
        rows = self.max_running + 16
        # entries are per request (no prefix sharing): as many as the target's slots plus scratch; requests
        # sharing a cached prefix can outgrow it, and then a round drafts nothing (still lossless)
        slots = r.max_total_tokens + rows * scratch
        self.pool = KVPool(slots, 1, r.kv_dtype, dmc.num_key_value_heads, dmc.head_dim, 1, r.device)
        self.allocator = TokenToKVPoolAllocator(self.pool.num_slots, 1)
        self.r2t = ReqToTokenPool(rows, r.context_len + scratch + 2, r.device)
        ctx = AttentionContext(
            device=r.device,
            dtype=r.dtype,
            kv_dtype=r.kv_dtype,
            num_heads=dmc.num_attention_heads,
            num_kv_heads=dmc.num_key_value_heads,
            head_dim=dmc.head_dim,
            page_size=1,
            req_to_token_pool=self.r2t,
            max_running_requests=self.max_running,
        )
        self.backend = create_attention_backend("torch_native", ctx)
        logger.info(
            "%s head %s: %d steps, top-%d, %d draft nodes; draft KV %d slots, aux layers %s",
            self.variant,
            self.path,
            self.steps,
            self.topk,
            self.k,
            self.pool.num_slots,
            list(self.head.cfg.aux_layer_ids) or "final",
        )

    def _store(self, out_cache_loc: torch.Tensor, hidden: torch.Tensor) -> None:
        self.features[out_cache_loc] = self.head.project(hidden).to(self.features.dtype)

    # --- per-request rows ----------------------------------------------------
    def release_missing(self, open_rids: set[str]) -> None:
        for rid in [r for r in self.rows if r not in open_rids]:
            row = self.rows.pop(rid)
            self.allocator.free(row.slots)
            self.r2t.free(row.idx)

    def free_slots(self) -> tuple[int, int]:
        """(free, total) draft KV slots: every slot is free once no request holds a row."""
        return self.allocator.available_size(), self.allocator.total_slots

    def _row(self, rid: str) -> _Row | None:
        row = self.rows.get(rid)
        if row is None:
            idx = self.r2t.alloc()
            if idx is None:
                return None
            row = self.rows[rid] = _Row(idx)
        return row

    # --- one round -----------------------------------------------------------
    def draft_trees(self, reqs: list[Any]) -> list[DraftTree]:
        self.rounds += 1
        works: list[_Work | None] = []
        batch: list[tuple[_Work, list[int], int, int]] = []
        for req in reqs:
            seq = req.fill_ids
            n = len(seq) - 1  # entries 0 .. L-2
            row = self._row(req.rid) if n >= 1 else None
            if row is None:
                works.append(None)
                continue
            want = seq[1:]
            common = 0
            for a, b in zip(row.tokens, want):
                if a != b:
                    break
                common += 1
            common = min(common, n - 1)  # the root entry is always recomputed: its output starts the draft
            if common < len(row.tokens):
                self.allocator.free(row.slots[common:])
                del row.slots[common:], row.tokens[common:]
            w = _Work(row, n)
            works.append(w)
            batch.append((w, want[common:], common, req.req_pool_idx))
        if batch:
            self._extend_entries(batch)
        live = [w for w in works if w is not None and w.root_hidden is not None]
        self._first_step(live)
        for step in range(2, self.steps + 1):
            if not live:
                break
            self._tree_step(live, step)
        return [self._tree(req.fill_ids[-1], w) for req, w in zip(reqs, works)]

    def _extend_entries(self, batch: list[tuple[_Work, list[int], int, int]]) -> None:
        """Compute the missing committed entries of every request in one extend.

        ``batch``: (work, entry tokens from ``start``, ``start``, the request's target row).
        """
        need = sum(len(toks) for _, toks, _, _ in batch)
        locs = self.allocator.alloc(need)
        if locs is None:  # the draft pool is full: no drafts this round
            return
        t_r2t = self.target.req_to_token_pool.req_to_token
        off = 0
        ids, pos, rows, prefix, ext, tslots = [], [], [], [], [], []
        for w, toks, start, target_row in batch:
            mine = locs[off : off + len(toks)]
            off += len(toks)
            self.r2t.write(w.row.idx, start, mine)
            w.row.slots += mine.tolist()
            w.row.tokens += toks
            ids += toks
            pos += range(start, start + len(toks))
            rows.append(w.row.idx)
            prefix.append(start)
            ext.append(len(toks))
            # entry j reads the target's feature of position j
            tslots.append(t_r2t[target_row, start : start + len(toks)].to(torch.int64))
        feats = self.features[torch.cat(tslots).to(self.device)]
        out, nxt = self._run(ids, feats, pos, rows, prefix, ext, locs, masks=None)
        ends = (torch.tensor(ext).cumsum(0) - 1).tolist()
        for (w, *_), e in zip(batch, ends):
            w.root_hidden = nxt[e]
            w.root_out = out[e]

    def _run(self, ids, feats, pos, rows, prefix, ext, locs, masks):
        dev = self.device

        def t(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        starts = [0]
        for e in ext[:-1]:
            starts.append(starts[-1] + e)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND,
            batch_size=len(rows),
            input_ids=t(ids),
            positions=t(pos),
            req_pool_indices=t(rows),
            seq_lens=t([p + e for p, e in zip(prefix, ext)]),
            seq_lens_cpu=[p + e for p, e in zip(prefix, ext)],
            out_cache_loc=locs.to(dev),
            req_to_token_pool=self.r2t,
            kv_pool=self.pool,
            attn_backend=self.backend,
            extend_seq_lens=t(ext),
            extend_prefix_lens=t(prefix),
            extend_start_loc=t(starts),
            extend_seq_lens_cpu=list(ext),
            extend_prefix_lens_cpu=list(prefix),
            tree_masks=masks,
        )
        with torch.inference_mode():
            self.backend.init_forward_metadata(fb)
            return self.head(fb.input_ids, feats, fb.positions, fb)

    def _topk(self, hidden: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k target ids and their log-probabilities for each row of ``hidden`` (logits of the head)."""
        with torch.inference_mode():
            logits = self.head.logits(hidden)
            if not self.head.eagle3:
                logits = logits[:, : self.vocab]
            lp = torch.log_softmax(logits.float(), dim=-1)
            v, ix = torch.topk(lp, min(self.topk, lp.shape[-1]), dim=-1)
            ix = self.head.to_target_ids(ix)
        return ix.tolist(), v.tolist()

    def _first_step(self, live: list[_Work]) -> None:
        if not live:
            return
        ids, lps = self._topk(torch.stack([w.root_out for w in live]))
        for w, toks, vals in zip(live, ids, lps):
            w.cands = [_Cand(t, -1, 1, v) for t, v in zip(toks, vals)]
            w.expanded = list(range(len(w.cands)))  # all depth-1 candidates are expanded

    def _tree_step(self, live: list[_Work], step: int) -> None:
        """Run the expanded nodes (depths 1 .. step-1) and add depth-``step`` candidates."""
        ids, feats, pos, rows, prefix, ext, masks, runs = [], [], [], [], [], [], [], []
        need = sum(len(w.expanded) for w in live)
        locs = self.allocator.alloc(need)
        if locs is None:
            return
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
            self.r2t.write(w.row.idx, w.n_entries, mine)
            for c in nodes:
                cand = w.cands[c]
                ids.append(cand.token)
                feats.append(w.root_hidden if cand.parent == -1 else w.hidden[cand.parent])
                pos.append(w.n_entries - 1 + cand.depth)
            rows.append(w.row.idx)
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
        ids_k, lps_k = self._topk(out[torch.tensor(deepest_rows, device=out.device)])
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

"""``EagleDrafter``: an EAGLE / EAGLE-3 head drafts a top-k tree from the target's hidden states.

Features.  The target's ``ModelRunner`` gets a ``HiddenCapture``: every eager
target forward (prefill chunks, verify rounds) stores, per KV slot it writes,
the feature the head drafts from (``EagleHead.project``: the final hidden
state, or fc over the EAGLE-3 auxiliary layers) in ``features[slot]``.  A
feature is a function of the token prefix exactly like that slot's K/V, so it
follows the slot through prefix caching and the speculator's slot remapping,
and freed slots need no cleanup.

Entries.  The head keeps K/V in its own one-layer pool (``draft_pool``) and ``topk`` rows of its own
``ReqToTokenPool`` per request (one per tree branch; every row holds the committed entries): entry ``j``
holds ``(t_{j+1}, f_j)`` (see ``eagle_head``).  A request whose sequence is ``t_0 .. t_{L-1}`` (``t_{L-1}`` =
the root, not yet in the target's cache) needs entries ``0 .. L-2``; a round:

1. keeps the row's entries whose tokens still match the sequence (the longest common prefix; rejected
   drafts of earlier rounds are never entries) and computes the others in one batched extend over all
   requests (the first round computes the whole prompt; later rounds the accepted tokens and the new root,
   with the target's features of the verified positions).  Variable lengths: this extend runs eagerly;
2. expands the tree from the root entry's output, ``steps`` top-k steps as one fixed-shape loop on the
   device (``eagle_tree.TreeExpansion``: each step one decode forward of ``topk`` frontier nodes per
   request over their branch rows and the request's scratch slots, reserved with its rows), replayed
   from CUDA graphs at the captured batch sizes (``graphs.DraftGraphs``) on CUDA with graphs;
3. reads the best ``nodes`` candidates of all depths (parents before children) as the ``DraftTree`` in
   one host read.

Tensor parallelism (docs/speculative.md, "Tensor parallelism").  The head is
replicated on every rank (one layer: its whole weights on each rank), while
the target's embedding and LM head it shares stay sharded, so every entries
extend and draft step runs their collectives in lock step on every rank (the
draft graphs capture them inside the target's ``graph_capture``).  The
features are whole on every rank (the target's hidden states are, after its
all-reduces).  A rank's head output could still differ in the last bit from
rank 0's (non-reproducible kernels), so each round's trees are broadcast from
rank 0 before the host reads them: every rank verifies the same trees and
allocates the same slots.

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
from kvship.engine.disagg.base import SlotFeatures
from kvship.engine.forward_batch import ForwardMode, HiddenCapture, build_forward_batch
from kvship.engine.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)


# verify graphs go up to this batch size (worker.Speculator); the draft graphs follow them
MAX_GRAPH_BS = 64


@dataclass
class _Row:
    rows: list[int]  # draft ReqToTokenPool rows, one per branch; rows[0] is the one the entries extend reads
    scratch: list[int]  # draft KV slots of the tree nodes: (steps - 1) x topk, reserved for the request's life
    tokens: list[int] = field(default_factory=list)  # t_{j+1} of each committed entry j
    slots: list[int] = field(default_factory=list)


class EagleDrafter(Drafter):
    def __init__(self, server_args: Any):
        self.variant = server_args.speculative_algorithm
        self.path = server_args.speculative_draft_model_path
        self.steps, self.topk, self.k = server_args.speculative_shape
        self.max_running = server_args.max_running_requests
        self.use_graphs = not server_args.disable_cuda_graph
        self.rows: dict[str, _Row] = {}
        self.rounds = 0
        self.target: Any = None
        self.graphs: Any = None  # graphs.DraftGraphs on CUDA with graphs
        self.graph_sizes: list[int] = []  # CUDA: the batch sizes draft steps run at (graphs on or off)

    # --- setup ---------------------------------------------------------------
    def _load(self, r: Any) -> None:
        """The head and the per-slot features buffer for target runner ``r`` (once)."""
        if self.target is not None:
            if self.target is not r:
                raise ValueError("an EagleDrafter drafts for one target model runner")
            return
        self.target = r
        self.device = r.device
        tp = getattr(r, "tp", None)
        self.tp = tp if tp is not None and tp.size > 1 else None  # rank 0's trees are every rank's
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
        from kvship.decode.spec.eagle_tree import TreeExpansion

        r = target_runner
        mc = r.model_config
        self._load(r)
        if self.head.cfg.draft_vocab_size < self.topk:
            raise ValueError(f"a draft vocabulary of {self.head.cfg.draft_vocab_size} has no top-{self.topk}")
        self.vocab = mc.vocab_size
        r.hidden_capture = HiddenCapture(layers=self.head.cfg.aux_layer_ids, sink=self._store)
        self.scratch = (self.steps - 1) * self.topk  # KV slots of one request's tree nodes
        rows = self.max_running + 16
        # entries are per request (no prefix sharing): as many as the target's slots plus scratch; requests
        # sharing a cached prefix can outgrow it, and then a round drafts nothing (still lossless)
        slots = r.max_total_tokens + rows * self.scratch
        # topk rows per request (its branches) and topk padding rows for the unused slots of a graph batch
        self.r2t = ReqToTokenPool((rows + 1) * self.topk, r.context_len + self.steps + 2, r.device, host_mirror=False)
        pad_rows = [self.r2t.alloc() for _ in range(self.topk)]
        cuda = torch.device(r.device).type == "cuda"
        # the draft graphs' batch sizes, also when graphs are off: the Triton decode kernel picks its splits by
        # the size a batch pads to, so eager and replayed draft steps compute alike
        sizes = [b for b in r.attn_context.cuda_graph_bs if b <= min(self.max_running, MAX_GRAPH_BS)]
        # the head's own KV pool and attention (an EAGLE layer: per-head K/V; DeepSeek's MTP block: MLA latent rows)
        graph_bs = tuple(b * self.topk for b in sizes) if cuda else ()
        self.pool, self.backend = self.head.draft_attention(slots, r, self.r2t, self.max_running * self.topk, graph_bs)
        self.allocator = TokenToKVPoolAllocator(self.pool.num_slots, 1)
        self.tree = TreeExpansion(
            self.head,
            self.vocab,
            self.pool,
            self.r2t,
            self.backend,
            (self.steps, self.topk, self.k),
            self.max_running,
            pad_rows,
            r.dtype,
        )
        if cuda:
            self.graph_sizes = sizes
        if cuda and self.use_graphs and r.cuda_graph_runner is not None and sizes and self.backend.supports_cuda_graph:
            from kvship.decode.spec.graphs import DraftGraphs

            self.graphs = DraftGraphs(self.tree, sizes, r.graph_capture)
        logger.info(
            "%s head %s: %d steps, top-%d, %d draft nodes; draft KV %d slots, aux layers %s; draft steps %s",
            self.variant,
            self.path,
            self.steps,
            self.topk,
            self.k,
            self.pool.num_slots,
            list(self.head.cfg.aux_layer_ids) or "final",
            f"replay CUDA graphs (bs {sizes})" if self.graphs is not None else "run eagerly",
        )

    def _store(self, out_cache_loc: torch.Tensor, hidden: torch.Tensor) -> None:
        self.features[out_cache_loc] = self.head.project(hidden).to(self.features.dtype)

    # --- per-request rows ----------------------------------------------------
    def release_missing(self, open_rids: set[str]) -> None:
        for rid in [r for r in self.rows if r not in open_rids]:
            row = self.rows.pop(rid)
            self.allocator.free(row.slots + row.scratch)
            for idx in row.rows:
                self.r2t.free(idx)

    def free_slots(self) -> tuple[int, int]:
        """(free, total) draft KV slots: every slot is free once no request holds a row."""
        return self.allocator.available_size(), self.allocator.total_slots

    def _row(self, rid: str) -> _Row | None:
        """The request's rows and scratch slots, taken at its first round; None (nothing taken) when short."""
        row = self.rows.get(rid)
        if row is not None:
            return row
        if self.r2t.available_size() < self.topk:
            return None
        scratch = self.allocator.alloc(self.scratch)
        if scratch is None:
            return None
        branch_rows = [self.r2t.alloc() for _ in range(self.topk)]
        row = self.rows[rid] = _Row([int(i) for i in branch_rows if i is not None], scratch.tolist())
        return row

    # --- one round -----------------------------------------------------------
    def draft_trees(self, reqs: list[Any]) -> list[DraftTree]:
        self.rounds += 1
        trees = [DraftTree(req.fill_ids[-1]) for req in reqs]
        live: list[int] = []
        batch: list[tuple[_Row, list[int], int, int]] = []
        for i, req in enumerate(reqs):
            seq = req.fill_ids
            n = len(seq) - 1  # entries 0 .. L-2
            row = self._row(req.rid) if n >= 1 else None
            if row is None:
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
            live.append(i)
            batch.append((row, want[common:], common, req.req_pool_idx))
        roots = self._extend_entries(batch) if batch else None
        if roots is None:  # nothing to draft from, or the draft pool is full: plain tokens this round
            return trees
        meta = [self.tree.meta_row(len(row.tokens), row.rows, row.scratch) for row, *_ in batch]
        n_entries = [len(row.tokens) for row, *_ in batch]
        for i, (tokens, parents) in zip(live, self._expand(*roots, meta, n_entries)):
            trees[i] = DraftTree(reqs[i].fill_ids[-1], tokens, parents)
        return trees

    def _expand(
        self, out: torch.Tensor, hidden: torch.Tensor, meta: list[list[int]], n_entries: list[int]
    ) -> list[tuple[list[int], list[int]]]:
        """The draft steps for the live requests (root outputs ``out`` / ``hidden``): (tokens, parent slots) each.

        On CUDA a batch runs at the graph size it pads to, replayed or not, so eager and replayed draft steps
        compute alike (as the speculator pads verify trees)."""
        bs = len(meta)
        rows = next((b for b in self.graph_sizes if b >= bs), bs)
        with torch.inference_mode():
            self.tree.load(out, hidden, meta, rows)
            if self.graphs is not None and self.graphs.can_run(rows):
                self.graphs.replay(rows)
            else:
                self.tree.run(rows, n_entries + [0] * (rows - bs))
            if self.tp is not None:
                self.tp.broadcast(self.tree.nodes[:bs])
            return self.tree.read(bs)

    def _extend_entries(
        self, batch: list[tuple[_Row, list[int], int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Compute the missing committed entries of every request in one extend; the root entries' outputs
        (hidden for logits, next feature), one row per request, or None when the draft pool is full.

        ``batch``: (row, entry tokens from ``start``, ``start``, the request's target row).
        """
        need = sum(len(toks) for _, toks, _, _ in batch)
        locs = self.allocator.alloc(need)
        if locs is None:
            return None
        t_r2t = self.target.req_to_token_pool.req_to_token
        off = 0
        ids, pos, rows, prefix, ext, tslots = [], [], [], [], [], []
        for row, toks, start, target_row in batch:
            mine = locs[off : off + len(toks)].tolist()
            off += len(toks)
            row.slots += mine
            row.tokens += toks
            ids += toks
            pos += range(start, start + len(toks))
            rows.append(row.rows[0])
            prefix.append(start)
            ext.append(len(toks))
            # entry j reads the target's feature of position j
            tslots.append(t_r2t[target_row, start : start + len(toks)].to(torch.int64))
        # every branch row of a request holds its committed entries: one write for all of them
        owner = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(ext))
        where = torch.stack([owner, torch.tensor(pos), locs]).to(self.device)  # per entry: request, column, slot
        branch_rows = torch.tensor([row.rows for row, *_ in batch]).to(self.device)[where[0]]  # [entries, topk]
        self.r2t.req_to_token[branch_rows, where[1][:, None]] = where[2][:, None].to(torch.int32)
        feats = self.features[torch.cat(tslots).to(self.device)]
        out, nxt = self._run(ids, feats, pos, rows, prefix, ext, locs)
        ends = torch.tensor(ext).cumsum(0).to(out.device) - 1
        return out[ends], nxt[ends]

    def _run(self, ids, feats, pos, rows, prefix, ext, locs):
        fb = build_forward_batch(
            ForwardMode.DRAFT_EXTEND,
            device=self.device,
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
        )
        with torch.inference_mode():
            self.backend.init_forward_metadata(fb)
            return self.head(fb.input_ids, feats, fb.positions, fb)

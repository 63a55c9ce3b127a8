"""``TreeExpansion``: an EAGLE head's draft steps as one fixed-shape loop on the device, no host sync inside.

Shapes: ``B`` requests, ``K`` = top-k, ``S`` = steps, ``N = K + (S - 1) K²`` candidates, ``k`` draft nodes.

* Step 1: the top ``K`` of the root entry's logits are the depth-1 candidates and the first *frontier*.
* Step ``d + 1`` (``d = 1 .. S - 1``): the frontier's ``B K`` nodes (all of depth ``d``) run through the head
  as one DECODE forward.  Branch ``j`` of request ``b`` owns the draft ``ReqToTokenPool`` row ``rows[b, j]``:
  columns ``0 .. n - 1`` hold the request's ``n`` committed entries (the entries extend writes them into
  every branch row), columns ``n .. n + d - 1`` the node's ancestors and itself (rewritten here each step
  from ``anc``, at most ``S - 1`` columns), so plain decode attention reads exactly the node's prefix.  The
  node's K/V goes to the request's scratch slot ``scratch[b, d - 1, j]`` (reserved with the row: nothing is
  allocated in the loop).  Each node's top ``K`` children are candidates, scored by cumulative
  log-probability in float64 (the sums Python floats of the float32 log-probabilities give); the best ``K``
  of the ``K²`` children (ties: the lower candidate index) are the next frontier, kept in index order.
* The tree: the best ``k`` candidates by (score descending, index), listed by (depth, score descending,
  index), each with its parent's slot.  The best ``k`` are closed under parents: a child's score never
  exceeds its parent's (log-probabilities are <= 0) and a parent's index is lower.

Candidate indices: ``0 .. K - 1`` are the root's children; depth ``d >= 2`` holds ``K + (d - 2) K²`` onwards,
child ``r`` of frontier node ``j`` at ``+ j K + r``.  Depth thus never decreases with the index.

Contract: ``load(out, hidden, meta, bs)`` fills the static inputs of rows ``0 .. bs - 1`` (the live requests'
rows first, padding rows after: the padding branch rows, no entries, KV slot 0, which the draft pool never
hands out); ``run(bs, n_entries)`` then writes ``nodes[:bs]``; ``read(bs)`` returns each row's (tokens,
parent slots), the round's one host sync.  ``run`` reads only the static buffers and keeps nothing it
allocates, so ``graphs.DraftGraphs`` captures it per batch size.
"""

from __future__ import annotations

from typing import Any

import torch

from kvship.engine.forward_batch import ForwardMode, build_forward_batch
from kvship.engine.mem.pools import KVPool, ReqToTokenPool


class TreeExpansion:
    def __init__(
        self,
        head: Any,
        vocab: int,
        pool: KVPool,
        r2t: ReqToTokenPool,
        backend: Any,
        shape: tuple[int, int, int],
        max_bs: int,
        pad_rows: list[int],
        dtype: torch.dtype,
    ):
        self.head, self.vocab, self.pool, self.r2t, self.backend = head, vocab, pool, r2t, backend
        self.steps, self.topk, self.k = shape
        S, K = self.steps, self.topk
        self.n_cand = K + (S - 1) * K * K
        if self.k > self.n_cand:
            raise ValueError(f"{self.k} draft nodes need more than the {self.n_cand} candidates of {S} x top-{K}")
        dev = r2t.device
        self.device = dev
        h = head.cfg.model.hidden_size
        self.max_bs = max_bs
        self.root_out = torch.zeros((max_bs, h), dtype=dtype, device=dev)  # the root entry's hidden for logits
        self.root_hidden = torch.zeros((max_bs, h), dtype=dtype, device=dev)  # its next-step feature
        # per row: committed entries n, K branch rows, (S - 1) x K scratch slots
        self.meta = torch.zeros((max_bs, self.meta_width), dtype=torch.int64, device=dev)
        self.pad_meta = [0, *pad_rows, *[0] * ((S - 1) * K)]
        self.nodes = torch.zeros((max_bs, 2, self.k), dtype=torch.int64, device=dev)  # tokens, parent slots
        c = torch.arange(self.n_cand, device=dev)
        self.depth = torch.where(c < K, 1, 2 + (c - K).clamp(min=0) // (K * K))

    @property
    def meta_width(self) -> int:
        return 1 + self.topk + (self.steps - 1) * self.topk

    def meta_row(self, n_entries: int, rows: list[int], scratch: list[int]) -> list[int]:
        """One live request's row of ``meta``: its committed entries, branch rows and scratch slots."""
        return [n_entries, *rows, *scratch]

    # --- per round -------------------------------------------------------------------------------------
    def load(self, out: torch.Tensor, hidden: torch.Tensor, meta: list[list[int]], bs: int) -> None:
        """The live requests' root outputs ``[n, H]`` and meta rows into rows ``0 .. n - 1``, padding up to ``bs``."""
        n = out.shape[0]
        self.root_out[:n].copy_(out)
        self.root_hidden[:n].copy_(hidden)
        self.root_out[n:bs].zero_()
        self.root_hidden[n:bs].zero_()
        host = torch.tensor(meta + [self.pad_meta] * (bs - n), dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.meta[:bs].copy_(host, non_blocking=True)

    def read(self, bs: int) -> list[tuple[list[int], list[int]]]:
        return [(t, p) for t, p in self.nodes[:bs].tolist()]

    # --- the loop --------------------------------------------------------------------------------------
    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k target ids and their log-probabilities (float32) per row of ``hidden``."""
        logits = self.head.logits(hidden)
        if not self.head.eagle3:
            logits = logits[:, : self.vocab]
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, ix = torch.topk(lp, self.topk, dim=-1)
        return self.head.to_target_ids(ix), v

    def run(self, bs: int, n_entries: list[int]) -> None:
        """Expand rows ``0 .. bs - 1`` (``n_entries``: their committed entries, on the host for backends that
        size their metadata by it) into ``nodes[:bs]``."""
        B, K, S = bs, self.topk, self.steps
        dev = self.device
        meta = self.meta[:B]
        n = meta[:, 0]
        # the kernels index these flat, by position: contiguous copies of the strided columns of ``meta``
        rows = meta[:, 1 : 1 + K].contiguous()
        scratch = meta[:, 1 + K :].reshape(B, S - 1, K)
        tok, lp = self._topk(self.root_out[:B])
        tokens, scores = [tok], [lp.double()]
        parents = [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        f_idx = torch.arange(K, device=dev).expand(B, K)  # the frontier's candidate indices, ascending
        f_score, f_tok = scores[0], tok
        f_feat = self.root_hidden[:B, None, :].expand(B, K, -1)
        anc = torch.zeros((B, K, S - 1), dtype=torch.int64, device=dev)  # each branch's ancestor slots
        h = f_feat.shape[-1]
        for d in range(1, S):
            anc[:, :, d - 1] = scratch[:, d - 1, :]
            cols = n[:, None, None] + torch.arange(d, device=dev)
            self.r2t.req_to_token[rows[:, :, None].expand(B, K, d), cols.expand(B, K, d)] = anc[:, :, :d].to(
                torch.int32
            )
            seq = (n + d)[:, None].expand(B, K).reshape(-1)
            fb = build_forward_batch(
                ForwardMode.DECODE,
                input_ids=f_tok.reshape(-1).contiguous(),
                positions=seq - 1,
                req_pool_indices=rows.view(-1),
                seq_lens=seq.contiguous(),
                seq_lens_cpu=[e + d for e in n_entries for _ in range(K)],
                out_cache_loc=scratch[:, d - 1, :].contiguous().view(-1),
                req_to_token_pool=self.r2t,
                kv_pool=self.pool,
                attn_backend=self.backend,
            )
            self.backend.init_forward_metadata(fb)
            out, nxt = self.head(fb.input_ids, f_feat.reshape(B * K, h), fb.positions, fb)
            c_tok, c_lp = self._topk(out)
            c_score = (f_score[:, :, None] + c_lp.view(B, K, K).double()).view(B, K * K)
            c_tok = c_tok.view(B, K * K)
            tokens.append(c_tok)
            scores.append(c_score)
            parents.append(f_idx[:, :, None].expand(B, K, K).reshape(B, K * K))
            if d == S - 1:
                break
            sel = _set_columns(_best(c_score, K), K)
            branch = sel // K
            f_idx = K + (d - 1) * K * K + sel
            f_score = c_score.gather(1, sel)
            f_tok = c_tok.gather(1, sel)
            f_feat = nxt.view(B, K, h).gather(1, branch[:, :, None].expand(B, K, h))
            anc = anc.gather(1, branch[:, :, None].expand(B, K, S - 1))
        all_tok, all_score, all_par = torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)
        pick = _set_columns(_best(all_score, self.k), self.k)  # ascending index: depth already in order
        depth, score = self.depth[pick], all_score.gather(1, pick)
        # within a depth, by score descending then index: each node's place among the picked
        same = depth[:, None, :] == depth[:, :, None]  # [b, i, j]: node j has node i's depth
        ar = torch.arange(self.k, device=dev)
        first = ar[None, :] < ar[:, None]  # [i, j]: j < i
        s_i, s_j = score[:, :, None], score[:, None, :]
        before = (depth[:, None, :] < depth[:, :, None]) | (same & ((s_j > s_i) | ((s_j == s_i) & first)))
        place = before.sum(dim=2)
        picked = torch.empty_like(pick).scatter_(1, place, pick)
        par = all_par.gather(1, picked)
        slot = (par[:, :, None] == picked[:, None, :]).to(torch.int64).argmax(dim=-1) + 1
        self.nodes[:B, 0].copy_(all_tok.gather(1, picked))
        self.nodes[:B, 1].copy_(torch.where(par < 0, 0, slot))


def _best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Mask of each row's best ``n`` columns by (score descending, column ascending): exactly ``n`` per row."""
    kth = torch.topk(scores, n, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = n - above.sum(dim=1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=1) <= room))


def _set_columns(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The columns of each row's ``n`` set entries, ascending (``[rows, n]``)."""
    rows, width = mask.shape
    slot = torch.where(mask, mask.cumsum(dim=1) - 1, n)  # unset columns land in a spare slot, dropped
    cols = torch.arange(width, device=mask.device).expand(rows, width)
    out = torch.zeros((rows, n + 1), dtype=torch.int64, device=mask.device)
    return out.scatter_(1, slot, cols)[:, :n]

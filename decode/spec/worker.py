"""``Speculator``: runs a decode batch as one speculative round (draft -> verify -> accept).

The scheduler hands it every decode batch (``Scheduler(..., speculator=...)``);
``run(batch)`` drafts a tree per request, runs one TARGET_VERIFY forward over
all trees, accepts per request (``verify``), and applies the outcome the way a
decode step does: tokens appended with the stop checks, chunks emitted,
finished requests finished.

KV invariants (page size 1):

* Before a round a request has K/V for ``P = kv_committed_len`` positions and
  its newest token (the root) has none.  The round allocates ``n + 1`` slots,
  writes them at ``req_to_token[row, P : P + n + 1]`` and computes K/V for the
  root and every node at positions ``P + depth``.
* After acceptance the slots of the accepted path move to rows ``P + 1 ..``
  (in depth order); every other slot of the round is freed at once.  Only K/V
  of tokens that stay in the sequence is kept: when a stop condition ends the
  request inside the accepted run, the later slots are freed too.
  ``kv_committed_len`` = ``kv_allocated_len`` = ``P + 1 + kept``.
* Requests that sample with a seed or use penalties (the host must see every
  token before the next draw) run a plain decode step in the same scheduler
  step.
* Tensor parallelism (docs/speculative.md, "Tensor parallelism"): every rank
  runs the same round in lock step.  The drafts are the same on every rank
  (n-gram from the same tokens; the draft model sharded like the target, its
  logits all-gathered; an EAGLE head's trees broadcast from rank 0), so every
  rank allocates and frees the same slots; rank 0 decides the acceptance of
  every request and broadcasts it (``_agree``), as ``RankZeroSampler`` does
  for plain decode steps.
* Pipeline parallelism (docs/speculative.md, "Pipeline parallelism"; ngram
  only): every stage keeps the same token history, so every stage drafts the
  same n-gram trees and allocates the same slots; the verify forward runs
  through the stages like any batch (hidden states sent on, tree masks on
  every stage); the last stage decides the acceptance (its TP rank 0, as
  above) and sends it with the emitted tokens' logprobs to the earlier
  stages (``StageLink.send_results``), so every stage keeps and frees the
  same slots.  ``PipelineLoop`` runs a round only with no other batch in
  flight, so the results channel stays in launch order.
* The verify forward is an extend with ``ForwardBatch.tree_masks``: every
  attention backend honours them (torch_native with SDPA masks, triton and
  flashinfer with our Triton extend kernel).  On CUDA with graphs, drafts are
  padded to ``k - 1`` nodes (extra children of the root: a candidate the
  target does not pick is never accepted, so padding cannot change the
  output) and the round replays a captured graph (``graphs.VerifyGraphs``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvship.decode.spec.drafter import Drafter
from kvship.decode.spec.ngram import NgramDrafter
from kvship.decode.spec.tree import DraftTree
from kvship.decode.spec.verify import Accepted, accept_greedy, accept_sampled
from kvship.engine.config import PP_SPEC_ALGORITHMS_LINE
from kvship.engine.forward_batch import ForwardMode, StageOutput, build_forward_batch
from kvship.engine.sampler import SamplingBatchInfo, filter_probs
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.engine.scheduler.launch import needs_host_state

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def create_drafter(server_args: Any) -> Drafter:
    """The drafter of ``--speculative-algorithm`` (``drafter.Drafter``; shapes from ``speculative_shape``)."""
    algo = server_args.speculative_algorithm
    steps, topk, nodes = server_args.speculative_shape
    if algo == "ngram":
        return NgramDrafter(num_draft_tokens=nodes, branches=topk)
    if algo == "draft":
        from kvship.decode.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter(server_args, nodes)
    if algo in ("eagle", "eagle3"):
        from kvship.decode.spec.eagle import EagleDrafter

        return EagleDrafter(server_args)
    raise ValueError(f"unknown --speculative-algorithm {algo!r}")


class Speculator:
    def __init__(self, sched: "Scheduler", drafter: Drafter):
        if sched.page_size != 1:
            raise ValueError("speculative decoding needs --page-size 1")
        self.s = sched
        # the TP communicator of a multi-rank worker (rank 0's acceptance is everyone's); None at one rank
        tp = getattr(sched.runner, "tp", None)
        self.tp = tp if tp is not None and tp.size > 1 else None
        # pipeline stages (docs/speculative.md, "Pipeline parallelism"): the last one decides, the others follow
        self.link = getattr(sched.runner, "pipeline", None)
        if self.link is not None and not isinstance(drafter, NgramDrafter):
            raise ValueError(PP_SPEC_ALGORITHMS_LINE)
        self.drafter = drafter
        drafter.attach(sched.runner)  # before the verify graphs: an EAGLE head asks for hidden states
        self.graphs = None
        cgr = sched.runner.cuda_graph_runner
        # CUDA with graphs: verify rounds of drafter.k + 1 slots replay graphs too (not over pipeline stages, whose
        # verify forwards run eagerly: docs/speculative.md, "Pipeline parallelism")
        if cgr is not None and self.link is None:
            from kvship.decode.spec.graphs import VerifyGraphs

            sizes = [b for b in cgr.batch_sizes if b <= min(sched.max_running, 64)]
            if sizes:
                self.graphs = VerifyGraphs(sched.runner, sizes, drafter.k + 1)
        # on CUDA every round's trees are padded to the graphs' size, replayed or not, so an eager round (a batch
        # past the largest graph, or graphs off) verifies and accepts exactly what a replay would
        self.pad_to = drafter.k + 1 if torch.device(sched.runner.device).type == "cuda" else None
        self.counters: Counter = Counter()
        self.accept_lengths: list[int] = []  # emitted tokens per round per request (recent window)

    def splits(self, batch: ScheduleBatch) -> tuple[list[Req], list[Req]]:
        """(requests that run speculatively, requests that need a plain decode step)."""
        spec = [r for r in batch.reqs if not needs_host_state(r)]
        return spec, [r for r in batch.reqs if needs_host_state(r)]

    # ------------------------------------------------------------ one round
    def run(self, reqs: list[Req]) -> None:
        s = self.s
        self.drafter.release_missing(set(s.reqs))
        trees = self.drafter.draft_trees(reqs)
        if self.pad_to is not None:
            trees = [t.padded(self.pad_to) for t in trees]
        prefix = [r.kv_committed_len for r in reqs]
        sizes = [t.size for t in trees]
        seq = [p + n for p, n in zip(prefix, sizes)]
        locs = s.allocator.alloc_extend(prefix, seq, [r.last_loc for r in reqs])
        if locs is None:
            s.kv.shortfall_after_evict(sum(sizes))
            locs = s.allocator.alloc_extend(prefix, seq, [r.last_loc for r in reqs])
        if locs is None:
            raise RuntimeError("KV pool exhausted for the draft tree")
        per_req: list[torch.Tensor] = []
        off = 0
        for r, p, n in zip(reqs, prefix, sizes):
            mine = locs[off : off + n]
            per_req.append(mine)
            s.req_to_token_pool.write(r.req_pool_idx, p, mine)
            r.kv_allocated_len = p + n
            off += n
        try:
            logits = self._verify(reqs, trees, prefix, locs)
        except BaseException:
            for r, mine in zip(reqs, per_req):  # nothing of the round is valid: drop every slot of it
                s.allocator.free(mine)
                r.kv_allocated_len = r.kv_committed_len
            raise
        link = self.link
        if link is None or link.is_last:  # the logits are here
            accs = self._decide(reqs, trees, logits) if self.tp is None or self.tp.is_leader else None
            if self.tp is not None:
                accs = self._agree(trees, accs)
            outs, off = [], 0
            for r, t, acc in zip(reqs, trees, accs):
                outs.append(self._logprobs(r, acc, logits[off : off + t.size]))
                off += t.size
            if link is not None:
                link.send_results((accs, outs))  # the earlier stages apply the same round
        else:  # an earlier pipeline stage: the last stage's decision (one message per round, in launch order)
            accs, outs = link.recv_results()
        for r, t, p, mine, acc, (lps, tops) in zip(reqs, trees, prefix, per_req, accs, outs):
            self._apply(r, t, p, mine, acc, lps, tops)
        s.counters["decode_steps"] += 1

    def _decide(self, reqs: list[Req], trees: list[DraftTree], logits: torch.Tensor) -> list[Accepted]:
        """The accepted path of every request's tree (on rank 0 only under tensor parallelism)."""
        # greedy requests' choices for every slot in one host read (one sync per round, not one per request)
        top = logits.argmax(dim=-1).tolist() if any(r.sampling_params.is_greedy for r in reqs) else None
        accs, off = [], 0
        for r, t in zip(reqs, trees):
            accs.append(self.accept(r, t, logits[off : off + t.size], None if top is None else top[off : off + t.size]))
            off += t.size
        return accs

    def _agree(self, trees: list[DraftTree], accs: Optional[list[Accepted]]) -> list[Accepted]:
        """Rank 0's acceptances on every rank: one broadcast of ``[n, 2 + 2 * max tree size]`` ids per round.

        Row ``i``: accepted drafts ``a``, bonus slot, the ``a`` accepted slots, then the ``a + 1`` emitted tokens
        (the rest -1).  The trees are the same on every rank, so every rank knows the shape."""
        width = 2 + 2 * max(t.size for t in trees)
        buf = torch.full((len(trees), width), -1, dtype=torch.int64)
        if accs is not None:
            for i, a in enumerate(accs):
                n = len(a.slots)
                buf[i, : 2 + 2 * n + 1] = torch.tensor([n, a.bonus_slot, *a.slots, *a.tokens], dtype=torch.int64)
        dev = torch.device(self.s.device)
        rows = self.tp.broadcast(buf.to(dev) if dev.type != "cpu" else buf).tolist()
        return [Accepted(row[2 : 2 + row[0]], row[2 + row[0] : 3 + 2 * row[0]], row[1]) for row in rows]

    def _verify(
        self, reqs: list[Req], trees: list[DraftTree], prefix: list[int], locs: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """The target's logits per tree slot; None on a pipeline stage before the last (its hidden states went on)."""
        runner = self.s.runner
        dev = self.s.device
        ids, ext = [], []
        for t in trees:
            ids += t.all_tokens
            ext.append(t.size)
        n_tok = len(ids)

        def tt(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=dev)

        g = self.graphs
        if g is not None and g.can_run(len(reqs), ext):  # the graph builds positions and masks from the parents
            with torch.inference_mode():
                logits = g.replay(ids, [t.all_parents for t in trees], locs, [r.req_pool_idx for r in reqs], prefix)
            return logits[:, : self.s.vocab_size].float()
        masks = [t.mask() for t in trees]
        pos = [q for t, p in zip(trees, prefix) for q in t.positions(p)]
        fb = build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            device=dev,
            input_ids=ids,
            positions=pos,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[p + e for p, e in zip(prefix, ext)],
            seq_lens_cpu=[p + e for p, e in zip(prefix, ext)],
            out_cache_loc=locs,
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
            extend_lens=ext,
            prefix_lens=prefix,
            logits_indices=torch.arange(n_tok, device=dev),
            tree_masks=masks,
        )
        with torch.inference_mode():
            out = runner.forward(fb)
        if isinstance(out, StageOutput):
            return None
        return out.next_token_logits[:, : self.s.vocab_size].float()

    def accept(self, req: Req, tree: DraftTree, logits: torch.Tensor, argmax: Optional[list[int]] = None) -> Accepted:
        """The accepted path of ``tree`` given the target's ``logits`` per slot (greedy or lossless sampled);
        ``argmax``: the logits' argmax per slot, when the caller read it already."""
        if req.sampling_params.is_greedy:
            return accept_greedy(tree, logits.argmax(dim=-1).tolist() if argmax is None else argmax)
        info = SamplingBatchInfo.from_reqs([req] * tree.size, self.s.vocab_size, "cpu")
        probs = torch.softmax(logits.cpu() / info.temperatures, dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            probs_sort, order = torch.sort(probs, dim=-1, descending=True)
            filter_probs(probs_sort, info)
            probs = torch.zeros_like(probs).scatter_(1, order, probs_sort)
        gen = self.s.launcher.sampler.generator
        return accept_sampled(tree, probs, generator=gen if gen.device.type == "cpu" else None)

    @staticmethod
    def _logprobs(
        req: Req, acc: Accepted, logits: torch.Tensor
    ) -> tuple[Optional[list[float]], Optional[list[list[tuple[int, float]]]]]:
        """The emitted tokens' logprobs and top logprobs (None when the request asks for none), from the logits
        of the slot that produced each token."""
        if not req.return_logprob:
            return None, None
        path = [0, *acc.slots]  # slot whose logits produced each emitted token
        lps = torch.log_softmax(logits, dim=-1)
        out_lp: list[float] = []
        out_top: list[list[tuple[int, float]]] = []
        for i, tok in enumerate(acc.tokens):
            out_lp.append(float(lps[path[i], tok]))
            if req.top_logprobs_num > 0:
                v, ix = torch.topk(lps[path[i]], req.top_logprobs_num)
                out_top.append(list(zip(ix.tolist(), v.tolist())))
        return out_lp, (out_top if req.top_logprobs_num > 0 else None)

    def _apply(
        self,
        req: Req,
        tree: DraftTree,
        p: int,
        slots: torch.Tensor,
        acc: Accepted,
        lps: Optional[list[float]],
        tops: Optional[list[list[tuple[int, float]]]],
    ) -> None:
        s = self.s
        kept = 0
        for i, tok in enumerate(acc.tokens):
            lp = None if lps is None else lps[i]
            top = None if tops is None else tops[i]
            req.append_token(tok, s.tokenizer, lp, top)
            s.counters["generation_tokens"] += 1
            kept = i + 1
            if req.finished:
                break
        # K/V to keep: the root and the accepted drafts among the tokens that stayed in the sequence
        keep_nodes = acc.slots[: min(len(acc.slots), kept)]
        row = req.req_pool_idx
        keep = [0, *keep_nodes]
        s.req_to_token_pool.write(row, p, slots[keep])  # the kept path, in depth order, from position p
        kept_set = set(keep)
        drop = [i for i in range(tree.size) if i not in kept_set]
        if drop:
            s.allocator.free(slots[drop])
        req.kv_committed_len = req.kv_allocated_len = p + len(keep)
        req.last_loc = int(slots[keep[-1]])
        self.counters["rounds"] += 1
        self.counters["draft_tokens"] += tree.size - 1
        self.counters["accepted_tokens"] += len(acc.slots)
        self.accept_lengths.append(kept)
        req.spec_rounds += 1
        req.spec_round_tokens += kept
        if req.finished:
            s.finish(req, req.finished_reason)
        else:
            s.emit(req)

    def stats(self) -> dict:
        c = self.counters
        return {
            "spec_rounds": c["rounds"],
            "spec_draft_tokens": c["draft_tokens"],
            "spec_accepted_tokens": c["accepted_tokens"],
            "spec_accept_length": (c["accepted_tokens"] + c["rounds"]) / c["rounds"] if c["rounds"] else 0.0,
        }

"""``DraftModelDrafter``: a smaller causal LM (same tokenizer) drafts a chain greedily.

The draft model runs on its own ``ModelRunner`` (own weights and KV pools,
torch_native attention, no CUDA graphs), built in ``attach``.  Under tensor
parallelism it is sharded like the target (its ``tp_plan``, the target's
process groups; docs/speculative.md, "Tensor parallelism"): its logits are
all-gathered, so every rank drafts the same chain with no extra exchange.
Per request it keeps a ``req_to_token`` row and the tokens whose draft K/V
that row holds.  A round:

1. keep the draft K/V of the longest common prefix of those tokens and the
   request's sequence minus its root; free the rest (rejected drafts);
2. one extend over the remaining tokens up to and including the root gives
   the first draft token; each further draft token is one decode step;
3. the row now holds K/V for the sequence plus all drafts but the last.

Rows of requests that are no longer open are released at the start of the
next round (``release_missing``).  Drafting never affects the output: the
target's verify decides, so any draft model is lossless; a good one raises
the acceptance length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kvship.decode.spec.drafter import SequenceDrafter
from kvship.decode.spec.tree import DraftTree
from kvship.engine.forward_batch import ForwardMode, build_forward_batch


@dataclass
class _Row:
    idx: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the row holds, position order
    slots: list[int] = field(default_factory=list)


class DraftModelDrafter(SequenceDrafter):
    def __init__(self, server_args: Any, num_draft_tokens: int):
        if not server_args.speculative_draft_model_path:
            raise ValueError("--speculative-algorithm draft needs --speculative-draft-model-path")
        self.draft_args = dataclasses.replace(
            server_args,
            model_path=server_args.speculative_draft_model_path,
            tokenizer_path=None,
            attention_backend="torch_native",
            disable_cuda_graph=True,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_num_draft_tokens=None,
            speculative_eagle_topk=None,
            page_size=1,
            mode="unified",
            ep_num_redundant_experts=0,  # EPLB is the target's (docs/parallel.md)
        )
        self.runner: Any = None
        self.k = num_draft_tokens
        self.rows: dict[str, _Row] = {}

    def attach(self, target_runner: Any) -> None:
        """The draft model's runner, on the target's device and sharded over its TP group (if any)."""
        from kvship.engine.model_runner import ModelRunner

        if self.runner is not None:
            raise ValueError("a DraftModelDrafter drafts for one target model runner")
        self.runner = ModelRunner(self.draft_args, groups=getattr(target_runner, "groups", None))

    def release_missing(self, open_rids: set[str]) -> None:
        for rid in [r for r in self.rows if r not in open_rids]:
            row = self.rows.pop(rid)
            self.runner.allocator.free(row.slots)
            self.runner.req_to_token_pool.free(row.idx)

    def _row(self, rid: str) -> _Row:
        row = self.rows.get(rid)
        if row is None:
            idx = self.runner.req_to_token_pool.alloc()
            if idx is None:
                raise RuntimeError("the draft model has no free request row")
            row = self.rows[rid] = _Row(idx)
        return row

    def _forward(self, row: _Row, new: list[int]) -> int:
        """Compute K/V for ``new`` after the row's tokens; returns the draft model's greedy next token."""
        r = self.runner
        p, n = len(row.tokens), len(new)
        locs = r.allocator.alloc(n)
        if locs is None:
            raise RuntimeError("the draft model's KV pool is full")
        r.req_to_token_pool.write(row.idx, p, locs)
        row.slots += locs.tolist()
        row.tokens += new
        fb = build_forward_batch(
            ForwardMode.DRAFT_EXTEND,
            device=r.device,
            input_ids=new,
            positions=list(range(p, p + n)),
            req_pool_indices=[row.idx],
            seq_lens=[p + n],
            seq_lens_cpu=[p + n],
            out_cache_loc=locs,
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            extend_lens=[n],
            prefix_lens=[p],
        )
        with torch.inference_mode():
            logits = r.forward(fb).next_token_logits
        return int(logits[0].argmax())

    def propose_for(self, rid: str, seq: list[int]) -> DraftTree:
        row = self._row(rid)
        ctx = seq[:-1]
        common = 0
        for a, b in zip(row.tokens, ctx):
            if a != b:
                break
            common += 1
        if common < len(row.tokens):  # drop draft K/V past the common prefix
            self.runner.allocator.free(row.slots[common:])
            del row.slots[common:]
            del row.tokens[common:]
        drafts = [self._forward(row, seq[common:])]
        while len(drafts) < self.k:
            drafts.append(self._forward(row, [drafts[-1]]))
        return DraftTree.chain(seq[-1], drafts)

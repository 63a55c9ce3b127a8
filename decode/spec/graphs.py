"""CUDA graphs of a speculative round: the verify forward (``VerifyGraphs``) and an EAGLE head's draft steps
(``DraftGraphs``), one graph per batch size each.

Verify.  Every round whose trees all have exactly ``k`` slots (root + ``k - 1`` nodes;
the speculator pads drafts to that size) and whose batch fits a captured size
replays a graph instead of running the extend eagerly.  The graph first derives
the trees' positions and tree mask from their parent slots (``tree_build``'s
Triton kernel; a replay copies only the parents).  The graph's attention
is our Triton extend kernel with tree masks (``TritonExtendMeta``; at most
``SPLIT_VERIFY_MAX_TOKENS`` tokens run the split-KV verify kernel unless
``KVSHIP_SPLIT_VERIFY=0``, docs/speculative.md; an MLA target's backend splits
its absorbed kernel by the graph size, into scratch it allocates in
``init_verify_cuda_graph_state``, docs/deepseek.md), whose
per-step tensors are static buffers refreshed before each replay; padding
requests use request row 0 with no prefix and write their K/V into slot 0,
which the KV pool reserves for padding.

Contract: ``can_run(bs, sizes)``; ``replay(...)`` returns a view of the static
logits ``[bs * k, vocab]``, valid until the next replay.  With the runner's
``hidden_capture`` set (EAGLE), the graphs also compute the hidden states and
``replay`` hands the real requests' rows to its sink, as an eager forward does.

Draft.  ``DraftGraphs`` captures ``eagle_tree.TreeExpansion.run`` (every draft step after the entries
extend: top-k, head forwards, selection, the final pick) for each batch size; its inputs are the
expansion's static buffers, which ``TreeExpansion.load`` refreshes (padding rows included) before
``replay(bs)``; its output is the expansion's static ``nodes``.  The Triton decode kernel reads the branch
rows and sequence lengths from those buffers and picks its splits by the batch size alone, so the
captured attention stays valid for any context length.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from typing import Any, Callable

import torch

from kvship.common.envs import ENV
from kvship.decode.spec.tree_build import build_tree_arrays
from kvship.engine.attention.triton_backend import SplitVerify, TritonExtendMeta
from kvship.engine.attention.triton_ops.verify_attention import SPLIT_VERIFY_MAX_TOKENS
from kvship.engine.cuda_graph_runner import collector_paused
from kvship.engine.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from kvship.engine.layers.moe.layer import count_rows_by_slot

logger = logging.getLogger(__name__)


class VerifyGraphs:
    def __init__(self, runner: Any, batch_sizes: list[int], k: int):
        self.r = runner
        self.k = k
        self.sizes = sorted(set(batch_sizes))
        self.max_bs = self.sizes[-1]
        dev = runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n * k, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n * k, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n * k, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.ext_lens = torch.full((n,), k, dtype=torch.int32, device=dev)
        self.starts = (torch.arange(n, dtype=torch.int32, device=dev) * k).contiguous()
        self.mask = torch.zeros(n * k * k, dtype=torch.uint8, device=dev)
        # the trees' parent slots; the graph builds positions and the mask from them (tree_build)
        self.parents = torch.full((n, k), -1, dtype=torch.int32, device=dev)
        self.mask_starts = torch.arange(n, dtype=torch.int64, device=dev) * (k * k)
        self.logits_idx = torch.arange(n * k, dtype=torch.int64, device=dev)
        # the split-KV verify attention's per-token view (graphs of at most SPLIT_VERIFY_MAX_TOKENS tokens): the
        # request's row and prefix length per token, refreshed before each replay; the tree layout is fixed
        tok = torch.arange(n * k, device=dev)
        self.tok_rows = torch.zeros(n * k, dtype=torch.int64, device=dev)
        self.tok_prefix = torch.zeros(n * k, dtype=torch.int32, device=dev)
        self.tok_local = (tok % k).to(torch.int32)
        self.tok_size = torch.full((n * k,), k, dtype=torch.int32, device=dev)
        self.tok_mask_row = tok * k
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metas: dict[int, TritonExtendMeta] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # an EAGLE head's hidden-state capture: the graphs also output the hidden states, handed to its sink
        self.capture = runner.hidden_capture
        self.hidden: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=dev)
        t0 = time.perf_counter()
        # fixed buffers the backend's verify attention captures against (the triton MLA backend's split scratch)
        runner.attn_backend.init_verify_cuda_graph_state(self.max_bs, k)
        # MoE targets: padding rows (KV slot 0) stay out of the expert load
        rows = count_rows_by_slot(runner.model, self.out_cache_loc)
        with torch.inference_mode(), rows, collector_paused(), runner.graph_capture():
            for bs in reversed(self.sizes):
                self._capture(bs)
        logger.info(
            "captured %d verify graphs (k=%d, bs %s) in %.1f s",
            len(self.sizes),
            k,
            self.sizes,
            time.perf_counter() - t0,
        )

    def _fb(self, bs: int) -> ForwardBatch:
        r, k = self.r, self.k
        return build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            input_ids=self.input_ids[: bs * k],
            positions=self.positions[: bs * k],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.prefix_lens[:bs],  # unused by the Triton extend (it reads prefix/extend lengths)
            seq_lens_cpu=[k] * bs,
            out_cache_loc=self.out_cache_loc[: bs * k],
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            logits_indices=self.logits_idx[: bs * k],
            capture_hidden=None if self.capture is None else self.capture.layers,
        )

    def _meta(self, bs: int) -> TritonExtendMeta:
        k = self.k
        n = bs * k
        split = None
        if n <= SPLIT_VERIFY_MAX_TOKENS and ENV.SPLIT_VERIFY:
            split = SplitVerify(
                self.tok_rows[:n],
                self.tok_prefix[:n],
                self.tok_local[:n],
                self.tok_size[:n],
                self.tok_mask_row[:n],
                k,
            )
        return TritonExtendMeta(
            self.prefix_lens[:bs],
            self.ext_lens[:bs],
            self.starts[:bs],
            k,
            self.mask[: bs * k * k],
            self.mask_starts[:bs],
            split,
        )

    def _capture(self, bs: int) -> None:
        fb = self._fb(bs)
        backend = self.r.attn_backend
        meta = self._meta(bs)
        backend.forward_metadata = meta
        fb.attn_metadata = meta
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self._forward(bs, fb)
        torch.cuda.current_stream().wait_stream(self.stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            out = self._forward(bs, fb)
        self.graphs[bs] = g
        self.metas[bs] = meta  # the graph reads its tensors, the split verify's scratch included: keep them alive
        self.outputs[bs] = out.next_token_logits
        if out.hidden_states is not None:
            self.hidden[bs] = out.hidden_states

    def _forward(self, bs: int, fb: ForwardBatch) -> Any:
        """What a graph runs: the trees' positions and mask from their parents, then the verify forward."""
        build_tree_arrays(self.parents[:bs], self.prefix_lens[:bs], self.positions, self.mask)
        return self.r.model(fb.input_ids, fb.positions, fb)

    def can_run(self, bs: int, tree_sizes: list[int]) -> bool:
        return 1 <= bs <= self.max_bs and all(s == self.k for s in tree_sizes)

    def replay(
        self,
        ids: list[int],
        parents: list[list[int]],
        locs: torch.Tensor,
        rows: list[int],
        prefix: list[int],
    ) -> torch.Tensor:
        """``parents``: each tree's ``DraftTree.all_parents`` (``k`` slots); the graph derives the positions
        and the tree mask from them and ``prefix`` (``tree_build``)."""
        bs, k = len(rows), self.k
        gbs = self.sizes[bisect.bisect_left(self.sizes, bs)]
        pad = gbs - bs
        host_i = torch.tensor(ids + [0] * pad * k, dtype=torch.int64)
        host_l = torch.cat([locs.to(torch.int64), torch.zeros(pad * k, dtype=torch.int64)])
        host_r = torch.tensor(rows + [0] * pad, dtype=torch.int64)
        host_pre = torch.tensor(prefix + [0] * pad, dtype=torch.int32)
        host_par = torch.tensor(parents + [list(range(-1, k - 1))] * pad, dtype=torch.int32)  # padding: chains
        self.input_ids[: gbs * k].copy_(host_i.pin_memory(), non_blocking=True)
        self.out_cache_loc[: gbs * k].copy_(host_l.pin_memory(), non_blocking=True)
        self.req_pool_indices[:gbs].copy_(host_r.pin_memory(), non_blocking=True)
        self.prefix_lens[:gbs].copy_(host_pre.pin_memory(), non_blocking=True)
        self.parents[:gbs].copy_(host_par.pin_memory(), non_blocking=True)
        if self.metas[gbs].split is not None:  # the split verify's per-token rows and prefixes
            self.tok_rows[: gbs * k].copy_(host_r.repeat_interleave(k).pin_memory(), non_blocking=True)
            self.tok_prefix[: gbs * k].copy_(host_pre.repeat_interleave(k).pin_memory(), non_blocking=True)
        self.graphs[gbs].replay()
        self.replays += 1
        if self.capture is not None:
            self.capture.sink(self.out_cache_loc[: bs * k], self.hidden[gbs][: bs * k])
        return self.outputs[gbs][: bs * k]


class DraftGraphs:
    def __init__(self, tree: Any, batch_sizes: list[int], capture: Callable[[], Any] = contextlib.nullcontext):
        """``capture``: the target runner's ``graph_capture`` (the draft steps run the target's embedding and
        LM head, whose collectives are captured too under tensor parallelism)."""
        self.tree = tree
        self.sizes = sorted(set(batch_sizes))
        self.max_bs = self.sizes[-1]
        if self.max_bs > tree.max_bs:
            raise ValueError(f"draft graphs up to bs {self.max_bs} need static buffers of that many rows")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=tree.device)
        t0 = time.perf_counter()
        with torch.inference_mode(), collector_paused(), capture():
            for bs in reversed(self.sizes):
                self._capture(bs)
        logger.info(
            "captured %d EAGLE draft graphs (%d steps, top-%d, bs %s) in %.1f s",
            len(self.sizes),
            tree.steps,
            tree.topk,
            self.sizes,
            time.perf_counter() - t0,
        )

    def _capture(self, bs: int) -> None:
        t = self.tree
        # every row a padding row: the captures write only the padding branch rows and KV slot 0
        t.load(t.root_out[:0], t.root_hidden[:0], [], bs)
        pad = [0] * bs
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                t.run(bs, pad)
        torch.cuda.current_stream().wait_stream(self.stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            t.run(bs, pad)
        self.graphs[bs] = g

    def can_run(self, bs: int) -> bool:
        """Whether a graph of exactly ``bs`` rows was captured (callers pad batches to a captured size)."""
        return bs in self.graphs

    def replay(self, bs: int) -> None:
        """Replay the graph of captured size ``bs`` over the expansion's loaded static inputs."""
        self.graphs[bs].replay()
        self.replays += 1

"""CUDA-graph capture and replay of decode steps.

``CudaGraphRunner(model, attn_backend, ctx, kv_pool, batch_sizes)`` captures
one decode forward pass per batch size (largest first, all into one shared memory pool) against
pre-allocated static input buffers.  ``replay(forward_batch)`` copies the
batch's inputs into those buffers, pads the batch up to the next captured size,
lets the attention backend refresh its metadata
(``init_forward_metadata_replay_cuda_graph``), replays the graph and returns
the first ``bs`` rows of the captured logits.

A later pipeline stage (``stage_input_width``) also has a static
``[2, max_bs, width]`` buffer for the received hidden states and residual:
``replay(fb, stage_input)`` copies them in, and its graphs return the
stage's ``StageOutput`` (rows ``[:bs]``, views of the static output) instead
of logits on every stage but the last.

Padding rows point at request row 0 with sequence length
``attn_backend.get_cuda_graph_seq_len_fill_value()`` and write their K/V into
slot 0, which the KV pool reserves for exactly this (page 0 is never handed
out).  They are reset on every replay, so stale values from a larger batch
never leak in.

Contract for callers:
* ``can_run(fb)`` says whether a batch may be replayed: DECODE, at most the
  largest captured size, default logits rows.  Everything else (extends,
  larger batches) runs eagerly.
* The model runner captures exactly ``AttentionContext.cuda_graph_bs``, the
  sizes backends choose their kernels by, so eager and replayed steps agree.
* The logits returned by ``replay`` are a view of the graph's static output:
  valid until the next ``replay`` (the sampler consumes them first).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from kvship.engine.forward_batch import ForwardBatch, ForwardMode, LogitsOutput, StageOutput, build_forward_batch
from kvship.engine.layers.moe.layer import count_rows_by_slot

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.attention.base import AttentionBackend, AttentionContext
    from kvship.engine.config import ServerArgs
    from kvship.engine.mem.pools import KVPool

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def collector_paused():
    """Collect once, then keep Python's cyclic garbage collector off for the block (every loop of graph
    captures runs in one).  A collection inside a capture runs the finalizers of whatever earlier objects
    became garbage, and some make CUDA calls a capture forbids (a pinned host buffer's free, a transfer
    engine's memory deregistration): the capture is invalidated and the worker fails to start.  Seen on the
    H100 when a process built a second model runner and a generation-1 collection of the first one's objects
    landed inside a decode-graph capture."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: "AttentionBackend",
        ctx: "AttentionContext",
        kv_pool: "KVPool",
        batch_sizes: Sequence[int],
        show_progress: bool = True,
        stage_input_width: Optional[int] = None,
    ):
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token_pool = ctx.req_to_token_pool
        self.kv_pool = kv_pool
        self.device = ctx.device
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not self.attn_backend.supports_cuda_graph:
            raise ValueError(f"attention backend {type(self.attn_backend).__name__} does not support CUDA graphs")
        sizes = sorted({int(b) for b in batch_sizes if int(b) >= 1})
        if not sizes:
            raise ValueError("no CUDA-graph batch sizes to capture")
        self.batch_sizes = sizes
        self.max_bs = sizes[-1]
        self.fill_seq_len = int(self.attn_backend.get_cuda_graph_seq_len_fill_value())

        dev, n = self.device, self.max_bs
        # the static inputs, rows of one buffer: the batch's packed ``decode_inputs`` land in one copy
        self.static_inputs = torch.zeros((5, n), dtype=torch.int64, device=dev)
        self.input_ids = self.static_inputs[0]
        self.positions = self.static_inputs[1]
        self.req_pool_indices = self.static_inputs[2]
        self.seq_lens = self.static_inputs[3]
        self.seq_lens.fill_(self.fill_seq_len)
        self.out_cache_loc = self.static_inputs[4]
        self.attn_backend.init_cuda_graph_state(n, n)
        # a later pipeline stage: the residual stream it continues (hidden, residual)
        self.stage_in: Optional[torch.Tensor] = None
        if stage_input_width is not None:
            # the activations' dtype (ctx.dtype), not a parameter's: a later stage's first parameter may be a
            # quantized weight (an FP8 checkpoint's first projection of its first layer)
            self.stage_in = torch.zeros((2, n, stage_input_width), dtype=ctx.dtype, device=dev)

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, LogitsOutput | StageOutput] = {}
        self.replays = 0  # graphs replayed so far (tests and metrics read it)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=dev)
        self.capture(show_progress)

    # --- capture -------------------------------------------------------------
    def _forward_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        return build_forward_batch(
            ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

    def capture(self, show_progress: bool = True) -> None:
        from tqdm import tqdm

        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        order = list(reversed(self.batch_sizes))  # largest first: later graphs reuse its pool blocks
        bar = tqdm(order, desc="Capturing CUDA graphs", unit="graph", disable=not show_progress)
        # MoE models: padding rows (KV slot 0) stay out of the expert load
        with torch.inference_mode(), count_rows_by_slot(self.model, self.out_cache_loc), collector_paused():
            for bs in bar:
                bar.set_postfix(bs=bs)
                self._capture_one(bs)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d decode CUDA graphs (bs %d..%d) in %.1f s, %.0f MiB",
            len(order),
            self.batch_sizes[0],
            self.max_bs,
            time.perf_counter() - t0,
            used / 2**20,
        )

    def _capture_one(self, bs: int) -> None:
        self.seq_lens[:bs].fill_(self.fill_seq_len)
        self.req_pool_indices[:bs].zero_()
        self.out_cache_loc[:bs].zero_()
        fb = self._forward_batch(bs, [self.fill_seq_len] * bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, self.req_pool_indices[:bs], self.seq_lens[:bs], ForwardMode.DECODE
        )
        kwargs = {}
        if self.stage_in is not None:
            kwargs["stage_input"] = (self.stage_in[0, :bs], self.stage_in[1, :bs])
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (autotuning, lazy init) outside the graph
                self.model(fb.input_ids, fb.positions, fb, **kwargs)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = self.model(fb.input_ids, fb.positions, fb, **kwargs)
        self.graphs[bs] = graph
        self.outputs[bs] = out

    # --- replay --------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode == ForwardMode.DECODE and 1 <= fb.batch_size <= self.max_bs and fb.logits_indices is None

    def padded_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay(
        self, fb: ForwardBatch, stage_input: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ) -> LogitsOutput | StageOutput:
        """Run ``fb`` (``can_run(fb)`` must hold) through the graph of the next captured size; ``stage_input``:
        a later pipeline stage's received (hidden, residual) rows."""
        bs = fb.batch_size
        if (stage_input is None) != (self.stage_in is None):
            raise ValueError("a later pipeline stage's graphs need its stage_input (and only they take one)")
        if stage_input is not None:
            self.stage_in[0, :bs].copy_(stage_input[0], non_blocking=True)
            self.stage_in[1, :bs].copy_(stage_input[1], non_blocking=True)
        gbs = self.padded_size(bs)
        if gbs != bs:
            self.input_ids[bs:gbs].zero_()
            self.positions[bs:gbs].zero_()
            self.req_pool_indices[bs:gbs].zero_()
            self.seq_lens[bs:gbs].fill_(self.fill_seq_len)
            self.out_cache_loc[bs:gbs].zero_()
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        if fb.decode_inputs is not None:  # positions, rows, lengths, slots: one copy
            self.static_inputs[1:, :bs].copy_(fb.decode_inputs, non_blocking=True)
        else:
            self.positions[:bs].copy_(fb.positions, non_blocking=True)
            self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
            self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
            self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        seq_cpu = list(fb.seq_lens_cpu) + [self.fill_seq_len] * (gbs - bs)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            gbs,
            self.req_pool_indices[:gbs],
            self.seq_lens[:gbs],
            sum(seq_cpu),
            ForwardMode.DECODE,
            seq_lens_cpu=torch.tensor(seq_cpu, dtype=torch.int64),
        )
        self.graphs[gbs].replay()
        self.replays += 1
        out = self.outputs[gbs]
        if isinstance(out, StageOutput):
            return StageOutput(out.hidden[:bs], out.residual[:bs])
        return LogitsOutput(next_token_logits=out.next_token_logits[:bs])


def cuda_graph_batch_sizes(server_args: "ServerArgs", max_running_requests: int) -> list[int]:
    """The decode batch sizes to capture: ``--cuda-graph-bs`` (or the default list) up to
    ``min(--cuda-graph-max-bs, max_running_requests)``; the default list also gets that limit itself,
    so every batch the scheduler can form has a graph.  Empty where nothing fits."""
    sa = server_args
    limit = min(sa.cuda_graph_max_bs, int(max_running_requests))
    sizes = [b for b in sa.resolved_cuda_graph_bs if b <= limit]
    if not sa.cuda_graph_bs and limit >= 1 and (not sizes or sizes[-1] < limit):
        sizes.append(limit)
    return sizes


def maybe_create_cuda_graph_runner(
    model: nn.Module,
    attn_backend: "AttentionBackend",
    ctx: "AttentionContext",
    kv_pool: "KVPool",
    disable: bool,
    stage_input_width: Optional[int] = None,
) -> Optional[CudaGraphRunner]:
    """A graph runner for ``ctx.cuda_graph_bs``, or None where graphs are off (``disable``), impossible
    (not CUDA) or unsupported by the backend or by the sizes (logged)."""
    if ctx.device.type != "cuda" or disable:
        return None
    if not attn_backend.supports_cuda_graph:
        logger.warning(
            "attention backend %s does not support CUDA graphs: decode runs eagerly", type(attn_backend).__name__
        )
        return None
    if not ctx.cuda_graph_bs:
        logger.warning(
            "no CUDA-graph batch size fits --cuda-graph-max-bs / --max-running-requests: decode runs eagerly"
        )
        return None
    return CudaGraphRunner(model, attn_backend, ctx, kv_pool, ctx.cuda_graph_bs, stage_input_width=stage_input_width)

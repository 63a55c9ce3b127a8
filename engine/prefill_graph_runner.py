"""Piecewise CUDA graphs for prefill (extend) forwards: everything but attention replayed from graphs.

Why: an eager prefill forward of a short prompt is bound by the host, not the
GPU.  Each of its ~400 kernels costs the Python and launch work of one torch or
Triton call, and on the H100 worker of docs/benchmarks.md the host needed
35 ms to enqueue a 512-token Llama-3.1-8B forward whose kernels keep the GPU
busy for 13 ms.  Short prompts are most of chat traffic, so this is the
time-to-first-token users feel, unified and PD alike (docs/gpu.md, "Prefill
graphs").

How: for each token count ``T`` of ``token_sizes`` the model's decoder stack
(``model.model``: embedding, layers, final norm) is captured as ``L + 1``
graphs, split at each layer's attention.  During capture the forward batch's
attention backend is a ``_SplitPoint``: it copies the layer's q/k/v into
static buffers (inside the graph before the split), ends that graph, and
returns a static output buffer the next graph's projections read.  A replay
copies the batch's ids, positions and KV slots into static inputs (the padding
tokens ``T_real..T`` get id 0, position 0 and KV slot 0, the pool's padding
slot), runs graph 0, then for each layer the real attention backend eagerly
over the first ``T_real`` rows of the static q/k/v (so any batch shape,
cached prefix or backend metadata works: only the token count is bucketed),
copies its output into the static buffer and replays the next graph.  The
logits (``model.logits``: the last token of each request, or the rows the
batch asks for) are computed eagerly from the static final hidden states.

RoPE and the K/V store run inside the graphs (the padding tokens write slot
0); ``forward_batch.layer_done`` hears of a layer after its eager attention,
as on the eager path.  The static buffers are shared by all token counts (the
largest ``T``); the graphs share the decode graphs' memory pool (replays never
overlap).

Not replayed (eager as before): batches of more than ``max(token_sizes)``
tokens, modes other than ``EXTEND`` (verify, draft extends), forwards that
capture hidden states for a speculator, and MoE under expert parallelism with
all-to-all dispatch (its token counts are exchanged on the host).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from kvship.engine.cuda_graph_runner import collector_paused
from kvship.engine.forward_batch import ForwardBatch, ForwardMode, LogitsOutput, build_forward_batch
from kvship.engine.layers.moe.layer import count_rows_by_slot

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.attention.base import AttentionBackend, AttentionLayerSpec
    from kvship.engine.mem.pools import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# token counts captured by default, up to --prefill-graph-max-tokens
DEFAULT_TOKEN_SIZES = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def prefill_graph_token_sizes(max_tokens: int) -> list[int]:
    """The token counts to capture for ``--prefill-graph-max-tokens``: the defaults up to it, and it."""
    if max_tokens <= 0:
        return []
    sizes = [t for t in DEFAULT_TOKEN_SIZES if t < max_tokens]
    return sizes + [int(max_tokens)]


class _SplitPoint:
    """The attention backend of a capture: ends the running graph at each layer's attention (module doc)."""

    def __init__(self, runner: "PrefillGraphRunner", tokens: int):
        self.runner = runner
        self.tokens = tokens
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple["AttentionLayerSpec", bool]] = []
        self.probe = False  # warm-up runs: record shapes, no graph

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.runner.pool)
        self.graphs.append(g)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "AttentionLayerSpec",
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        out_group: int = 0,
    ) -> torch.Tensor:
        # (``out_group`` concerns decode steps only: an extend's output is model-dtype rows)
        r, t = self.runner, self.tokens
        if self.probe:
            r.ensure_buffers(q, k, v)
            return r.out[: q.shape[0], : q.shape[1]]
        sq, sk, sv = r.views(t, q, k, v)
        sq.copy_(q)
        sk.copy_(k)
        sv.copy_(v)
        self.end()
        self.layers.append((layer, save_kv_cache))
        self.begin()
        return r.out[:t, : q.shape[1]]


class _Captured:
    """One token count's graphs: ``graphs[i]`` runs up to layer i's attention, the last to the final norm."""

    def __init__(self, graphs: list, layers: list, hidden: torch.Tensor):
        self.graphs = graphs
        self.layers = layers
        self.hidden = hidden


class PrefillGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: "AttentionBackend",
        req_to_token_pool: "ReqToTokenPool",
        kv_pool: "KVPool",
        device: torch.device,
        token_sizes: Sequence[int],
        pool: Optional[tuple] = None,
        show_progress: bool = True,
    ):
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not (hasattr(model, "model") and hasattr(model, "logits")):
            raise ValueError(f"{type(model).__name__} has no decoder stack / logits split for prefill graphs")
        sizes = sorted({int(t) for t in token_sizes if int(t) >= 1})
        if not sizes:
            raise ValueError("no prefill token counts to capture")
        self.model = model
        self.attn_backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.device = device
        self.token_sizes = sizes
        self.max_tokens = sizes[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        # static attention buffers (largest count; allocated by the first warm-up, outside any graph)
        self.q: Optional[torch.Tensor] = None
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self.captured: dict[int, _Captured] = {}
        self.replays = 0  # forwards replayed so far (tests and metrics read it)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.capture(show_progress)

    # --- buffers -------------------------------------------------------------
    def ensure_buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = self.max_tokens
        if self.q is None or self.q.shape[1] < q.shape[1] or self.k.shape[1] < k.shape[1]:
            self.q = torch.zeros(n, q.shape[1], dtype=q.dtype, device=self.device)
            self.k = torch.zeros(n, k.shape[1], dtype=k.dtype, device=self.device)
            self.v = torch.zeros(n, v.shape[1], dtype=v.dtype, device=self.device)
            self.out = torch.zeros(n, q.shape[1], dtype=q.dtype, device=self.device)

    def views(self, t: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        return self.q[:t, : q.shape[1]], self.k[:t, : k.shape[1]], self.v[:t, : v.shape[1]]

    # --- capture -------------------------------------------------------------
    def _forward_batch(self, t: int, backend: object) -> ForwardBatch:
        dev = self.device
        return build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device=dev),
            seq_lens=torch.full((1,), t, dtype=torch.int64, device=dev),
            seq_lens_cpu=[t],
            out_cache_loc=self.out_cache_loc[:t],
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=backend,  # type: ignore[arg-type]
            extend_lens=[t],
            prefix_lens=[0],
            extend_tensors=(
                torch.full((1,), t, dtype=torch.int64, device=dev),
                torch.zeros(1, dtype=torch.int64, device=dev),
                torch.zeros(1, dtype=torch.int64, device=dev),
            ),
        )

    def capture(self, show_progress: bool = True) -> None:
        from tqdm import tqdm

        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        order = list(reversed(self.token_sizes))  # largest first: the others reuse its pool blocks
        bar = tqdm(order, desc="Capturing prefill graphs", unit="size", disable=not show_progress)
        with torch.inference_mode(), count_rows_by_slot(self.model, self.out_cache_loc), collector_paused():
            for t in bar:
                bar.set_postfix(tokens=t)
                self._capture_one(t)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        pieces = len(next(iter(self.captured.values())).graphs)
        logger.info(
            "captured prefill CUDA graphs for %d token counts (%d..%d, %d pieces each) in %.1f s, %.0f MiB",
            len(order),
            self.token_sizes[0],
            self.max_tokens,
            pieces,
            time.perf_counter() - t0,
            used / 2**20,
        )

    def _capture_one(self, t: int) -> None:
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.out_cache_loc[:t].zero_()
        split = _SplitPoint(self, t)
        fb = self._forward_batch(t, split)
        decoder = self.model.model
        split.probe = True
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (autotuning, lazy init, the static buffers) outside the graphs
                decoder(fb.input_ids, fb.positions, fb)
            torch.cuda.synchronize(self.device)
            split.probe = False
            split.begin()
            hidden = decoder(fb.input_ids, fb.positions, fb)
            split.end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.captured[t] = _Captured(split.graphs, split.layers, hidden)

    # --- replay --------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.forward_mode == ForwardMode.EXTEND
            and fb.capture_hidden is None
            and 1 <= fb.input_ids.shape[0] <= self.max_tokens
        )

    def padded_size(self, tokens: int) -> int:
        return self.token_sizes[bisect.bisect_left(self.token_sizes, tokens)]

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        """``fb`` (``can_run(fb)`` must hold) through the graphs of the next captured token count; the
        caller has run ``attn_backend.init_forward_metadata(fb)``."""
        n = fb.input_ids.shape[0]
        t = self.padded_size(n)
        cap = self.captured[t]
        if t != n:
            self.input_ids[n:t].zero_()
            self.positions[n:t].zero_()
            self.out_cache_loc[n:t].zero_()
        self.input_ids[:n].copy_(fb.input_ids, non_blocking=True)
        self.positions[:n].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc, non_blocking=True)
        backend = self.attn_backend
        cap.graphs[0].replay()
        for i, (layer, save_kv) in enumerate(cap.layers):
            qw = layer.num_heads * layer.head_dim
            kw = layer.num_kv_heads * layer.head_dim
            o = backend.forward(self.q[:n, :qw], self.k[:n, :kw], self.v[:n, :kw], layer, fb, save_kv)
            self.out[:n, :qw].copy_(o)
            if fb.layer_done is not None:
                fb.layer_done(layer.layer_id)
            cap.graphs[i + 1].replay()
        self.replays += 1
        return self.model.logits(cap.hidden[:n], fb)


def maybe_create_prefill_graph_runner(
    model: nn.Module,
    attn_backend: "AttentionBackend",
    req_to_token_pool: "ReqToTokenPool",
    kv_pool: "KVPool",
    device: torch.device,
    max_tokens: int,
    disable: bool,
    ep_all_to_all: bool,
    pool: Optional[tuple] = None,
) -> Optional[PrefillGraphRunner]:
    """A prefill graph runner up to ``max_tokens`` tokens, or None where it is off (``disable``, 0 tokens),
    impossible (not CUDA) or not applicable (logged)."""
    if device.type != "cuda" or disable or max_tokens <= 0:
        return None
    if ep_all_to_all:
        logger.info("prefill graphs off: expert-parallel all-to-all dispatch exchanges token counts on the host")
        return None
    if not (hasattr(model, "model") and hasattr(model, "logits")):
        logger.info("prefill graphs off: %s has no decoder stack / logits split", type(model).__name__)
        return None
    return PrefillGraphRunner(
        model, attn_backend, req_to_token_pool, kv_pool, device, prefill_graph_token_sizes(max_tokens), pool
    )

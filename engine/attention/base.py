"""The attention backend contract and its registry.

A backend computes attention for one layer over the KV pools.  The model runner
calls ``init_forward_metadata(forward_batch)`` once per step, before the model
runs; every layer then calls ``forward`` (which dispatches to
``forward_extend`` / ``forward_decode``).  Metadata built once per step is
shared by all layers: a backend must not recompute it per layer.

Contract every backend keeps:
* ``q`` is ``[num_tokens, num_heads * head_dim]``; ``k`` / ``v`` are
  ``[num_tokens, num_kv_heads * head_dim]`` for the *new* tokens only.
* When ``save_kv_cache`` is true the backend writes ``k`` / ``v`` into
  ``forward_batch.kv_pool`` at ``forward_batch.out_cache_loc`` before reading.
* A new token at position p attends causally to every position <= p of its own
  request: the cached prefix (read through ``req_to_token``) and the new tokens.
* The output is ``[num_tokens, num_heads * head_dim]`` in ``q``'s dtype.
* Over an FP8 pool (``kv_pool.is_fp8``) a store writes ``quantize_kv(x, scale)``
  with the layer's ``kv_pool.scales(layer_id)`` and every read computes with
  ``float(e4m3) * scale`` -- the new tokens' own K/V included, so an extend
  sees what later decode steps see (docs/quantization.md, "FP8 KV cache").

CUDA graphs: ``init_cuda_graph_state`` allocates fixed buffers once for the
largest captured batch; ``init_forward_metadata_capture_cuda_graph`` points
the metadata at those buffers for a batch of ``bs`` during capture;
``init_forward_metadata_replay_cuda_graph`` refreshes their contents in place
before replay (no new allocations, no host sync beyond what the caller gives).
Backends that cannot run under CUDA graphs set ``supports_cuda_graph = False``.

Construction: a backend is built from an ``AttentionContext`` (the static
facts of the worker it serves) through the registry
(``@register_attention_backend("name")`` / ``create_attention_backend``); it
reads nothing else of the model runner.  Environment knobs a backend has are
read once, in its constructor, through ``kvship.common.envs.ENV``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.mem.pools import ReqToTokenPool


@dataclass(frozen=True)
class AttentionContext:
    """The static facts of a worker an attention backend is built for (the model runner makes one).

    Invariants the runner keeps: ``num_heads`` is a multiple of ``num_kv_heads``;
    the KV pool of every ForwardBatch has ``num_kv_heads x head_dim`` rows of
    ``kv_dtype`` in pages of ``page_size`` slots; ``req_to_token_pool`` is the
    table every ForwardBatch carries (captured CUDA graphs read it in place);
    no decode batch has more than ``max_running_requests`` requests.

    ``cuda_graph_bs`` (ascending) are the decode batch sizes a CUDA graph is
    captured for -- given also when graphs are off, so that a backend can choose
    its kernels by the size a batch *would* pad to and eager and replayed steps
    compute alike.  Empty where no size fits.
    """

    device: torch.device
    dtype: torch.dtype  # of q / k / v and of the output
    kv_dtype: torch.dtype  # of the KV pool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    req_to_token_pool: ReqToTokenPool
    max_running_requests: int
    cuda_graph_bs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads")
        if list(self.cuda_graph_bs) != sorted(set(self.cuda_graph_bs)):
            raise ValueError(f"cuda_graph_bs must be ascending and distinct, got {self.cuda_graph_bs}")

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static shape of one attention layer, given to the backend on every call."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build per-step metadata shared by all layers."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        out_group: int = 0,
    ) -> torch.Tensor:
        """Attention of the batch's new tokens; ``out_group`` (``QuantMethod.input_group`` of the projection that
        follows): a decode step may return its output as that projection's ``QuantizedInput`` instead
        (``forward_decode_quant``), where the backend has such a kernel."""
        if forward_batch.kv_ready is not None:  # host-tier pages loading back (docs/cache.md, "Load-back")
            forward_batch.kv_ready(layer.layer_id)
        if forward_batch.forward_mode.is_decode():
            if out_group:
                out = self.forward_decode_quant(q, k, v, layer, forward_batch, save_kv_cache, out_group)
                if out is not None:
                    return out
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode_quant(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
        group: int,
    ) -> Optional[Any]:
        """``forward_decode`` with its output quantized per ``group`` columns by the attention's own last kernel
        (a ``QuantizedInput``), or None: this backend has no such kernel (the caller runs ``forward_decode``)."""
        return None

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for new tokens over cached prefix + themselves (causal)."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for one new token per request over its whole context."""

    # --- CUDA-graph hooks -------------------------------------------------
    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed buffers graphs capture against (once)."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        """Point the metadata at the fixed buffers for a capture of batch ``bs``."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> None:
        """Refresh the fixed buffers in place before replaying the graph for ``bs``."""

    def init_verify_cuda_graph_state(self, max_bs: int, tokens_per_request: int) -> None:
        """Allocate fixed buffers for the speculative verify graphs (kvship.decode.spec.graphs: up to ``max_bs``
        requests of ``tokens_per_request`` draft tokens each), once, before they are captured; most backends need
        none (the triton MLA backend's split-KV verify does)."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length written into padded rows of a replayed batch."""
        return 1


BackendFactory = Callable[[AttentionContext], AttentionBackend]

_REGISTRY: dict[str, BackendFactory] = {}
# backends living in modules that may need optional packages are imported lazily
_LAZY_MODULES = {
    "torch_native": "kvship.engine.attention.torch_native",
    "triton": "kvship.engine.attention.triton_backend",
    "flashinfer": "kvship.engine.attention.flashinfer_backend",
}


def register_attention_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def create_attention_backend(name: str, ctx: AttentionContext) -> AttentionBackend:
    """Instantiate backend ``name`` for ``ctx`` (imports its module on first use).

    ValueError when the name is unknown or its module cannot be imported here
    (e.g. ``flashinfer`` without the package)."""
    if name not in _REGISTRY and name in _LAZY_MODULES:
        import importlib

        try:
            importlib.import_module(_LAZY_MODULES[name])
        except ImportError as e:
            raise ValueError(f"attention backend '{name}' is unavailable here: {e}") from e
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend '{name}'; known: {sorted(set(_REGISTRY) | set(_LAZY_MODULES))}")
    return _REGISTRY[name](ctx)

"""What the model runner computes in one step.

Data flow:  ``Req`` (one request, scheduler-owned)
         -> ``ScheduleBatch`` (CPU lists, built by the scheduler each step)
         -> ``ForwardBatch`` (tensors on the model's device, this module)
         -> ``ModelRunner.forward`` -> ``LogitsOutput`` -> sampler.

Layout rules a caller must keep:
* Tokens of all requests are packed along dim 0 in request order
  (``input_ids``, ``positions``, ``out_cache_loc`` all have ``num_tokens`` rows).
* ``seq_lens[i]`` is request i's total length *after* this step (cached prefix
  + new tokens).  ``extend_prefix_lens[i]`` is the part already in the KV pool;
  ``extend_seq_lens[i]`` the part computed now.  For DECODE, every request has
  exactly one new token.
* ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` must already hold the KV
  slots of every position, including the new ones (= ``out_cache_loc``), when
  ``forward`` is called; attention writes the new K/V into ``out_cache_loc``.
* ``logits_indices`` selects which rows of the final hidden states get logits
  (default: the last new token of each request).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.attention.base import AttentionBackend
    from kvship.engine.mem.pools import KVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill (possibly a chunk, possibly over a cached prefix)
    DECODE = 2  # one new token per request
    TARGET_VERIFY = 5  # score a draft tree with the target model (an extend with ``tree_masks``)
    DRAFT_EXTEND = 6  # extend a draft model (reserved for model-based drafters)

    def is_extend(self) -> bool:
        """Runs as an extend: new tokens packed per request over a cached prefix."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64 (device)
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot of each new token
    req_to_token_pool: "ReqToTokenPool"
    kv_pool: "KVPool"
    attn_backend: "AttentionBackend"
    # decode: positions, req_pool_indices, seq_lens and out_cache_loc as the rows of one [4, bs] int64 tensor
    # (those fields are its rows), so a CUDA graph's inputs take one copy; None where they lie apart
    decode_inputs: Optional[torch.Tensor] = None
    # extend-only
    extend_seq_lens: Optional[torch.Tensor] = None  # [bs] int64
    extend_prefix_lens: Optional[torch.Tensor] = None  # [bs] int64
    extend_start_loc: Optional[torch.Tensor] = None  # [bs] int64, offset of each req in the packed tokens
    extend_seq_lens_cpu: Optional[list[int]] = None
    extend_prefix_lens_cpu: Optional[list[int]] = None
    # TARGET_VERIFY: per request [extend_len, extend_len] bool, True where a new token attends to another new
    # token (its tree ancestors and itself); every new token also attends to the whole cached prefix
    tree_masks: Optional[list[torch.Tensor]] = None
    # rows of the final hidden states to compute logits for (default: last new token per req)
    logits_indices: Optional[torch.Tensor] = None
    # hidden states to return for every new token (``LogitsOutput.hidden_states``; EAGLE drafting,
    # docs/speculative.md): None = none (no cost), () = the final normed hidden state, (i, j, ...) = the
    # outputs of decoder layers i, j, ... concatenated
    capture_hidden: Optional[tuple[int, ...]] = None
    # attention backends keep their per-step metadata here
    attn_metadata: Any = field(default=None, repr=False)
    # called with a layer's id once that layer's attention stored the new tokens' K/V (on CUDA: queued on the
    # current stream); None = no call.  A prefill worker ships early layers while later ones compute
    # (docs/pd.md, "Layer-wise transfer")
    layer_done: Optional[Callable[[int], None]] = field(default=None, repr=False)

    def default_logits_indices(self) -> torch.Tensor:
        """Index of the last new token of each request in the packed tokens."""
        if self.forward_mode.is_decode():
            return torch.arange(self.batch_size, device=self.input_ids.device)
        assert self.extend_seq_lens is not None
        return torch.cumsum(self.extend_seq_lens, dim=0) - 1


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [len(logits_indices), vocab] float32
    hidden_states: Optional[torch.Tensor] = None  # [num_tokens, width] when ``capture_hidden`` asked for them


@dataclass(frozen=True)
class HiddenCapture:
    """What a model runner does with captured hidden states (``ModelRunner.hidden_capture``).

    Every eager forward (and the speculator's verify graphs) runs with
    ``capture_hidden = layers`` and hands the new tokens' hidden states to
    ``sink(out_cache_loc, hidden)`` right after the model, before sampling.
    Decode steps replaying the decode CUDA graphs capture nothing.
    """

    layers: tuple[int, ...]
    sink: Callable[[torch.Tensor, torch.Tensor], None]

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

Every ``ForwardBatch`` is made by ``build_forward_batch`` (the scheduler's
batches, the CUDA-graph runners' static batches, speculative rounds, tests and
benchmarks): it derives the batch size and the extend fields and checks the
rules above that can be checked without reading the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

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
    # EXTEND of an MLA model (docs/deepseek.md, "Absorbed or decompressed extend"): True = its MLA layers attend
    # absorbed, False = decompressed.  None until the first MLA layer picks it from the host lengths (the
    # model's cost rule, or KVSHIP_MLA_EXTEND) and stores it here, so every layer of the forward takes the same
    # path; a builder may set it to force one
    mla_absorbed_extend: Optional[bool] = None
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
    # called with a layer's id before that layer's attention reads the KV pool: pages loading back from the
    # host tier are in place once it returns (on CUDA: the current stream waits for them); None = no call
    # (docs/cache.md, "Load-back")
    kv_ready: Optional[Callable[[int], None]] = field(default=None, repr=False)

    def default_logits_indices(self) -> torch.Tensor:
        """Index of the last new token of each request in the packed tokens."""
        if self.forward_mode.is_decode():
            return torch.arange(self.batch_size, device=self.input_ids.device)
        assert self.extend_seq_lens is not None
        return torch.cumsum(self.extend_seq_lens, dim=0) - 1


@dataclass
class StageOutput:
    """What a model built for layers that do not end the decoder returns (``kvship.engine.models.stage``): the
    residual stream after its last layer, which the next pipeline stage continues."""

    hidden: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]


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


IntsOrTensor = Union[torch.Tensor, Sequence[int]]


def build_forward_batch(
    mode: ForwardMode,
    *,
    input_ids: IntsOrTensor,
    positions: IntsOrTensor,
    out_cache_loc: IntsOrTensor,
    req_pool_indices: IntsOrTensor,
    seq_lens: IntsOrTensor,
    seq_lens_cpu: Sequence[int],
    req_to_token_pool: "ReqToTokenPool",
    kv_pool: "KVPool",
    attn_backend: "AttentionBackend",
    device: Optional[torch.device | str] = None,
    extend_lens: Optional[Sequence[int]] = None,
    prefix_lens: Optional[Sequence[int]] = None,
    extend_tensors: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    logits_indices: Optional[IntsOrTensor] = None,
    **extra: Any,
) -> ForwardBatch:
    """The one way to make a ``ForwardBatch``.

    Contract:
    * ``input_ids``, ``positions``, ``out_cache_loc`` have one row per new token; ``req_pool_indices``,
      ``seq_lens`` and ``seq_lens_cpu`` one per request (``batch_size = len(seq_lens_cpu)``).  Integer lists
      become int64 tensors on ``device``; tensors are used as they are (moved to ``device`` when it is given),
      so a caller's static CUDA-graph buffers stay the batch's tensors.
    * EXTEND and DRAFT_EXTEND need ``extend_lens`` and ``prefix_lens`` (host lists, one per request): new
      tokens and cached prefix of each, with ``seq_lens_cpu[i] == prefix_lens[i] + extend_lens[i]`` and the
      new tokens summing to the rows.  The device ``extend_seq_lens`` / ``extend_prefix_lens`` /
      ``extend_start_loc`` are made from them, unless ``extend_tensors`` hands them in (in that order).
      TARGET_VERIFY takes them too, or leaves them to its backend's own metadata (the verify graphs).
    * DECODE has exactly one new token per request.
    * ``extra``: the optional fields as named on ``ForwardBatch`` (``decode_inputs``, ``tree_masks``,
      ``capture_hidden``, ``layer_done``, ``mla_absorbed_extend``).
    Violations raise ValueError; nothing here reads the device.
    """

    def dev(v: IntsOrTensor) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v if device is None else v.to(device)
        return torch.tensor(v, dtype=torch.int64, device=device)

    bs = len(seq_lens_cpu)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=dev(input_ids),
        positions=dev(positions),
        req_pool_indices=dev(req_pool_indices),
        seq_lens=dev(seq_lens),
        seq_lens_cpu=list(seq_lens_cpu),
        out_cache_loc=dev(out_cache_loc),
        req_to_token_pool=req_to_token_pool,
        kv_pool=kv_pool,
        attn_backend=attn_backend,
        logits_indices=None if logits_indices is None else dev(logits_indices),
        **extra,
    )
    n = fb.input_ids.shape[0]
    if fb.positions.shape[0] != n or fb.out_cache_loc.shape[0] != n:
        raise ValueError(
            f"{mode.name}: {n} input ids but {fb.positions.shape[0]} positions and {fb.out_cache_loc.shape[0]} "
            "KV slots: one of each per new token"
        )
    if fb.req_pool_indices.shape[0] != bs or fb.seq_lens.shape[0] != bs:
        raise ValueError(
            f"{mode.name}: {bs} requests but {fb.req_pool_indices.shape[0]} pool rows and {fb.seq_lens.shape[0]} "
            "sequence lengths"
        )
    if mode.is_decode() and n != bs:
        raise ValueError(f"DECODE computes one token per request: {n} tokens for {bs} requests")
    if extend_lens is None or prefix_lens is None:
        if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
            raise ValueError(f"{mode.name} needs extend_lens and prefix_lens")
        return fb
    if len(extend_lens) != bs or len(prefix_lens) != bs:
        raise ValueError(
            f"{mode.name}: extend/prefix lengths for {len(extend_lens)}/{len(prefix_lens)} of {bs} requests"
        )
    if sum(extend_lens) != n:
        raise ValueError(f"{mode.name}: the requests' {sum(extend_lens)} new tokens are not the batch's {n} rows")
    if any(s != p + e for s, p, e in zip(seq_lens_cpu, prefix_lens, extend_lens)):
        raise ValueError(f"{mode.name}: sequence lengths are not prefix + new tokens")
    fb.extend_seq_lens_cpu = list(extend_lens)
    fb.extend_prefix_lens_cpu = list(prefix_lens)
    if extend_tensors is not None:
        fb.extend_seq_lens, fb.extend_prefix_lens, fb.extend_start_loc = extend_tensors
    else:
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        fb.extend_seq_lens = dev(list(extend_lens))
        fb.extend_prefix_lens = dev(list(prefix_lens))
        fb.extend_start_loc = dev(starts)
    return fb

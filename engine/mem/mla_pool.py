"""The latent KV pool of Multi-head Latent Attention (DeepSeek; docs/deepseek.md).

``MLAKVPool`` holds, per layer, ONE latent row per KV slot: ``[num_slots +
page_size, 1, latent_dim]`` with ``latent_dim = kv_lora_rank +
qk_rope_head_dim`` (the normalised compressed KV ``c`` then the RoPE'd shared
key ``k_pe``) -- not per-head keys and values.  Slots, pages, page 0 as the
padding page, ``ReqToTokenPool`` and the radix cache work exactly as with
``KVPool`` (kvship.engine.mem.pools): only what a slot holds differs.

Memory: ``bytes_per_token = num_layers * latent_dim * element_size`` (no
factor 2: keys and values are both read from the one latent row).  For
DeepSeek-V3 (61 layers, 512 + 64) that is 70,272 bytes per token in bf16 and
35,136 in FP8.

FP8 (``--kv-cache-dtype fp8_e4m3``; docs/deepseek.md, "FP8 latent cache"):
the rows are stored as ``float8_e4m3fn`` with ONE fp32 dequantization scale
per layer for the whole row (``latent_scales``, default 1.0): a store writes
``quantize_kv(x, scale)``, every reader computes ``float(e4m3) * scale``
(``read_latent`` does).  ``scales(layer)`` answers ``(s, s)`` and
``k_scales`` / ``v_scales`` are both the latent scales, so code written for
``KVPool`` (the PD layout's scale check) reads them alike.  Other dtypes keep
1.0.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvship.engine.mem.pools import dequantize_kv, is_fp8_kv, quantize_kv


class MLAKVPool:
    def __init__(
        self,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        num_layers: int,
        device: str | torch.device,
        latent_scales: Optional[Sequence[float]] = None,
    ):
        self.is_fp8 = is_fp8_kv(dtype)
        # one dequantization scale per layer for the whole latent row; fixed at construction (a captured CUDA
        # graph holds it as a constant) and part of the PD layout check
        self.latent_scales = _latent_scales(latent_scales, num_layers) if self.is_fp8 else [1.0] * num_layers
        self.k_scales = self.v_scales = self.latent_scales
        self.page_size = page_size
        self.num_slots = (num_slots // page_size) * page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        # the layout a KVPool reader sees: one "head" of latent_dim values per slot
        self.num_kv_heads = 1
        self.head_dim = self.latent_dim
        self.num_layers = num_layers
        self.device = torch.device(device)
        rows = self.num_slots + page_size
        self.kv_buffer = [
            torch.zeros((rows, 1, self.latent_dim), dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes in a pool of ``num_layers`` layers (module docstring; FP8: one byte a value)."""
        return num_layers * latent_dim * torch.empty((), dtype=dtype).element_size()

    def get_latent_buffer(self, layer_id: int) -> torch.Tensor:
        """``[num_slots + page_size, 1, latent_dim]``: ``[..., :kv_lora_rank]`` is ``c``, the rest ``k_pe``
        (as stored: over an FP8 pool, e4m3 values to multiply by ``latent_scale(layer_id)``)."""
        return self.kv_buffer[layer_id]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The keys of absorbed attention: the whole latent row."""
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The values of absorbed attention: the latent's first ``kv_lora_rank`` columns (a view)."""
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def latent_scale(self, layer_id: int) -> float:
        """The layer's dequantization scale (1.0 on a pool that is not FP8)."""
        return self.latent_scales[layer_id]

    def scales(self, layer_id: int) -> tuple[float, float]:
        """``(s, s)``: the latent row is both the keys and the values, with one scale."""
        s = self.latent_scales[layer_id]
        return s, s

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """Write new latent rows ``[n, latent_dim]`` (or ``[n, 1, latent_dim]``) at slots ``loc`` (over an FP8
        pool quantized with the layer's scale)."""
        latent = latent.reshape(-1, 1, self.latent_dim)
        if self.is_fp8 and latent.dtype != self.dtype:
            latent = quantize_kv(latent, self.latent_scales[layer_id])
        else:
            latent = latent.to(self.dtype)
        if loc.dtype != torch.int64:
            loc = loc.long()
        buf = self.kv_buffer[layer_id]
        if self.is_fp8:  # index_copy_ has no float8 kernel on every device: copy the bytes
            buf, latent = buf.view(torch.uint8), latent.view(torch.uint8)
        # index_copy_ rather than ``buf[loc] = x``: on CPU advanced-index assignment is far slower
        buf.index_copy_(0, loc, latent)

    def read_latent(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The latent rows at ``slots`` (int64) as ``[n, 1, latent_dim]`` in ``dtype``: ``float(e4m3) * scale``
        over an FP8 pool (the FP8 read of docs/quantization.md), else the stored values cast."""
        buf = self.kv_buffer[layer_id]
        if self.is_fp8:  # gather the bytes (no float8 gather kernel on every device)
            rows = buf.view(torch.uint8).index_select(0, slots).view(self.dtype)
            return dequantize_kv(rows, self.latent_scales[layer_id], dtype)
        return buf.index_select(0, slots).to(dtype)

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's latent buffer, in layer order."""
        return list(self.kv_buffer)


def _latent_scales(scales: Optional[Sequence[float]], num_layers: int) -> list[float]:
    """One positive finite scale per layer (1.0 each when none are given); ValueError naming the bad one."""
    if scales is None:
        return [1.0] * num_layers
    out = [float(x) for x in scales]
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} latent KV scales for {num_layers} layers")
    for i, x in enumerate(out):
        if not (0 < x < float("inf")):
            raise ValueError(f"layer {i}: the latent KV scale must be a positive finite number, got {x}")
    return out

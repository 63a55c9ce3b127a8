"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama uses).

The cos/sin table is computed once in float32 for positions
``0..max_position-1`` on the module's device, so a forward only indexes it
(safe under CUDA graphs).  Supported ``rope_scaling`` types: none/default,
``linear``, ``llama3``, ``freq_factors`` (GGUF ``rope_freqs``); anything else is a clear error at construction.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from kvship.common.envs import ENV
from kvship.engine.layers.fused_dispatch import cuda_fused_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: per-frequency divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)  # type: ignore[index]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    raise ValueError(f"rope_scaling type '{kind}' is not supported (supported: default, linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Optional[dict] = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.fuse_kv_store = ENV.FUSE_ROPE_KV_STORE
        self._base, self._scaling = base, scaling
        self.register_buffer("cos_sin_cache", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        """``[max_position, head_dim]``: cos half || sin half, on the current default device."""
        inv_freq = compute_inv_freq(self.head_dim, self._base, self._scaling)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def rebuild_table_(self) -> None:
        """Recompute the table where it lives (after ``Module.to_empty``: a model built on the meta device)."""
        with torch.device(self.cos_sin_cache.device):
            self.cos_sin_cache = self._table()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` by their token positions ``[T]``."""
        fused = cuda_fused_ops(q)
        if fused is not None and q.stride(-1) == 1 and k.stride(-1) == 1:  # in place, one Triton kernel
            return fused.rope_inplace(positions, q, k, self.cos_sin_cache)
        cs = self.cos_sin_cache.index_select(0, positions)
        half = self.head_dim // 2
        cos = cs[:, None, :half].to(q.dtype)
        sin = cs[:, None, half:].to(q.dtype)
        return _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        loc: torch.Tensor,
        qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
    ) -> bool:
        """Rotate ``q`` / ``k`` in place and write the rotated keys and ``v [T, Hk, D]`` into the pool buffers
        at ``loc``, all in one CUDA kernel; returns False (having done nothing) where that kernel does not apply
        (CPU, no Triton, ``KVSHIP_FUSE_ROPE_KV_STORE=0``, a layout it cannot take): the caller then rotates
        with ``forward`` and lets the attention backend store the keys and values.  ``qk_norm=(q_weight,
        k_weight, eps)``: per-head RMSNorm of q and k first, in the same kernel (Qwen3)."""
        fused = cuda_fused_ops(q)
        if fused is None or not self.fuse_kv_store:
            return False
        try:  # rope_inplace checks every layout before it launches anything
            fused.rope_inplace(positions, q, k, self.cos_sin_cache, store=(v, k_buf, v_buf, loc), qk_norm=qk_norm)
        except ValueError:
            return False
        return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

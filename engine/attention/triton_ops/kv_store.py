"""Write the new tokens' K and V into the pool in one kernel (instead of two index copies).

``store_kv(kv_pool, layer_id, loc, k, v)`` keeps ``KVPool.set_kv_buffer``'s
contract (rows ``[n, Hkv*D]`` or ``[n, Hkv, D]``, cast to the pool dtype,
written at slots ``loc``) for the plain per-layer MHA pool on CUDA with a
contiguous row layout; anything else goes through ``set_kv_buffer``.

An FP8 pool: the kernel quantizes with the layer's scales as ``quantize_kv``
does (fp32 ``x / scale`` with IEEE division, clamp to +-448, round to nearest
even), docs/quantization.md "FP8 KV cache".  ``store_kv_fp8`` also returns
the quantized rows packed (``[n, Hkv, D]`` float8), which the extend and
verify kernels read as the new tokens' K/V.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter
from kvship.engine.mem.pools import FP8_E4M3_MAX, KVPool, quantize_kv


@triton.jit
def _store_kv_kernel(
    k_buf,
    v_buf,
    loc,
    k,
    v,
    k_out,
    v_out,
    k_scale,
    v_scale,
    stride_kb,
    stride_vb,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr,
    PACKED_OUT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    pdl_enter(USE_PDL)
    slot = tl.load(loc + t).to(tl.int64)
    kv = tl.load(k + t * stride_k + offs, mask=m)
    vv = tl.load(v + t * stride_v + offs, mask=m)
    if KV_FP8:
        kq = tl.math.div_rn(kv.to(tl.float32), k_scale)
        vq = tl.math.div_rn(vv.to(tl.float32), v_scale)
        kq = tl.minimum(tl.maximum(kq, -FP8_MAX), FP8_MAX).to(k_buf.dtype.element_ty)
        vq = tl.minimum(tl.maximum(vq, -FP8_MAX), FP8_MAX).to(v_buf.dtype.element_ty)
    else:
        kq = kv.to(k_buf.dtype.element_ty)
        vq = vv.to(v_buf.dtype.element_ty)
    tl.store(k_buf + slot * stride_kb + offs, kq, mask=m)
    tl.store(v_buf + slot * stride_vb + offs, vq, mask=m)
    if PACKED_OUT:
        tl.store(k_out + t * ROW + offs, kq, mask=m)
        tl.store(v_out + t * ROW + offs, vq, mask=m)


def _plain(kv_pool: KVPool, k_buf: torch.Tensor, v_buf: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> bool:
    row = k_buf.shape[1] * k_buf.shape[2]
    return (
        type(kv_pool) is KVPool
        and k_buf.is_cuda
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
        and k2.shape[0] > 0
        and k2.shape[1] == row
        and v2.shape[1] == row
        and k2.stride(1) == 1
        and v2.stride(1) == 1
    )


def _launch(kv_pool, layer_id, loc, k2, v2, k_out: Optional[torch.Tensor], v_out: Optional[torch.Tensor]) -> None:
    k_buf = kv_pool.get_key_buffer(layer_id)
    v_buf = kv_pool.get_value_buffer(layer_id)
    row = k_buf.shape[1] * k_buf.shape[2]
    ks, vs = kv_pool.scales(layer_id)
    pdl = use_pdl(k_buf)
    _store_kv_kernel[(loc.numel(),)](
        k_buf,
        v_buf,
        loc,
        k2,
        v2,
        k_out if k_out is not None else k_buf,
        v_out if v_out is not None else v_buf,
        ks,
        vs,
        k_buf.stride(0),
        v_buf.stride(0),
        k2.stride(0),
        v2.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4 if row >= 512 else 1,
        USE_PDL=pdl,
        KV_FP8=kv_pool.is_fp8 and k2.dtype != k_buf.dtype,
        PACKED_OUT=k_out is not None,
        FP8_MAX=FP8_E4M3_MAX,
        launch_pdl=pdl,
    )


def store_kv(kv_pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv_pool.set_kv_buffer(layer_id, loc, k, v)`` in one Triton kernel where the layout allows."""
    k_buf = kv_pool.get_key_buffer(layer_id)
    v_buf = kv_pool.get_value_buffer(layer_id)
    n = loc.numel()
    k2 = k.reshape(n, -1) if n else k
    v2 = v.reshape(n, -1) if n else v
    if not _plain(kv_pool, k_buf, v_buf, k2, v2):
        kv_pool.set_kv_buffer(layer_id, loc, k, v)
        return
    _launch(kv_pool, layer_id, loc, k2, v2, None, None)


def quantize_new_kv(
    kv_pool: KVPool, layer_id: int, loc: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 pool's new K/V ``[n, Hkv, D]`` quantized with the layer's scales (what the extend and verify
    kernels read as the new tokens'), stored at ``loc`` too unless ``loc`` is None (already stored)."""
    hk, d = kv_pool.num_kv_heads, kv_pool.head_dim
    n = k.numel() // (hk * d)
    k2, v2 = k.reshape(n, hk * d), v.reshape(n, hk * d)
    k_buf, v_buf = kv_pool.get_key_buffer(layer_id), kv_pool.get_value_buffer(layer_id)
    if loc is not None and n and _plain(kv_pool, k_buf, v_buf, k2, v2):
        k_out = torch.empty((n, hk, d), dtype=k_buf.dtype, device=k.device)
        v_out = torch.empty((n, hk, d), dtype=v_buf.dtype, device=v.device)
        _launch(kv_pool, layer_id, loc, k2, v2, k_out, v_out)
        return k_out, v_out
    ks, vs = kv_pool.scales(layer_id)
    k8, v8 = quantize_kv(k2, ks).view(n, hk, d), quantize_kv(v2, vs).view(n, hk, d)
    if loc is not None:
        kv_pool.set_kv_buffer(layer_id, loc, k8, v8)
    return k8, v8

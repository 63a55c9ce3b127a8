"""Write the new tokens' K and V into the pool in one kernel (instead of two index copies).

``store_kv(kv_pool, layer_id, loc, k, v)`` keeps ``KVPool.set_kv_buffer``'s
contract (rows ``[n, Hkv*D]`` or ``[n, Hkv, D]``, cast to the pool dtype,
written at slots ``loc``) for the plain per-layer MHA pool on CUDA with a
contiguous row layout; anything else goes through ``set_kv_buffer``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter
from kvship.engine.mem.pools import KVPool


@triton.jit
def _store_kv_kernel(
    k_buf,
    v_buf,
    loc,
    k,
    v,
    stride_kb,
    stride_vb,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    pdl_enter(USE_PDL)
    slot = tl.load(loc + t).to(tl.int64)
    kv = tl.load(k + t * stride_k + offs, mask=m)
    vv = tl.load(v + t * stride_v + offs, mask=m)
    tl.store(k_buf + slot * stride_kb + offs, kv.to(k_buf.dtype.element_ty), mask=m)
    tl.store(v_buf + slot * stride_vb + offs, vv.to(v_buf.dtype.element_ty), mask=m)


def store_kv(kv_pool: KVPool, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv_pool.set_kv_buffer(layer_id, loc, k, v)`` in one Triton kernel where the layout allows."""
    k_buf = kv_pool.get_key_buffer(layer_id)
    v_buf = kv_pool.get_value_buffer(layer_id)
    n = loc.numel()
    row = k_buf.shape[1] * k_buf.shape[2]
    k2 = k.reshape(n, -1) if n else k
    v2 = v.reshape(n, -1) if n else v
    plain = (
        type(kv_pool) is KVPool
        and k_buf.is_cuda
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
        and n > 0
        and k2.shape[1] == row
        and v2.shape[1] == row
        and k2.stride(1) == 1
        and v2.stride(1) == 1
    )
    if not plain:
        kv_pool.set_kv_buffer(layer_id, loc, k, v)
        return
    pdl = use_pdl(k_buf)
    _store_kv_kernel[(n,)](
        k_buf,
        v_buf,
        loc,
        k2,
        v2,
        k_buf.stride(0),
        v_buf.stride(0),
        k2.stride(0),
        v2.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4 if row >= 512 else 1,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )

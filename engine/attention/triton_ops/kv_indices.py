"""Page-index lists built on the GPU from ``req_to_token``.

FlashInfer's paged kernels take a CSR list of page ids: request ``i`` owns
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.  With the pool's layout rule
(position ``p`` of a request lives in slot ``page * page_size + p % page_size``)
page ``j`` of a request is ``req_to_token[row, j * page_size] // page_size``,
so one Triton program per request copies every ``page_size``-th entry of its
``req_to_token`` row.  For ``page_size == 1`` pages are slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_indices_kernel(
    req_to_token, req_pool_indices, kv_lens, kv_indptr, out, stride_r2t, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    out_off = tl.load(kv_indptr + pid).to(tl.int64)
    n_tok = tl.load(kv_lens + pid).to(tl.int32)
    n_pages = (n_tok + PAGE_SIZE - 1) // PAGE_SIZE
    base = req_to_token + row * stride_r2t
    for start in range(0, n_pages, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_pages
        slot = tl.load(base + offs * PAGE_SIZE, mask=mask, other=0)
        tl.store(out + out_off + offs, (slot // PAGE_SIZE).to(out.dtype.element_ty), mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    out: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Fill ``out[kv_indptr[i] : kv_indptr[i] + ceil(kv_lens[i]/page_size)]`` with request i's page ids.

    ``req_to_token`` is the pool's ``[rows, max_context]`` int32 table;
    ``req_pool_indices`` / ``kv_lens`` are ``[bs]`` (any int dtype);
    ``kv_indptr`` is ``[bs + 1]`` on the same device.  ``out`` must hold at least
    ``kv_indptr[bs]`` entries.  Returns ``out``.  Launches one kernel, no sync.
    """
    bs = int(req_pool_indices.shape[0])
    if bs == 0:
        return out
    _kv_indices_kernel[(bs,)](
        req_to_token, req_pool_indices, kv_lens, kv_indptr, out, req_to_token.stride(0), PAGE_SIZE=page_size, BLOCK=512
    )
    return out

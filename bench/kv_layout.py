"""Our Triton decode attention over KV pools of two layouts: is an FP8 page slow to read, or slow where it lies?

The KV pool keeps a layer's keys as ``[slots, kv_heads, head_dim]`` (token-major: one token's heads side by
side).  A decode program reads one KV head of a request, so on an FP8 pool it reads 128-byte rows (head dim
128) one kv-head row apart, where a bf16 pool gives it 256-byte rows.  This times ``decode_attention`` (both
stages, the backend's split count, its default tiles), eagerly with CUDA events (``--graph``: replayed in a
CUDA graph, as a decode step runs it), on synthetic pools of the
Llama-3.1-8B attention shape (``--batch`` requests x ``--context`` tokens, 32 query heads, 8 KV heads, 128):

* ``token_major``: the pool's layout;
* ``head_major``: the same tensor viewed from a ``[kv_heads, slots, head_dim]`` buffer (a head's tokens side by
  side), which the kernel reads through its strides unchanged;

for bf16 and e4m3 pages, with each request's slots contiguous and shuffled over the pool.  Prints one row per
case (microseconds, KV bytes read per second) and writes ``kv_layout.json`` to ``--out``.  GPU only.

    python bench/kv_layout.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import cuda_time, environment, graph_time  # noqa: E402

from kvship.engine.attention.triton_ops.decode_attention import (  # noqa: E402
    MAX_KV_SPLITS,
    decode_attention,
    num_kv_splits,
)


def pool(slots: int, hkv: int, d: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A ``[slots, hkv, d]`` tensor of random values stored in ``layout``."""
    shape = (slots, hkv, d) if layout == "token_major" else (hkv, slots, d)
    t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.5).to(dtype)
    return t if layout == "token_major" else t.permute(1, 0, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="time the calls replayed in a CUDA graph, not eagerly")
    ap.add_argument("--dtypes", default="bf16,fp8", help="page dtypes to run (a profiler run takes one)")
    ap.add_argument("--layouts", default="token_major,head_major")
    ap.add_argument("--slots", default="contiguous,shuffled")
    ap.add_argument(
        "--launch",
        default="",
        help="stage-1 tile overrides to time beside the default, ';'-separated JSON objects "
        '(e.g. \'{"maxnreg": 128};{"num_warps": 8}\'; keys of decode_attention.stage1_tile)',
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kv_layout.py needs a GPU")
    h, hkv, d = 32, 8, 128
    bs, ctx = args.batch, args.context
    slots = bs * ctx + 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_kv_splits(bs, hkv, sms)
    seq = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
    rows = torch.arange(bs, device="cuda")
    contiguous = torch.arange(bs * ctx, device="cuda", dtype=torch.int32).view(bs, ctx)
    shuffled = torch.randperm(bs * ctx, device="cuda").to(torch.int32).view(bs, ctx)
    q = torch.randn(bs, h, d, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    mid_o = torch.empty(bs, h, MAX_KV_SPLITS, d, device="cuda", dtype=torch.float32)
    mid_l = torch.empty(bs, h, MAX_KV_SPLITS, device="cuda", dtype=torch.float32)
    results = []
    launches = [None] + [json.loads(x) for x in args.launch.split(";") if x.strip()]
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    layouts = [x for x in ("token_major", "head_major") if x in args.layouts.split(",")]
    orders = [x for x in ("contiguous", "shuffled") if x in args.slots.split(",")]
    for dtype in (dtypes[x] for x in args.dtypes.split(",") if x):
        outs = {}
        ref_k = ref_v = None
        for layout in layouts:
            k, v = pool(slots, hkv, d, dtype, layout), pool(slots, hkv, d, dtype, layout)
            if ref_k is None:
                ref_k, ref_v = k, v
            else:  # the same values as the first layout's pool, for the equality check below
                k.copy_(ref_k)
                v.copy_(ref_v)
            for (order, r2t), launch in (
                ((o_, contiguous if o_ == "contiguous" else shuffled), ln) for o_ in orders for ln in launches
            ):

                def call():
                    decode_attention(q, k, v, o, r2t, rows, seq, mid_o, mid_l, splits, d**-0.5, launch=launch)

                call()
                if launch is None:
                    outs[(layout, order)] = o.clone()
                s = graph_time(lambda i: call(), args.iters) if args.graph else cuda_time(call, args.iters)
                kv_bytes = bs * ctx * hkv * d * 2 * k.element_size()
                row = {
                    "kv_dtype": str(dtype).removeprefix("torch."),
                    "layout": layout,
                    "slots": order,
                    "launch": launch,
                    "splits": splits,
                    "us": round(s * 1e6, 1),
                    "kv_TBps": round(kv_bytes / s / 1e12, 2),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
            del k, v
        for order in orders if len(layouts) == 2 else ():  # the layout must not change the result
            diff = (outs[("token_major", order)].float() - outs[("head_major", order)].float()).abs().max().item()
            print(f"{dtype} {order}: max |token_major - head_major| = {diff}", flush=True)
            assert diff == 0.0, "the two layouts gave different outputs"
        del ref_k, ref_v
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_layout.json"), "w") as f:
            json.dump({"env": environment(), "args": vars(args), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()

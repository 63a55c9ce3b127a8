"""Does a weight prefetched into L2 while a latency-bound kernel runs make its matmul faster?

A batch-1 decode step runs, between its matmuls, kernels that barely touch
HBM (attention over a short context, the all-reduce, norms).  This measures,
inside CUDA graphs, for each decode-shaped projection of a model shape
(``--tp-size`` ranks' parts) and each idle time ``T`` (a one-program kernel
that spins ``T`` microseconds on the GPU's clock, standing in for those
kernels), with the weights rotated over enough copies that L2 holds none of
them:

* ``plain``: spin ``T``, then the matmul (cuBLAS ``F.linear``, and our skinny
  GEMV where it applies: ``skinny``);
* ``prefetch``: ``prefetch_l2`` of the weight (``--prefetch-mb`` caps the
  bytes), spin ``T``, the matmul, all on one stream;
* ``side``: the prefetch on a second stream beside the spin (a fork and a
  join in the graph), then the matmul.

Each row gives microseconds per iteration and what the prefetch saved.  GPU
only (the prefetch is inline PTX).  Writes ``l2_prefetch.json`` to ``--out``.

    python bench/l2_prefetch.py --shape llama3-8b --tp-size 2 --spin-us 0,5,10,20 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import environment, graph_time  # noqa: E402
from skinny_gemm import projections  # noqa: E402

from kvship.engine.layers import skinny_gemm_cuda as sg  # noqa: E402
from kvship.engine.layers.fused_dispatch import use_pdl  # noqa: E402


@triton.jit
def _spin_kernel(X, ns):
    """One program that returns after ``ns`` nanoseconds of the GPU's global timer."""
    zero = tl.load(X)
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False, pack=1
        )


# --- the prefetch: Hopper's bulk prefetch (one instruction a 64 KiB chunk, the TMA unit does the rest), or one
# ``prefetch.global.L2`` a 128-byte line before Hopper.  Under PDL it issues its prefetches, lets the next kernel
# be scheduled, then waits on ``griddepcontrol.wait`` (a kernel after it that waits on it must also have waited on
# the kernel before it).
LINE = 128  # bytes a line prefetch brings (an L2 sector group)
BULK_CHUNK = 64 << 10  # bytes one bulk prefetch instruction asks for
CHUNKS_PER_PROGRAM = 32  # bulk instructions a program issues (one per thread of its warp)
LINES_PER_PROGRAM = 1024


@triton.jit
def _l2_prefetch_kernel(
    base,  # int64: the tensor's address
    nbytes,
    CHUNK: tl.constexpr,  # bytes an instruction asks for (LINE for line prefetches)
    PER_PROGRAM: tl.constexpr,  # instructions a program issues
    BULK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    ok = (offs < nbytes).to(tl.int32)
    addr = base + offs
    if BULK:
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r,r",
            [addr, size, ok],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            "=r,l,r",
            [addr, ok],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def _bulk(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 9


def prefetch_l2(w: torch.Tensor, nbytes: Optional[int] = None, pdl: Optional[bool] = None) -> None:
    """Ask for the first ``nbytes`` (all by default) of contiguous CUDA tensor ``w`` in L2 (on an H200 the kernel
    lasted about as long as reading the bytes: 24 MiB ~10 us, docs/benchmarks.md, session 34).
    ``pdl``: launch under programmatic dependent launch (default: ``fused_dispatch.use_pdl(w)``)."""
    total = w.numel() * w.element_size()
    n = total if nbytes is None else max(0, min(int(nbytes), total))
    if n <= 0:
        return
    if pdl is None:
        pdl = use_pdl(w)
    bulk = _bulk(w.device)
    n = n // 16 * 16 if bulk else n  # a bulk prefetch moves whole 16-byte units
    chunk, per = (BULK_CHUNK, CHUNKS_PER_PROGRAM) if bulk else (LINE, LINES_PER_PROGRAM)
    grid = (triton.cdiv(n, chunk * per),)
    _l2_prefetch_kernel[grid](
        w.data_ptr(), n, CHUNK=chunk, PER_PROGRAM=per, BULK=bulk, USE_PDL=pdl, num_warps=1, launch_pdl=pdl
    )


def spin(flag: torch.Tensor, us: float) -> None:
    if us > 0:
        _spin_kernel[(1,)](flag, int(us * 1000), num_warps=1)


def run_shape(
    name: str, n: int, k: int, act: int, spins: list[float], prefetch_mb: float, l2: int
) -> list[dict[str, Any]]:
    dev = "cuda"
    wbytes = n * k * 2
    copies = max(4, -(-(4 * l2) // wbytes) + 1)  # rotate past L2 several times over
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    kin = 2 * k if act == sg.ACT_SILU_MUL else k
    x = torch.randn(1, kin, device=dev, dtype=torch.bfloat16)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    cap = None if prefetch_mb <= 0 else int(prefetch_mb * 2**20)
    side = torch.cuda.Stream()

    def cublas(i: int) -> Any:
        inp = x if act != sg.ACT_SILU_MUL else F.silu(x[:, :k]) * x[:, k:]
        return F.linear(inp, ws[i % copies])

    cfg = sg.pick_config(1, n, k) if sg.applies(x, ws[0], act) else None

    def skinny(i: int) -> Any:
        return sg.launch(x, ws[i % copies], None, torch.empty(1, n, device=dev, dtype=torch.bfloat16), act, cfg)

    mms = {"cublas": cublas}
    if cfg is not None:
        mms["skinny"] = skinny
    rows = []
    for mm_name, mm in mms.items():
        for us in spins:

            def plain(i: int, mm=mm, us=us) -> Any:
                spin(flag, us)
                return mm(i)

            def inline(i: int, mm=mm, us=us) -> Any:
                prefetch_l2(ws[i % copies], cap)
                spin(flag, us)
                return mm(i)

            def beside(i: int, mm=mm, us=us) -> Any:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch_l2(ws[i % copies], cap, pdl=False)
                spin(flag, us)
                main.wait_stream(side)
                return mm(i)

            calls = 4 * copies
            t = {k_: graph_time(f, calls) * 1e6 for k_, f in (("plain", plain), ("prefetch", inline), ("side", beside))}
            spin_alone = graph_time(lambda i, us=us: spin(flag, us), calls) * 1e6 if us > 0 else 0.0
            row = {
                "proj": name,
                "n": n,
                "k": k,
                "mb": round(wbytes / 2**20, 1),
                "matmul": mm_name,
                "spin_us": us,
                "spin_alone_us": round(spin_alone, 2),
                **{f"{k_}_us": round(v, 2) for k_, v in t.items()},
                "saved_inline_us": round(t["plain"] - t["prefetch"], 2),
                "saved_side_us": round(t["plain"] - t["side"], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--spin-us", default="0,5,10,20")
    ap.add_argument("--prefetch-mb", type=float, default=0.0, help="cap on the bytes prefetched (0: the whole weight)")
    ap.add_argument("--projs", default="qkv_proj,o_proj,gate_up_proj,down_proj")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/l2_prefetch.py needs a GPU (the prefetch is inline PTX)")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    spins = [float(s) for s in args.spin_us.split(",") if s]
    projs = projections(args.shape, args.tp_size)
    rows: list[dict[str, Any]] = []
    for name in args.projs.split(","):
        n, k, act = projs[name]
        rows += run_shape(name, n, k, act, spins, args.prefetch_mb, l2)
    result = {"env": {**environment(), "l2_bytes": l2}, "args": vars(args), "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "l2_prefetch.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

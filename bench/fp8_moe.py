"""One MoE layer's experts in bf16 against block-FP8 (w8a8, 128x128 weight blocks), side by side.

Shape (default): Qwen3-30B-A3B's layer, E=128 experts, top-8, H=2048, I=768.
For each token count M, random router logits pick the experts (the same ids
for both) and we time, in CUDA graphs rotating over ``--copies`` weight
copies (so L2 holds none of them):

* ``bf16``: ``triton_moe.fused_experts`` on bf16 experts;
* ``fp8``: ``triton_moe_fp8.fused_experts_fp8`` on the same experts quantized
  per 128x128 block (activation quantization per token-group included).

Reported per M: time, the fp8 speed-up, bytes read (the active experts'
weights, their block scales, x and the output) per second against the
measured copy bandwidth, and the fp8 output's relative error against
``fp8.moe_reference`` (fp32 quantize-dequantize) and against bf16.  Writes
``fp8_moe.json`` / ``fp8_moe.md`` to ``--out``.  ``--gemv-sweep M`` also times
the decode GEMV kernels' launch configs at M tokens (gate/up's tile, warps and
stages with down's default, then down's with the best of those), fastest
first, each checked against the reference.

    python bench/fp8_moe.py --out /tmp/out
    python bench/fp8_moe.py --m 1 --gemv-sweep 1 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import copy_bandwidth, environment, graph_time  # noqa: E402

from kvship.engine.layers.moe.topk import select_experts  # noqa: E402
from kvship.engine.layers.moe.triton_moe import fused_experts  # noqa: E402
from kvship.engine.layers.moe.triton_moe_fp8 import GEMV_CONFIG_FP8, fused_experts_fp8  # noqa: E402
from kvship.engine.layers.quantization import fp8_math as fm  # noqa: E402
from kvship.engine.layers.quantization.fp8 import moe_reference  # noqa: E402

BLOCK = (128, 128)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, R, C]`` (R a multiple of 128) -> e4m3 ``[E, R, C]`` and block scales ``[E, R/128, ceil(C/128)]``."""
    e, r, c = w.shape
    q, s = fm.quantize_blocks(w.reshape(e * r, c), BLOCK)
    return q.view(e, r, c), s.view(e, r // BLOCK[0], -1).contiguous()


def make_weights(args) -> tuple[list, list]:
    e, h, inter = args.experts, args.hidden, args.inter
    bf16, fp8 = [], []
    for c in range(args.copies):
        g = torch.Generator(device="cuda").manual_seed(100 + c)
        w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
        bf16.append((w13, w2))
        (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
        fp8.append((q13, s13, q2, s2))
    return bf16, fp8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_m(m: int, args, bf16: list, fp8: list, copy_bw: float) -> dict:
    e, k, h, inter = args.experts, args.topk, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    topk_w, ids = select_experts(torch.randn(m, e, device="cuda", generator=g), k, renormalize=True)
    active = int(torch.unique(ids).numel())
    copies = len(bf16)
    out_bf16 = fused_experts(x, *bf16[0], topk_w, ids)
    out_fp8 = fused_experts_fp8(x, *fp8[0], BLOCK, topk_w, ids)
    ref = moe_reference(x, *fp8[0], BLOCK, topk_w, ids)
    t_bf16 = graph_time(lambda i: fused_experts(x, *bf16[i % copies], topk_w, ids), calls=2 * copies)
    t_fp8 = graph_time(lambda i: fused_experts_fp8(x, *fp8[i % copies], BLOCK, topk_w, ids), calls=2 * copies)
    io = 2 * m * h * 2  # x in, y out (bf16)
    scales = 4 * (2 * inter // 128 * (h // 128) + (h // 128) * (inter // 128))
    bytes_bf16 = active * 3 * h * inter * 2 + io
    bytes_fp8 = active * (3 * h * inter + scales) + io
    return {
        "m": m,
        "active_experts": active,
        "bf16_us": t_bf16 * 1e6,
        "fp8_us": t_fp8 * 1e6,
        "speedup": t_bf16 / t_fp8,
        "bf16_bw_frac": bytes_bf16 / t_bf16 / copy_bw,
        "fp8_bw_frac": bytes_fp8 / t_fp8 / copy_bw,
        "fp8_tflops": 2 * m * k * 3 * h * inter / t_fp8 / 1e12,
        "fp8_rel_err_vs_reference": _rel(out_fp8, ref),
        "fp8_rel_err_vs_bf16": _rel(out_fp8, out_bf16),
    }


def gemv_sweep(m: int, args, fp8: list) -> list[dict]:
    """The decode GEMVs' launch configs at ``m`` tokens (module docstring): microseconds, fastest first."""
    e, k, h = args.experts, args.topk, args.hidden
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    topk_w, ids = select_experts(torch.randn(m, e, device="cuda", generator=g), k, renormalize=True)
    ref = moe_reference(x, *fp8[0], BLOCK, topk_w, ids)
    copies = len(fp8)
    rows: list[dict] = []

    def run(gemv: dict) -> dict:
        cfg = {"gemv": gemv}
        try:
            out = fused_experts_fp8(x, *fp8[0], BLOCK, topk_w, ids, config=cfg)
            t = graph_time(lambda i: fused_experts_fp8(x, *fp8[i % copies], BLOCK, topk_w, ids, config=cfg),
                           calls=2 * copies)  # fmt: skip
        except Exception as exc:  # a config that does not compile or fit: named, skipped
            row = {**gemv, "error": str(exc)[:120]}
        else:
            row = {**gemv, "us": t * 1e6, "rel_err_vs_reference": _rel(out, ref)}
        rows.append(row)
        return row

    base = dict(GEMV_CONFIG_FP8)
    for mbn, mw, mst in ((64, 4, 3), (64, 4, 4), (64, 4, 6), (64, 8, 4), (128, 4, 4), (128, 8, 4), (128, 8, 3)):
        run({**base, "MMA_BLOCK_N": mbn, "mma_num_warps": mw, "mma_num_stages": mst})  # gate/up on the tensor cores
    base["MMA_BLOCK_N"] = 0
    for bn in (4, 8, 16, 32):
        for w in (2, 4, 8):
            for st in (2, 3, 4):
                run({**base, "BLOCK_N": bn, "num_warps": w, "num_stages": st})
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else base
    best = {kk: best[kk] for kk in base}
    for unroll in (2, 4):  # gate/up K-blocks an iteration
        for bn in (4, 8, 16):
            for st in (2, 3, 4):
                run({**best, "K_UNROLL": unroll, "BLOCK_N": bn, "num_stages": st})
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else best
    best = {kk: best[kk] for kk in base}
    for dbn in (2, 4, 8, 16):
        for dw in (2, 4, 8):
            for du in (1, 2, 3):  # down K-blocks an iteration
                run({**best, "DOWN_BLOCK_N": dbn, "down_num_warps": dw, "DOWN_K_UNROLL": du})
    rows.sort(key=lambda r: r.get("us", float("inf")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 4096])
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--out", default=".")
    p.add_argument("--gemv-sweep", type=int, nargs="*", default=[], help="token counts to sweep the GEMV configs at")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bf16, fp8 = make_weights(args)
    copy_bw = copy_bandwidth()
    rows = [bench_m(m, args, bf16, fp8, copy_bw) for m in args.m]
    result = {"environment": environment(), "copy_bandwidth": copy_bw, "shape": vars(args), "rows": rows}
    for m in args.gemv_sweep:
        sweep = gemv_sweep(m, args, fp8)
        result[f"gemv_sweep_m{m}"] = sweep
        print(f"GEMV sweep at M={m} (default {GEMV_CONFIG_FP8}):")
        for r in sweep[:10]:
            print("  ", json.dumps(r))
    with open(os.path.join(args.out, "fp8_moe.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        f"MoE layer E={args.experts} top-{args.topk} H={args.hidden} I={args.inter} on {result['environment']['gpu']}"
        f" (copy bandwidth {copy_bw / 1e12:.2f} TB/s)",
        "",
        "| M | active | bf16 us | fp8 us | fp8 speed-up | bf16 % copy BW | fp8 % copy BW | fp8 TFLOP/s | "
        "fp8 err vs ref | fp8 vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['m']} | {r['active_experts']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['speedup']:.2f}x | "
            f"{100 * r['bf16_bw_frac']:.0f}% | {100 * r['fp8_bw_frac']:.0f}% | {r['fp8_tflops']:.0f} | "
            f"{r['fp8_rel_err_vs_reference']:.1e} | {r['fp8_rel_err_vs_bf16']:.1e} |"
        )
    text = "\n".join(lines)
    with open(os.path.join(args.out, "fp8_moe.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

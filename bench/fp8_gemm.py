"""FP8 linear kernels against bf16 at the Llama-3.1-8B projection shapes, side by side in one run.

For every projection (q/k/v 4096->6144, o 4096->4096, gate/up 4096->28672, down 14336->4096):

* decode rows M in ``--gemv-ms`` (default 1,2,4,8,16): bf16 ``F.linear`` (cuBLAS), bf16 through our skinny
  GEMV dispatch (``skinny_gemm_cuda``), FP8 per-channel (per-token activations) and FP8 block-128
  (per-token-group activations) through ``fp8_kernels.fp8_linear`` (what ``Fp8Method.apply`` runs),
  each timed inside a CUDA graph of back-to-back calls that rotate over enough weight copies that L2 holds none
  of them; bytes = weight bytes + scale bytes, as GB/s and as a fraction of the measured copy bandwidth
  (bytes read + written of a large device copy, ``decode_latency.copy_bandwidth``);
* ``--sweep``: every candidate decode config of the FP8 kernels per (shape, M, format) (``--sweep swap``: the
  default and the tiles with the weight rows as the MMA's left operand only), the best printed as a
  ``TUNED`` entry for ``fp8_kernels.py``;
* prefill rows M in ``--gemm-ms`` (default 256,1024,4096,8192): bf16 ``F.linear``, FP8 per-channel
  (quantize + ``torch._scaled_mm`` row-wise, and the Triton GEMM), FP8 block-128 (quantize + the product's
  own path: cuBLAS ``scaled_mm`` with block-wise scales where ``probe_block_scaled_mm`` found it, and the
  Triton block-scaled GEMM, with ``--gemm-configs`` candidates), in TFLOP/s and as a fraction of the measured
  FP8 peak (``torch._scaled_mm``, tensor-wise scales, 8192^3, bf16 out).

Writes ``fp8_gemm.json`` and ``fp8_gemm.md`` under ``--out``.

    python bench/fp8_gemm.py --out /tmp/out --sweep        # on a GPU
    python bench/fp8_gemm.py --out /tmp/out --gemm-ms "" --sweep swap   # the swapped decode tiles only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import copy_bandwidth, cuda_time, environment, graph_time  # noqa: E402

from kvship.engine.layers import skinny_gemm_cuda as sg  # noqa: E402
from kvship.engine.layers.quantization import fp8_kernels as fk  # noqa: E402
from kvship.engine.layers.quantization import fp8_math as fm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_FLUSH_BYTES = 300 << 20  # rotate over at least this many weight bytes (H100/H200 L2: 50-60 MiB)
FORMATS = {"fp8_channel": ("channel", fk.ACT_TOKEN), "fp8_block": ("block", fk.ACT_GROUP)}


def _weights(n: int, k: int, fmt: str, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out.append(fm.quantize_blocks(w, (128, 128)) if fmt == "block" else fm.quantize_channel(w))
        del w
    return out


def _copies(nbytes: int) -> int:
    return max(2, math.ceil(L2_FLUSH_BYTES / nbytes))


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _gemv_time(fn: Callable[[int], Any], copies: int) -> float:
    return graph_time(fn, calls=max(copies, 16))


def swap_candidates(m: int) -> list[fk.Fp8Config]:
    """The tiles with the weight rows as the MMA's left operand (``Fp8Config.swap``): 64 or 128 weight rows a
    program (Hopper's warpgroup MMA takes 64-row left operands), the activation rows as its right operand."""
    bm = min(max(fk.bucket(m), 16), 64)
    out = []
    for bn, warps in ((64, 4), (128, 4), (128, 8)):
        for split in (1, 2, 4):
            for dot in (True, False):
                out.append(
                    fk.Fp8Config(
                        "mma", bm, bn, 128, num_warps=warps, num_stages=4, fp8_dot=dot, split_k=split, swap=True
                    )
                )
    out.append(fk.Fp8Config("mma", bm, 64, 128, num_warps=4, num_stages=6, fp8_dot=True, split_k=4, swap=True))
    return out


def candidates(m: int, which: str = "all") -> list[fk.Fp8Config]:
    """Decode configs worth timing at ``m`` rows: the skinny tensor-core tiles over weight rows per program,
    pipeline stages and K split (more programs in flight for narrow or long-K projections), one CUDA-core
    GEMV for reference (measured 2-9x slower on an H200, docs/quantization.md), and the swapped tiles.
    ``which="swap"``: the default config and the swapped tiles only."""
    if which == "swap":
        return [fk.pick_config(m, 4096, 4096, fk.ACT_GROUP)] + swap_candidates(m)
    return _plain_candidates(m) + swap_candidates(m)


def _plain_candidates(m: int) -> list[fk.Fp8Config]:
    if m > fk.GEMV_MAX_M:  # decode batches past the skinny tiles (fk.mid_config's regime)
        bm = min(fk.bucket(m), 64)
        out = [fk.Fp8Config("mma", 16, 64, 128, num_warps=4, num_stages=4, split_k=4)]
        for bn in (64, 128):
            for split in (1, 2, 4):
                for dot in (False, True):
                    out.append(fk.Fp8Config("mma", bm, bn, 128, num_warps=4, num_stages=4, fp8_dot=dot, split_k=split))
        out.append(fk.Fp8Config("mma", bm, 64, 128, num_warps=4, num_stages=3, fp8_dot=True, split_k=2))
        out.append(fk.Fp8Config("mma", bm, 32, 128, num_warps=4, num_stages=4, fp8_dot=True, split_k=2))
        return out
    out = [fk.Fp8Config("gemv", fk.bucket(m), 8, 512, num_warps=4 if m <= 2 else 8, preq=True)]
    for bn in (16, 32, 64):
        for stages in (4, 6):
            for split in (1, 2, 4):
                out.append(fk.Fp8Config("mma", 16, bn, 128, num_warps=4, num_stages=stages, split_k=split))
    out.append(fk.Fp8Config("mma", 16, 128, 128, num_warps=4, num_stages=4))
    out.append(fk.Fp8Config("mma", 16, 32, 128, num_warps=4, num_stages=4, fp8_dot=True))
    return out


def gemv_rows(ms: list[int], hbm: float, sweep: str) -> tuple[list[dict], list[str]]:
    rows, tuned = [], []
    for name, (n, k) in SHAPES.items():
        bf_w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(_copies(2 * n * k))]
        fp8 = {f: _weights(n, k, fmt, _copies(n * k)) for f, (fmt, _) in FORMATS.items()}
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            bf_bytes = 2 * n * k
            t = _gemv_time(lambda i: F.linear(x, bf_w[i % len(bf_w)]), len(bf_w))
            row["bf16_cublas_us"] = t * 1e6
            row["bf16_cublas_pct_bw"] = 100 * bf_bytes / t / hbm

            def skinny(i):
                w = bf_w[i % len(bf_w)]
                y = sg.linear(x, w)
                return y if y is not None else F.linear(x, w)

            t = _gemv_time(skinny, len(bf_w))
            row["bf16_best_us"] = min(t * 1e6, row["bf16_cublas_us"])
            for f, (fmt, act) in FORMATS.items():
                ws = fp8[f]
                block = (128, 128) if fmt == "block" else None
                nbytes = _nbytes(*ws[0])

                def run(i, cfg=None, ws=ws, block=block, act=act):
                    q, s = ws[i % len(ws)]
                    return fk.fp8_linear(x, q, s, act, block, 128, None, None, cfg=cfg)

                if m > fk.GEMV_MAX_M:  # the prefill path these rows took before fk.MID_MAX_M

                    def gemm(i, ws=ws, block=block, act=act):
                        q, s = ws[i % len(ws)]
                        if block is None:
                            xq, xs = fk.quantize_act(x, act, 128)
                            y = fk.scaled_mm_rowwise(xq, xs, q, s, x.dtype)
                            if y is not None:
                                return y
                        return fk.fp8_linear(x, q, s, act, block, 128, None, None, cfg=fk.GEMM_CONFIG)

                    tg = _gemv_time(gemm, len(ws))
                    row[f"{f}_gemm_us"] = tg * 1e6
                xq, xs = fk.quantize_act(x, act, 128)

                def run_q(i, ws=ws, block=block, act=act, xq=xq, xs=xs):  # the matmul alone, input quantized
                    q, s = ws[i % len(ws)]
                    return fk.launch_q(xq, xs, q, s, act, block, 128, None, x.dtype, fk.pick_config(m, n, k, act))

                if m <= fk.MID_MAX_M:
                    tq = _gemv_time(run_q, len(ws))
                    row[f"{f}_mm_us"] = tq * 1e6
                    row[f"{f}_mm_pct_bw"] = 100 * nbytes / tq / hbm
                t = _gemv_time(run, len(ws))
                row[f"{f}_us"] = t * 1e6
                row[f"{f}_gbs"] = nbytes / t / 1e9
                row[f"{f}_pct_bw"] = 100 * nbytes / t / hbm
                row[f"{f}_speedup_vs_bf16"] = row["bf16_best_us"] / row[f"{f}_us"]
                if sweep:
                    best = None
                    for cfg in candidates(m, sweep):
                        try:
                            tc = _gemv_time(lambda i, cfg=cfg: run(i, cfg), len(ws))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                            print(f"  {name} m={m} {f} {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
                            continue
                        if best is None or tc < best[0]:
                            best = (tc, cfg)
                    if best is not None:
                        row[f"{f}_best_us"] = best[0] * 1e6
                        row[f"{f}_best_pct_bw"] = 100 * nbytes / best[0] / hbm
                        row[f"{f}_best_cfg"] = repr(best[1])
                        tuned.append(f"({n}, {k}, {fk.bucket(m)}, {act}): {best[1]!r},  # {best[0] * 1e6:.1f} us")
            rows.append(row)
            print(_fmt_gemv(row), flush=True)
        del bf_w, fp8
        torch.cuda.empty_cache()
    return rows, tuned


def _fmt_gemv(r: dict) -> str:
    parts = [f"{r['shape']:8s} M={r['m']:<3d} bf16 {r['bf16_best_us']:7.1f}us ({r['bf16_cublas_pct_bw']:4.0f}% cuBLAS)"]
    for f in FORMATS:
        s = f" | {f} {r[f + '_us']:7.1f}us {r[f + '_pct_bw']:4.0f}% x{r[f + '_speedup_vs_bf16']:.2f}"
        if f + "_mm_us" in r:
            s += f" (matmul alone {r[f + '_mm_us']:.1f}us {r[f + '_mm_pct_bw']:.0f}%)"
        if f + "_gemm_us" in r:
            s += f" (prefill path {r[f + '_gemm_us']:.1f}us)"
        if f + "_best_us" in r:
            s += f" (best {r[f + '_best_us']:.1f}us {r[f + '_best_pct_bw']:.0f}%)"
        parts.append(s)
    return "".join(parts)


def fp8_peak() -> float:
    """FLOP/s of ``torch._scaled_mm`` on 8192^3 e4m3 with tensor-wise scales, bf16 out."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(fm.FP8)
    b = torch.randn(n, n, device="cuda").to(fm.FP8)
    one = torch.ones((), device="cuda")
    t = cuda_time(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=10)
    return 2 * n**3 / t


def gemm_rows(ms: list[int], peak: float, configs: list[fk.Fp8Config]) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        bf_w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        chan = fm.quantize_channel(bf_w)
        blk = fm.quantize_blocks(bf_w, (128, 128))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            row["bf16_tflops"] = flop / cuda_time(lambda: F.linear(x, bf_w), iters=10) / 1e12
            row["fp8_channel_tflops"] = flop / cuda_time(lambda: fk.fp8_linear(x, *chan, fk.ACT_TOKEN), iters=10) / 1e12
            row["fp8_channel_triton_tflops"] = (
                flop / cuda_time(lambda: fk.fp8_linear(x, *chan, fk.ACT_TOKEN, cfg=fk.GEMM_CONFIG), iters=10) / 1e12
            )
            best = (0.0, None)
            for cfg in configs:
                try:
                    t = cuda_time(lambda cfg=cfg: fk.fp8_linear(x, *blk, fk.ACT_GROUP, (128, 128), cfg=cfg), iters=10)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} m={m} block {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
                if flop / t > best[0]:
                    best = (flop / t, cfg)
            t = cuda_time(lambda: fk.fp8_linear(x, *blk, fk.ACT_GROUP, (128, 128)), iters=10)
            row["fp8_block_tflops"] = flop / t / 1e12  # the product's own path (cuBLAS where the probe found it)
            t = cuda_time(lambda: fk.fp8_linear(x, *blk, fk.ACT_GROUP, (128, 128), cfg=fk.GEMM_CONFIG), iters=10)
            row["fp8_block_triton_tflops"] = flop / t / 1e12
            row["fp8_block_best_tflops"] = best[0] / 1e12
            row["fp8_block_best_cfg"] = repr(best[1])
            for f in ("bf16", "fp8_channel", "fp8_block", "fp8_block_triton", "fp8_block_best"):
                row[f"{f}_pct_peak"] = 100 * row[f"{f}_tflops"] * 1e12 / peak
            row["fp8_channel_speedup_vs_bf16"] = row["fp8_channel_tflops"] / row["bf16_tflops"]
            row["fp8_block_speedup_vs_bf16"] = row["fp8_block_tflops"] / row["bf16_tflops"]
            rows.append(row)
            print(
                f"{name:8s} M={m:<5d} bf16 {row['bf16_tflops']:6.0f} | ch {row['fp8_channel_tflops']:6.0f} "
                f"(triton {row['fp8_channel_triton_tflops']:.0f}) x{row['fp8_channel_speedup_vs_bf16']:.2f} | "
                f"block {row['fp8_block_tflops']:6.0f} ({row['fp8_block_pct_peak']:.0f}% peak; triton "
                f"{row['fp8_block_triton_tflops']:.0f}) "
                f"best {row['fp8_block_best_tflops']:.0f} {best[1]} TFLOP/s",
                flush=True,
            )
        del bf_w, chan, blk
        torch.cuda.empty_cache()
    return rows


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"# FP8 linear kernels ({env['gpu']}, torch {env['torch']}, triton {env['triton']})",
        "",
        f"copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s (read + written); FP8 peak "
        f"(torch._scaled_mm 8192^3) {res['fp8_peak'] / 1e12:.0f} TFLOP/s",
        "",
        "## Decode (CUDA graph, weights rotated past L2): us, % of copy bandwidth",
        "",
        "| shape | M | bf16 best us | fp8 channel us | % bw | x bf16 | fp8 block us | % bw | x bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["gemv"]:
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['bf16_best_us']:.1f} | {r['fp8_channel_us']:.1f} | "
            f"{r['fp8_channel_pct_bw']:.0f}% | {r['fp8_channel_speedup_vs_bf16']:.2f} | {r['fp8_block_us']:.1f} | "
            f"{r['fp8_block_pct_bw']:.0f}% | {r['fp8_block_speedup_vs_bf16']:.2f} |"
            + (
                f" prefill path: channel {r['fp8_channel_gemm_us']:.1f} us, block {r['fp8_block_gemm_us']:.1f} us |"
                if "fp8_block_gemm_us" in r
                else ""
            )
        )
    lines += [
        "",
        "## Prefill GEMM: TFLOP/s (% of FP8 peak)",
        "",
        f"| shape | M | bf16 | fp8 channel | fp8 block (cuBLAS: {res.get('block_scaled_mm')}) | fp8 block Triton | "
        "fp8 block best Triton config |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["gemm"]:
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['bf16_tflops']:.0f} | {r['fp8_channel_tflops']:.0f} "
            f"({r['fp8_channel_pct_peak']:.0f}%) | {r['fp8_block_tflops']:.0f} ({r['fp8_block_pct_peak']:.0f}%) | "
            f"{r['fp8_block_triton_tflops']:.0f} ({r['fp8_block_triton_pct_peak']:.0f}%) | "
            f"{r['fp8_block_best_tflops']:.0f} {r['fp8_block_best_cfg']} |"
        )
    if res.get("tuned"):
        lines += ["", "## Best decode configs (TUNED entries)", "", "```"] + res["tuned"] + ["```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemv-ms", default="1,2,4,8,16")
    ap.add_argument("--gemm-ms", default="256,1024,4096,8192")
    ap.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        default="",
        choices=["", "all", "swap"],
        help="time every candidate decode config (swap: the default and the swapped tiles only)",
    )
    ap.add_argument(
        "--gemm-configs",
        default="128x128x8x4,128x128x8x3,128x128x4x3,64x128x4x4,256x128x8x3,128x256x8x3,64x256x4x3,128x128x4x4",
        help="block GEMM tiles BLOCK_MxBLOCK_NxWARPSxSTAGES",
    )
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "fp8_gemm.py needs a CUDA GPU (the kernels' CPU checks are tests/test_quantization_fp8_kernels.py)"
        )
    for s in list(SHAPES):
        if s not in args.shapes.split(","):
            del SHAPES[s]
    configs = []
    for spec in filter(None, args.gemm_configs.split(",")):
        bm, bn, w, st = (int(v) for v in spec.split("x"))
        configs.append(fk.Fp8Config("mma", bm, bn, 128, num_warps=w, num_stages=st, fp8_dot=True))
    res: dict[str, Any] = {"environment": environment()}
    res["copy_bw"] = copy_bandwidth()
    res["fp8_peak"] = fp8_peak()
    res["block_scaled_mm"] = fk.probe_block_scaled_mm(torch.device("cuda"))  # block-128 GEMMs through cuBLAS
    print(f"copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, FP8 peak {res['fp8_peak'] / 1e12:.0f} TFLOP/s", flush=True)
    ms = [int(v) for v in args.gemv_ms.split(",") if v]
    res["gemv"], res["tuned"] = gemv_rows(ms, res["copy_bw"], args.sweep) if ms else ([], [])
    gm = [int(v) for v in args.gemm_ms.split(",") if v]
    res["gemm"] = gemm_rows(gm, res["fp8_peak"], configs) if gm else []
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "fp8_gemm.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

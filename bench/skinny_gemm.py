"""Decode-shaped projections: our Triton skinny GEMMs against cuBLAS, timed inside CUDA graphs.

For every projection of a model shape (q/k/v, o, gate/up, down with SwiGLU
fused into its input, lm_head) and every row count M (= decode batch), one run
measures side by side:

* ``cublas``: ``F.linear`` on the checkpoint-layout weight (what the layers
  called before), for down_proj plus the separate SiLU-and-mul kernel;
* ``cublas_kmajor``: ``F.linear`` on a K-major copy of the weight;
* every candidate tile config of ``kvship.engine.layers.skinny_gemm_cuda``
  (each checked against a float32 reference first), and the config that
  ``pick_config`` chooses (``auto``).

Calls are captured back to back in a CUDA graph (as in a decode step, where
launch cost is the graph's) and rotate over enough weight copies that L2 holds
none of them.  Bandwidth = weight bytes / time, as a fraction of the measured
copy bandwidth.  Writes ``skinny_gemm.json`` / ``skinny_gemm.md`` to ``--out``.

    python bench/skinny_gemm.py --out /tmp/out            # on a GPU
    python bench/skinny_gemm.py --norm --ms 1,2,4,8       # the RMSNorm inside the GEMV vs norm + matmul
    TRITON_INTERPRET=1 python bench/skinny_gemm.py --smoke  # CPU: checks the candidates only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import SHAPES, copy_bandwidth, environment, graph_time  # noqa: E402

from kvship.engine.layers import skinny_gemm_cuda as sg  # noqa: E402
from kvship.engine.layers.fused_ops_cuda import silu_and_mul  # noqa: E402


def projections(shape: str, tp: int = 1) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, act) for one layer of ``shape`` plus its lm_head; ``tp``: one tensor-parallel rank's part
    (column-parallel N and row-parallel K divided by ``tp``, docs/parallel.md)."""
    c = SHAPES[shape]
    if "kv_lora_rank" in c:
        if tp != 1:
            raise SystemExit("--tp-size applies to the dense (GQA) shapes")
        return _mla_projections(c)
    d = c["head_dim"]
    q, kv = c["num_attention_heads"] * d // tp, max(1, c["num_key_value_heads"] // tp) * d
    h, i = c["hidden_size"], c["intermediate_size"] // tp
    out = {
        "qkv_proj": (q + 2 * kv, h, sg.ACT_NONE),
        "o_proj": (h, q, sg.ACT_NONE),
        "gate_up_proj": (2 * i, h, sg.ACT_NONE),
        "down_proj": (h, i, sg.ACT_SILU_MUL),
        "lm_head": (c["vocab_size"] // tp, h, sg.ACT_NONE),
    }
    if "num_experts" in c:  # MoE shapes: the router (its experts run the fused-MoE kernels, bench/moe_layer.py)
        out["router"] = (c["num_experts"], h, sg.ACT_NONE)
    return out


def _mla_projections(c: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """The dense projections of a DeepSeek (MLA) layer: the fused q / kv_a projection, q_b (q LoRA), o, the shared
    experts and the first dense layers' MLP, plus the lm_head (the routed experts run the fused-MoE kernels)."""
    h, heads, rope = c["hidden_size"], c["num_attention_heads"], c["qk_rope_head_dim"]
    q_head = c["qk_nope_head_dim"] + rope
    q_lora = c.get("q_lora_rank")
    shared = c.get("n_shared_experts", 0) * c["moe_intermediate_size"]
    out = {
        "qkv_a_proj": ((q_lora or heads * q_head) + c["kv_lora_rank"] + rope, h, sg.ACT_NONE),
        "o_proj": (h, heads * c["v_head_dim"], sg.ACT_NONE),
        "dense_gate_up": (2 * c["intermediate_size"], h, sg.ACT_NONE),
        "dense_down": (h, c["intermediate_size"], sg.ACT_SILU_MUL),
        "lm_head": (c["vocab_size"], h, sg.ACT_NONE),
    }
    if q_lora:
        out["q_b_proj"] = (heads * q_head, q_lora, sg.ACT_NONE)
    if shared:
        out["shared_gate_up"] = (2 * shared, h, sg.ACT_NONE)
        out["shared_down"] = (h, shared, sg.ACT_SILU_MUL)
    return out


def candidates(m: int, wide: bool = False) -> list[sg.SkinnyConfig]:
    """Tile configs worth timing for ``m`` rows."""
    out: list[sg.SkinnyConfig] = []
    if m <= sg.GEMV_MAX_M:
        bm = 1 << (m - 1).bit_length()
        bns = (1, 2, 4, 8, 16) if bm == 1 else (2, 4, 8)
        bks = (512, 1024, 2048, 4096) if bm == 1 else (256, 512, 1024)
        warps = (4, 8) if bm == 1 else (8,)
        for w in warps:
            for bn in bns:
                for bk in bks:
                    per_thread = bm * bn * bk // (32 * w)
                    if 8 <= per_thread <= 64:
                        out.append(sg.SkinnyConfig(False, bm, bn, bk, num_warps=w))
    if m >= 8:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        for bn in (16, 32, 64):
            for bk in (128, 256):
                out.append(sg.SkinnyConfig(True, bm, bn, bk, num_warps=4, num_stages=4))
        if wide:  # deeper pipelines and more warps per tile
            for bn in (32, 64):
                for bk in (128, 256):
                    for warps in (4, 8):
                        for stages in (3, 5, 6):
                            out.append(sg.SkinnyConfig(True, bm, bn, bk, num_warps=warps, num_stages=stages))
    return out


WIDE = False


def reference(x: torch.Tensor, w: torch.Tensor, act: int) -> torch.Tensor:
    if act == sg.ACT_SILU_MUL:
        x = silu_and_mul(x) if x.is_cuda else F.silu(x[:, : w.shape[1]]) * x[:, w.shape[1] :]
    return x.float() @ w.float().t()


def bench_case(
    name: str, n: int, k: int, act: int, m: int, hbm: float, dev: torch.device, dtype: torch.dtype, smoke: bool
) -> dict[str, Any]:
    wbytes = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = 1 if smoke else max(2, -(-(256 << 20) // wbytes))  # > 5x the H100's 50 MB L2
    gen = torch.Generator(device=dev).manual_seed(n * 31 + k)
    ws = [torch.randn(n, k, dtype=dtype, device=dev, generator=gen) * 0.02 for _ in range(copies)]
    xk = 2 * k if act == sg.ACT_SILU_MUL else k
    x = torch.randn(m, xk, dtype=dtype, device=dev, generator=gen)
    y = torch.empty(m, n, dtype=dtype, device=dev)
    ref = reference(x, ws[0], act)
    row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, "weight_mb": wbytes / 1e6, "configs": []}

    def frac(t: float) -> float:
        return wbytes / t / hbm

    calls = 0 if smoke else max(8, min(64, int(4e-3 / max(wbytes / hbm, 1e-7))))
    if not smoke:
        xin = silu_and_mul(x) if act == sg.ACT_SILU_MUL else x
        t = graph_time(lambda i: F.linear(xin, ws[i % copies]), calls)
        row["cublas_us"], row["cublas_frac"] = t * 1e6, frac(t)
        if act == sg.ACT_SILU_MUL:
            t = graph_time(lambda i: F.linear(silu_and_mul(x), ws[i % copies]), calls)
            row["cublas_with_act_us"], row["cublas_with_act_frac"] = t * 1e6, frac(t)
        wts = [w.t().contiguous().t() for w in ws[: max(2, copies // 2)]] if copies > 1 else []
        if wts:
            t = graph_time(lambda i: F.linear(xin, wts[i % len(wts)]), calls)
            row["cublas_kmajor_us"], row["cublas_kmajor_frac"] = t * 1e6, frac(t)
            del wts
    auto = sg.pick_config(m, n, k)  # None: the table says cuBLAS
    row["auto"] = str(auto)
    cands = candidates(m, WIDE)
    if auto is not None and auto not in cands:
        cands.append(auto)
    best: Optional[tuple[float, sg.SkinnyConfig]] = None
    for cfg in cands:
        entry: dict[str, Any] = {"cfg": cfg.__dict__.copy()}
        try:
            t0 = time.perf_counter()
            y.fill_(float("nan"))
            sg.launch(x, ws[0], None, y, act, cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            entry["compile_s"] = time.perf_counter() - t0
            entry["rel_err"] = err
            if not err < 1e-2:
                entry["error"] = f"wrong result: relative error {err:.3g}"
            elif not smoke:
                t = graph_time(lambda i, c=cfg: sg.launch(x, ws[i % copies], None, y, act, c), calls)
                entry["us"], entry["frac"] = t * 1e6, frac(t)
                if best is None or t < best[0]:
                    best = (t, cfg)
                if cfg == auto:
                    row["auto_us"], row["auto_frac"] = t * 1e6, frac(t)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["configs"].append(entry)
    if best is not None:
        row["best_us"], row["best_frac"], row["best_cfg"] = best[0] * 1e6, frac(best[0]), best[1].__dict__.copy()
        base = row.get("cublas_with_act_us", row.get("cublas_us"))
        row["cublas_over_best"] = base / row["best_us"] if base else None
    del ws, x, y
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


NORMED = ("qkv_proj", "gate_up_proj", "router")  # projections whose input is a pre-norm block's RMSNorm


def bench_norm_case(name: str, n: int, k: int, m: int, hbm: float) -> dict[str, Any]:
    """``--norm``: the RMSNorm kernel (with the residual add) then the matmul as the layers pick it, against
    ``norm_linear`` (the norm inside the GEMV's input) with each GEMV tile config, inside CUDA graphs."""
    from kvship.engine.layers.fused_ops_cuda import rmsnorm

    dev, dtype = torch.device("cuda"), torch.bfloat16
    wbytes = n * k * 2
    copies = max(2, -(-(256 << 20) // wbytes))
    gen = torch.Generator(device=dev).manual_seed(n * 17 + k)
    ws = [torch.randn(n, k, dtype=dtype, device=dev, generator=gen) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=dtype, device=dev, generator=gen)
    res = torch.randn(m, k, dtype=dtype, device=dev, generator=gen)
    nw = torch.rand(k, dtype=dtype, device=dev, generator=gen) + 0.5
    calls = max(8, min(64, int(4e-3 / max(wbytes / hbm, 1e-7))))

    def apart(i: int) -> torch.Tensor:
        h, _ = rmsnorm(x, nw, 1e-6, res)
        y = sg.linear(h, ws[i % copies])
        return y if y is not None else F.linear(h, ws[i % copies])

    ref = apart(0).float()
    row: dict[str, Any] = {"layer": name, "n": n, "k": k, "m": m, "configs": []}
    t = graph_time(apart, calls)
    row["apart_us"], row["apart_frac"] = t * 1e6, wbytes / t / hbm
    auto = sg.pick_norm_config(m, n, k)
    row["auto"] = str(auto)
    cands = [c for c in candidates(m) if not c.mma]
    bm = 1 << (m - 1).bit_length()
    for bn in (4, 8, 16):  # wider programs read the input fewer times
        for bk in (256, 512, 1024):
            if bm * bn * bk // 128 <= 64:
                cands.append(sg.SkinnyConfig(False, bm, bn, bk, num_warps=4))
    best = None
    for cfg in dict.fromkeys(cands):
        entry: dict[str, Any] = {"cfg": cfg.__dict__.copy()}
        try:
            out = sg.norm_linear(x, res, nw, 1e-6, ws[0], cfg=cfg)
            err = ((out[0].float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                entry["error"] = f"wrong result: relative error {err:.3g}"
            else:
                t = graph_time(lambda i, c=cfg: sg.norm_linear(x, res, nw, 1e-6, ws[i % copies], cfg=c), calls)
                entry["us"] = t * 1e6
                if best is None or t < best[0]:
                    best = (t, cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["configs"].append(entry)
    if best is not None:
        row["best_us"], row["best_cfg"] = best[0] * 1e6, best[1].__dict__.copy()
        row["apart_over_best"] = row["apart_us"] / row["best_us"]
    del ws
    torch.cuda.empty_cache()
    return row


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"GPU: {res['env'].get('gpu')}, torch {res['env'].get('torch')}, triton {res['env'].get('triton')}; "
        f"copy bandwidth {res['hbm_TBps']:.2f} TB/s; shape {res['shape']}; times are per call inside a CUDA "
        "graph; % = weight bytes / time / copy bandwidth.",
        "",
        "| layer | M | cuBLAS us (%) | cuBLAS K-major us (%) | ours, best us (%) | ours, auto us (%) | "
        "cuBLAS / best | best config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:

        def cell(key: str) -> str:
            us = r.get(key + "_us")
            return f"{us:.1f} ({100 * r[key + '_frac']:.0f}%)" if us is not None else "-"

        cub = "cublas_with_act" if "cublas_with_act_us" in r else "cublas"
        bc = r.get("best_cfg") or {}
        cfg = (
            (
                f"{'mma' if bc.get('mma') else 'gemv'} m{bc.get('block_m')} n{bc.get('block_n')} k{bc.get('block_k')} "
                f"w{bc.get('num_warps')} s{bc.get('num_stages')}"
            )
            if bc
            else "-"
        )
        ratio = r.get("cublas_over_best")
        lines.append(
            f"| {r['layer']} | {r['m']} | {cell(cub)} | {cell('cublas_kmajor')} | {cell('best')} | "
            f"{cell('auto')} | {f'{ratio:.2f}x' if ratio else '-'} | {cfg} |"
        )
    lines.append("")
    lines.append(
        "down_proj's cuBLAS column includes the separate SiLU-and-mul kernel; ours computes it in the matmul's input."
    )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--ms", default="1,2,4,8,16,32,64", help="row counts (decode batch sizes)")
    ap.add_argument("--layers", default="", help="comma list of projections (default: all)")
    ap.add_argument("--tp-size", type=int, default=1, help="time one tensor-parallel rank's projections")
    ap.add_argument("--wide", action="store_true", help="also time deeper-pipelined / 8-warp tensor-core tiles")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter works)")
    ap.add_argument(
        "--norm", action="store_true", help="time the RMSNorm inside the GEMV (norm_linear) against norm + matmul"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.ms.split(",") if v]
    global WIDE
    WIDE = a.wide
    if a.smoke:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        projs = {"tiny_qkv": (96, 64, sg.ACT_NONE), "tiny_down": (64, 160, sg.ACT_SILU_MUL)}
        hbm = 1.0
        env: dict[str, Any] = {"device": str(dev)}
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        projs = projections(a.shape, a.tp_size)
        hbm = copy_bandwidth()
        env = environment()
    if a.layers:
        projs = {k: v for k, v in projs.items() if k in a.layers.split(",")}
    res: dict[str, Any] = {"env": env, "shape": a.shape, "hbm_TBps": hbm / 1e12, "rows": []}
    t0 = time.time()
    if a.norm:
        for name, (n, k, _act) in projs.items():
            if name not in NORMED:
                continue
            for m in [m for m in ms if m <= sg.GEMV_MAX_M]:
                row = bench_norm_case(name, n, k, m, hbm)
                res["rows"].append(row)
                bc = row.get("best_cfg") or {}
                print(
                    f"{name:13s} m={m}: norm + matmul {row['apart_us']:7.1f} us, norm inside the GEMV best "
                    f"{row.get('best_us', float('nan')):7.1f} us (n{bc.get('block_n')} k{bc.get('block_k')} "
                    f"w{bc.get('num_warps')}), auto {row['auto']}",
                    flush=True,
                )
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "skinny_norm.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    for name, (n, k, act) in projs.items():
        for m in ms:
            if a.smoke:
                # the candidate tiles are sized for real shapes; shrink them to the tiny ones
                row = {"layer": name, "m": m, "configs": []}
                for cfg in candidates(m):
                    small = sg.SkinnyConfig(
                        cfg.mma, cfg.block_m, min(cfg.block_n, 16), min(cfg.block_k, 64), cfg.num_warps, cfg.num_stages
                    )
                    x = torch.randn(m, 2 * k if act else k, dtype=dtype, device=dev)
                    w = torch.randn(n, k, dtype=dtype, device=dev)
                    y = sg.launch(x, w, None, torch.empty(m, n, dtype=dtype, device=dev), act, small)
                    ref = reference(x, w, act)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    row["configs"].append({"cfg": small.__dict__.copy(), "rel_err": err})
                    if not err < 1e-3:
                        print(f"FAIL {name} m={m} {small}: relative error {err:.3g}")
                        return 1
                print(f"{name} m={m}: {len(row['configs'])} configs correct")
                res["rows"].append(row)
                continue
            row = bench_case(name, n, k, act, m, hbm, dev, dtype, a.smoke)
            if row.get("auto_us") is None and "cublas_us" in row:  # the table picks cuBLAS here
                row["auto_us"] = row.get("cublas_with_act_us", row["cublas_us"])
                row["auto_frac"] = row.get("cublas_with_act_frac", row["cublas_frac"])
            res["rows"].append(row)
            print(
                f"[{time.time() - t0:6.1f}s] {name:13s} m={m:3d} cublas {row.get('cublas_us', 0):8.1f}us "
                f"({100 * row.get('cublas_frac', 0):3.0f}%)  kmajor {row.get('cublas_kmajor_us', 0):8.1f}us  "
                f"best {row.get('best_us', 0):8.1f}us ({100 * row.get('best_frac', 0):3.0f}%) "
                f"{row.get('best_cfg')}  auto {row.get('auto_us', 0):8.1f}us",
                flush=True,
            )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "skinny_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)
    if not a.smoke:
        md = markdown(res)
        with open(os.path.join(a.out, "skinny_gemm.md"), "w") as f:
            f.write(md)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

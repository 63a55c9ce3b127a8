"""Weight prefetch into L2 beside latency-bound kernels: does a GEMV that follows run faster?

docs/gpu.md, "Weight prefetch into L2".  Three measurements on one GPU (CUDA
graphs, CUDA events, medians):

1. ``prefetch``: the prefetch kernel alone over 1 GiB (both modes: Hopper's bulk
   prefetch per 16 KiB and one ``prefetch.global.L2`` per 128-byte line), its
   rate against a device copy's.
2. ``gemv``: a GEMV of each shape with cold L2 (a 1 GiB buffer read between
   replays), and right after its whole weight was prefetched (prefetch joined
   first): the most a prefetch can give that GEMV.
3. ``layers``: ``--layers`` simulated decoder layers of ``--shape`` at
   ``--tp-size`` (each its own weights: no L2 reuse between layers) as batch-1
   decode runs them: a spin of ``--norm-us`` (the input norm with the
   all-reduce it meets), the qkv GEMV, a spin of ``--attn-us`` (RoPE and
   attention), the o GEMV, a spin of ``--norm-us``, gate/up, down (SwiGLU in
   the GEMV's input).  The spins are one-thread kernels (``torch.cuda._sleep``)
   that leave HBM idle as the real latency-bound kernels do.  The same chain is
   timed without prefetch and with ``l2_prefetch.plan_windows`` regions issued on
   a side stream at each window, for each ``--budgets`` pair (norm MiB, attention
   MiB): ratio = without / with.

    python bench/l2_prefetch.py --shape llama3-8b --tp-size 2 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

import torch

SHAPES = {
    # hidden, q heads, kv heads, head dim, intermediate
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "qwen3-8b": (4096, 32, 8, 128, 12288),
    "llama3-70b": (8192, 64, 8, 128, 28672),
}


def _time_graph(fn: Callable[[], Any], rounds: int, before: Callable[[], Any] | None = None) -> float:
    """Milliseconds of one replay of ``fn`` captured in a graph (median of ``rounds``); ``before`` runs
    untimed ahead of each replay (an L2 flush)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = []
    for _ in range(rounds):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    out.sort()
    return out[len(out) // 2]


def _cycles_per_us() -> float:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(2_000_000)
    b.record()
    b.synchronize()
    return 2_000_000 / (a.elapsed_time(b) * 1e3)


def bench_prefetch(rounds: int) -> list[dict[str, Any]]:
    from kvship.engine.layers import l2_prefetch_cuda as pc

    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    rows = []
    copy_ms = _time_graph(lambda: dst.copy_(buf), rounds)
    rows.append({"what": "copy 1 GiB (read + write)", "ms": copy_ms, "GBps": 2 * buf.numel() / copy_ms / 1e6})
    for mode, name in ((pc.MODE_BULK, "bulk"), (pc.MODE_LINES, "lines")):
        ms = _time_graph(lambda m=mode: pc.prefetch_bytes(buf, 0, buf.numel(), m), rounds)
        rows.append({"what": f"prefetch 1 GiB ({name})", "ms": ms, "GBps": buf.numel() / ms / 1e6})
    return rows


def _gemv(x: torch.Tensor, w: torch.Tensor, act: int = 0) -> torch.Tensor:
    from kvship.engine.layers import skinny_gemm_cuda as sk

    y = sk.linear(x, w, None, act)
    if y is None:  # cuBLAS picked for this shape
        if act:
            g, u = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(g) * u
        y = torch.nn.functional.linear(x, w)
    return y


def layer_weights(shape: str, tp: int, layers: int) -> list[list[torch.Tensor]]:
    h, qh, kvh, hd, inter = SHAPES[shape]
    dt = torch.bfloat16
    out = []
    for _ in range(layers):
        qkv = torch.randn((qh + 2 * kvh) * hd // tp, h, dtype=dt, device="cuda") * 0.02
        o = torch.randn(h, qh * hd // tp, dtype=dt, device="cuda") * 0.02
        gu = torch.randn(2 * inter // tp, h, dtype=dt, device="cuda") * 0.02
        down = torch.randn(h, inter // tp, dtype=dt, device="cuda") * 0.02
        out.append([qkv, o, gu, down])
    return out


def bench_gemv(shape: str, tp: int, rounds: int) -> list[dict[str, Any]]:
    """Each GEMV after an L2 flush, then after each way of warming L2 with its weight first (outside the timed
    replay): running the same GEMV once (its own loads), a bulk prefetch, a per-line prefetch, a bulk prefetch
    followed by a 50 us spin (its fills surely landed)."""
    from kvship.engine.layers import l2_prefetch_cuda as pc

    flush = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    cyc = _cycles_per_us()
    ws = layer_weights(shape, tp, 1)[0]
    rows = []
    for name, w, act in zip(("qkv", "o", "gate_up", "down"), ws, (0, 0, 0, 1)):
        k = w.shape[1] * (2 if act else 1)
        x = torch.randn(1, k, dtype=w.dtype, device="cuda")
        nbytes = w.numel() * w.element_size()
        warmers: dict[str, Callable[[], Any]] = {
            "cold": lambda: None,
            "after_itself": lambda: _gemv(x, w, act),
            "after_bulk": lambda: pc.prefetch_bytes(w, 0, nbytes, pc.MODE_BULK),
            "after_lines": lambda: pc.prefetch_bytes(w, 0, nbytes, pc.MODE_LINES),
            "after_bulk_50us": lambda: (
                pc.prefetch_bytes(w, 0, nbytes, pc.MODE_BULK),
                torch.cuda._sleep(int(50 * cyc)),
            ),
        }
        row: dict[str, Any] = {"gemv": name, "shape": list(w.shape), "MiB": nbytes / 2**20}
        for label, warm in warmers.items():

            def before(warm=warm) -> None:
                flush.add_(1)
                warm()
                torch.cuda.synchronize()

            row[f"{label}_us"] = _time_graph(lambda: _gemv(x, w, act), rounds, before=before) * 1e3
        rows.append(row)
    return rows


def bench_layers(
    shape: str, tp: int, layers: int, norm_us: float, attn_us: float, budgets: list[tuple[float, float]], rounds: int
) -> list[dict[str, Any]]:
    from kvship.engine.layers.l2_prefetch import MiB, plan_windows
    from kvship.engine.layers.l2_prefetch_cuda import L2Prefetcher

    cyc = _cycles_per_us()
    ws = layer_weights(shape, tp, layers)
    h = ws[0][1].shape[0]
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    pf = L2Prefetcher(torch.device("cuda"))

    def chain(plans: list[list[list]] | None) -> Callable[[], None]:
        def run() -> None:
            y = x
            for li, (qkv, o, gu, down) in enumerate(ws):
                p = plans[li] if plans else None
                if p:
                    pf.issue(p[0])
                torch.cuda._sleep(int(norm_us * cyc))
                a = _gemv(y, qkv)
                if p:
                    pf.issue(p[1])
                torch.cuda._sleep(int(attn_us * cyc))
                b = _gemv(a[:, : o.shape[1]].contiguous(), o)
                if p:
                    pf.issue(p[2])
                torch.cuda._sleep(int(norm_us * cyc))
                c = _gemv(b, gu)
                y = _gemv(c, down, act=1)
            pf.join()

        return run

    # the spins alone (no GEMV): the chain's latency-bound part
    def spins() -> None:
        for _ in ws:
            torch.cuda._sleep(int(norm_us * cyc))
            torch.cuda._sleep(int(attn_us * cyc))
            torch.cuda._sleep(int(norm_us * cyc))

    rows = [{"variant": "spins only", "ms": _time_graph(spins, rounds)}]
    base = _time_graph(chain(None), rounds)
    rows.append({"variant": "no prefetch", "ms": base, "ratio": 1.0})
    for norm_mb, attn_mb in budgets:
        plans = [
            plan_windows(w, [(0, int(norm_mb * MiB)), (1, int(attn_mb * MiB)), (2, int(norm_mb * MiB))]) for w in ws
        ]
        ms = _time_graph(chain(plans), rounds)
        rows.append({"variant": f"prefetch norm {norm_mb:g} MiB, attn {attn_mb:g} MiB", "ms": ms, "ratio": base / ms})
    base2 = _time_graph(chain(None), rounds)
    rows.append({"variant": "no prefetch (again)", "ms": base2, "ratio": base / base2})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tp-size", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--norm-us", type=float, default=5.5)
    ap.add_argument("--attn-us", type=float, default=12.0)
    ap.add_argument("--budgets", default="8:16,16:32,16:48,24:32,0:32,16:0")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = [tuple(float(v) for v in b.split(":")) for b in args.budgets.split(",")]
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    result["prefetch"] = bench_prefetch(args.rounds)
    for r in result["prefetch"]:
        print(f"{r['what']:<32} {r['ms']:8.3f} ms {r['GBps']:8.0f} GB/s")
    for tp in args.tp_size:
        g = bench_gemv(args.shape, tp, args.rounds)
        result[f"gemv_tp{tp}"] = g
        for r in g:
            times = "  ".join(f"{k[:-3]} {v:6.1f}" for k, v in r.items() if k.endswith("_us"))
            print(f"tp{tp} {r['gemv']:<8} {r['MiB']:7.1f} MiB  us: {times}")
        if args.skip_layers:
            continue
        lay = bench_layers(args.shape, tp, args.layers, args.norm_us, args.attn_us, budgets, args.rounds)
        result[f"layers_tp{tp}"] = lay
        for r in lay:
            ratio = f"  x{r['ratio']:.3f}" if "ratio" in r else ""
            print(f"tp{tp} {args.layers} layers {r['variant']:<40} {r['ms']:8.3f} ms{ratio}")
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"l2_prefetch_{args.shape}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""MLA tree-verify attention: the single-pass absorbed kernel against the split-KV one (docs/deepseek.md, "Triton
extend and tree-verify kernels"; issue 34).

For each model shape (``v2-lite``: DeepSeek-V2-Lite, 16 heads; ``v3``: one DeepSeek-V3 layer, 128 heads; both
``kv_lora_rank`` 512, rope 64), batch (``--batch-sizes``), verify tokens per request (``--tokens``) and cached
context (``--contexts``), ``mla_extend_absorbed`` (engine/attention/mla_triton_extend.py) over one layer's latent
pool, every request's draft tokens under a random tree mask (TARGET_VERIFY), run

* ``single``: the single-pass kernel (``num_splits=1``), what every verify ran before;
* ``split``: the split-KV kernel and its merge at the split count the backend picks for a verify graph of that
  batch (``graph_extend_splits``: padded batch, tokens, heads and SM count; static scratch, as under graphs);
  where that count is 1 the backend keeps the single pass, and the row says so (``split`` = ``single``).
  ``--sweep`` also times every split count of 2, 4, 8 and 16.

Each is timed as ``--calls`` launches captured in one CUDA graph (as in a verify graph), median replay over 7
rounds (bench/decode_latency.py's ``graph_time``).  Reported per row: microseconds, the ratio single / split
(> 1: the split kernel is faster), the bandwidth achieved on the latent bytes the attention must read once
(``bs x (context + tokens) x 576 x element size``) and its fraction of a device-to-device copy's bandwidth
measured in the same run, and how far the two outputs are apart (max |split - single| / max |single|; the
split kernel multiplies in the queries' dtype, bf16 here, the single pass in float32 / TF32, so about 1e-2 is
expected; a row above ``--tolerance`` fails the run after the JSON is written).

    python bench/mla_verify.py --out DIR          # everything above on a GPU (well under a minute on an H200)
    python bench/mla_verify.py --reduced --out DIR  # tiny shapes under Triton's interpreter on a CPU: a self-check

Writes ``mla_verify.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Callable

import torch

# decode_latency's CUDA timers (graph_time, copy_bandwidth) when run from anywhere
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {"v2-lite": 16, "v3": 128}  # query heads of one MLA layer (no tensor parallelism)
KV_LORA_RANK, ROPE_DIM = 512, 64
SOFTMAX_DIM = 192  # qk_nope_head_dim + qk_rope_head_dim of both models: the softmax scale's 1/sqrt
REDUCED = dict(kv_lora_rank=32, rope_dim=16, contexts=[40, 200], batch_sizes=[1, 2], tokens=[1, 4])


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench_results", help="folder for mla_verify.json (default bench_results)")
    p.add_argument("--models", default="v2-lite,v3", help=f"comma list of {', '.join(MODELS)} (default both)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="requests per verify (default 1,8)")
    p.add_argument(
        "--tokens", type=_ints, default=None, help="verify (draft tree) tokens per request (default 1,2,4,8)"
    )
    p.add_argument("--contexts", type=_ints, default=None, help="cached context per request (default 1024,8192,32768)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16", help="latent pool dtype (default bf16)")
    p.add_argument("--calls", type=int, default=20, help="kernel launches per timed CUDA graph (default 20)")
    p.add_argument("--sweep", action="store_true", help="also time split counts 2, 4, 8 and 16 per row")
    p.add_argument("--tolerance", type=float, default=3e-2, help="max |split - single| / max |single| (default 3e-2)")
    p.add_argument("--reduced", action="store_true", help="tiny shapes; on a CPU under Triton's interpreter")
    return p.parse_args(argv)


def tree_masks(g: torch.Generator, bs: int, k: int) -> torch.Tensor:
    """``bs`` random draft trees of ``k`` nodes (node ``i``'s parent a random earlier node), packed ``[bs*k*k]``
    uint8 ancestor-or-self masks as ``extend_meta`` builds them."""
    out = []
    for _ in range(bs):
        m = torch.eye(k, dtype=torch.bool)
        for i in range(1, k):
            parent = int(torch.randint(0, i, (1,), generator=g))
            m[i] |= m[parent]
        out.append(m.reshape(-1))
    return torch.cat(out).to(torch.uint8)


def timer(device: torch.device, calls: int) -> Callable[[Callable[[], Any]], float]:
    """Seconds per call: CUDA-graph replays (``graph_time``) on a GPU, the median wall time of 3 calls elsewhere."""
    if device.type == "cuda":
        from decode_latency import graph_time

        return lambda fn: graph_time(lambda i: fn(), calls=calls)

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    return wall


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.reduced:
            raise SystemExit("bench/mla_verify.py needs a CUDA GPU (or --reduced on a CPU, under Triton's interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from kvship.engine.attention.mla_triton import MAX_GRAPH_SPLITS, device_sm_count, graph_extend_splits
    from kvship.engine.attention.mla_triton_extend import absorbed_programs, mla_extend_absorbed, split_scratch_size

    device = torch.device("cuda" if cuda else "cpu")
    r, p = (REDUCED["kv_lora_rank"], REDUCED["rope_dim"]) if args.reduced else (KV_LORA_RANK, ROPE_DIM)
    batch_sizes = args.batch_sizes or (REDUCED["batch_sizes"] if args.reduced else [1, 8])
    tokens = args.tokens or (REDUCED["tokens"] if args.reduced else [1, 2, 4, 8])
    contexts = args.contexts or (REDUCED["contexts"] if args.reduced else [1024, 8192, 32768])
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}: one of {', '.join(MODELS)}")
    qdt = torch.bfloat16 if cuda else torch.float32
    fp8 = args.kv_dtype == "fp8_e4m3"
    kv_scale = 0.05 if fp8 else 1.0
    sms = device_sm_count(device)
    time_it = timer(device, args.calls)
    copy_bw = None
    if cuda:
        from decode_latency import copy_bandwidth

        copy_bw = copy_bandwidth(1.0)
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + written)", flush=True)

    max_bs, max_k, max_ctx = max(batch_sizes), max(tokens), max(contexts)
    per_req = max_ctx + max_k
    g = torch.Generator().manual_seed(0)  # the trees
    torch.manual_seed(0)  # the latent rows and queries
    # one layer's latent pool: request b's positions at slots 1 + b * per_req ... (slot 0: padding)
    latent = torch.randn((1 + max_bs * per_req, 1, r + p), device=device, dtype=qdt)
    if fp8:
        latent = (latent / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    elem = latent.element_size()
    r2t = (1 + torch.arange(max_bs * per_req, device=device, dtype=torch.int32)).view(max_bs, per_req)
    scale = SOFTMAX_DIM**-0.5
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for model in models:
        heads = MODELS[model]
        for bs in batch_sizes:
            for k in tokens:
                q = torch.randn((bs * k, heads, r + p), device=device, dtype=qdt)
                mask = tree_masks(g, bs, k).to(device)
                mask_starts = (torch.arange(bs, device=device, dtype=torch.int64)) * (k * k)
                ext = torch.full((bs,), k, dtype=torch.int32, device=device)
                starts = torch.arange(bs, dtype=torch.int32, device=device) * k
                rpi = torch.arange(bs, dtype=torch.int64, device=device)
                splits = graph_extend_splits(bs, k, heads, sms)
                counts = sorted({splits} | ({2, 4, 8, 16} if args.sweep else set()))
                counts = [s for s in counts if s <= MAX_GRAPH_SPLITS]
                n_out, n_lse = split_scratch_size(bs * k, heads, max(counts), r)
                scratch = (
                    torch.empty(n_out, dtype=torch.float32, device=device),
                    torch.empty(n_lse, dtype=torch.float32, device=device),
                )
                for ctx in contexts:
                    pre = torch.full((bs,), ctx, dtype=torch.int32, device=device)

                    def call(s: int) -> torch.Tensor:
                        return mla_extend_absorbed(
                            q, latent, r2t, rpi, pre, ext, starts, k, r, scale,
                            tree_mask=mask, mask_starts=mask_starts, kv_scale=kv_scale, num_splits=s,
                            scratch=scratch if s > 1 else None,
                        )  # fmt: skip

                    single_out = call(1).float()
                    t_single = time_it(lambda: call(1))
                    read = bs * (ctx + k) * (r + p) * elem
                    row: dict[str, Any] = {
                        "model": model,
                        "heads": heads,
                        "bs": bs,
                        "tokens": k,
                        "ctx": ctx,
                        "programs": absorbed_programs(bs, heads, k),
                        "splits": splits,
                        "single_us": t_single * 1e6,
                        "single_GBps": read / t_single / 1e9,
                    }
                    timed: dict[int, float] = {1: t_single}
                    worst = 0.0
                    for s in counts:
                        if s == 1:
                            continue
                        got = call(s).float()
                        diff = ((got - single_out).abs().max() / single_out.abs().max().clamp_min(1e-6)).item()
                        worst = max(worst, diff)
                        timed[s] = time_it(lambda s=s: call(s))
                    t_split = timed[splits]
                    row.update(
                        {
                            "split_us": t_split * 1e6,
                            "split_GBps": read / t_split / 1e9,
                            "speedup": t_single / t_split,
                            "max_rel_diff": worst,
                            "agree": worst <= args.tolerance,
                        }
                    )
                    if copy_bw:
                        row["single_of_copy_bw"] = read / t_single / copy_bw
                        row["split_of_copy_bw"] = read / t_split / copy_bw
                    if args.sweep:
                        row["sweep_us"] = {str(s): t * 1e6 for s, t in sorted(timed.items())}
                    rows.append(row)
                    print(
                        f"{model:8s} bs {bs:2d} k {k:2d} ctx {ctx:6d}: single {row['single_us']:9.1f} us "
                        f"({row['single_GBps']:7.1f} GB/s)  split x{splits:<2d} {row['split_us']:9.1f} us "
                        f"({row['split_GBps']:7.1f} GB/s)  {row['speedup']:5.2f}x  diff {worst:.1e}",
                        flush=True,
                    )
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or 'unknown'}), interpreter",
        "sms": sms,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "kv_dtype": args.kv_dtype,
        "query_dtype": str(qdt).removeprefix("torch."),
        "kv_lora_rank": r,
        "rope_dim": p,
        "calls_per_graph": args.calls,
        "copy_GBps": copy_bw / 1e9 if copy_bw else None,
        "seconds": time.perf_counter() - t_start,
    }
    return {"env": env, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mla_verify.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {path} ({len(res['rows'])} rows, {res['env']['seconds']:.1f} s)")
    bad = [r for r in res["rows"] if not r["agree"]]
    if bad:
        raise SystemExit(f"{len(bad)} rows where the split kernel's output is off the single pass's: {bad[:3]}")
    return res


if __name__ == "__main__":
    main()

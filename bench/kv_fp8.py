"""FP8 KV cache against bf16 KV, side by side in one run (docs/quantization.md, "FP8 KV cache"; issue 31).

For each KV dtype (``auto`` = bf16, ``fp8_e4m3``) one ``ModelRunner`` on the GPU at a model shape of
bench/decode_latency.py (default the Llama-3.1-8B shape, ``--load-format dummy``), the same
``--mem-fraction-static``, CUDA graphs on:

* **tokens that fit the pool**: ``max_total_tokens`` as the runner sized it from the free memory (no
  ``--max-total-tokens``), and the ratio FP8 / bf16;
* **decode throughput at batch ``--batch`` x ``--context``**: every request's context is laid out in the pool
  (its slots written into ``req_to_token``; decode speed does not depend on the values), then ``--steps`` decode
  steps (CUDA-graph replays) are timed with CUDA events; output tokens per second and the ratio;
* **one layer's decode attention alone** on that batch (the backend's ``forward_decode``, eager): microseconds
  and the KV bytes it must read per second;
* with ``--sweep`` (triton rows): our Triton decode kernel over its tiles and split counts, fastest first.

``--attention-backend`` takes a comma list: every backend runs each of ``--kv-dtypes``, and the ratios are
against the fastest bf16 row.

    python bench/kv_fp8.py                          # Llama-3.1-8B shape, batch 32 at 8k context, flashinfer
    python bench/kv_fp8.py --attention-backend flashinfer,triton --json out.json --append-md out.md
    python bench/kv_fp8.py --attention-backend triton --kv-dtypes fp8_e4m3 --sweep
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_latency import cuda_time, write_model_dir  # noqa: E402  (bench/ is not a package)

from kvship.engine.config import ServerArgs  # noqa: E402
from kvship.engine.forward_batch import ForwardMode, build_forward_batch  # noqa: E402
from kvship.engine.model_runner import ModelRunner  # noqa: E402

logger = logging.getLogger("kv_fp8")


def lay_out_contexts(runner: ModelRunner, bs: int, context: int) -> tuple[list[int], list[int]]:
    """``bs`` request rows whose first ``context`` positions hold slots of the pool; (rows, last slots)."""
    rows, last = [], []
    for _ in range(bs):
        row = runner.req_to_token_pool.alloc()
        slots = runner.allocator.alloc(context)
        if row is None or slots is None:
            raise RuntimeError(f"the pool of {runner.max_total_tokens} tokens cannot hold {bs} x {context}")
        runner.req_to_token_pool.write(row, 0, slots)
        rows.append(row)
        last.append(int(slots[-1]))
    return rows, last


def decode_throughput(
    runner: ModelRunner, bs: int, context: int, steps: int, warmup: int = 3, sweep: bool = False
) -> dict:
    rows, last = lay_out_contexts(runner, bs, context)
    dev = runner.device
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(warmup + steps):  # every step's batch built (and its slots allocated) before timing
        seq = [context + i + 1] * bs
        locs = runner.allocator.alloc_decode(seq, last)
        assert locs is not None
        last = locs.tolist()
        for r, s in zip(rows, last):
            runner.req_to_token_pool.write(r, context + i, torch.tensor([s]))
        batches.append(
            build_forward_batch(
                ForwardMode.DECODE,
                input_ids=torch.randint(3, vocab, (bs,), generator=gen).tolist(),
                positions=[context + i] * bs,
                out_cache_loc=locs,
                req_pool_indices=rows,
                seq_lens=seq,
                seq_lens_cpu=seq,
                req_to_token_pool=runner.req_to_token_pool,
                kv_pool=runner.kv_pool,
                attn_backend=runner.attn_backend,
                device=dev,
            )
        )
    cgr = runner.cuda_graph_runner
    replays = cgr.replays if cgr is not None else 0
    for fb in batches[:warmup]:
        runner.forward(fb)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fb in batches[warmup:]:
        runner.forward(fb)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    out = {
        "step_ms": ms,
        "tok_s": bs * 1000.0 / ms,
        "graph_replays": (cgr.replays - replays) if cgr is not None else 0,
    }
    out.update(attention_alone(runner, batches[-1], steps))
    if sweep and runner.server_args.attention_backend == "triton":
        out["sweep"] = triton_decode_sweep(runner, batches[-1], steps)
    return out


def triton_decode_sweep(runner: ModelRunner, fb, iters: int) -> list[dict]:
    """Our Triton decode kernel (``decode_attention``, two stages) on layer 0 of the laid-out batch over
    splits x keys per iteration x (warps, stages): microseconds and KV TB/s of each, fastest first."""
    from kvship.engine.attention.triton_ops.decode_attention import MAX_KV_SPLITS, decode_attention

    mc = runner.model_config
    h, hk, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    bs, dev = fb.batch_size, runner.device
    kbuf, vbuf = runner.kv_pool.get_key_buffer(0), runner.kv_pool.get_value_buffer(0)
    q = torch.randn(bs, h, d, dtype=torch.bfloat16, device=dev)
    o = torch.empty_like(q)
    mid_out = torch.empty((bs, h, MAX_KV_SPLITS, d), dtype=torch.float32, device=dev)
    mid_lse = torch.empty((bs, h, MAX_KV_SPLITS), dtype=torch.float32, device=dev)
    r2t = runner.req_to_token_pool.req_to_token
    kv_bytes = sum(fb.seq_lens_cpu) * hk * d * 2 * kbuf.element_size()
    rows = []
    fp8 = kbuf.dtype == torch.float8_e4m3fn
    # products on an FP8 pool: in the model dtype, in fp16, in fp16 with the pages read as int32 words
    products = ({"dot_f16": False}, {"dot_f16": True}, {"dot_f16": True, "words": True}) if fp8 else ({},)
    tiles = [
        {"block_n": n, "num_warps": w, "num_stages": st, **prod}
        for n in (32, 64, 128)
        for w, st in ((4, 2), (4, 3), (8, 2), (8, 3))
        for prod in products
    ]
    for cfg in tiles:
        for splits in (4, 8, 16):

            def call():
                decode_attention(
                    q, kbuf, vbuf, o, r2t, fb.req_pool_indices, fb.seq_lens, mid_out, mid_lse, splits,
                    d**-0.5, launch=cfg,
                )  # fmt: skip

            try:
                call()
                torch.cuda.synchronize()
            except Exception as e:  # a tile that does not fit shared memory: skipped, named
                rows.append({**cfg, "splits": splits, "error": str(e)[:120]})
                continue
            s = cuda_time(call, iters)
            rows.append({**cfg, "splits": splits, "us": s * 1e6, "kv_TBps": kv_bytes / s / 1e12})
    rows.sort(key=lambda r: r.get("us", float("inf")))
    for r in rows[:12]:
        logger.info("sweep %s", r)
    return rows


def attention_alone(runner: ModelRunner, fb, iters: int) -> dict:
    """One layer's decode attention on the last step's batch, eagerly, timed with CUDA events: microseconds
    and the KV bytes it must read (every request's context, K and V of every KV head) per second."""
    from kvship.engine.attention.base import AttentionLayerSpec

    mc = runner.model_config
    h, hk, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    bs = fb.batch_size
    dev = runner.device
    spec = AttentionLayerSpec(0, h, hk, d, d**-0.5)
    q = torch.randn(bs, h * d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(bs, hk * d, dtype=torch.bfloat16, device=dev)
    backend = runner.attn_backend
    backend.init_forward_metadata(fb)
    s = cuda_time(lambda: backend.forward_decode(q, k, k, spec, fb, save_kv_cache=False), iters)
    kv_bytes = sum(fb.seq_lens_cpu) * hk * d * 2 * runner.kv_pool.get_key_buffer(0).element_size()
    return {"attention_layer_us": s * 1e6, "attention_kv_TBps": kv_bytes / s / 1e12}


def run_one(model_dir: str, kv_dtype: str, backend: str, args: argparse.Namespace) -> dict:
    sa = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        attention_backend=backend,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=max(args.batch, 64),  # the pool cap (4 contexts a row) stays above the memory
        context_length=args.context + args.steps + 64,
        cuda_graph_bs=[args.batch],
        cuda_graph_max_bs=args.batch,
        page_size=args.page_size,
    )
    t0 = time.perf_counter()
    runner = ModelRunner(sa)
    res = {
        "kv_cache_dtype": kv_dtype,
        "backend": backend,
        "pool_dtype": str(runner.kv_pool.dtype).removeprefix("torch."),
        "pool_tokens": runner.max_total_tokens,
        "kv_bytes_per_token": runner._bytes_per_token(),
        "setup_s": time.perf_counter() - t0,
    }
    res.update(decode_throughput(runner, args.batch, args.context, args.steps, sweep=args.sweep))
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    logger.info("%s", res)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument(
        "--attention-backend",
        default="flashinfer",
        help="one backend or a comma list (flashinfer,triton): each runs both KV dtypes; the ratios are against "
        "the fastest bf16 row",
    )
    p.add_argument("--kv-dtypes", default="auto,fp8_e4m3", help="KV dtypes to run (the ratios need both)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument(
        "--sweep", action="store_true", help="also time our Triton decode kernel over splits and tile shapes"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--append-md", help="append a markdown table here")
    args = p.parse_args()
    backends = [b for b in args.attention_backend.split(",") if b]
    kv_dtypes = [k for k in args.kv_dtypes.split(",") if k]
    if not kv_dtypes or set(kv_dtypes) - {"auto", "fp8_e4m3"}:
        raise SystemExit(f"--kv-dtypes: {args.kv_dtypes!r}; choose from auto, fp8_e4m3")
    bad = [b for b in backends if b not in ("flashinfer", "triton")]
    if bad or not backends:
        raise SystemExit(f"--attention-backend: unknown {bad}; choose from flashinfer, triton")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench/kv_fp8.py needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir(args.shape, root)
        rows = [run_one(model_dir, kv, b, args) for b in backends for kv in kv_dtypes]
    bf16 = max((r for r in rows if r["kv_cache_dtype"] == "auto"), key=lambda r: r["tok_s"], default=rows[0])
    fp8 = max((r for r in rows if r["kv_cache_dtype"] != "auto"), key=lambda r: r["tok_s"], default=rows[0])
    for r in rows:
        r["tok_s_vs_best_bf16"] = r["tok_s"] / bf16["tok_s"]
    out = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "backends": backends,
        "batch": args.batch,
        "context": args.context,
        "rows": rows,
        "pool_tokens_ratio": fp8["pool_tokens"] / bf16["pool_tokens"],
        "decode_tok_s_ratio": fp8["tok_s"] / bf16["tok_s"],
        "best": {"bf16": bf16["backend"], "fp8": fp8["backend"]},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.append_md:
        with open(args.append_md, "a") as f:
            f.write(
                f"\n### FP8 KV vs bf16 KV: {args.shape}, {out['gpu']}, batch {args.batch} x {args.context} "
                "context, CUDA graphs\n\n| backend | KV dtype | pool tokens | decode step (ms) | decode tok/s | "
                "x best bf16 | attention a layer (us) | KV TB/s |\n|---|---|---|---|---|---|---|---|\n"
            )
            for r in rows:
                f.write(
                    f"| {r['backend']} | {r['pool_dtype']} | {r['pool_tokens']} | {r['step_ms']:.2f} | "
                    f"{r['tok_s']:.0f} | {r['tok_s_vs_best_bf16']:.2f} | {r['attention_layer_us']:.0f} | "
                    f"{r['attention_kv_TBps']:.2f} |\n"
                )
            f.write(
                f"| **best FP8 / best bf16** | | **{out['pool_tokens_ratio']:.2f}x** | | "
                f"**{out['decode_tok_s_ratio']:.2f}x** | | | |\n"
            )


if __name__ == "__main__":
    main()

"""FP8 KV cache against bf16 KV, side by side in one run (docs/quantization.md, "FP8 KV cache"; issue 31).

For each KV dtype (``auto`` = bf16, ``fp8_e4m3``) one ``ModelRunner`` on the GPU at a model shape of
bench/decode_latency.py (default the Llama-3.1-8B shape, ``--load-format dummy``), the same
``--mem-fraction-static``, CUDA graphs on:

* **tokens that fit the pool**: ``max_total_tokens`` as the runner sized it from the free memory (no
  ``--max-total-tokens``), and the ratio FP8 / bf16;
* **decode throughput at batch ``--batch`` x ``--context``**: every request's context is laid out in the pool
  (its slots written into ``req_to_token``; decode speed does not depend on the values), then ``--steps`` decode
  steps (CUDA-graph replays) are timed with CUDA events; output tokens per second and the ratio.

    python bench/kv_fp8.py                          # Llama-3.1-8B shape, batch 32 at 8k context, flashinfer
    python bench/kv_fp8.py --attention-backend triton --json out.json --append-md out.md
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
from decode_latency import write_model_dir  # noqa: E402  (bench/ is not a package)

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


def decode_throughput(runner: ModelRunner, bs: int, context: int, steps: int, warmup: int = 3) -> dict:
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
    return {
        "step_ms": ms,
        "tok_s": bs * 1000.0 / ms,
        "graph_replays": (cgr.replays - replays) if cgr is not None else 0,
    }


def run_one(model_dir: str, kv_dtype: str, args: argparse.Namespace) -> dict:
    sa = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        attention_backend=args.attention_backend,
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
        "pool_dtype": str(runner.kv_pool.dtype).removeprefix("torch."),
        "pool_tokens": runner.max_total_tokens,
        "kv_bytes_per_token": runner._bytes_per_token(),
        "setup_s": time.perf_counter() - t0,
    }
    res.update(decode_throughput(runner, args.batch, args.context, args.steps))
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    logger.info("%s", res)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--attention-backend", default="flashinfer", choices=("flashinfer", "triton"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--append-md", help="append a markdown table here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench/kv_fp8.py needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir(args.shape, root)
        rows = [run_one(model_dir, kv, args) for kv in ("auto", "fp8_e4m3")]
    bf16, fp8 = rows
    out = {
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "backend": args.attention_backend,
        "batch": args.batch,
        "context": args.context,
        "rows": rows,
        "pool_tokens_ratio": fp8["pool_tokens"] / bf16["pool_tokens"],
        "decode_tok_s_ratio": fp8["tok_s"] / bf16["tok_s"],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.append_md:
        with open(args.append_md, "a") as f:
            f.write(
                f"\n### FP8 KV vs bf16 KV: {args.shape}, {out['gpu']}, {args.attention_backend}, "
                f"batch {args.batch} x {args.context} context, CUDA graphs\n\n"
                "| KV dtype | pool tokens | decode step (ms) | decode tok/s |\n|---|---|---|---|\n"
            )
            for r in rows:
                f.write(f"| {r['pool_dtype']} | {r['pool_tokens']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} |\n")
            f.write(
                f"| **FP8 / bf16** | **{out['pool_tokens_ratio']:.2f}x** | | **{out['decode_tok_s_ratio']:.2f}x** |\n"
            )


if __name__ == "__main__":
    main()

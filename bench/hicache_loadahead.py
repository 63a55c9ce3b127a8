"""Decode beside host-tier load-backs, with the copies inside the extend that reads them or loaded ahead of it
(issue 35's goal: unrelated decode within 5% while load-backs run; docs/cache.md, "Load-ahead").

One ``kvship serve`` worker (``--load-format dummy``; on CUDA the Llama-3.1-8B shape, ``--tiny`` a tiny model of
its family) per config, one after the other, all on the same request stream:

* ``gpu_hits``: a device pool that holds every document, no host tier: each request finds its document cached on
  the device.  The control: the same extends, no copies.
* ``load_in_extend``: a device pool of a quarter of the documents, the host tier holds them all,
  ``KVSHIP_HICACHE_LOAD_AHEAD=0``: each request's document comes back from host inside the extend that admits it.
* ``load_ahead``: the same pool and tier, ``KVSHIP_HICACHE_LOAD_AHEAD`` (default 8): the document is loaded before
  the request joins an extend; decode steps run meanwhile.
* ``load_in_extend_dma``, ``load_ahead_dma``: the two above with ``--hicache-io-backend dma`` (the copy engines move
  the pages; no SMs taken from the decode's kernels).

Workload: ``--docs`` documents of ``--doc-tokens`` random ids, each first prefilled once; then ``--beside`` unrelated
requests stream ``--decode-tokens`` tokens each (restarted when they end) while ``--requests`` requests, ``--concurrency``
in flight, go round-robin over the documents: document + ``--new-tokens`` fresh ids, one output token.  Round-robin over
four times the pool's documents means every request (with the tier) finds its document on host, so a load-back of
``--doc-tokens`` tokens runs for each.  Reported per config: the unrelated requests' ms/token p50 and mean over the
workload window and alone before it, the requests' TTFT p50, load-back bytes; and each config's decode over
``gpu_hits``' (goal <= 1.05).

    python bench/hicache_loadahead.py                       # one GPU, llama3-8b shape
    nice -n 10 .venv/bin/python bench/hicache_loadahead.py --device cpu --tiny --out /tmp/o   # harness check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
from typing import Any, Optional

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hicache_multiturn import (  # noqa: E402
    Phases,
    gaps,
    model_args,
    model_setup,
    pct,
    server_info,
    stream_generate,
    token_pct,
)
from pd_ttft import Proc, free_port, wait_ready  # noqa: E402

CONFIGS = ("gpu_hits", "load_in_extend", "load_ahead", "load_in_extend_dma", "load_ahead_dma")


def worker_argv(args: argparse.Namespace, config: str, model: str, port: int) -> list[str]:
    ps = args.page_size
    doc_pages = -(-(args.doc_tokens + args.new_tokens + 2) // ps) * ps
    # what the requests in flight hold at most; the rest of the pool caches documents
    room = args.beside * (args.decode_prompt + args.decode_tokens + 2 * ps) + (args.concurrency + 2) * doc_pages
    pool = args.docs * doc_pages + room if config == "gpu_hits" else args.docs * doc_pages // 4 + room
    argv = [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", model, "--load-format", "dummy",
            "--device", args.device, "--dtype", args.dtype, "--page-size", str(ps),
            "--max-total-tokens", str(pool), "--max-running-requests", str(args.beside + args.concurrency + 2),
            "--host", "127.0.0.1", "--port", str(port), "--enable-step-timing"]  # fmt: skip
    if config != "gpu_hits":  # a host tier that holds every document
        argv += ["--hicache-ratio", str(round(1.25 * args.docs * doc_pages / pool + 0.05, 2))]
    if config.endswith("_dma"):
        argv += ["--hicache-io-backend", "dma"]
    return argv + args.extra.split()


async def drive(url: str, args: argparse.Namespace, phases: Phases) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        rng = random.Random(args.seed)  # the documents and the requests' new ids: the same for every config
        docs = [[rng.randrange(3, args.vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
        news = [[rng.randrange(3, args.vocab) for _ in range(args.new_tokens)] for _ in range(args.requests)]
        fresh = random.Random(args.seed + 1)

        def ids(n: int) -> list[int]:
            return [fresh.randrange(3, args.vocab) for _ in range(n)]

        await asyncio.gather(*(stream_generate(http, url, ids(32), 8) for _ in range(args.beside + 1)))  # warm-up
        for d in docs:  # every document prefilled once (later ones push earlier ones to host)
            await stream_generate(http, url, d + [4], 1)
        phases.done("warm-up and documents")
        alone = await stream_generate(http, url, ids(args.decode_prompt), args.decode_tokens)
        phases.done("unrelated decode alone")

        beside: list[dict] = []

        async def unrelated() -> None:
            while True:
                beside.append({})
                await stream_generate(http, url, ids(args.decode_prompt), args.decode_tokens, beside[-1])

        order = iter(range(args.requests))
        reqs: list[dict] = []

        async def one(i: int) -> None:
            rec = await stream_generate(http, url, docs[i % args.docs] + news[i], 1)
            reqs.append(
                {
                    "ttft_s": rec["times"][0] - rec["t0"],
                    "window": (rec["t0"], rec["times"][0]),
                    "cached": int(rec["meta"].get("cached_tokens", 0)),
                }
            )

        async def client() -> None:
            for i in order:
                await one(i)

        async def paced() -> None:  # --rate: request i is sent at start + i / rate, whatever the others do
            t = time.perf_counter()
            sent = []
            for i in range(args.requests):
                await asyncio.sleep(max(0.0, t + i / args.rate - time.perf_counter()))
                sent.append(asyncio.create_task(one(i)))
            await asyncio.gather(*sent)

        side = [asyncio.create_task(unrelated()) for _ in range(args.beside)]
        await asyncio.sleep(args.settle_s)  # the unrelated requests are decoding before the workload starts
        before = await server_info(http, url)
        try:
            start = time.perf_counter()
            if args.rate:
                await paced()
            else:
                await asyncio.gather(*(client() for _ in range(args.concurrency)))
            end = time.perf_counter()
            after = await server_info(http, url)
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
        phases.done("workload", f"{len(reqs)} requests")
    in_run = [g for rec in beside if rec.get("times") for g in gaps(rec) if start <= g[0] and g[1] <= end]
    per_token = [g[2] for g in in_run for _ in range(g[3])]
    # the unrelated tokens that arrived while a request waited for its first token (its load-back, with the tier,
    # and its extend): "while load-backs run"
    windows = sorted(r["window"] for r in reqs)
    during = [g for g in in_run if any(w0 < g[1] and g[0] < w1 for w0, w1 in windows)]
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    counted = ("host_bytes_loaded", "host_load_ahead_tokens", "host_bytes_written", "extend_steps", "decode_steps",
               "num_retracted", "generation_tokens")  # fmt: skip
    load = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in counted}
    return {
        "decode_alone_p50_ms": ms(token_pct(gaps(alone), 0.5)),
        "decode_p50_ms": ms(token_pct(in_run, 0.5)),
        "decode_mean_ms": ms(statistics.fmean(per_token)) if per_token else None,
        "decode_tokens": len(per_token),
        "decode_during_p50_ms": ms(token_pct(during, 0.5)),
        "decode_during_mean_ms": ms(statistics.fmean([g[2] for g in during for _ in range(g[3])])) if during else None,
        "decode_during_tokens": sum(g[3] for g in during),
        "ttft_p50_ms": ms(pct([r["ttft_s"] for r in reqs], 0.5)),
        "ttft_p90_ms": ms(pct([r["ttft_s"] for r in reqs], 0.9)),
        "cached_share": round(sum(r["cached"] for r in reqs) / (len(reqs) * (args.doc_tokens + args.new_tokens)), 4),
        "wall_s": round(end - start, 3),
        "load_back_gb": round(load["host_bytes_loaded"] / 1e9, 4),
        "load_back_gb_per_s": round(load["host_bytes_loaded"] / 1e9 / (end - start), 2),
        "load_ahead_tokens": load["host_load_ahead_tokens"],
        "server_counters": load,  # the worker's own counts over the workload window
        # the scheduler's host seconds per step phase over the window (--enable-step-timing; recv includes idle)
        "step_phase_s": {
            k: round(v - before.get("step_phase_s", {}).get(k, 0.0), 4)
            for k, v in after.get("step_phase_s", {}).items()
        },
    }


def run_config(args: argparse.Namespace, config: str, model: str, logs: str) -> dict:
    phases = Phases(config)
    port = free_port()
    env = {"KVSHIP_HICACHE_LOAD_AHEAD": "0" if config.startswith("load_in_extend") else str(args.load_ahead)}
    proc = Proc(config, worker_argv(args, config, model, port), logs, env=env)
    try:
        wait_ready(proc, port, "/health", args.start_timeout_s)
        phases.done("worker start")
        res = asyncio.run(drive(f"http://127.0.0.1:{port}", args, phases))
    except BaseException:
        print(f"[{config}] failed; worker log {proc.log}:\n{proc.tail(40)}", file=sys.stderr, flush=True)
        raise
    finally:
        proc.stop(grace=15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.p.pid, signal.SIGKILL)
    print(f"[{config}] {json.dumps(res)}", flush=True)
    return res


def markdown(res: dict[str, Any]) -> str:
    a = res["args"]
    na = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    lines = [
        f"# Decode beside host-tier load-backs ({res['model']} on {a['device']})",
        "",
        f"{res['machine']}; {res['when']}.  {a['docs']} documents of {a['doc_tokens']} tokens; {a['requests']} "
        f"requests (document + {a['new_tokens']} ids, 1 token), "
        f"{str(a.get('rate')) + ' a second' if a.get('rate') else str(a['concurrency']) + ' in flight'}; {a['beside']} "
        f"unrelated requests of {a['decode_prompt']} + {a['decode_tokens']} tokens beside; page {a['page_size']}; "
        f"`KVSHIP_HICACHE_LOAD_AHEAD={a['load_ahead']}` for load_ahead.",
        "",
        "| config | decode ms/tok p50 | mean | x gpu_hits (p50 / mean) | during loads p50 / mean (x gpu_hits) | "
        "alone p50 | request TTFT p50 ms | p90 | cached share | load-back GB | GB/s over the run | "
        "tokens loaded ahead | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = res["gpu_hits"]
    for name in [c for c in CONFIGS if c in res]:
        r = res[name]
        rp = r["decode_p50_ms"] / base["decode_p50_ms"] if r["decode_p50_ms"] and base["decode_p50_ms"] else None
        rm = r["decode_mean_ms"] / base["decode_mean_ms"] if r["decode_mean_ms"] and base["decode_mean_ms"] else None
        dp, dm = r.get("decode_during_p50_ms"), r.get("decode_during_mean_ms")
        bp, bm = base.get("decode_during_p50_ms"), base.get("decode_during_mean_ms")
        xdp = dp / bp if dp and bp else None
        xdm = dm / bm if dm and bm else None
        lines.append(
            f"| {name} | {na(r['decode_p50_ms'])} | {na(r['decode_mean_ms'])} | {na(rp, '{:.3f}')} / "
            f"{na(rm, '{:.3f}')} | {na(dp)} / {na(dm)} ({na(xdp, '{:.3f}')} / {na(xdm, '{:.3f}')}) | "
            f"{na(r['decode_alone_p50_ms'])} | {na(r['ttft_p50_ms'], '{:.1f}')} | "
            f"{na(r['ttft_p90_ms'], '{:.1f}')} | {r['cached_share']:.1%} | {r['load_back_gb']} | "
            f"{r['load_back_gb_per_s']} | {r['load_ahead_tokens']} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap)
    ap.add_argument("--docs", type=int, default=None, help="documents (32; tiny 16)")
    ap.add_argument("--doc-tokens", type=int, default=None, help="tokens a document has (4096; tiny 256)")
    ap.add_argument("--new-tokens", type=int, default=16, help="fresh ids after the document in each request")
    ap.add_argument("--requests", type=int, default=None, help="requests of the timed workload (384; tiny 48)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (closed loop; without --rate)")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests per second, sent on a fixed clock whatever the server does "
        "(every config then runs the same extends per second: their decode compares like for like); 0 = closed loop",
    )
    ap.add_argument("--beside", type=int, default=4, help="unrelated decoding requests")
    ap.add_argument("--decode-prompt", type=int, default=None, help="their prompt ids (128; tiny 32)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="their output tokens (2048; tiny 128)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--load-ahead", type=float, default=8.0, help="KVSHIP_HICACHE_LOAD_AHEAD of load_ahead")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--extra", default="", help="more `kvship serve` flags for every worker")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.docs = args.docs or (16 if args.tiny else 32)
    args.doc_tokens = args.doc_tokens or (256 if args.tiny else 4096)
    args.requests = args.requests or (48 if args.tiny else 384)
    args.decode_prompt = args.decode_prompt or (32 if args.tiny else 128)
    args.decode_tokens = args.decode_tokens or (128 if args.tiny else 2048)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    root, model, res = model_setup(args, "kvship-hicache-la-")
    for config in args.configs.split(","):
        res[config] = run_config(args, config, model, root)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hicache_loadahead.json"), "w") as f:
        json.dump(res, f, indent=1)
    if "gpu_hits" in res:
        md = markdown(res)
        with open(os.path.join(args.out, "hicache_loadahead.md"), "w") as f:
            f.write(md)
        print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

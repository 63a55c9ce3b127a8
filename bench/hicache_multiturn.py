"""Multi-turn chat TTFT with and without the host KV tier, and decode speed beside its load-backs (issue 35).

Starts one ``kvship serve`` worker (``--load-format dummy``; on CUDA the Llama-3.1-8B shape, ``--tiny`` a tiny
model of its family) twice, one after the other: without the host tier, then with it (``--hicache-ratio``;
docs/cache.md, "Tiers").  Both get ``--max-total-tokens`` = a quarter of the workload's working set (sessions x
final context), so the device pool holds about a quarter of it; the host tier's default holds the whole set.

Workload (the same ids in both runs): ``--sessions`` S conversations of ``--turns`` T turns; each turn appends
U random user ids to the conversation and generates A tokens (greedy, ``ignore_eos``); the next turn's prompt is
the previous prompt + its answer + U new ids, so a conversation ends at about ``--max-context`` tokens
(U + A = max-context / T).  Requests go out turn by turn, round-robin over the sessions, ``--concurrency`` in
flight; a session's next turn waits for its previous one.  By the time a session comes back the others have
pushed its prefix out of the device pool: without the host tier it is recomputed, with it it is loaded back.
TTFT = the arrival of the first event of a streamed ``/generate`` (``"stream": true``).

Unrelated decode: on each worker one request of a fresh prompt (``--decode-prompt`` ids, ``--decode-tokens``
tokens) first runs alone on the idle worker (after a warm-up); then, during the workload, the same kind of
request streams beside it, restarted with a fresh prompt whenever it ends.  Its inter-token times (per event,
divided by the tokens the event added) are split by what the worker did meanwhile: a gap that overlaps a poll
interval (``--poll-ms``) in which the worker's ``host_bytes_loaded`` grew is "during load-back", the rest of the
workload is "busy".  Reports p50 of each against idle (issue goal: within 5% while load-backs run).

Writes ``hicache_multiturn.json`` and ``hicache_multiturn.md`` under ``--out``; prints the elapsed time of every
phase and a summary.  docs/cache.md, "Benchmark: multi-turn TTFT with the host tier".

    python bench/hicache_multiturn.py                                   # one GPU, llama3-8b shape, 64 x 8, 8k
    python bench/hicache_multiturn.py --sessions 32 --turns 4 --max-context 4096     # shorter
    nice -n 10 .venv/bin/python bench/hicache_multiturn.py --device cpu --tiny --sessions 8 --turns 3 --out /tmp/o
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Optional

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_latency import write_model_dir  # noqa: E402
from pd_ttft import Proc, free_port, wait_ready, write_wordlevel_tokenizer  # noqa: E402
from pp import TINY  # noqa: E402

CONFIGS = ("no_host_tier", "host_tier")


# -- sizes ----------------------------------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Turn lengths, the device pool (a quarter of the working set), the host tier and the context length."""
    ps = args.page_size
    growth = args.max_context // args.turns  # tokens a turn adds: U user ids + A answer tokens
    user = growth - args.answer_tokens
    if user < 1:
        raise SystemExit(f"--max-context {args.max_context} / --turns {args.turns} leaves no room for user tokens")
    final_context = args.turns * growth
    working_set = args.sessions * final_context
    quarter = -(-working_set // (4 * ps)) * ps
    # one whole conversation and the unrelated request must fit at once, whatever the quarter is
    floor = -(-(max(final_context, args.decode_prompt + args.decode_tokens) + 2 * ps) // ps) * ps
    pool = max(quarter, floor)
    # the host tier holds the whole working set with a tenth to spare (the unrelated requests' pages also pass
    # through it, and a host tier a little too small drops exactly the session that comes back next: LRU)
    ratio = args.hicache_ratio or math.ceil(10 * 1.1 * working_set / pool) / 10
    return {
        "user_tokens": user,
        "answer_tokens": args.answer_tokens,
        "final_prompt": args.turns * user + (args.turns - 1) * args.answer_tokens,
        "final_context": final_context,
        "working_set_tokens": working_set,
        "pool_tokens": pool,
        "pool_share_of_working_set": pool / working_set,
        "hicache_ratio": ratio,
        "host_tokens": int(ratio * pool),
        "context_length": max(final_context, args.decode_prompt + args.decode_tokens) + 2 * ps,
    }


def worker_argv(args: argparse.Namespace, plan: dict[str, Any], model: str, port: int, host_tier: bool) -> list[str]:
    argv = [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", model, "--load-format", "dummy",
            "--device", args.device, "--dtype", args.dtype, "--page-size", str(args.page_size),
            "--max-total-tokens", str(plan["pool_tokens"]), "--context-length", str(plan["context_length"]),
            "--max-running-requests", str(args.concurrency + 2),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if args.device == "cuda":
        argv += ["--cuda-graph-max-bs", str(max(16, args.concurrency + 2))]
    if host_tier:
        argv += ["--hicache-ratio", str(plan["hicache_ratio"]), "--hicache-write-policy", args.hicache_write_policy,
                 "--hicache-io-backend", args.hicache_io_backend]  # fmt: skip
    return argv + args.extra.split()


# -- HTTP -----------------------------------------------------------------------------------------------------------


async def stream_generate(
    http: aiohttp.ClientSession, url: str, ids: list[int], max_new: int, rec: Optional[dict] = None
) -> dict:
    """One streamed ``/generate`` of ``ids``.  ``rec`` (returned) fills as events arrive, so a cancelled call
    keeps what it saw: ``t0`` (sent), ``times``/``counts`` (each read's arrival, the cumulative output ids by then),
    ``meta`` and ``output_ids`` of the last event."""
    rec = {} if rec is None else rec
    rec.update(t0=time.perf_counter(), times=[], counts=[], meta={}, output_ids=[])
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    async with http.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate: HTTP {r.status}: {(await r.text())[:300]}")
        buf = b""
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return rec
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"/generate stream error: {event}")
                if rec["times"] and rec["times"][-1] == now:  # events read together count as one arrival
                    rec["counts"][-1] = len(event["output_ids"])
                else:
                    rec["times"].append(now)
                    rec["counts"].append(len(event["output_ids"]))
                rec["meta"], rec["output_ids"] = event["meta_info"], event["output_ids"]
    if not rec["times"]:
        raise RuntimeError("/generate: the stream ended without an event")
    return rec


async def server_info(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/get_server_info") as r:
        r.raise_for_status()
        return await r.json()


HOST_KEYS = ("host_total_slots", "host_hit_tokens", "host_bytes_loaded", "host_bytes_written")


# -- one worker -----------------------------------------------------------------------------------------------------


def gaps(rec: dict) -> list[tuple[float, float, float, int]]:
    """(start, end, seconds per token, tokens) of each event after the first of a streamed request."""
    t, c = rec["times"], rec["counts"]
    return [(t[i - 1], t[i], (t[i] - t[i - 1]) / (c[i] - c[i - 1]), c[i] - c[i - 1])
            for i in range(1, len(t)) if c[i] > c[i - 1]]  # fmt: skip


def pct(xs: list[float], q: float) -> Optional[float]:
    """The q-quantile of xs, linear between order statistics (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_pct(gs: list[tuple[float, float, float, int]], q: float) -> Optional[float]:
    """The q-quantile of the per-token time over the tokens of ``gs`` (an event of n tokens counts n times)."""
    return pct([g[2] for g in gs for _ in range(g[3])], q)


class Phases:
    """Elapsed time per phase, printed as it goes."""

    def __init__(self, label: str):
        self.label, self.s, self._t = label, {}, time.perf_counter()

    def done(self, name: str, note: str = "") -> None:
        now = time.perf_counter()
        self.s[name] = round(now - self._t, 2)
        self._t = now
        print(f"[{self.label}] {name}: {self.s[name]:.1f} s{'; ' + note if note else ''}", flush=True)


async def drive(url: str, args: argparse.Namespace, plan: dict[str, Any], phases: Phases) -> dict[str, Any]:
    """Warm-up, the unrelated request alone, then the workload with it alongside; returns the raw records."""
    vocab = args.vocab
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        fresh = random.Random(args.seed + 1)  # warm-up and unrelated prompts: never cached

        def ids(n: int) -> list[int]:
            return [fresh.randrange(3, vocab) for _ in range(n)]

        # warm-up: a prompt as long as a last turn, then a full batch of short ones (kernels, graphs, allocator)
        await stream_generate(http, url, ids(plan["final_prompt"]), plan["answer_tokens"])
        await asyncio.gather(*(stream_generate(http, url, ids(32), 8) for _ in range(args.concurrency + 1)))
        phases.done("warm-up")
        idle = await stream_generate(http, url, ids(args.decode_prompt), args.decode_tokens)
        phases.done("unrelated decode alone", f"{len(idle['times'])} events")

        rng = random.Random(args.seed)  # the workload: the same ids on both workers
        users = [[[rng.randrange(3, vocab) for _ in range(plan["user_tokens"])] for _ in range(args.turns)]
                 for _ in range(args.sessions)]  # fmt: skip
        history: list[list[int]] = [[] for _ in range(args.sessions)]
        done = [[asyncio.Event() for _ in range(args.turns)] for _ in range(args.sessions)]
        order = iter([(s, t) for t in range(args.turns) for s in range(args.sessions)])
        turns: list[dict] = []

        async def client() -> None:
            for s, t in order:  # one shared iterator: each client takes the next (session, turn)
                if t:
                    await done[s][t - 1].wait()
                prompt = history[s] + users[s][t]
                rec = await stream_generate(http, url, prompt, plan["answer_tokens"])
                meta = rec["meta"]
                assert len(rec["output_ids"]) == plan["answer_tokens"], f"session {s} turn {t + 1} ended early"
                turns.append({"session": s, "turn": t + 1, "prompt_tokens": int(meta["prompt_tokens"]),
                              "cached_tokens": int(meta.get("cached_tokens", 0)),
                              "ttft_s": rec["times"][0] - rec["t0"], "sent": rec["t0"], "end": rec["times"][-1]})  # fmt: skip
                history[s] = prompt + list(rec["output_ids"])
                done[s][t].set()

        beside: list[dict] = []

        async def unrelated() -> None:
            while True:
                beside.append({})
                await stream_generate(http, url, ids(args.decode_prompt), args.decode_tokens, beside[-1])

        polls: list[tuple[float, int, int]] = []  # (time, host_bytes_loaded, host_hit_tokens)

        async def poll() -> None:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):  # a missed poll widens one gap
                    info = await server_info(http, url)
                    polls.append((time.perf_counter(), int(info.get("host_bytes_loaded", 0)),
                                  int(info.get("host_hit_tokens", 0))))  # fmt: skip
                await asyncio.sleep(args.poll_ms / 1000)

        before = await server_info(http, url)
        side = [asyncio.create_task(unrelated()), asyncio.create_task(poll())]
        try:
            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            end = time.perf_counter()
        finally:
            for task in side:
                task.cancel()
            # the cancelled stream closes: the worker aborts that request
            failed = [e for e in await asyncio.gather(*side, return_exceptions=True)
                      if isinstance(e, Exception) and not isinstance(e, asyncio.CancelledError)]  # fmt: skip
        if failed:
            raise RuntimeError(f"the unrelated decode request or the stats poll failed: {failed[0]!r}")
        phases.done("workload", f"{len(turns)} requests")
        after = await server_info(http, url)
    return {"idle": idle, "turns": turns, "beside": beside, "polls": polls, "start": start, "end": end,
            "info_before": before, "info_after": after}  # fmt: skip


def summarize(raw: dict[str, Any], host_tier: bool) -> dict[str, Any]:
    turns = raw["turns"]
    ttft = [r["ttft_s"] * 1e3 for r in turns]
    back = [r["ttft_s"] * 1e3 for r in turns if r["turn"] > 1]
    prompt, cached = sum(r["prompt_tokens"] for r in turns), sum(r["cached_tokens"] for r in turns)
    back_prompt = sum(r["prompt_tokens"] for r in turns if r["turn"] > 1)
    back_cached = sum(r["cached_tokens"] for r in turns if r["turn"] > 1)
    # poll intervals in which load-backs happened
    polls = raw["polls"]
    loading = [(a[0], b[0]) for a, b in zip(polls, polls[1:]) if b[1] > a[1]]
    starts = [a for a, _ in loading]

    def during_load(g: tuple[float, float, float, int]) -> bool:
        i = bisect.bisect_left(starts, g[1])  # intervals starting before the gap ends; the last one ends latest
        return i > 0 and loading[i - 1][1] > g[0]

    beside = [g for rec in raw["beside"] if rec.get("times") for g in gaps(rec)]
    in_run = [g for g in beside if raw["start"] <= g[0] and g[1] <= raw["end"]]
    loaded = [g for g in in_run if during_load(g)]
    busy = [g for g in in_run if not during_load(g)]
    idle = gaps(raw["idle"])
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    decode = {
        "idle_p50_ms": ms(token_pct(idle, 0.5)),
        "during_workload_p50_ms": ms(token_pct(in_run, 0.5)),
        "during_load_back_p50_ms": ms(token_pct(loaded, 0.5)),
        "busy_without_load_back_p50_ms": ms(token_pct(busy, 0.5)),
        "tokens": {"idle": sum(g[3] for g in idle), "during_workload": sum(g[3] for g in in_run),
                   "during_load_back": sum(g[3] for g in loaded), "busy_without_load_back": sum(g[3] for g in busy)},
        "requests_beside": len(raw["beside"]),
    }  # fmt: skip
    for name in ("during_load_back", "during_workload", "busy_without_load_back"):
        v, base = decode[f"{name}_p50_ms"], decode["idle_p50_ms"]
        decode[f"{name}_over_idle"] = round(v / base, 4) if v and base else None
    if decode["during_load_back_p50_ms"] and decode["busy_without_load_back_p50_ms"]:
        decode["load_back_over_busy"] = round(
            decode["during_load_back_p50_ms"] / decode["busy_without_load_back_p50_ms"], 4
        )
    info0, info1 = raw["info_before"], raw["info_after"]
    wall = raw["end"] - raw["start"]
    host = {
        k: int(info1[k]) - (0 if k == "host_total_slots" else int(info0.get(k, 0))) for k in HOST_KEYS if k in info1
    }
    if host_tier and "host_bytes_loaded" in host:
        host["load_back_gb_per_s_over_the_run"] = round(host["host_bytes_loaded"] / wall / 1e9, 4)
        host["poll_intervals_with_load_back"] = len(loading)
        host["seconds_with_load_back"] = round(sum(b - a for a, b in loading), 3)
    return {
        "requests": len(turns),
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(pct(ttft, 0.5), 3),
        "ttft_p90_ms": round(pct(ttft, 0.9), 3),
        "ttft_returning_p50_ms": None if not back else round(pct(back, 0.5), 3),
        "ttft_returning_p90_ms": None if not back else round(pct(back, 0.9), 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt else None,
        "cached_share_returning": round(back_cached / back_prompt, 4) if back_prompt else None,
        "decode": decode,
        "host": host,
        "pool_tokens_reported": int(info1.get("max_total_tokens", 0)),
    }


def run_config(args: argparse.Namespace, plan: dict[str, Any], model: str, logs: str, host_tier: bool) -> dict:
    label = CONFIGS[host_tier]
    phases = Phases(label)
    port = free_port()
    proc = Proc(label, worker_argv(args, plan, model, port, host_tier), logs)
    try:
        wait_ready(proc, port, "/health", args.start_timeout_s)
        phases.done("worker start")
        raw = asyncio.run(drive(f"http://127.0.0.1:{port}", args, plan, phases))
    except BaseException:
        print(f"[{label}] failed; worker log {proc.log}:\n{proc.tail(40)}", file=sys.stderr, flush=True)
        raise
    finally:
        proc.stop(grace=15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.p.pid, signal.SIGKILL)  # anything the worker started in its session
    phases.done("worker stop")
    res = summarize(raw, host_tier)
    res["phases_s"] = phases.s
    d = res["decode"]
    print(f"[{label}] TTFT p50 {res['ttft_p50_ms']:.1f} ms, p90 {res['ttft_p90_ms']:.1f} ms "
          f"(returning turns p50 {res['ttft_returning_p50_ms']} ms); cached share {res['cached_share']}; "
          f"unrelated decode ms/token p50: idle {d['idle_p50_ms']}, workload {d['during_workload_p50_ms']}, "
          f"during load-back {d['during_load_back_p50_ms']}; host {res['host']}", flush=True)  # fmt: skip
    if args.keep_raw:
        res["raw_turns"] = raw["turns"]
    return res


# -- report ---------------------------------------------------------------------------------------------------------


def ratios(res: dict[str, Any]) -> dict[str, Optional[float]]:
    a, b = res["no_host_tier"], res["host_tier"]

    def r(k: str) -> Optional[float]:
        return round(a[k] / b[k], 3) if a.get(k) and b.get(k) else None

    d = b["decode"]
    return {
        "ttft_p50_without_over_with": r("ttft_p50_ms"),
        "ttft_p90_without_over_with": r("ttft_p90_ms"),
        "ttft_returning_p50_without_over_with": r("ttft_returning_p50_ms"),
        "decode_during_load_back_over_idle": d.get("during_load_back_over_idle"),
        "decode_during_load_back_over_busy": d.get("load_back_over_busy"),
    }


def markdown(res: dict[str, Any]) -> str:
    a, p, rt = res["args"], res["plan"], res["ratios"]
    na = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    lines = [
        f"# Multi-turn TTFT with the host KV tier ({res['model']} on {a['device']})",
        "",
        f"{res['machine']}; {res['when']}.  {a['sessions']} sessions x {a['turns']} turns, {p['user_tokens']} user "
        f"ids + {p['answer_tokens']} answer tokens a turn (contexts up to {p['final_context']}), "
        f"{a['concurrency']} in flight, page {a['page_size']}.  Working set {p['working_set_tokens']} tokens; device "
        f"pool {p['pool_tokens']} ({p['pool_share_of_working_set']:.0%}); host tier {p['hicache_ratio']}x = "
        f"{p['host_tokens']} tokens ({a['hicache_write_policy']}, I/O {a['hicache_io_backend']}).  Unrelated decode: {a['decode_prompt']} + "
        f"{a['decode_tokens']} tokens.",
        "",
        "| config | requests | TTFT p50 ms | TTFT p90 ms | returning p50 ms | cached share | returning cached share | "
        "decode idle ms/tok | during workload | during load-back | busy, no load-back | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        r, d = res[name], res[name]["decode"]
        lines.append(
            f"| {name} | {r['requests']} | {na(r['ttft_p50_ms'])} | {na(r['ttft_p90_ms'])} | "
            f"{na(r['ttft_returning_p50_ms'])} | {na(r['cached_share'], '{:.1%}')} | "
            f"{na(r['cached_share_returning'], '{:.1%}')} | {na(d['idle_p50_ms'], '{:.2f}')} | "
            f"{na(d['during_workload_p50_ms'], '{:.2f}')} | {na(d['during_load_back_p50_ms'], '{:.2f}')} | "
            f"{na(d['busy_without_load_back_p50_ms'], '{:.2f}')} | {r['wall_s']:.1f} |"
        )
    h = res["host_tier"]["host"]
    lines += [
        "",
        f"* TTFT p50 without / with the host tier: **{na(rt['ttft_p50_without_over_with'], '{:.2f}x')}** (goal >= 2x); "
        f"p90 {na(rt['ttft_p90_without_over_with'], '{:.2f}x')}; returning turns p50 "
        f"{na(rt['ttft_returning_p50_without_over_with'], '{:.2f}x')}.",
        f"* Unrelated decode p50 during load-backs / alone on the idle worker: "
        f"**{na(rt['decode_during_load_back_over_idle'], '{:.3f}')}** (goal <= 1.05); / the same run's busy "
        f"moments without load-back: {na(rt['decode_during_load_back_over_busy'], '{:.3f}')}.",
        f"* Host tier: {h.get('host_hit_tokens', 0)} tokens hit, {h.get('host_bytes_loaded', 0) / 1e9:.3f} GB "
        f"loaded back, {h.get('host_bytes_written', 0) / 1e9:.3f} GB written; load-backs seen in "
        f"{h.get('poll_intervals_with_load_back', 0)} poll intervals of {a['poll_ms']} ms.",
        "* Phases (s): " + "; ".join(f"{n}: {json.dumps(res[n]['phases_s'])}" for n in CONFIGS),
    ]
    return "\n".join(lines) + "\n"


def model_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the worker's model and device, shared by the host-tier benchmarks."""
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the shape's family (harness check)")
    ap.add_argument("--dtype", default="auto")


def model_setup(args: argparse.Namespace, prefix: str) -> tuple[str, str, dict[str, Any]]:
    """A temporary folder, the dummy model written in it (with a tokenizer: the worker detokenizes the stream;
    ``args.vocab`` set to the ids the workload draws from) and the result's header: (folder, model, header)."""
    root = tempfile.mkdtemp(prefix=prefix)
    model = write_model_dir(args.shape, root, **(TINY if args.tiny else {}))
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    write_wordlevel_tokenizer(model, vocab)
    args.vocab = min(vocab, 32000)
    res: dict[str, Any] = {
        "args": dict(vars(args)),
        "model": f"{args.shape}{' (tiny)' if args.tiny else ''}, dummy weights",
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs ({platform.machine()})",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.device == "cuda":
        import torch

        res["machine"] += f", {torch.cuda.get_device_name(0)}"
    return root, model, res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=None, help="tokens a conversation ends at (8192; tiny 512)")
    ap.add_argument("--answer-tokens", type=int, default=None, help="tokens generated a turn (64; tiny 16)")
    ap.add_argument("--concurrency", type=int, default=8, help="workload requests in flight")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hicache-ratio", type=float, default=0.0, help="0: enough for the whole working set")
    ap.add_argument("--hicache-write-policy", default="write_back", choices=("write_back", "write_through"))
    ap.add_argument("--hicache-io-backend", default="auto", choices=("auto", "kernel", "copy"))
    ap.add_argument("--decode-prompt", type=int, default=None, help="unrelated request's prompt ids (128; tiny 32)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="its output tokens (1024; tiny 256)")
    ap.add_argument("--poll-ms", type=float, default=None, help="/get_server_info poll period (50; cpu 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0, help="longest wait for a stream's next bytes")
    ap.add_argument("--extra", default="", help="more `kvship serve` flags for both workers")
    ap.add_argument("--keep-raw", action="store_true", help="every request's TTFT and tokens in the JSON")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.max_context = args.max_context or (512 if args.tiny else 8192)
    args.answer_tokens = args.answer_tokens or (16 if args.tiny else 64)
    args.decode_prompt = args.decode_prompt or (32 if args.tiny else 128)
    args.decode_tokens = args.decode_tokens or (256 if args.tiny else 1024)
    args.poll_ms = args.poll_ms or (200.0 if args.device == "cpu" else 50.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: the workers stop

    t_all = time.perf_counter()
    plan = make_plan(args)
    print(f"plan: {json.dumps(plan)}", flush=True)
    print(f"device pool {plan['pool_tokens']} tokens = {plan['pool_share_of_working_set']:.0%} of the working set "
          f"({args.sessions} sessions x {plan['final_context']} tokens = {plan['working_set_tokens']}); host tier "
          f"{plan['hicache_ratio']}x = {plan['host_tokens']} tokens", flush=True)  # fmt: skip
    root, model, res = model_setup(args, "kvship-hicache-mt-")
    res["plan"] = plan
    for host_tier in (False, True):
        res[CONFIGS[host_tier]] = run_config(args, plan, model, root, host_tier)
    shutil.rmtree(root, ignore_errors=True)  # the model folder and the worker logs (kept when a run fails)
    res["ratios"] = ratios(res)
    res["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hicache_multiturn.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "hicache_multiturn.md"), "w") as f:
        f.write(md)
    print("\n" + md + f"\nall phases: {res['elapsed_s']} s; wrote {args.out}/hicache_multiturn.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

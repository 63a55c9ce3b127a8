"""Added latency of one resume: a stream whose worker is SIGKILLed mid-answer, continued on another.

Starts three unified ``kvship serve`` workers on CPU (the embedded SmolLM2 by
default, ``--model-path`` for another) and a router in front of them
(in-process, ``--max-resumes 2``).  Each round streams one greedy chat
completion through the router; after ``--kill-after`` events the client
SIGKILLs the worker serving it (``x-kvship-worker``) and measures the time
from the kill to the next event (the router sees the reset, opens the
continuation elsewhere, the new worker prefills prompt + tokens so far and
samples the next token).  The killed worker is started again between rounds
and re-added through the admin API.  Prints the median gap between events
of an undisturbed stream beside the kill-to-next-event times.

    .venv/bin/python bench/router_resume.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from router_fixtures import running_router  # noqa: E402
from server_fixtures import start_server  # noqa: E402

from kvship.router.config import RouterConfig  # noqa: E402

PROMPT = "Write a short story about a fox who learns to read. Use simple words."


async def one_round(c: httpx.AsyncClient, url: str, max_tokens: int, kill_after: int) -> tuple[list[float], float, str]:
    """(gaps between events before the kill, kill -> next event in s, the killed worker's URL)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps: list[float] = []
    t_kill, after_kill, victim, resumed = 0.0, 0.0, "", 0
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        victim = r.headers["x-kvship-worker"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if t_kill and not after_kill:
                after_kill = now - t_kill
            stamps.append(now)
            resumed = max(resumed, json.loads(line[6:]).get("kvship_resumes", 0))
            if len(stamps) == kill_after:
                pid = (await c.get(victim + "/get_server_info")).json()["pid"]
                os.kill(int(pid), signal.SIGKILL)
                t_kill = time.perf_counter()
    assert resumed == 1, "the stream was not resumed"
    gaps = [b - a for a, b in zip(stamps[1 : kill_after - 1], stamps[2:kill_after])]
    return gaps, after_kill, victim


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=24, help="events relayed before the kill")
    ap.add_argument("--log-level", default="warning", help="router log level (info shows each resume's steps)")
    args = ap.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    worker_args = ["--device", "cpu", "--served-model-name", "m"]
    if args.model_path:
        worker_args += ["--model-path", args.model_path]
    with contextlib.ExitStack() as stack:
        workers = {}
        for _ in range(3):
            w = stack.enter_context(start_server(worker_args))
            workers[w.url] = w
        cfg = RouterConfig(worker_urls=list(workers), policy="round_robin", max_resumes=2)
        gaps: list[float] = []
        resumes: list[float] = []
        async with running_router(cfg) as (url, _):
            async with httpx.AsyncClient(timeout=300) as c:
                for i in range(args.rounds):
                    g, after_kill, victim = await one_round(c, url, args.max_tokens, args.kill_after)
                    gaps += g
                    resumes.append(after_kill)
                    print(f"round {i}: killed {victim}; next event after {after_kill * 1000:.0f} ms", flush=True)
                    await c.delete(url + "/workers", params={"url": victim})
                    w = stack.enter_context(start_server(worker_args))
                    r = await c.post(url + "/workers", json={"url": w.url, "role": "unified"})
                    assert r.status_code == 200, r.text
        med_gap = statistics.median(gaps) * 1000
        med_resume = statistics.median(resumes) * 1000
        print(
            f"CPU ({os.cpu_count()} cores), {args.model_path or 'SmolLM2-135M'}, prompt + {args.kill_after} tokens "
            f"resumed: gap between events {med_gap:.1f} ms (median); kill -> next event {med_resume:.0f} ms "
            f"median, {min(resumes) * 1000:.0f}-{max(resumes) * 1000:.0f} ms over {args.rounds} rounds; "
            f"added by one resume ~{med_resume - med_gap:.0f} ms"
        )


if __name__ == "__main__":
    asyncio.run(main())

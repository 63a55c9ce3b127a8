"""Router overhead: the same fixed-rate load against a fast worker directly and through the router.

Starts the fast test-double worker (tests/router_fixtures.py, answers at once)
and ``kvship router`` in front of it (both subprocesses), then in one run:

1. open-loop load at ``--rate`` req/s for ``--seconds`` s, direct and through
   the router (interleaved rounds so machine noise hits both alike), for
   non-streaming chat completions and for SSE streams (time to first chunk);
2. a ramp of offered rates through the router and directly, to find the
   highest rate each sustains (>= 97% of the offered rate completed on time
   and p99 below ``--p99-limit-ms``).

Prints added latency p50/p99 (router minus direct) and the max sustainable
rates side by side; ``--append-md FILE`` appends a "Router overhead" section.
Goal on a 2-core dev box: p50 added <= 2 ms at 200 req/s.

    .venv/bin/python bench/router_overhead.py --rate 200 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from router_fixtures import router_process, start_double  # noqa: E402

logger = logging.getLogger("router_overhead")

BODY = {
    "model": "double-model",
    "max_tokens": 8,
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Name three prime numbers and say why they are prime."},
    ],
}


ERROR_KINDS: collections.Counter = collections.Counter()


@dataclass
class Run:
    latencies: list[float]  # seconds, completed requests only
    errors: int
    offered: float
    elapsed: float

    @property
    def achieved(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _one(
    client: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    out: list[float],
    errors: list[int],
    kinds: collections.Counter,
) -> None:
    t0 = time.perf_counter()
    try:
        async with client.post(url, data=body, headers={"content-type": "application/json"}) as r:
            if stream:
                first = await r.content.readany()
                t1 = time.perf_counter()  # time to first chunk
                await r.read()
            else:
                first = await r.read()
                t1 = time.perf_counter()
            if r.status == 200 and first:
                out.append(t1 - t0)
            else:
                errors[0] += 1
                kinds[f"http {r.status}"] += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        errors[0] += 1
        kinds[type(e).__name__] += 1


async def fixed_rate(client: aiohttp.ClientSession, base: str, rate: float, seconds: float, stream: bool) -> Run:
    """Open loop: request i starts at i / rate, whatever happened to the earlier ones."""
    body = json.dumps({**BODY, "stream": stream}).encode()
    url = base + "/v1/chat/completions"
    lat: list[float] = []
    errors = [0]
    n = int(rate * seconds)
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(client, url, body, stream, lat, errors, ERROR_KINDS)))
    await asyncio.wait(tasks, timeout=seconds + 30)
    elapsed = max(loop.time() - start, seconds)
    return Run(lat, errors[0] + sum(1 for t in tasks if not t.done()), rate, elapsed)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(direct: str, routed: str, router_pid: int, args) -> dict:
    # aiohttp, not httpx, drives the load: httpx's pool costs ~6 ms CPU per request at 400 req/s here
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as client:
        for base in (direct, routed):  # warm up connections and code paths
            await fixed_rate(client, base, 100, 1.0, False)
            await fixed_rate(client, base, 50, 0.5, True)
        res: dict = {}
        seq: dict[str, list[float]] = {"direct": [], "router": []}
        for _ in tqdm(range(args.sequential // 100), desc="one at a time", leave=False):
            for name, base in (("direct", direct), ("router", routed)):
                for _ in range(100):
                    await _one(
                        client,
                        base + "/v1/chat/completions",
                        json.dumps(BODY).encode(),
                        False,
                        seq[name],
                        [0],
                        ERROR_KINDS,
                    )
        res["sequential"] = {name: Run(lat, 0, 0, 1) for name, lat in seq.items()}
        rounds = max(1, args.rounds)
        for stream in (False, True):
            key = "stream" if stream else "plain"
            runs: dict[str, list[float]] = {"direct": [], "router": []}
            errs = {"direct": 0, "router": 0}
            router_cpu = 0.0
            for _ in tqdm(range(rounds), desc=f"fixed {args.rate:g} req/s ({key})", leave=False):
                for name, base in (("direct", direct), ("router", routed)):
                    cpu0 = cpu_seconds(router_pid)
                    r = await fixed_rate(client, base, args.rate, args.seconds / rounds, stream)
                    if name == "router":
                        router_cpu += cpu_seconds(router_pid) - cpu0
                    runs[name].extend(r.latencies)
                    errs[name] += r.errors
            res[key] = {name: Run(lat, errs[name], args.rate, args.seconds) for name, lat in runs.items()}
            res[key + "_cpu_ms"] = router_cpu / max(1, len(runs["router"]) + errs["router"]) * 1000
        ramp: dict[str, float] = {}
        for name, base in (("direct", direct), ("router", routed)):
            best = 0.0
            for rate in tqdm(args.ramp, desc=f"ramp {name}", leave=False):
                r = await fixed_rate(client, base, rate, args.ramp_seconds, False)
                ok = (
                    r.errors == 0
                    and len(r.latencies) >= 0.97 * rate * args.ramp_seconds
                    and r.pct(0.99) <= args.p99_limit_ms
                )
                logger.info(
                    "ramp %s %g req/s: achieved %.0f, p50 %.2f ms, p99 %.2f ms, errors %d -> %s",
                    name,
                    rate,
                    r.achieved,
                    r.pct(0.5),
                    r.pct(0.99),
                    r.errors,
                    "ok" if ok else "over",
                )
                if not ok:
                    break
                best = rate
            ramp[name] = best
        res["ramp"] = ramp
        return res


def report(res: dict, args) -> str:
    lines = [
        f"Machine: {args.machine}; load average before the run {res['load_before']:.1f} (other jobs share the box).",
        "",
        f"Fixed load: {args.rate:g} req/s for {args.seconds:g} s each (in {args.rounds} interleaved rounds), "
        f"non-streaming chat completions of {len(json.dumps(BODY))} bytes and SSE streams (first chunk).",
        "",
        "| load | path | n | errors | p50 ms | p99 ms | added p50 ms | added p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cpu: dict[str, float] = {}
    sd, sr = res["sequential"]["direct"], res["sequential"]["router"]
    lines.append(
        f"| chat, JSON reply, one request at a time | direct | {len(sd.latencies)} | 0 | {sd.pct(0.5):.2f} | "
        f"{sd.pct(0.99):.2f} | - | - |"
    )
    lines.append(
        f"| chat, JSON reply, one request at a time | router | {len(sr.latencies)} | 0 | {sr.pct(0.5):.2f} | "
        f"{sr.pct(0.99):.2f} | {sr.pct(0.5) - sd.pct(0.5):.2f} | {sr.pct(0.99) - sd.pct(0.99):.2f} |"
    )
    for key, label in (("plain", "chat, JSON reply"), ("stream", "chat, SSE first chunk")):
        d, r = res[key]["direct"], res[key]["router"]
        cpu[label] = res[key + "_cpu_ms"]
        for name, run in (("direct", d), ("router", r)):
            added = f"{r.pct(0.5) - d.pct(0.5):.2f} | {r.pct(0.99) - d.pct(0.99):.2f}" if name == "router" else "- | -"
            lines.append(
                f"| {label} | {name} | {len(run.latencies)} | {run.errors} | {run.pct(0.5):.2f} | "
                f"{run.pct(0.99):.2f} | {added} |"
            )
    lines += [
        "",
        "Router process CPU per request (whole request, all chunks of a stream): "
        + ", ".join(f"{label} {ms:.2f} ms" for label, ms in cpu.items())
        + ".",
    ]
    ramp = res["ramp"]
    ratio = ramp["router"] / ramp["direct"] if ramp["direct"] else float("nan")
    lines += [
        "",
        f"Max sustainable rate (offered {', '.join(f'{x:g}' for x in args.ramp)} req/s, "
        f"{args.ramp_seconds:g} s each; >= 97% done, no errors, p99 <= {args.p99_limit_ms:g} ms): "
        f"direct {ramp['direct']:g} req/s, through the router {ramp['router']:g} req/s "
        f"(ratio {ratio:.2f}).",
        f"Goal p50 added <= 2 ms at 200 req/s: "
        f"{'met' if res['plain']['router'].pct(0.5) - res['plain']['direct'].pct(0.5) <= 2.0 else 'NOT met'} "
        f"at {args.rate:g} req/s.",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sequential", type=int, default=1000, help="requests sent one at a time per path")
    p.add_argument("--ramp", type=float, nargs="+", default=[200, 300, 400, 500, 600, 800, 1000, 1200])
    p.add_argument("--ramp-seconds", type=float, default=4.0)
    p.add_argument("--p99-limit-ms", type=float, default=50.0)
    p.add_argument("--router-args", default="", help="extra kvship router flags, e.g. '--policy round_robin'")
    p.add_argument("--machine", default=f"{os.cpu_count()}-core CPU dev box ({platform.machine()}), no GPU")
    p.add_argument("--append-md", default=None, help="append a 'Router overhead' section to this markdown file")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with start_double(name="fast", tokens=8) as worker:
        with router_process(["--worker-urls", worker.url, *args.router_args.split()]) as (url, proc):
            load_before = os.getloadavg()[0]
            res = asyncio.run(measure(worker.url, url, proc.pid, args))
            res["load_before"] = load_before
    text = report(res, args)
    if ERROR_KINDS:
        text += f"\nErrors seen by the load generator: {dict(ERROR_KINDS)}."
    text += f"\nLoad average at the end (other jobs on the box included): {os.getloadavg()[0]:.1f}."
    print(text)
    if args.append_md:
        new = not os.path.exists(args.append_md)
        with open(args.append_md, "a") as f:
            if new:
                f.write("# Benchmarks\n")
            f.write(
                f"\n## Router overhead\n\n`python bench/router_overhead.py {' '.join(sys.argv[1:])}` "
                f"({time.strftime('%Y-%m-%d')}); router flags: defaults (cache_aware, log level info)"
                f"{' + ' + args.router_args if args.router_args else ''}.\n\n{text}\n"
            )


if __name__ == "__main__":
    main()

"""Tracing on vs off, side by side: router added latency and worker decode speed (docs/observability.md, "Cost").

Tracing "on" exports every request's spans (sample ratio 1) over OTLP/HTTP to a sink in its own process (an
HTTP server that accepts and drops the exports), as ``--otlp-traces-endpoint`` does; "off" is the default.
The router's CPU is its own process's (its span export process is another).

* ``--part router``: the fast test-double worker (tests/router_fixtures.py, answers at once) behind two
  ``kvship router`` processes, one without tracing and one with it.  In ``--rounds`` rounds (the order of the
  paths rotates, so machine noise hits all alike): ``--sequential`` non-streaming chat requests one at a time
  to the worker directly, through the untraced and through the traced router, then ``--seconds`` of open-loop
  load at ``--rate`` req/s through each router.  Prints p50 / p99 latency, the added latency (router less
  direct), the router process's CPU per request, and the ratios on / off; then tracing's own CPU per request
  measured alone (steadier than the difference of two noisy end-to-end figures on a shared machine).
* ``--part worker``: one ``ModelRunner`` + ``Scheduler`` (the embedded SmolLM2 by default; ``--model-path``
  for another, e.g. a tiny random Llama), ``--batch`` greedy requests of ``--input-len`` random ids and
  ``--output-len`` new tokens, in ``--rounds`` interleaved rounds, with and without a ``WorkerTracer`` on the
  scheduler's event bus.  Prints output tokens per second (prefill included), best round, and the ratio.

    .venv/bin/python bench/tracing_overhead.py --part both --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

logger = logging.getLogger("tracing_overhead")

# The OTLP sink: its own process, so decoding nothing and answering 200 costs neither the router nor the load.
_SINK = """
import http.server, os, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()  # ends with its parent
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --------------------------------------------------------------------------- router


async def _router_rounds(direct: str, routers: dict[str, tuple[str, int]], args) -> dict:
    import aiohttp
    from router_overhead import BODY, ERROR_KINDS, _one, cpu_seconds, fixed_rate

    body = json.dumps(BODY).encode()
    seq: dict[str, list[float]] = {"direct": [], "off": [], "on": []}
    seq_cpu = {"off": [0.0, 0], "on": [0.0, 0]}
    load: dict[str, list[float]] = {"off": [], "on": []}
    load_cpu = {"off": [0.0, 0], "on": [0.0, 0]}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as client:
        for url in (direct, *(u for u, _ in routers.values())):  # warm connections and code paths
            await fixed_rate(client, url, 100, 1.0, False)
        targets = [("direct", direct, 0), *((name, url, pid) for name, (url, pid) in routers.items())]
        for r in range(args.rounds):
            order = targets[r % 3 :] + targets[: r % 3]
            for name, url, pid in order:
                cpu0 = cpu_seconds(pid) if pid else 0.0
                for _ in range(args.sequential):
                    await _one(client, url + "/v1/chat/completions", body, False, seq[name], [0], ERROR_KINDS)
                if pid:
                    seq_cpu[name][0] += cpu_seconds(pid) - cpu0
                    seq_cpu[name][1] += args.sequential
            if args.rate > 0:
                for name, (url, pid) in sorted(routers.items(), reverse=r % 2 == 1):
                    cpu0 = cpu_seconds(pid)
                    run = await fixed_rate(client, url, args.rate, args.seconds, False)
                    load_cpu[name][0] += cpu_seconds(pid) - cpu0
                    load_cpu[name][1] += len(run.latencies) + run.errors
                    load[name].extend(run.latencies)
            logger.info("router round %d/%d done", r + 1, args.rounds)
    return {"seq": seq, "seq_cpu": seq_cpu, "load": load, "load_cpu": load_cpu, "errors": dict(ERROR_KINDS)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def tracing_path_us(sink: str, n: int = 5000, rounds: int = 5) -> tuple[float, float]:
    """The router's own tracing work per request (a request span and a pick span, as a unified route makes),
    CPU microseconds, best of ``rounds``: recording on the request path, and the background hand-over of the
    finished spans to the export process (pickling them into its pipe)."""
    from kvship.common.tracing import Tracing
    from kvship.router.tracing import RequestSpans

    tracing = Tracing.configure(sink, 1.0, "kvship-router", export_process=True)
    path, handover = [], []
    for _ in range(rounds):
        c0 = time.process_time()
        for i in range(n):
            spans = RequestSpans(tracing, None, "/v1/chat/completions", f"req-{i:08d}", time.time())
            spans.end(spans.start("router.pick", attempt=1), worker="http://127.0.0.1:30000")
            spans.headers()
            spans.finish(200, "http://127.0.0.1:30000")
        c1 = time.process_time()
        tracing.flush()  # the hand-over of what the background thread has not sent yet
        c2 = time.process_time()
        path.append((c1 - c0) / n * 1e6)
        handover.append((c2 - c1) / n * 1e6)
    tracing.shutdown()
    return min(path), min(handover)


def router_part(args) -> str:
    from router_fixtures import router_process, start_double

    with otlp_sink() as sink, start_double(name="fast", tokens=8) as worker:
        on_flags = ["--otlp-traces-endpoint", sink, "--otlp-traces-sample-ratio", "1"]
        with router_process(["--worker-urls", worker.url]) as (off_url, off_proc):
            with router_process(["--worker-urls", worker.url, *on_flags]) as (on_url, on_proc):
                res = asyncio.run(
                    _router_rounds(worker.url, {"off": (off_url, off_proc.pid), "on": (on_url, on_proc.pid)}, args)
                )
        path_us, handover_us = tracing_path_us(sink)
    seq, load = res["seq"], res["load"]
    d50 = _pct(seq["direct"], 0.5)
    cpu = {k: v[0] / max(1, v[1]) * 1000 for k, v in res["seq_cpu"].items()}
    lines = [
        f"Router, tracing off vs on ({args.machine}; load average {os.getloadavg()[0]:.1f} at the end): "
        f"{args.rounds} rounds of {args.sequential} chat requests one at a time"
        + (f" and {args.seconds:g} s at {args.rate:g} req/s" if args.rate > 0 else "")
        + ".",
        "",
        "| load | path | n | p50 ms | p99 ms | added p50 ms | router CPU ms / request |",
        "|---|---|---|---|---|---|---|",
        f"| one at a time | direct | {len(seq['direct'])} | {d50:.3f} | {_pct(seq['direct'], 0.99):.3f} | - | - |",
    ]
    for name in ("off", "on"):
        lines.append(
            f"| one at a time | router, tracing {name} | {len(seq[name])} | {_pct(seq[name], 0.5):.3f} | "
            f"{_pct(seq[name], 0.99):.3f} | {_pct(seq[name], 0.5) - d50:.3f} | {cpu[name]:.3f} |"
        )
    ratios = [
        f"p50 latency through the router on / off {_pct(seq['on'], 0.5) / _pct(seq['off'], 0.5):.3f}",
        f"added p50 on / off {(_pct(seq['on'], 0.5) - d50) / (_pct(seq['off'], 0.5) - d50):.3f}",
        f"router CPU per request on / off {cpu['on'] / cpu['off']:.3f}",
    ]
    if args.rate > 0:
        lcpu = {k: v[0] / max(1, v[1]) * 1000 for k, v in res["load_cpu"].items()}
        for name in ("off", "on"):
            lines.append(
                f"| {args.rate:g} req/s | router, tracing {name} | {len(load[name])} | {_pct(load[name], 0.5):.3f} | "
                f"{_pct(load[name], 0.99):.3f} | - | {lcpu[name]:.3f} |"
            )
        ratios.append(f"p50 at {args.rate:g} req/s on / off {_pct(load['on'], 0.5) / _pct(load['off'], 0.5):.3f}")
        ratios.append(f"router CPU per request at {args.rate:g} req/s on / off {lcpu['on'] / lcpu['off']:.3f}")
    lines += ["", "Ratios: " + "; ".join(ratios) + "."]
    lines.append(
        f"Tracing's own router CPU per request (measured alone, best of 5 x 5000): {path_us:.1f} us on the request "
        f"path + {handover_us:.1f} us handing the spans to the export process = "
        f"{(path_us + handover_us) / (cpu['off'] * 1000) * 100:.1f}% of the untraced router's "
        f"{cpu['off']:.3f} ms per request."
    )
    if res["errors"]:
        lines.append(f"Errors seen by the load generator: {res['errors']}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- worker


def worker_part(args) -> str:
    import torch

    from kvship.common.tracing import Tracing, WorkerTracer
    from kvship.engine.config import ServerArgs
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler

    sa = ServerArgs(
        model_path=args.model_path,
        device=args.device,
        load_format=args.load_format,
        max_total_tokens=args.batch * (args.input_len + args.output_len + 16) * 2,
        max_running_requests=args.batch,
        disable_radix_cache=True,
    )
    runner = ModelRunner(sa)
    done: dict[str, int] = {}

    def on_chunks(chunks: list) -> None:
        for c in chunks:
            if c.finished:
                done[c.rid] = c.completion_tokens

    sched = Scheduler(sa, runner, None, on_chunks)
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with otlp_sink() as sink:
        tracing = Tracing.configure(sink, service="kvship-bench", export_process=True)  # as a worker does

        def one(tag: str, traced: bool) -> float:
            tracer = WorkerTracer(tracing if traced else Tracing.OFF, sched.events, "unified")
            done.clear()
            sp = SamplingParams(temperature=0.0, max_new_tokens=args.output_len, ignore_eos=True)
            t0 = time.perf_counter()
            for i in range(args.batch):
                ids = torch.randint(3, vocab, (args.input_len,), generator=gen).tolist()
                rid = f"{tag}-{i}"
                if tracer.enabled:
                    tracer.request_started(rid, None, len(ids))
                sched.submit(GenerateRequest(rid, ids, sp))
            while len(done) < args.batch:
                sched.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            tracer.close()  # unsubscribes; exports what it built (outside the timed window)
            return sum(done.values()) / elapsed

        one("warm", False)
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                tok_s = one(f"{mode}{r}", mode == "on")
                runs[mode].append(tok_s)
                logger.info("worker round %d %s: %.1f tok/s", r, mode, tok_s)
        tracing.shutdown()
    best = {k: max(v) for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    return "\n".join(
        [
            f"Worker decode, tracing off vs on ({args.machine}, device {args.device}, "
            f"model {args.model_path or 'embedded SmolLM2-135M'}): {args.rounds} rounds each.",
            "",
            "| batch | input len | output len | off tok/s (best / median) | on tok/s (best / median) | on / off best | "
            "on / off median |",
            "|---|---|---|---|---|---|---|",
            f"| {args.batch} | {args.input_len} | {args.output_len} | {best['off']:.1f} / {med['off']:.1f} | "
            f"{best['on']:.1f} / {med['on']:.1f} | {best['on'] / best['off']:.3f} | {med['on'] / med['off']:.3f} |",
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="both", choices=("router", "worker", "both"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--machine", default=f"{os.cpu_count()}-core CPU box ({platform.machine()})")
    g = ap.add_argument_group("router")
    g.add_argument("--sequential", type=int, default=300, help="requests one at a time per path and round")
    g.add_argument("--rate", type=float, default=200.0, help="open-loop req/s per round (0: skip)")
    g.add_argument("--seconds", type=float, default=3.0, help="seconds of open-loop load per path and round")
    g = ap.add_argument_group("worker")
    g.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    g.add_argument("--load-format", default="auto")
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--input-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = []
    if args.part in ("router", "both"):
        out.append(router_part(args))
    if args.part in ("worker", "both"):
        out.append(worker_part(args))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

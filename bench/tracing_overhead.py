"""Worker decode speed with request tracing on vs off (docs/observability.md, "Cost").

One ``ModelRunner`` + ``Scheduler`` (the embedded SmolLM2 on CPU by default), ``--batch`` greedy requests of
``--input-len`` random ids and ``--output-len`` new tokens, in ``--rounds`` interleaved rounds:

* ``off``: nobody subscribes to the scheduler's events (the default worker);
* ``on``: a ``WorkerTracer`` exporting over OTLP/HTTP to a sink in this process (an HTTP server that accepts
  and drops the exports), every request traced (sample ratio 1), as ``--otlp-traces-endpoint`` does.

Prints output tokens per second (prefill included) of each, best round, and the ratio on / off.

    .venv/bin/python bench/tracing_overhead.py --batch 16 --output-len 64 --rounds 4
"""

from __future__ import annotations

import argparse
import http.server
import logging
import threading
import time

import torch

from kvship.common.tracing import Tracing, WorkerTracer
from kvship.engine.config import ServerArgs
from kvship.engine.io_struct import GenerateRequest, SamplingParams

logger = logging.getLogger("tracing_overhead")


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler

    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
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
    tracing = Tracing.configure(f"http://127.0.0.1:{sink.server_address[1]}", service="kvship-bench")

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
    best = {"off": 0.0, "on": 0.0}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            tok_s = one(f"{mode}{r}", mode == "on")
            best[mode] = max(best[mode], tok_s)
            logger.info("round %d %s: %.1f tok/s", r, mode, tok_s)
    tracing.shutdown()
    sink.shutdown()
    print("| batch | output len | off tok/s | on tok/s | on / off |\n|---|---|---|---|---|")
    print(
        f"| {args.batch} | {args.output_len} | {best['off']:.1f} | {best['on']:.1f} | {best['on'] / best['off']:.3f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pipeline parallelism: ``--pp-size 2`` against one GPU on the Llama-3.1-8B shape (dummy weights).

Starts a ``kvship serve`` worker at ``--pp-size 1`` (GPU ``--base-gpu-id``)
and then one at ``--pp-size 2`` (that GPU and the next), each on the same
dummy model, and measures through ``/generate`` (the product's own path):

* batch N (``--batch``, default 128): N requests of ``--input-len`` random
  prompt tokens at once, ``--output-len`` greedy tokens each (``ignore_eos``);
  output tokens per second over the whole call (prefill included);
* batch 1: one such request; milliseconds per output token.

Each figure is the best of ``--rounds`` calls after a warm-up call; every
call uses fresh prompts (the prefix cache never helps).  Prints both
workers' figures and the ratios PP=2 / PP=1 (issue 32's goals: throughput at
batch 128 >= 1.5x, batch-1 latency <= 1.15x).  Needs 2 GPUs
(``nvidia-h200-x2``); ``--device cpu --tiny`` runs the harness on a tiny
model over gloo.  ``--vs '--tp-size 2'`` measures tensor parallelism the same
way (issue 33: batch 1 >= 1.6x, batch 64 >= 1.7x one GPU over HTTP).
``--vs-env 'KVSHIP_PP_CHAIN=0'`` also measures the ``--vs`` worker under
that environment (result ``vs_env``), side by side in the same call.

    python bench/pp.py                       # 2 GPUs, llama3-8b shape, bf16
    python bench/pp.py --device cpu --tiny --batch 8 --output-len 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_latency import write_model_dir  # noqa: E402
from pd_ttft import write_wordlevel_tokenizer  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One ``kvship serve`` process, healthy on entry, stopped on exit."""

    def __init__(self, args: list[str], timeout_s: float = 900.0, env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kvship-pp-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvship.app.cli", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s; log: {self.log.name}")
            time.sleep(0.5)

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        """Seconds one ``/generate`` call of ``prompts`` takes (every prompt gets ``output_len`` tokens)."""
        sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/generate", json={"input_ids": prompts, "sampling_params": sp}, timeout=3600)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        out = r.json()
        assert all(len(o["output_ids"]) == output_len for o in out), "a request ended early"
        return seconds

    def info(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(worker: Worker, args: argparse.Namespace, rng: random.Random) -> dict:
    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, args.vocab) for _ in range(args.input_len)] for _ in range(n)]

    worker.generate(prompts(args.batch), args.output_len)  # warm-up (graphs, autotuning)
    tput = max(args.batch * args.output_len / worker.generate(prompts(args.batch), args.output_len)
               for _ in range(args.rounds))  # fmt: skip
    lat = min(worker.generate(prompts(1), args.output_len) / args.output_len for _ in range(args.rounds))
    info = worker.info()
    keys = ("pp_max_in_flight", "pp_chained_launches", "pp_steps", "pp_host_s")
    return {"tok_s": tput, "ms_per_token_b1": 1000 * lat, **{k: info.get(k) for k in keys}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the shape's family (harness check)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--extra", default="", help="more `kvship serve` flags for both workers")
    ap.add_argument(
        "--vs",
        default="--pp-size 2",
        help="the second worker's flags, measured against the first (one GPU); e.g. '--tp-size 2' for TP over HTTP",
    )
    ap.add_argument("--vs-env", default="", help="also measure the --vs worker with these KEY=VALUE variables set")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="kvship-pp-bench-")
    model = write_model_dir(args.shape, root, **(TINY if args.tiny else {}))
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    write_wordlevel_tokenizer(model, vocab)  # the worker loads a tokenizer (stop strings, detokenizing)
    args.vocab = min(vocab, 32000)
    common = ["--model-path", model, "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
              "--max-running-requests", str(max(args.batch, 1)), "--base-gpu-id", str(args.base_gpu_id),
              "--context-length", str(args.input_len + args.output_len + 64), *args.extra.split()]  # fmt: skip
    if args.device == "cpu":
        common += ["--max-total-tokens", str((args.batch + 1) * (args.input_len + args.output_len + 64))]
    results = {}
    env = dict(kv.split("=", 1) for kv in args.vs_env.split())
    runs = [("one_gpu", [], None), ("vs", args.vs.split(), None)] + ([("vs_env", args.vs.split(), env)] if env else [])
    for seed, (name, flags, extra_env) in enumerate(runs, start=1):
        worker = Worker(common + flags, env=extra_env)
        try:
            results[name] = measure(worker, args, random.Random(seed))
        finally:
            worker.stop()
            if args.json:  # every rank's log (a PP rank logs its host seconds per step part)
                shutil.copy(worker.log.name, os.path.join(os.path.dirname(os.path.abspath(args.json)), f"{name}.log"))
        print(f"{name} {' '.join(flags)} {args.vs_env if extra_env else ''}: {json.dumps(results[name])}", flush=True)
    one, two = results["one_gpu"], results["vs"]
    results["ratio"] = {
        f"throughput_b{args.batch}": two["tok_s"] / one["tok_s"],
        "latency_b1": two["ms_per_token_b1"] / one["ms_per_token_b1"],
    }
    if env:
        alt = results["vs_env"]
        results["ratio_env"] = {
            f"throughput_b{args.batch}": alt["tok_s"] / one["tok_s"],
            "latency_b1": alt["ms_per_token_b1"] / one["ms_per_token_b1"],
        }
        print(f"with {args.vs_env}: {json.dumps(results['ratio_env'])}", flush=True)
    print(
        f"{args.shape}{' (tiny)' if args.tiny else ''} on {args.device}, one GPU vs {args.vs!r}: batch {args.batch} "
        f"{one['tok_s']:.0f} -> {two['tok_s']:.0f} tok/s ({results['ratio'][f'throughput_b{args.batch}']:.2f}x; "
        f"PP goal >= 1.5x), batch 1 {one['ms_per_token_b1']:.2f} -> {two['ms_per_token_b1']:.2f} ms/token "
        f"({results['ratio']['latency_b1']:.2f}x; PP goal <= 1.15x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, **results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

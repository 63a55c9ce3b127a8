r"""TTFT of a PD request over HTTP, broken down stage by stage, beside a unified worker's TTFT in the same run.

What runs (all real processes on this machine): one unified worker (``kvship serve --mode unified``) and, for each
``--backend``, a ``kvship local`` deployment (router + 1 prefill + 1 decode worker over that transfer backend).  For
each prompt length and each of ``--repeats`` rounds (after ``--warmup``), three requests in rotating order: the same
fresh random prompt to the unified worker and to the PD router, and another one to the PD router with
``"return_trace": true`` (``POST /generate``, ``max_new_tokens: 1``, greedy).  TTFT is from the client's send to its
first response byte (non-streaming with one token: the whole answer), taken on the untraced requests; the unified
and PD answers must hold the same token (greedy equality; with ``--shape``'s dummy weights, whose flat logits may flip
a token, differing tokens are counted in the "same token" column instead).

The breakdown comes from the processes themselves (docs/pd.md, "Reading a request's trace"): the decode worker's
``meta_info.trace``, and the router's ``x-kvship-trace`` header with its own stamps and the prefill worker's
``meta_info.trace``.  Every stamp is ``time.time()`` of its process; all processes run on this machine, so they
share one wall clock.  Stages, in order (ms between consecutive stamps in the table):

    client send -> router received -> prefill http_received / scheduled -> prefill admitted -> forward_done
    (first token sampled) -> kv_send_start (once decode's Register reached prefill: room_registered) -> kv_send_end
    -> decode kv_arrived -> kv_verified -> decode admitted / first_token_flush -> decode http_respond
    -> router decode_first_byte -> client first byte

The prefill computes the prompt beside decode's registration; with ``--disaggregation-prefill-wait-for-room`` it
waits for the registration first (scheduled -> admitted).  ``--variant LABEL=FLAG[,FLAG...]`` runs each backend once
more with those worker flags (e.g. ``--variant wait-for-room=--disaggregation-prefill-wait-for-room``, the order
before issue 19, or ``--variant whole=--no-disaggregation-layerwise``, the whole-request send after the forward
instead of the layer-wise one) and adds a before/after table: every variant against the plain deployment, in the
same run.  A layer-wise send starts before ``forward_done``: the critical path counts the transfer from
``max(kv_send_start, forward_done)``, and the ``p:`` transfer columns show the lead, the last layers' write and
the whole trip (the KV GB/s column's time).

CPU (tiny random Llama, then the embedded SmolLM2-135M; tcp backend)::

    .venv/bin/python bench/pd_ttft.py --model tiny --prompt-len 128 512 1536 --out /tmp/pd_ttft_tiny \
        --variant wait-for-room=--disaggregation-prefill-wait-for-room
    .venv/bin/python bench/pd_ttft.py --model smollm2 --prompt-len 128 256 --repeats 4 --out /tmp/pd_ttft_smol
    # streamed: the router's first token from prefill (docs/pd.md) against the decode-only stream
    .venv/bin/python bench/pd_ttft.py --model tiny --prompt-len 128 512 1536 --stream 4 \
        --variant no-first-token=--no-pd-first-token --out /tmp/pd_ttft_stream

GPU (Llama-3.1-8B shape, dummy bf16 weights; a word-level tokenizer of the shape's vocabulary is written beside the
config, since nothing can be downloaded there), one device call from the repository root with
``carry: [".device", ".whl"]`` (``.whl`` with the ``httptools`` wheel: the product's ``uvicorn[standard]`` parses
HTTP with it, the device image has only ``h11``)::

    PARTS=none bash bench/gpu_suite.sh >/dev/null 2>&1; . /tmp/site/env.sh; \
    timeout -s TERM 540 python3 bench/pd_ttft.py --device cuda --shape llama3-8b --backend nixl --backend tcp \
        --backend mooncake --prompt-len 512 2048 4096 8000 --repeats 5 --warmup 1 --out "$OUT" 2>&1 | tail -45

and for the issue-19 changes (prefill computing beside decode's registration; the first token from prefill;
layer-wise transfer), add
``--backend nixl --prompt-len 512 4096 --variant wait-for-room=--disaggregation-prefill-wait-for-room`` to one run,
``--stream 4 --variant no-first-token=--no-pd-first-token`` to another (the streamed run's breakdown shows the
traced, non-streamed requests) and ``--backend nixl --prompt-len 512 4096 --variant whole=--no-disaggregation-layerwise``
to a third.

``--code LABEL=PATH`` runs each backend's PD deployment once more with the kvship code of another checkout (its
processes import ``kvship`` from PATH: ``git worktree add /tmp/before <commit>``), beside the plain one and
interleaved with it, so a code change's before/after comes from one run; the tables add each deployment's fixed
cost, the traced TTFT less its prefill forward (what PD adds around the computation; steadier than PD - unified on
a busy CPU, where the forwards vary by more than it)::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/pd_ttft.py --model tiny --prompt-len 128 512 1536 --repeats 10 --code before=/tmp/before

Writes ``--out/pd_ttft.json`` (every sample with its whole trace) and ``--out/pd_ttft.md`` (the tables), again
after every backend, so a run cut off by SIGTERM (it stops its children) keeps the backends it finished.  On GPU the
unified worker and the two PD workers share the device: each gets ``--max-total-tokens`` (default 2 x the longest
prompt + 1024).  The in-process variant (schedulers in threads of one process, no HTTP) is bench/pd_ttft_inproc.py.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import logging
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("bench.pd_ttft")
ROOT = Path(__file__).resolve().parent.parent

# (column, from stamp, to stamp): consecutive stages of one PD request; "c." client, "r." router, "p." prefill,
# "d." decode.  Decode's side runs beside prefill's: its columns show where it waits for prefill.
FORWARD = "prefill forward"
SEGMENTS: list[tuple[str, str, str]] = [
    ("client->router", "c.sent", "r.received"),
    ("router->prefill http", "r.received", "p.http_received"),
    ("prefill http->sched", "p.http_received", "p.scheduled"),
    ("prefill admit (waits for decode's room with the flag)", "p.scheduled", "p.admitted"),
    (FORWARD, "p.admitted", "p.forward_done"),
    ("hand-off to sender (waits for a later room)", "p.forward_done", "p.kv_send_after_forward"),
    ("KV lands on decode", "p.kv_send_after_forward", "d.kv_arrived"),
    ("decode sees KV", "d.kv_arrived", "d.kv_verified"),
    ("decode admit+flush", "d.kv_verified", "d.first_token_flush"),
    ("decode http out", "d.first_token_flush", "d.http_respond"),
    ("router relay", "d.http_respond", "r.decode_first_byte"),
    ("router->client", "r.prefill_reply", "c.first_byte"),
]
# decode's own path to the registration prefill waits for
DECODE_SIDE: list[tuple[str, str, str]] = [
    ("d: router->http", "r.sent", "d.http_received"),
    ("d: http->sched", "d.http_received", "d.scheduled"),
    ("d: sched->registered", "d.scheduled", "d.room_registered"),
    ("p: registration seen", "d.room_registered", "p.room_registered"),
    ("p: room registered after forward_done (< 0: hidden by it)", "p.forward_done", "p.room_registered"),
    ("r: trace waits for prefill reply", "r.decode_first_byte", "r.prefill_reply"),
]
# the KV's whole trip, and a layer-wise send's parts (docs/pd.md, "Layer-wise transfer"): it starts before the
# forward ends (the lead), so the critical path above only has what is left after forward_done
KV_TRIP = "p: KV send start -> landed (whole trip)"
TRANSFER_SIDE: list[tuple[str, str, str]] = [
    (KV_TRIP, "p.kv_send_start", "d.kv_arrived"),
    ("p: layer-wise lead (send start before forward_done)", "p.kv_send_start", "p.forward_done"),
    ("p: last layers -> aux handed over", "p.kv_layers_last", "p.kv_tail_start"),
    ("p: aux + done", "p.kv_tail_start", "p.kv_send_end"),
]


# ----------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python() -> list[str]:
    return [sys.executable, "-m", "kvship.app.cli"]


class Proc:
    """A child process (own session) with its log file; ``stop()`` SIGINTs it, SIGKILLs it after a grace period."""

    def __init__(self, name: str, argv: list[str], log_dir: str, env: Optional[dict[str, str]] = None):
        self.name = name
        self.log = os.path.join(log_dir, f"{name}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )

    def tail(self, n: int = 30) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, grace: float = 30.0) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p.pid, signal.SIGINT)
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)


def code_env(tree: str, where: str) -> dict[str, str]:
    """The environment that makes a process import ``kvship`` from the checkout ``tree`` (``--code``): a folder
    holding a ``kvship`` link to it, first on ``PYTHONPATH`` (ahead of the editable install's finder)."""
    os.makedirs(where, exist_ok=True)
    link = os.path.join(where, "kvship")
    if not os.path.islink(link):
        os.symlink(os.path.abspath(tree), link)
    return {"PYTHONPATH": os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH", "")) if p)}


def wait_ready(proc: Proc, port: int, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.p.returncode}:\n{proc.tail()}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} not ready within {timeout:.0f} s:\n{proc.tail()}")


class Client:
    """One kept-alive HTTP connection; ``generate`` returns (status, headers, body, send time, first-byte time)."""

    def __init__(self, port: int, timeout: float):
        self.port, self.timeout = port, timeout
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def generate(self, body: dict) -> tuple[int, dict, dict, float, float]:
        """A streamed body's answer is its last event, and the first-byte time that of its first event."""
        data = json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        for attempt in range(2):
            try:
                t0 = time.time()
                self.conn.request("POST", "/generate", data, headers)
                resp = self.conn.getresponse()  # returns once the status line and headers are in
                t1 = time.time()
                if body.get("stream") and resp.status == 200:
                    events = []
                    for line in resp:
                        if line.startswith(b"data: "):
                            if not events:
                                t1 = time.time()
                            events.append(line[6:].strip())
                    raw = next((e for e in reversed(events) if e != b"[DONE]"), b"{}")
                else:
                    raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                self.conn.close()  # a kept-alive connection the server closed: reconnect once
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                if attempt:
                    raise
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw), t0, t1


# ----------------------------------------------------------------------------------- models


def write_wordlevel_tokenizer(model_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id (``<i>``), so a dummy-weight shape can be served offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token="<1>").save_pretrained(model_dir)


def model_flags(args: argparse.Namespace, work: str) -> tuple[list[str], int, str]:
    """Worker flags naming the model, its vocabulary size and a label."""
    if args.shape:
        spec = importlib.util.spec_from_file_location("bench_decode_latency", ROOT / "bench" / "decode_latency.py")
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        path = mod.write_model_dir(args.shape, work)
        vocab = int(mod.SHAPES[args.shape]["vocab_size"])
        write_wordlevel_tokenizer(path, vocab)
        return ["--model-path", path, "--load-format", "dummy", "--dtype", "bfloat16"], vocab, args.shape
    if args.model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import _TINY_SPECS, TINY_VOCAB_SIZE, build_tiny_model  # tests/conftest.py, test-only models

        spec = dict(_TINY_SPECS["llama"])
        path = build_tiny_model(os.path.join(work, "tiny"), spec.pop("arch"), seed=spec.pop("seed"), **spec)
        return ["--model-path", path], TINY_VOCAB_SIZE, "tiny random Llama"
    if args.model == "smollm2":
        from kvship.engine.embedded import embedded_model_path

        return ["--model-path", embedded_model_path()], 49152, "SmolLM2-135M-Instruct (GGUF)"
    return ["--model-path", args.model], args.vocab_size, os.path.basename(args.model)


def kv_bytes_per_token(model_flags_: list[str], dtype: str) -> Optional[int]:
    """K+V bytes of one token over all layers, from the model folder's config.json (None without one)."""
    path = model_flags_[model_flags_.index("--model-path") + 1]
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except OSError:
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return int(cfg["num_hidden_layers"]) * 2 * int(kv_heads) * int(head_dim) * size


def copy_bandwidth(device: str, mib: int = 512) -> float:
    """Bytes/s that ``dst.copy_(src)`` moves on ``device`` (bytes copied, not read + written), best of 5."""
    import torch

    src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    n = src.numel()
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the device to the workers
    return n / best


# ----------------------------------------------------------------------------------- one request


def flatten(client: tuple[float, float], headers: dict, body: dict) -> dict[str, float]:
    """Every stamp of one PD answer under one namespace: c. (client), r. (router), p. (prefill), d. (decode)."""
    out = {"c.sent": client[0], "c.first_byte": client[1]}
    for k, v in ((body.get("meta_info") or {}).get("trace") or {}).items():
        out["d." + k] = v
    raw = headers.get("x-kvship-trace")
    if raw:
        rt = json.loads(raw)
        for k, v in (rt.get("router") or {}).items():
            out["r." + k] = v
        for k, v in (rt.get("prefill") or {}).items():
            out["p." + k] = v
    if "p.kv_send_start" in out and "p.forward_done" in out:  # what of the transfer is left after the forward
        out["p.kv_send_after_forward"] = max(out["p.kv_send_start"], out["p.forward_done"])
    return out


def segments(st: dict[str, float]) -> dict[str, float]:
    return {name: st[b] - st[a] for name, a, b in SEGMENTS + DECODE_SIDE + TRANSFER_SIDE if a in st and b in st}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="kvship-pd-ttft-")
    flags, vocab, label = model_flags(args, work)
    longest = max(args.prompt_len)
    mtt = args.max_total_tokens or 2 * longest + 1024
    flags += ["--device", args.device, "--page-size", str(args.page_size), "--max-total-tokens", str(mtt)]
    flags += ["--context-length", str(longest + 64)]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    flags += args.worker_arg
    res: dict[str, Any] = {
        "model": label,
        "device": args.device,
        "clock": "time.time() of each process (one machine, one wall clock)",
        "env": {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "label": args.label,
        "prompt_lens": args.prompt_len,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "page_size": args.page_size,
        "stream": args.stream,
        "worker_flags": flags,
        "copy_bandwidth_Bps": copy_bandwidth(args.device),
        "unified": {},
        "backends": {},
    }
    if args.device == "cuda":
        import torch

        res["env"]["gpu"] = torch.cuda.get_device_name(0)
    rng = random.Random(args.seed)
    u_port = free_port()
    unified = Proc("unified", _python() + ["serve", "--mode", "unified", "--port", str(u_port)] + flags, work)
    logger.info("logs in %s", work)
    try:
        wait_ready(unified, u_port, "/health", args.startup_timeout)
        u_client = Client(u_port, args.timeout)
        info = http.client.HTTPConnection("127.0.0.1", u_port, timeout=30)
        info.request("GET", "/get_server_info")
        dtype = json.loads(info.getresponse().read())["model"]["dtype"]
        res["kv_dtype"] = dtype
        res["kv_bytes_per_token"] = kv_bytes_per_token(flags, dtype) if "--kv-cache-dtype" not in flags else None
        everything = [("", [], None)] + args.variant
        # every variant of a backend runs at once, so their requests interleave (same machine state); with
        # --one-at-a-time (the default on cuda: five 8B-shape processes do not fit one GPU) each runs alone beside
        # the unified worker
        groups = [[v] for v in everything] if args.one_at_a_time else [everything]
        for backend in args.backend:
            for group in groups:
                deployments: dict[str, tuple[Proc, int]] = {}
                try:
                    for label, extra, tree in group:
                        name = backend + (" " + label if label else "")
                        r_port = free_port()
                        argv = ["local", "--port", str(r_port), "--transfer-backend", backend, "--log-dir", work]
                        argv += ["--shutdown-grace", "20"] + flags + extra
                        tag = backend + ("-" + label if label else "")
                        env = code_env(tree, os.path.join(work, "code-" + label)) if tree else None
                        deployments[name] = (Proc(f"local-{tag}", _python() + argv, work, env), r_port)
                    for proc, port in deployments.values():
                        wait_ready(proc, port, "/readiness", args.startup_timeout)
                    clients = {name: Client(port, args.timeout) for name, (_, port) in deployments.items()}
                    for name, rows in measure(args, backend, clients, u_client, vocab, rng, res).items():
                        res["backends"][name] = rows
                except Exception as e:  # noqa: BLE001 - report it, keep the other backends
                    logger.exception("backend %s failed", backend)
                    for name in deployments or [backend]:
                        res["backends"][name] = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    for proc, _ in deployments.values():
                        proc.stop()
                write_results(res, args.out)
    finally:
        unified.stop()
    return res


def measure(
    args: argparse.Namespace,
    backend: str,
    pds: dict[str, Client],
    uni: Client,
    vocab: int,
    rng: random.Random,
    res: dict,
) -> dict[str, dict[str, Any]]:
    """Per deployment name (``pds``' keys), per prompt length: medians and samples."""
    out: dict[str, dict[str, Any]] = {name: {} for name in pds}
    for n in args.prompt_len:
        rows: dict[str, list] = {name: [] for name in pds}
        u_rows = res["unified"].setdefault(str(n), [])
        for i in range(args.warmup + args.repeats):

            def body(trace: bool) -> dict:  # a fresh prompt: no prefix-cache hit anywhere
                out = {
                    "input_ids": [rng.randrange(3, vocab) for _ in range(n)],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                    "return_trace": trace,
                }
                if args.stream and not trace:  # the traced request stays a one-token answer (its breakdown)
                    del out["return_trace"]  # a key the router's resume does not know makes a stream unresumable
                    out["stream"] = True
                    out["sampling_params"]["max_new_tokens"] = args.stream
                return out

            plain = body(False)
            calls = [("unified", uni, plain)]
            for name, client in pds.items():
                calls += [(name, client, plain), (name + " traced", client, body(True))]
            calls = calls[i % len(calls) :] + calls[: i % len(calls)]  # rotate who goes first (drift, caches)
            got: dict[str, tuple] = {}
            for who, client, b in calls:
                status, headers, answer, t0, t1 = client.generate(b)
                if status != 200:
                    raise RuntimeError(f"{who} prompt {n}: HTTP {status}: {answer}")
                got[who] = (headers, answer, t0, t1)
            _, ua, u0, u1 = got["unified"]
            urow = {"ttft": u1 - u0}
            if i >= args.warmup:
                u_rows.append(urow)
            for name in pds:
                (_, pa, p0, p1), (th, ta, t0, t1) = got[name], got[name + " traced"]
                equal = ua["output_ids"] == pa["output_ids"]
                if not equal and not args.shape:  # dummy weights: flat logits may flip a token (DESIGN.md); counted
                    raise RuntimeError(f"{name} prompt {n}: PD answered {pa['output_ids']}, unified {ua['output_ids']}")
                stamps = flatten((t0, t1), th, ta)
                row = {
                    "ttft": p1 - p0,
                    "traced_ttft": t1 - t0,
                    "equal": equal,
                    "prefill_first": got[name][0].get("x-kvship-first-token") == "prefill",
                    "stamps": stamps,
                    "segments": segments(stamps),
                }
                logger.info(
                    "%s n=%d%s: PD %.2f ms, unified %.2f ms",
                    name,
                    n,
                    " (warm-up)" if i < args.warmup else "",
                    row["ttft"] * 1e3,
                    urow["ttft"] * 1e3,
                )
                if i >= args.warmup:
                    rows[name].append(row)
        seg_names = [s[0] for s in SEGMENTS + DECODE_SIDE + TRANSFER_SIDE]
        for name, rs in rows.items():
            med = {
                k: statistics.median(r["segments"][k] for r in rs if k in r["segments"])
                for k in seg_names
                if any(k in r["segments"] for r in rs)
            }
            out[name][str(n)] = {
                "ttft": statistics.median(r["ttft"] for r in rs),
                "traced_ttft": statistics.median(r["traced_ttft"] for r in rs),
                "fixed": fixed_cost(rs),
                "unified_ttft": statistics.median(r["ttft"] for r in u_rows[-args.repeats :]),
                "segments": med,
                "equal": f"{sum(r['equal'] for r in rs)}/{len(rs)}",
                "prefill_first": f"{sum(r.get('prefill_first', False) for r in rs)}/{len(rs)}",
                "samples": rs,
            }
    return out


def fixed_cost(rows: list[dict[str, Any]]) -> Optional[float]:
    """Median over the traced requests of their TTFT less their prefill forward: what PD adds around the
    computation.  Steadier than PD - unified on a busy machine, where the forwards vary by more than it."""
    vals = [r["traced_ttft"] - r["segments"][FORWARD] for r in rows if FORWARD in r["segments"]]
    return statistics.median(vals) if vals else None


# ----------------------------------------------------------------------------------- report


def kv_cells(res: dict[str, Any], n: int, r: dict[str, Any]) -> str:
    """The prompt's KV size and the rate it moved at (median of the traced samples), or blanks."""
    per_token = res.get("kv_bytes_per_token")
    t = r["segments"].get(KV_TRIP)
    if not per_token or not t:
        return " | "
    nbytes = per_token * n
    return f"{nbytes / 2**20:.1f} | {nbytes / t / 1e9:.2f}"


def markdown(res: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    dev = res["device"] + (" " + res["env"].get("gpu", "") if res["device"] == "cuda" else "")
    lines = [
        f"## PD TTFT over HTTP{' (' + res['label'] + ')' if res['label'] else ''}: {res['model']}, {dev}, "
        f"page {res['page_size']}",
        "",
        f"Medians of {res['repeats']} fresh prompts per length (after {res['warmup']} warm-up), `/generate` with "
        + (
            f"`stream: true`, `max_new_tokens: {res['stream']}` (the traced request: one token, not streamed)"
            if res.get("stream")
            else "`max_new_tokens: 1`"
        )
        + f"; per repeat one unified, one PD and one traced PD request (`return_trace`), in "
        f"rotating order. TTFT: client send to first response byte (streamed: first event), untraced requests. "
        f"Clock: {res['clock']}. "
        f"`copy_` on this {res['device']}: {res['copy_bandwidth_Bps'] / 1e9:.1f} GB/s (bytes copied per second).",
        "",
        "| backend | prompt | unified TTFT ms | PD TTFT ms | PD - unified ms | PD / unified | same token | "
        "first token from prefill | KV MiB | KV GB/s (send start -> landed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, per in res["backends"].items():
        if "error" in per:
            lines.append(f"| {b} | failed: {per['error']} | | | | | | | | |")
            continue
        for n, r in per.items():
            lines.append(
                f"| {b} | {n} | {ms(r['unified_ttft'])} | {ms(r['ttft'])} | {ms(r['ttft'] - r['unified_ttft'])} | "
                f"{r['ttft'] / r['unified_ttft']:.2f}x | {r['equal']} | {r.get('prefill_first', '')} | "
                f"{kv_cells(res, int(n), r)} |"
            )
    lines += compare_lines(res, ms)
    names = [s[0] for s in SEGMENTS + DECODE_SIDE + TRANSFER_SIDE]
    lines += [
        "",
        "Breakdown of the traced requests (ms between the stamps named in bench/pd_ttft.py's SEGMENTS, medians; "
        "the `d:` / `p:` columns are decode's path to the registration prefill waits for and the KV's trip (a "
        "layer-wise send's lead over forward_done, its last layers, its aux + done), the `r:` column the "
        "router's wait for the prefill reply, which only traced requests have):",
        "",
    ]
    lines.append("| backend | prompt | traced TTFT | traced TTFT - prefill forward | " + " | ".join(names) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(names))
    for b, per in res["backends"].items():
        if "error" in per:
            continue
        for n, r in per.items():
            cells = [ms(r["segments"][k]) if k in r["segments"] else "" for k in names]
            fixed = _ms_or_blank(ms, r.get("fixed"))
            lines.append(f"| {b} | {n} | {ms(r['traced_ttft'])} | {fixed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_lines(res: dict[str, Any], ms: Any) -> list[str]:
    """Before/after rows: each ``--variant`` deployment against its backend's plain one (same run)."""
    lines: list[str] = []
    for name, per in res["backends"].items():
        backend, _, label = name.partition(" ")
        base = res["backends"].get(backend)
        if not label or "error" in per or not base or "error" in base:
            continue
        if not lines:
            lines = [
                "",
                "Same run, variant (the `--variant` worker flags or `--code` checkout) against the plain deployment "
                "(untraced TTFT medians; ratio = plain / variant; fixed = traced TTFT - prefill forward, medians):",
                "",
                "| backend | prompt | variant | variant TTFT ms | plain TTFT ms | plain - variant ms | plain / variant "
                "| variant fixed ms | plain fixed ms |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
        for n, r in per.items():
            b = base.get(n)
            if b is None:
                continue
            lines.append(
                f"| {backend} | {n} | {label} | {ms(r['ttft'])} | {ms(b['ttft'])} | {ms(b['ttft'] - r['ttft'])} | "
                f"{b['ttft'] / r['ttft']:.2f}x | {_ms_or_blank(ms, r.get('fixed'))} | {_ms_or_blank(ms, b.get('fixed'))} |"
            )
    return lines


def _ms_or_blank(ms: Any, v: Optional[float]) -> str:
    return "" if v is None else ms(v)


def write_results(res: dict[str, Any], out: str) -> str:
    """Write ``out/pd_ttft.json`` and ``out/pd_ttft.md`` (after every backend, so a cut-off run keeps what it
    measured); returns the markdown."""
    os.makedirs(out, exist_ok=True)
    md = markdown(res)
    with open(os.path.join(out, "pd_ttft.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "pd_ttft.md"), "w") as f:
        f.write(md)
    return md


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", choices=("tcp", "mooncake", "nixl"), help="repeatable (default tcp)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | a model folder / .gguf (with --vocab-size)")
    ap.add_argument("--vocab-size", type=int, default=None, help="prompt ids are drawn below this (--model PATH)")
    ap.add_argument("--shape", default=None, help="a bench/decode_latency.py shape, dummy weights (e.g. llama3-8b)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--max-total-tokens", type=int, default=None, help="each worker's KV pool (default 2 x longest + 1024)"
    )
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads per worker (default 1 on cpu)")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable, e.g. =--foo)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--label", default="", help="a name for this run in the tables (e.g. before / after)")
    ap.add_argument(
        "--stream",
        type=int,
        default=0,
        metavar="N",
        help="untraced requests stream N tokens (TTFT = first event); with the router's first token from "
        "prefill (docs/pd.md) compare against --variant no-first-token=--no-pd-first-token",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="LABEL=FLAG[,FLAG...]: also run each backend with these worker flags, beside the plain deployment "
        "(repeatable), e.g. wait-for-room=--disaggregation-prefill-wait-for-room",
    )
    ap.add_argument(
        "--code",
        action="append",
        default=[],
        help="LABEL=PATH: also run each backend's PD deployment with the kvship code of the checkout at PATH "
        "(e.g. `git worktree add /tmp/before HEAD~1`), beside the plain one: a code change's before/after in one "
        "run (repeatable)",
    )
    ap.add_argument(
        "--one-at-a-time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a backend's variants one after another (each beside the unified worker) instead of at once; "
        "default: on for cuda (a GPU holds three 8B-shape processes, not five)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.backend = args.backend or ["tcp"]
    if args.one_at_a_time is None:
        args.one_at_a_time = args.device == "cuda"
    variants = []
    for v in args.variant:
        label, sep, flag_list = v.partition("=")
        if not sep or not label or " " in label or not flag_list:
            ap.error(f"--variant {v!r}: expected LABEL=FLAG[,FLAG...] (a label without spaces)")
        variants.append((label, flag_list.split(","), None))
    for v in args.code:
        label, sep, tree = v.partition("=")
        if not sep or not label or " " in label or not os.path.isfile(os.path.join(tree, "app", "cli.py")):
            ap.error(f"--code {v!r}: expected LABEL=PATH of a kvship checkout (a label without spaces)")
        variants.append((label, [], tree))
    args.variant = variants
    if args.repeats < 1 or args.warmup < 0 or min(args.prompt_len) < 2:
        ap.error("--repeats >= 1, --warmup >= 0, every --prompt-len >= 2")
    if args.model not in ("tiny", "smollm2") and not args.shape and args.vocab_size is None:
        ap.error("--model PATH needs --vocab-size")
    if args.num_threads is None and args.device == "cpu":
        args.num_threads = 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run's finally blocks stop the children
    res = run(args)
    print(write_results(res, args.out))
    return 0 if all("error" not in r for r in res["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

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

KV-plane authentication (issue 30) is on in every PD deployment (``kvship local`` gives its workers a KV
transfer secret); ``--kv-auth off`` runs them with ``--kv-transfer-insecure``, and
``--variant kv-auth-off=--kv-transfer-insecure`` puts both side by side in one run (the H100 nixl comparison at 512
and 4096 tokens: ``--backend nixl --prompt-len 512 4096 --variant kv-auth-off=--kv-transfer-insecure``).

``--code LABEL=PATH`` runs each backend's PD deployment once more with the kvship code of another checkout (its
processes import ``kvship`` from PATH: ``git worktree add /tmp/before <commit>``), beside the plain one and
interleaved with it, so a code change's before/after comes from one run; the tables add each deployment's fixed
cost, the traced TTFT less its prefill forward (what PD adds around the computation; steadier than PD - unified on
a busy CPU, where the forwards vary by more than it)::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/pd_ttft.py --model tiny --prompt-len 128 512 1536 --repeats 10 --code before=/tmp/before

Writes ``--out/pd_ttft.json`` (every sample with its whole trace) and ``--out/pd_ttft.md`` (the tables), again
after every backend, so a run cut off by SIGTERM (it stops its children) keeps the backends it finished.  On GPU the
unified worker runs on GPU 0 and ``kvship local`` spreads its workers (``--gpu-placement spread``, docs/pd.md):
with 2+ GPUs prefill runs on GPU 0 beside the unified worker and decode on GPU 1, so the KV crosses GPUs (nixl: CUDA
IPC over NVLink); with one GPU all three share it.  Every worker gets ``--max-total-tokens`` (default 2 x the
longest prompt + 1024).  Each deployment's devices are read back from its workers' ``/get_server_info``.

The KV GB/s column is read against ``copy_`` rates measured in the same run, in a child process before the PD
workers start (``device_copies``): a ``--copy-tokens`` (4096) token prompt's KV copied GPU0->GPU1 and within GPU 0;
the last column is the KV rate over the GPU0->GPU1 one (issue 15's goal: >= 70%).  Without two GPUs the output says
why that reference is missing.  ``--check-tokens N`` sends a few fixed prompts with greedy ``max_new_tokens: N``
to the unified worker and to each PD deployment, one at a time, and counts the answers equal token for token.
``--variant one-gpu=--gpu-placement,shared`` adds PD on GPU 0 alone beside the cross-GPU one.
Two H100s (issue 15, part 4)::

    PARTS=none bash bench/gpu_suite.sh >/dev/null 2>&1; . /tmp/site/env.sh; \
    timeout -s TERM 540 python3 bench/pd_ttft.py --device cuda --shape llama3-8b --backend nixl --backend mooncake \
        --prompt-len 512 4096 --repeats 5 --warmup 1 --check-tokens 32 --out "$OUT" 2>&1 | tail -45

The in-process variant (schedulers in threads of one process, no HTTP) is bench/pd_ttft_inproc.py.
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
import secrets
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
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best


def gpu_copy_rates(nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """``copy_`` of ``nbytes`` within GPU 0 and from GPU 0 to GPU 1 (when there is one): bytes/s, medians
    and bests of ``repeats`` copies timed with CUDA events on GPU 0's stream (where a cross-device
    ``copy_`` runs), after 3 warm-up copies (the first GPU0->GPU1 one enables peer access)."""
    import torch

    out: dict[str, Any] = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "same_device_Bps": copy_bandwidth("cuda:0"),
    }
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    targets = {"gpu0_gpu0": "cuda:0"}
    if torch.cuda.device_count() >= 2:
        targets["gpu0_gpu1"] = "cuda:1"
    with torch.cuda.device(0):
        for key, target in targets.items():
            dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
            for _ in range(3):
                dst.copy_(src)
            torch.cuda.synchronize(target)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            out[key + "_Bps"] = nbytes / statistics.median(times)
            out[key + "_best_Bps"] = nbytes / min(times)
            del dst
    return out


def device_copies(device: str, kv_nbytes: int, kv_tokens: int) -> dict[str, Any]:
    """The ``copy_`` rates the KV rates are read against, measured before the PD workers start.

    ``same_device_Bps``: 512 MiB within the device (CPU memory, or GPU 0's).  On CUDA, ``gpu0_gpu0_Bps`` and
    ``gpu0_gpu1_Bps``: a ``kv_tokens``-token prompt's KV (``kv_nbytes``) copied within GPU 0 and from GPU 0
    to GPU 1, where PD's prefill and decode workers run (``kvship local --gpu-placement spread``); without a
    second GPU ``peer_skipped`` says why.  The CUDA part runs in a child process, so that this one never holds
    GPU memory (or a CUDA context) the workers need.
    """
    import concurrent.futures
    import multiprocessing

    out: dict[str, Any] = {"kv_tokens": kv_tokens, "kv_bytes": kv_nbytes, "peer_skipped": None}
    if device != "cuda":
        out["same_device_Bps"] = copy_bandwidth(device)
        out["peer_skipped"] = f"--device {device}: GPU0->GPU1 copy_ not measured"
        return out
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        out.update(pool.submit(gpu_copy_rates, kv_nbytes).result())
    if "gpu0_gpu1_Bps" not in out:
        out["peer_skipped"] = f"{len(out['gpus'])} GPU visible: GPU0->GPU1 copy_ not measured"
    return out


# the worker key of this run's `kvship local` deployments (they read it from KVSHIP_WORKER_API_KEY): the router's
# GET /workers and the workers themselves take only it (docs/router.md, "Authentication")
WORKER_KEY = secrets.token_urlsafe(32)


def worker_devices(router_port: int) -> dict[str, list[str]]:
    """Each PD role's devices, read back from its workers (the router's ``/workers``, then each worker's
    ``/get_server_info`` ``device``: ``cuda:1``, or rank 0's at ``--tp-size`` > 1)."""
    out: dict[str, list[str]] = {}
    for w in http_json(router_port, "/workers", WORKER_KEY)["workers"]:
        port = int(w["url"].rsplit(":", 1)[1])
        out.setdefault(w["role"], []).append(http_json(port, "/get_server_info", WORKER_KEY)["device"])
    return out


def http_json(port: int, path: str, key: Optional[str] = None) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def local_supports(tree: Optional[str], needle: str) -> bool:
    """Whether the `kvship local` of ``tree`` (None: this checkout) knows ``needle`` (a flag's field name)."""
    with open(os.path.join(tree or ROOT, "app", "local.py")) as f:
        return needle in f.read()


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
    flags += ["--context-length", str(longest + max(64, args.check_tokens + 8))]
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
        "kv_auth": args.kv_auth,
        "worker_flags": flags,
        "unified": {},
        "backends": {},
        "devices": {},  # deployment -> role -> the devices its workers report
        "token_check": {},  # deployment -> --check-tokens' result
    }
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
        res["devices"]["unified"] = {"unified": [http_json(u_port, "/get_server_info")["device"]]}
        kv_nbytes = (res["kv_bytes_per_token"] or 2**17) * args.copy_tokens  # 128 KiB a token: Llama-3-8B's
        res["copy"] = device_copies(args.device, kv_nbytes, args.copy_tokens)
        res["copy_bandwidth_Bps"] = res["copy"]["same_device_Bps"]
        if args.device == "cuda":
            res["env"]["gpu"] = res["copy"]["gpus"][0]
            res["env"]["gpus"] = res["copy"]["gpus"]
        logger.info("copy_ rates: %s", {k: v for k, v in res["copy"].items() if k != "gpus"})
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
                        if args.kv_auth == "off":  # kvship local hands its workers a KV secret; this turns it off
                            argv.append("--kv-transfer-insecure")
                        if local_supports(tree, "debug_headers"):  # the trace and pair headers this bench reads
                            argv.append("--debug-headers")
                        tag = backend + ("-" + label if label else "")
                        env = code_env(tree, os.path.join(work, "code-" + label)) if tree else {}
                        env["KVSHIP_WORKER_API_KEY"] = WORKER_KEY
                        deployments[name] = (Proc(f"local-{tag}", _python() + argv, work, env), r_port)
                    for proc, port in deployments.values():
                        wait_ready(proc, port, "/readiness", args.startup_timeout)
                    for name, (_, port) in deployments.items():
                        res["devices"][name] = worker_devices(port)
                        logger.info("%s runs on %s", name, res["devices"][name])
                    clients = {name: Client(port, args.timeout) for name, (_, port) in deployments.items()}
                    for name, rows in measure(args, backend, clients, u_client, vocab, rng, res).items():
                        res["backends"][name] = rows
                    if args.check_tokens:
                        for name, client in clients.items():
                            res["token_check"][name] = check_tokens(args, client, u_client, vocab)
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
                if not equal and not args.shape:  # dummy weights: flat logits may flip a token; counted
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
            out[name][str(n)].update(kv_rates(res, n, med))
    return out


def check_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The fixed prompts of ``--check-tokens`` (the same for every deployment): 16, 128, 1024 tokens and the
    longest ``--prompt-len``, each short enough for its answer to fit the context."""
    rng = random.Random(args.seed + 1)
    room = max(args.prompt_len) + max(64, args.check_tokens + 8) - args.check_tokens
    lens = sorted({min(n, room) for n in (16, 128, 1024, max(args.prompt_len))})
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def check_tokens(args: argparse.Namespace, pd: Client, uni: Client, vocab: int) -> dict[str, Any]:
    """Greedy ``--check-tokens`` N-token answers of the unified worker and of the PD deployment to the same fixed
    prompts, one request at a time: how many sequences are equal token for token (PD across GPUs must equal
    unified), with the first differing position of each that is not."""
    out: dict[str, Any] = {"max_new_tokens": args.check_tokens, "prompts": [], "equal": 0}
    for ids in check_prompts(args, vocab):
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": args.check_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        answers = []
        for client in (uni, pd):
            status, _, answer, _, _ = client.generate(body)
            if status != 200:
                raise RuntimeError(f"--check-tokens, prompt of {len(ids)}: HTTP {status}: {answer}")
            answers.append(answer["output_ids"])
        u, p = answers
        first_diff = next((i for i, (a, b) in enumerate(zip(u, p)) if a != b), None)
        if first_diff is None and len(u) != len(p):
            first_diff = min(len(u), len(p))
        out["equal"] += first_diff is None
        out["prompts"].append({"prompt_len": len(ids), "tokens": len(u), "first_difference": first_diff})
    out["summary"] = f"{out['equal']}/{len(out['prompts'])}"
    logger.info("--check-tokens %d: %s sequences equal", args.check_tokens, out["summary"])
    return out


def fixed_cost(rows: list[dict[str, Any]]) -> Optional[float]:
    """Median over the traced requests of their TTFT less their prefill forward: what PD adds around the
    computation.  Steadier than PD - unified on a busy machine, where the forwards vary by more than it."""
    vals = [r["traced_ttft"] - r["segments"][FORWARD] for r in rows if FORWARD in r["segments"]]
    return statistics.median(vals) if vals else None


# ----------------------------------------------------------------------------------- report


def kv_rates(res: dict[str, Any], n: int, segments_: dict[str, float]) -> dict[str, Any]:
    """A prompt's KV bytes, the rate they moved at (bytes/s over the median trip of the traced samples) and
    that rate over the GPU0->GPU1 ``copy_`` rate of the same run (the issue's goal: >= 0.7); {} without them."""
    per_token, t = res.get("kv_bytes_per_token"), segments_.get(KV_TRIP)
    if not per_token or not t:
        return {}
    out: dict[str, Any] = {"kv_bytes": per_token * n, "kv_Bps": per_token * n / t}
    peer = res.get("copy", {}).get("gpu0_gpu1_Bps")
    if peer:
        out["kv_over_gpu0_gpu1_copy"] = out["kv_Bps"] / peer
    return out


def kv_cells(r: dict[str, Any]) -> str:
    """The prompt's KV size, its rate and that rate's share of the GPU0->GPU1 ``copy_`` rate, or blanks."""
    if "kv_Bps" not in r:
        return " | | "
    share = f"{100 * r['kv_over_gpu0_gpu1_copy']:.0f}%" if "kv_over_gpu0_gpu1_copy" in r else ""
    return f"{r['kv_bytes'] / 2**20:.1f} | {r['kv_Bps'] / 1e9:.2f} | {share}"


def copy_lines(res: dict[str, Any]) -> list[str]:
    """Where each deployment ran and the ``copy_`` rates its KV rate is read against."""
    c = res.get("copy") or {}
    lines = []
    if c:
        lines.append(
            f"`copy_` within this {res['device']} (512 MiB): {c['same_device_Bps'] / 1e9:.1f} GB/s (bytes copied "
            "per second, best of 6)."
        )
    if "gpu0_gpu1_Bps" in c:
        lines.append(
            f"`copy_` of a {c['kv_tokens']}-token prompt's KV ({c['kv_bytes'] / 2**20:.1f} MiB), medians of 10 after "
            f"warm-up: GPU0->GPU1 {c['gpu0_gpu1_Bps'] / 1e9:.1f} GB/s (best {c['gpu0_gpu1_best_Bps'] / 1e9:.1f}), "
            f"within GPU 0 {c['gpu0_gpu0_Bps'] / 1e9:.1f} GB/s; the KV table's last column is the KV rate over "
            "the GPU0->GPU1 one (goal >= 70%)."
        )
    elif c.get("peer_skipped"):
        lines.append(f"No GPU0->GPU1 reference: {c['peer_skipped']}.")
    if res.get("devices"):
        where = "; ".join(
            f"{name}: " + ", ".join(f"{role} {'/'.join(devs)}" for role, devs in roles.items())
            for name, roles in res["devices"].items()
        )
        lines.append(f"Devices (each worker's `/get_server_info`): {where}.")
    return [" ".join(lines)] if lines else []


def check_lines(res: dict[str, Any]) -> list[str]:
    """``--check-tokens``: PD's greedy answers against unified's, per deployment."""
    checks = res.get("token_check") or {}
    if not checks:
        return []
    lines = [
        "",
        "Token-for-token check (`--check-tokens`): greedy answers of the unified worker and of the PD deployment "
        "to the same fixed prompts, one request at a time:",
        "",
        "| deployment | max_new_tokens | equal sequences | prompt lengths | first difference (per prompt) |",
        "|---|---|---|---|---|",
    ]
    for name, c in checks.items():
        lens = ", ".join(str(p["prompt_len"]) for p in c["prompts"])
        diffs = ", ".join("-" if p["first_difference"] is None else str(p["first_difference"]) for p in c["prompts"])
        lines.append(f"| {name} | {c['max_new_tokens']} | {c['summary']} | {lens} | {diffs} |")
    return lines


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
        f"Clock: {res['clock']}.",
        "",
        *copy_lines(res),
        "",
        "| backend | prompt | unified TTFT ms | PD TTFT ms | PD - unified ms | PD / unified | same token | "
        "first token from prefill | KV MiB | KV GB/s (send start -> landed) | KV / GPU0->GPU1 copy_ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, per in res["backends"].items():
        if "error" in per:
            lines.append(f"| {b} | failed: {per['error']} | | | | | | | | | |")
            continue
        for n, r in per.items():
            lines.append(
                f"| {b} | {n} | {ms(r['unified_ttft'])} | {ms(r['ttft'])} | {ms(r['ttft'] - r['unified_ttft'])} | "
                f"{r['ttft'] / r['unified_ttft']:.2f}x | {r['equal']} | {r.get('prefill_first', '')} | "
                f"{kv_cells(r)} |"
            )
    lines += check_lines(res)
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
    ap.add_argument(
        "--check-tokens",
        type=int,
        default=0,
        metavar="N",
        help="per deployment, also send a few fixed prompts with greedy max_new_tokens N to unified and to PD and "
        "count the answers equal token for token (0: off)",
    )
    ap.add_argument(
        "--copy-tokens",
        type=int,
        default=4096,
        help="the GPU0->GPU1 copy_ reference moves this many tokens' KV (cuda with 2+ GPUs)",
    )
    ap.add_argument(
        "--kv-auth",
        choices=("on", "off"),
        default="on",
        help="KV-plane authentication of the PD deployments (docs/pd.md, 'KV plane authentication'): on (the "
        "product default) or off (--kv-transfer-insecure); `--variant kv-auth-off=--kv-transfer-insecure` runs "
        "both side by side in one run",
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
    if args.repeats < 1 or args.warmup < 0 or min(args.prompt_len) < 2 or args.check_tokens < 0:
        ap.error("--repeats >= 1, --warmup >= 0, --check-tokens >= 0, every --prompt-len >= 2")
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

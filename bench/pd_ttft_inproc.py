r"""TTFT of one PD request, broken down, beside the unified-mode TTFT of the same prompt (same run, same runner).

GPU (Llama-3.1-8B shape, dummy bf16 weights built on the GPU), one device call from the repository root with
``carry: [".device", ".whl"]`` (``PARTS=none`` makes gpu_suite.sh do only its setup: bundles, env,
``pip install --no-deps --no-build-isolation -e .``; about 1-3 minutes of benchmark after that)::

    PARTS=none bash bench/gpu_suite.sh >/dev/null 2>&1; . /tmp/site/env.sh; \
    python3 bench/pd_ttft_inproc.py --device cuda --shape llama3-8b --prompt-len 4096 \
        --backend nixl --backend mooncake --backend tcp --out "$OUT" 2>&1 | tail -40

CPU smoke run (embedded SmolLM2-135M, short prompt)::

    .venv/bin/python bench/pd_ttft_inproc.py --device cpu --prompt-len 256 --backend tcp --backend mooncake \
        --backend nixl --repeats 3 --out /tmp/pd_ttft

What one run does: builds a prefill ``ModelRunner`` and a decode ``ModelRunner`` in this process (both with a
small KV pool: ``--max-total-tokens``, default 3 x prompt + 1024, so two 8B-shape runners fit one 80 GB GPU),
then for each ``--backend`` wires a ``PrefillScheduler`` and a ``DecodeScheduler`` over the real transfer layer on
loopback (nixl: VRAM -> VRAM on the same GPU; mooncake: its tcp protocol; tcp: our socket backend) and measures,
after ``--warmup`` requests, ``--repeats`` fresh random prompts (no prefix reuse: radix cache off):

* breakdown (both schedulers stepped from this thread, so each phase runs alone):
  (a) ``prefill``: the prefill scheduler's extend step(s) of the prompt, first-token sampling included
      (device synchronized around each step);
  (b) ``transfer``: from "KV ready on prefill" (the first token is on the host and the scheduler hands the
      pages to the sender) until decode's receiver ``poll()`` returns Success (pages + aux record, the done
      signal, decode noticing it; polled every ~50 us);
  (c) ``decode_step``: the decode scheduler's first decode step (forward + sampling of token 2; the request
      joins the running batch with prefill's first token in the same step);
* ``pd_ttft``: end to end through both schedulers running their real loops in two threads (as the workers
  do): submit to both (as the router does) until decode's output sink gets the request's first token.
  Decode emits prefill's token in the same flush as the first decode step's token, so this TTFT includes (c);
* ``unified_ttft``: the unified ``Scheduler`` on the prefill runner (same runner type, same chunking), submit
  until its first token; ``unified_extend`` is its extend step(s) alone.  Measured before and after the PD
  runs (``--repeats`` each), the median over both.

Medians are printed with ratios (``pd_ttft / unified_ttft``; phases / ``pd_ttft``) and written to
``--out/pd_ttft.json`` and ``--out/pd_ttft.md``.  On CPU torch runs one intra-op thread by default
(``--num-threads``).  Overlap scheduling is off in every scheduler (each step's
timing is then that step's own); decode CUDA graphs stay on (``--disable-cuda-graph`` turns them off).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

logger = logging.getLogger("bench.pd_ttft_inproc")
BENCH_DIR = Path(__file__).resolve().parent


# the pair's KV transfer secret (one process, loopback; docs/pd.md "KV plane authentication")
_SECRET = b"kvship-bench-kv-transfer-secret-0123"


def _ensure_kvship() -> None:
    """Make ``kvship`` importable from a checkout that is not pip-installed (folders linked under a temp dir)."""
    try:
        import kvship.engine.config  # noqa: F401

        return
    except ImportError:
        pass
    root = BENCH_DIR.parent
    link_root = Path(tempfile.mkdtemp(prefix="kvship-src-"))
    (link_root / "kvship").mkdir()
    for d in ("engine", "prefill", "decode"):
        os.symlink(root / d, link_root / "kvship" / d)
    sys.path.insert(0, str(link_root))


_ensure_kvship()


def _write_model_dir(shape: str, root: str) -> str:
    """The dummy model folder (config.json only) of ``shape``, from bench/decode_latency.py."""
    spec = importlib.util.spec_from_file_location("bench_decode_latency", BENCH_DIR / "decode_latency.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.write_model_dir(shape, root)


# ----------------------------------------------------------------------------------- timing helpers


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Sink:
    """An ``output_sink`` recording when each request's first chunk with tokens (and its finish) arrived."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, dict] = {}
        self.cv = threading.Condition()

    def __call__(self, chunks: list) -> None:
        now = time.perf_counter()
        with self.cv:
            for c in chunks:
                if c.token_ids and c.rid not in self.first:
                    self.first[c.rid] = now
                if c.finished:
                    self.done[c.rid] = c.finish_reason
            self.cv.notify_all()

    def wait_done(self, rid: str, timeout: float) -> dict:
        with self.cv:
            if not self.cv.wait_for(lambda: rid in self.done, timeout):
                raise RuntimeError(f"request {rid} did not finish within {timeout} s")
            return self.done[rid]


def instrument(sched: Any, device: str) -> dict[str, list]:
    """Time ``sched``'s forward steps (and prefill's hand-off to the sender) from its events; returns the record
    lists.

    ``rec["steps"]``: (rids, is_extend, seconds) per forward, from its ``ForwardStarted`` (the device synchronized
    first, so a step's time is its own) to its ``ForwardFinished`` (its tokens on the host); ``rec["ship"]``:
    (rid, t) when prefill samples a prompt's first token, the moment it hands the computed prompt to its sender
    (docs/observability.md, "Events").
    """
    from kvship.common.events import FirstToken, ForwardFinished, ForwardStarted

    rec: dict[str, list] = {"steps": [], "ship": []}
    started: dict[tuple[str, ...], float] = {}
    prefill = sched.role.mode == "prefill"

    def on_event(ev: Any) -> None:
        if isinstance(ev, ForwardStarted):
            _sync(device)
            started[ev.rids] = time.perf_counter()
        elif isinstance(ev, ForwardFinished):
            rec["steps"].append((list(ev.rids), ev.mode == "extend", time.perf_counter() - started.pop(ev.rids)))
        elif prefill and isinstance(ev, FirstToken):
            rec["ship"].append((ev.rid, time.perf_counter()))

    sched.events.subscribe(on_event)
    return rec


def step_time(rec: dict[str, list], rid: str, extend: bool) -> float:
    """Seconds of ``rid``'s extend steps (summed) or of its first decode step."""
    times = [s for rids, ext, s in rec["steps"] if rid in rids and ext == extend]
    if not times:
        raise RuntimeError(f"no {'extend' if extend else 'decode'} step recorded for {rid}")
    return sum(times) if extend else times[0]


class LoopThread:
    """``sched.run_forever`` in a daemon thread; ``stop()`` runs the scheduler's shutdown path."""

    def __init__(self, sched: Any, name: str):
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=sched.run_forever, args=(self.stop_event,), name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(60)
        if self.thread.is_alive():
            raise RuntimeError("scheduler thread did not stop")


# ----------------------------------------------------------------------------------- the measurements


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Optional[str]):
        from kvship.engine.config import ServerArgs
        from kvship.engine.model_runner import ModelRunner

        self.args = args
        self.device = args.device
        n = args.prompt_len
        common = dict(
            model_path=model_dir,
            load_format=args.load_format,
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens or 3 * n + 1024,
            context_length=n + 64,
            max_running_requests=8,
            disable_radix_cache=True,
            disable_overlap_schedule=True,
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=max(8192, n),
            cuda_graph_max_bs=8,
            disable_cuda_graph=args.disable_cuda_graph,
            num_threads=args.num_threads,
        )
        if args.attention_backend:
            common["attention_backend"] = args.attention_backend
        self.common = common
        self.sa = {m: ServerArgs(mode=m, **common) for m in ("prefill", "decode", "unified")}
        logger.info("building the prefill runner")
        self.p_runner = ModelRunner(self.sa["prefill"])
        logger.info("building the decode runner")
        self.d_runner = ModelRunner(self.sa["decode"])
        self.vocab = int(self.p_runner.model_config.vocab_size)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.rooms = itertools.count(1 << 40)
        self.rids = itertools.count()

    def prompt(self) -> list[int]:
        return torch.randint(3, self.vocab, (self.args.prompt_len,), generator=self.gen).tolist()

    def request(self, rid: str, ids: list[int], room: Optional[int] = None, port: Optional[int] = None):
        from kvship.engine.io_struct import GenerateRequest, SamplingParams

        sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        if room is None:
            return GenerateRequest(rid=rid, input_ids=ids, sampling_params=sp)
        return GenerateRequest(
            rid=rid,
            input_ids=ids,
            sampling_params=sp,
            bootstrap_host="127.0.0.1",
            bootstrap_port=port,
            bootstrap_room=room,
            bootstrap_token=f"bench-room-token-{room}",
        )

    def _check_free(self, runner: Any, who: str) -> None:
        a = runner.allocator
        if a.available_size() != a.total_slots:
            raise RuntimeError(f"{who}: {a.total_slots - a.available_size()} KV slots still held after the run")

    # ---------------------------------------------------------------- PD
    def pd(self, backend: str) -> dict[str, Any]:
        from kvship.decode.scheduler import DecodeScheduler
        from kvship.engine.disagg import KVPoll, KVTransferConfig
        from kvship.prefill.scheduler import PrefillScheduler

        a = self.args
        p_sink, d_sink = Sink(), Sink()
        prefill = PrefillScheduler(
            self.sa["prefill"],
            self.p_runner,
            None,
            p_sink,
            kv_config=KVTransferConfig(backend=backend, bootstrap_port=0, secret=_SECRET),
        )
        try:
            decode = DecodeScheduler(
                self.sa["decode"],
                self.d_runner,
                None,
                d_sink,
                kv_config=KVTransferConfig(backend=backend, secret=_SECRET),
            )
        except BaseException:
            prefill.close()
            raise
        p_rec, d_rec = instrument(prefill, self.device), instrument(decode, self.device)
        port = prefill.bootstrap_port
        rows: list[dict[str, float]] = []
        loops: list[LoopThread] = []
        try:
            # --- breakdown: both schedulers stepped from this thread
            for i in range(a.warmup + a.repeats):
                rid = f"{backend}-b{next(self.rids)}"
                ids, room = self.prompt(), next(self.rooms)
                t0 = time.perf_counter()
                decode.submit(self.request(rid, ids, room, port))
                prefill.submit(self.request(rid, ids, room, port))
                deadline = time.monotonic() + a.timeout
                while prefill.role.inflight_queue.get(rid) is None:  # the extend(s), then the hand-off
                    decode.step()
                    prefill.step()
                    if rid in p_sink.done or rid in d_sink.done:
                        why = p_sink.done.get(rid) or d_sink.done.get(rid)
                        raise RuntimeError(f"{backend}: {rid} ended early: {why}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{backend}: {rid} not prefilled within {a.timeout} s")
                    time.sleep(0.0002)
                entry = decode.role.transfer_queue.get(rid)
                if entry is None:
                    raise RuntimeError(f"{backend}: {rid} is not in decode's transfer queue")
                while not (state := entry.transfer.poll()).is_terminal:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{backend}: no KV for {rid} within {a.timeout} s")
                    time.sleep(0.00005)
                t_success = time.perf_counter()
                if state != KVPoll.Success:
                    raise RuntimeError(f"{backend}: transfer of {rid} failed: {entry.transfer.failure_reason}")
                while rid not in d_sink.done:  # joins the running batch, first decode step, finishes
                    decode.step()
                    prefill.step()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{backend}: {rid} not decoded within {a.timeout} s")
                while rid not in p_sink.done:
                    prefill.step(block_s=0.001)
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{backend}: prefill never released {rid}")
                if d_sink.done[rid].get("type") == "abort":
                    raise RuntimeError(f"{backend}: {rid} aborted: {d_sink.done[rid]}")
                t_ready = dict(p_rec["ship"])[rid]
                row = dict(
                    prefill=step_time(p_rec, rid, True),
                    transfer=t_success - t_ready,
                    decode_step=step_time(d_rec, rid, False),
                    stepped_ttft=d_sink.first[rid] - t0,
                )
                if i >= a.warmup:
                    rows.append(row)
                logger.info(
                    "%s breakdown %s%s: %s",
                    backend,
                    rid,
                    " (warm-up)" if i < a.warmup else "",
                    {k: round(v * 1e3, 3) for k, v in row.items()},
                )
            # --- end to end: the real scheduler loops
            loops = [LoopThread(prefill, "pd-prefill"), LoopThread(decode, "pd-decode")]
            e2e: list[dict[str, float]] = []
            for i in range(a.warmup + a.repeats):
                rid = f"{backend}-e{next(self.rids)}"
                ids, room = self.prompt(), next(self.rooms)
                t0 = time.perf_counter()
                decode.submit(self.request(rid, ids, room, port))
                prefill.submit(self.request(rid, ids, room, port))
                reason = d_sink.wait_done(rid, a.timeout)
                p_sink.wait_done(rid, a.timeout)
                if reason.get("type") == "abort":
                    raise RuntimeError(f"{backend}: {rid} aborted: {reason}")
                row = dict(pd_ttft=d_sink.first[rid] - t0, pd_prefill_in_loop=step_time(p_rec, rid, True))
                if i >= a.warmup:
                    e2e.append(row)
                logger.info(
                    "%s end to end %s%s: %s",
                    backend,
                    rid,
                    " (warm-up)" if i < a.warmup else "",
                    {k: round(v * 1e3, 3) for k, v in row.items()},
                )
        finally:
            for lp in loops:
                lp.stop()
            if not loops:  # never looped: close the transfer layers ourselves
                prefill.close()
                decode.close()
        self._check_free(self.p_runner, f"{backend} prefill")
        self._check_free(self.d_runner, f"{backend} decode")
        out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out.update({k: statistics.median(r[k] for r in e2e) for k in e2e[0]})
        out["samples"] = {"breakdown": rows, "end_to_end": e2e}
        return out

    # ---------------------------------------------------------------- unified
    def unified(self) -> list[dict[str, float]]:
        """Unified TTFT samples (after warm-up) on the prefill runner."""
        from kvship.engine.scheduler import Scheduler

        a = self.args
        sink = Sink()
        sched = Scheduler(self.sa["unified"], self.p_runner, None, sink)
        rec = instrument(sched, self.device)
        loop = LoopThread(sched, "unified")
        rows = []
        try:
            for i in range(a.warmup + a.repeats):
                rid = f"u{next(self.rids)}"
                ids = self.prompt()
                t0 = time.perf_counter()
                sched.submit(self.request(rid, ids))
                reason = sink.wait_done(rid, a.timeout)
                if reason.get("type") == "abort":
                    raise RuntimeError(f"unified: {rid} aborted: {reason}")
                row = dict(unified_ttft=sink.first[rid] - t0, unified_extend=step_time(rec, rid, True))
                if i >= a.warmup:
                    rows.append(row)
                logger.info(
                    "unified %s%s: %s",
                    rid,
                    " (warm-up)" if i < a.warmup else "",
                    {k: round(v * 1e3, 3) for k, v in row.items()},
                )
        finally:
            loop.stop()
        self._check_free(self.p_runner, "unified")
        return rows


# ----------------------------------------------------------------------------------- report


def environment(device: str) -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    from importlib.metadata import PackageNotFoundError, version

    dists = {
        "flashinfer": ("flashinfer-python",),
        "nixl": ("nixl", "nixl-cu13", "nixl-cu12"),
        "mooncake": (
            "mooncake-transfer-engine-cuda13",
            "mooncake-transfer-engine",
            "mooncake-transfer-engine-non-cuda",
        ),
    }
    for pkg, names in dists.items():
        for name in names:
            with contextlib.suppress(PackageNotFoundError):
                env[pkg] = version(name)
                break
    return env


def markdown(res: dict[str, Any]) -> str:
    u = res["unified"]
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [
        f"## PD TTFT breakdown ({res['model']}, prompt {res['prompt_len']} tokens, page {res['page_size']}, "
        f"{res['device']}{' ' + res['env'].get('gpu', '') if res['device'] == 'cuda' else ''})",
        "",
        f"Medians of {res['repeats']} requests per phase (after {res['warmup']} warm-up; unified: "
        f"{2 * res['repeats']}, half before and half after the PD runs). Unified TTFT "
        f"{ms(u['unified_ttft'])} ms (its extend {ms(u['unified_extend'])} ms).",
        "",
        "| backend | (a) prefill ms | (b) KV transfer ms | (c) first decode step ms | a+b+c ms | "
        "PD TTFT ms (e2e) | e2e - (a+b+c) ms | unified TTFT ms | PD / unified | transfer / PD TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, r in res["backends"].items():
        if "error" in r:
            lines.append(f"| {b} | failed: {r['error']} | | | | | | | | |")
            continue
        abc = r["prefill"] + r["transfer"] + r["decode_step"]
        lines.append(
            f"| {b} | {ms(r['prefill'])} | {ms(r['transfer'])} | {ms(r['decode_step'])} | {ms(abc)} | "
            f"{ms(r['pd_ttft'])} | {ms(r['pd_ttft'] - abc)} | {ms(u['unified_ttft'])} | "
            f"{r['pd_ttft'] / u['unified_ttft']:.2f}x | "
            f"{r['transfer'] / r['pd_ttft']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--backend",
        action="append",
        choices=("tcp", "mooncake", "nixl"),
        help="transfer backend (repeatable; default: tcp, mooncake, nixl)",
    )
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--model-path",
        default=None,
        help="model folder / .gguf (default: --shape's dummy config on cuda, the embedded SmolLM2 on cpu)",
    )
    ap.add_argument(
        "--shape",
        default=None,
        help="write this bench/decode_latency.py shape's config.json "
        "(e.g. llama3-8b) and use it with --load-format dummy",
    )
    ap.add_argument("--load-format", default=None, help="default: dummy with --shape, else auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048, help="as the server's flag (-1: off)")
    ap.add_argument("--attention-backend", default=None, help="default: the server's auto")
    ap.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool of each runner (default 3 x prompt + 1024)"
    )
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on cpu, where each scheduler thread gets its own "
        "OpenMP team and teams of several threads spin against each other, which swamps the "
        "timings; torch's choice on cuda)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.repeats < 1 or args.warmup < 0 or args.prompt_len < 2:
        ap.error("--repeats >= 1, --warmup >= 0 and --prompt-len >= 2")
    if args.shape is None and args.model_path is None and args.device == "cuda":
        args.shape = "llama3-8b"
    model_dir = args.model_path
    if args.shape is not None:
        if args.model_path is not None:
            ap.error("give --shape or --model-path, not both")
        try:
            model_dir = _write_model_dir(args.shape, tempfile.mkdtemp(prefix="kvship-pd-ttft-"))
        except KeyError:
            ap.error(f"--shape {args.shape}: not a shape of bench/decode_latency.py")
        args.load_format = args.load_format or "dummy"
        if args.dtype == "auto" and args.device == "cuda":
            args.dtype = "bfloat16"
    args.load_format = args.load_format or "auto"
    if args.num_threads is None and args.device == "cpu":
        args.num_threads = 1
    backends = args.backend or ["tcp", "mooncake", "nixl"]

    bench = Bench(args, model_dir)
    res: dict[str, Any] = {
        "env": environment(args.device),
        "device": args.device,
        "prompt_len": args.prompt_len,
        "page_size": args.page_size,
        "chunked_prefill_size": args.chunked_prefill_size,
        "model": args.shape or os.path.basename(str(bench.p_runner.model_path)),
        "load_format": args.load_format,
        "dtype": str(bench.p_runner.dtype),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "max_total_tokens": bench.common["max_total_tokens"],
        "num_threads": torch.get_num_threads(),
        "backends": {},
    }
    os.makedirs(args.out, exist_ok=True)
    unified = bench.unified()  # before and after the PD runs: drift of the machine shows in both
    for b in backends:
        try:
            res["backends"][b] = bench.pd(b)
        except Exception as e:  # noqa: BLE001 - report it, keep the other backends
            logger.exception("backend %s failed", b)
            res["backends"][b] = {"error": f"{type(e).__name__}: {e}"}
    unified += bench.unified()
    res["unified"] = {k: statistics.median(r[k] for r in unified) for k in unified[0]}
    res["unified"]["samples"] = unified
    md = markdown(res)
    with open(os.path.join(args.out, "pd_ttft.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "pd_ttft.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all("error" not in r for r in res["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

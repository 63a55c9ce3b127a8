"""Helpers for the PD tests (test code only; importable, not a test module).

In-process (fast, no HTTP):

* ``Collector``: an ``output_sink`` that keeps every ``TokenChunk``.
* ``SchedulerThread``: a scheduler stepping in a daemon thread (``stop()`` ends it,
  which runs its shutdown path).
* ``InProcessPD(model_dir, ...)``: a ``PrefillScheduler`` and a ``DecodeScheduler``
  on their own ``ModelRunner``s (new, or reused through ``runners=``) in this process, talking through the real transfer
  layer on loopback (``tokenizer=``: a kvship ``Tokenizer`` for both, e.g. for structured output; ``submit(...,
  sampling={...})``: extra ``SamplingParams`` fields).  ``submit(rid, ids, ...)`` sends a request to both with a fresh
  room (or only to one side), ``wait(rids)`` waits for the decode side's finished
  chunks, ``tokens(rid)`` / ``finish(rid)`` read them, ``wait_idle()`` waits until
  both sides hold no request and every KV slot is free; ``run_registered_first(prompts, max_new)``
  lets decode register every room before prefill sees the requests (layer-wise sends).
* ``HeldLayer(pd, layer)``: holds the prefill forward's last layer of a layer-wise send;
  ``layer0_on_decode(pd, rid, n)``: layer 0's KV of ``rid`` reached decode.
* ``unified_greedy(model_dir, prompts, max_new, **server_args)``: the unified
  scheduler's greedy outputs (the reference PD must equal), cached per arguments.
* ``make_prompts(n, seed, lo, hi)``: random token-id prompts for the tiny models.
* ``KV_SECRET`` / ``room_token(room)``: the KV transfer secret and a room's ``bootstrap_token`` the in-process
  PD tests use (KV-plane authentication is on, as in the product; docs/pd.md "KV plane authentication").

Real processes (``kvship local`` on loopback):

* ``start_local(args, env=None)``: context manager running ``kvship local <args>
  --port <free> --debug-headers`` (env ``KVSHIP_WORKER_API_KEY``: a random worker key) until its router is ready
  (``--debug-headers``: tests read which workers served from the ``x-kvship-*``
  headers); yields a ``LocalCluster`` with ``url``, ``worker_headers`` (the worker
  key, which the workers and the router's ``/workers`` / ``/metrics`` / ``/slo``
  require), ``workers(role)`` (URLs from the router's ``/workers``), ``info(url)``,
  ``pid(url)``, ``generate(...)`` and ``wait_free(urls)``.  On exit it sends SIGINT
  (the real Ctrl-C path) and SIGKILLs the process group only as a last resort.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import httpx
import torch

from kvship.common.ports import free_port  # below the ephemeral range: no race with bind(0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 384
KV_SECRET = b"kvship-test-kv-transfer-secret-0123456789"


def room_token(room: int) -> str:
    """A valid ``bootstrap_token`` for ``room`` (tests; the router draws them with ``secrets``)."""
    return f"test-room-token-{room}"


def make_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 120, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


# ----------------------------------------------------------------------------------- in process


class Collector:
    def __init__(self) -> None:
        self.chunks: list = []
        self.lock = threading.Lock()

    def __call__(self, chunks: list) -> None:
        with self.lock:
            self.chunks.extend(chunks)

    def tokens(self, rid: str) -> list[int]:
        with self.lock:
            return [t for c in self.chunks if c.rid == rid for t in c.token_ids]

    def finished(self, rid: str) -> list:
        with self.lock:
            return [c for c in self.chunks if c.rid == rid and c.finished]


class SchedulerThread:
    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=scheduler.run_forever, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "scheduler thread did not stop"


def _server_args(model_dir: str, **kw: Any):
    from kvship.engine.config import ServerArgs

    args = dict(model_path=model_dir, device="cpu", max_total_tokens=8192)
    args.update(kw)
    return ServerArgs(**args)


class InProcessPD:
    """Prefill + decode schedulers in this process (see the module docstring)."""

    _rooms = itertools.count(1000)

    def __init__(
        self,
        model_dir: str,
        *,
        backend: str = "tcp",
        prefill_kv: Optional[dict] = None,
        decode_kv: Optional[dict] = None,
        prefill_args: Optional[dict] = None,
        decode_args: Optional[dict] = None,
        runners: Optional[tuple] = None,
        tokenizer: Any = None,
        **common: Any,
    ):
        from kvship.app.roles import scheduler_for_mode
        from kvship.engine.disagg import KVTransferConfig
        from kvship.engine.model_runner import ModelRunner
        from kvship.prefill.scheduler import PrefillScheduler

        psa = _server_args(
            model_dir,
            mode="prefill",
            disaggregation_transfer_backend=backend,
            # layer-wise sends on (the product default, docs/pd.md; explicit so that these tests cover it whatever
            # the default): they cover both sends
            **{
                "disaggregation_layerwise": True,
                "disaggregation_layerwise_min_tokens": 0,
                **common,
                **(prefill_args or {}),
            },
        )
        dsa = _server_args(
            model_dir, mode="decode", disaggregation_transfer_backend=backend, **{**common, **(decode_args or {})}
        )
        self.p_out, self.d_out = Collector(), Collector()
        # ``runners``: (prefill, decode) ModelRunners to reuse (their pools must be empty: run with
        # disable_radix_cache so no KV stays behind in a cache the next scheduler would not know)
        p_runner, d_runner = runners if runners is not None else (ModelRunner(psa), ModelRunner(dsa))
        # through the app's factory, so --speculative-algorithm eagle|eagle3 in prefill_args ships prompt features
        self.prefill: PrefillScheduler = scheduler_for_mode("prefill")(
            psa,
            p_runner,
            tokenizer,
            self.p_out,
            kv_config=KVTransferConfig(
                backend=backend, bootstrap_port=0, **{"secret": KV_SECRET, **(prefill_kv or {})}
            ),
        )
        try:
            # --speculative-* in decode_args gives the decode worker a speculator
            self.decode = scheduler_for_mode("decode")(
                dsa,
                d_runner,
                tokenizer,
                self.d_out,
                kv_config=KVTransferConfig(backend=backend, **{"secret": KV_SECRET, **(decode_kv or {})}),
            )
        except BaseException:
            self.prefill.close()
            raise
        self.p_thread = SchedulerThread(self.prefill)
        self.d_thread = SchedulerThread(self.decode)

    def close(self) -> None:
        self.p_thread.stop()
        self.d_thread.stop()

    def __enter__(self) -> "InProcessPD":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(
        self, rid: str, ids: Sequence[int], room: int, max_new: int = 16, port: Optional[int] = None, **kw: Any
    ):
        from kvship.engine.io_struct import GenerateRequest, SamplingParams

        sp = SamplingParams(**{"max_new_tokens": max_new, "temperature": 0.0, **kw.pop("sampling", {})})
        return GenerateRequest(
            rid=rid,
            input_ids=list(ids),
            sampling_params=sp,
            bootstrap_host="127.0.0.1",
            bootstrap_port=port or self.prefill.bootstrap_port,
            bootstrap_room=room,
            **{"bootstrap_token": room_token(room), **kw},
        )

    def submit(
        self, rid: str, ids: Sequence[int], max_new: int = 16, to: str = "both", room: Optional[int] = None, **kw: Any
    ) -> int:
        room = next(self._rooms) if room is None else room
        if to in ("both", "prefill"):
            self.prefill.submit(self.request(rid, ids, room, max_new, **kw))
        if to in ("both", "decode"):
            self.decode.submit(self.request(rid, ids, room, max_new, **kw))
        return room

    def wait_registered(self, n: int, timeout: float = 30.0) -> None:
        """Prefill holds ``n`` registrations of rooms it has no request for yet."""
        m = self.prefill.kv_manager
        deadline = time.monotonic() + timeout
        while True:
            with m.lock:
                if len(m._pending) >= n:
                    return
            assert time.monotonic() < deadline, "decode's registrations never reached prefill"
            time.sleep(0.01)

    def run_registered_first(self, prompts: Sequence[Sequence[int]], max_new: int, **kw: Any) -> list[str]:
        """Decode takes every request (and registers its room) before prefill sees any, so every prompt's last
        chunk may ship layer-wise (docs/pd.md, "Layer-wise transfer"); returns the rids, once both sides finished."""
        rids = [f"r{i}" for i in range(len(prompts))]
        rooms = [self.submit(rid, p, max_new, to="decode", **kw) for rid, p in zip(rids, prompts)]
        self.wait_registered(len(prompts))
        for rid, p, room in zip(rids, prompts, rooms):
            self.submit(rid, p, max_new, to="prefill", room=room, **kw)
        self.wait(rids)
        self.wait(rids, side="prefill")
        return rids

    def tokens(self, rid: str) -> list[int]:
        return self.d_out.tokens(rid)

    def finish(self, rid: str, side: str = "decode") -> Optional[dict]:
        fin = (self.d_out if side == "decode" else self.p_out).finished(rid)
        assert len(fin) <= 1, f"{rid} finished {len(fin)} times on {side}"
        return fin[0].finish_reason if fin else None

    def wait(self, rids: Sequence[str], side: str = "decode", timeout: float = 60.0) -> None:
        out = self.d_out if side == "decode" else self.p_out
        deadline = time.monotonic() + timeout
        while not all(out.finished(r) for r in rids):
            if time.monotonic() > deadline:
                missing = [r for r in rids if not out.finished(r)]
                raise AssertionError(f"{side}: {len(missing)} requests unfinished after {timeout} s: {missing[:5]}")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Both schedulers hold no request and report every KV slot free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = [s.get_stats() for s in (self.prefill, self.decode)]
            busy = [s for s in (self.prefill, self.decode) if s.reqs]
            if not busy and all(st["free_slots"] == st["total_slots"] for st in stats):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: prefill {stats[0]}, decode {stats[1]}")
            time.sleep(0.05)


class HeldLayer:
    """Wraps the prefill runner's attention backend (a context manager): the first time layer ``layer`` runs in a
    forward that signals its layers (``ForwardBatch.layer_done``: a layer-wise send), it waits for ``release``
    before its attention (so its K/V is not stored yet) and runs ``while_held()`` meanwhile (its result in
    ``result``), or raises with ``fail``.  ``done_at``: when that layer's attention returned."""

    def __init__(self, pd: InProcessPD, layer: int, while_held: Any = None, fail: bool = False):
        self.backend = pd.prefill.runner.attn_backend
        self.held = threading.Event()
        self.release = threading.Event()
        self.result: Any = None
        self.done_at: Optional[float] = None
        real = type(self.backend).forward

        def forward(q, k, v, spec, fb, save_kv_cache=True, out_group=0):
            if spec.layer_id != layer or fb.layer_done is None or self.held.is_set():
                return real(self.backend, q, k, v, spec, fb, save_kv_cache, out_group)
            self.held.set()
            if while_held is not None:
                self.result = while_held()
            self.release.wait(30)
            if fail:
                raise RuntimeError("injected failure in the last layer")
            out = real(self.backend, q, k, v, spec, fb, save_kv_cache, out_group)
            self.done_at = time.time()
            return out

        self.backend.forward = forward

    def __enter__(self) -> "HeldLayer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        del self.backend.forward


def layer0_on_decode(pd: InProcessPD, rid: str, n: int, timeout: float = 10.0) -> bool:
    """Layer 0's K and V of ``rid``'s ``n``-token prompt are in decode's pool (what prefill holds) within
    ``timeout``; ``rid`` waits for its KV on decode."""
    p_req = pd.prefill.reqs[rid]
    d_req = pd.decode.role.transfer_queue.get(rid).req
    src = pd.prefill.req_to_token_pool.read(p_req.req_pool_idx, 0, n).long()
    dst = pd.decode.req_to_token_pool.read(d_req.req_pool_idx, 0, n).long()
    p_pool, d_pool = pd.prefill.runner.kv_pool, pd.decode.runner.kv_pool
    pairs = ((p_pool.k_buffer[0], d_pool.k_buffer[0]), (p_pool.v_buffer[0], d_pool.v_buffer[0]))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(torch.equal(dbuf[dst.to(dbuf.device)], pbuf[src.to(pbuf.device)]) for pbuf, dbuf in pairs):
            return True
        time.sleep(0.005)
    return False


_UNIFIED_CACHE: dict = {}


def run_until_idle(sched: Any, timeout_s: float = 120.0, block_s: float = 0.01) -> None:
    """Step a scheduler in this thread until it is idle; fail after ``timeout_s`` (a deadline, not a step count:
    a grammar compiling on a busy box leaves steps with nothing to run)."""
    deadline = time.monotonic() + timeout_s
    while not sched.idle():
        assert time.monotonic() < deadline, f"scheduler not idle after {timeout_s:.0f} s"
        sched.step(block_s=0.0 if sched.has_work() else block_s)  # as the serving loop does


def unified_greedy(model_dir: str, prompts: Sequence[Sequence[int]], max_new: int, **kw: Any) -> list[list[int]]:
    """Greedy outputs of the unified scheduler (all prompts submitted at once)."""
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler

    key = (model_dir, tuple(map(tuple, prompts)), max_new, tuple(sorted(kw.items())))
    if key not in _UNIFIED_CACHE:
        sa = _server_args(model_dir, **kw)
        out = Collector()
        sched = Scheduler(sa, ModelRunner(sa), None, out)
        for i, p in enumerate(prompts):
            sched.submit(
                GenerateRequest(
                    rid=f"u{i}",
                    input_ids=list(p),
                    sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
                )
            )
        run_until_idle(sched)
        assert all(out.finished(f"u{i}") for i in range(len(prompts)))
        _UNIFIED_CACHE[key] = [out.tokens(f"u{i}") for i in range(len(prompts))]
    return _UNIFIED_CACHE[key]


# ----------------------------------------------------------------------------------- processes


@dataclass
class LocalCluster:
    url: str
    proc: subprocess.Popen
    log_dir: str
    stdout_path: str
    headers: dict = field(default_factory=dict)  # the router's client key, if it has one
    worker_headers: dict = field(default_factory=dict)  # the worker key (workers; the router's /workers)

    def workers(self, role: str) -> list[str]:
        data = httpx.get(self.url + "/workers", timeout=10, headers=self.worker_headers).json()
        return sorted(w["url"] for w in data["workers"] if w["role"] == role)

    def info(self, url: str) -> dict:
        return httpx.get(url + "/get_server_info", timeout=10, headers=self.worker_headers).json()

    def pid(self, url: str) -> int:
        return int(self.info(url)["pid"])

    def generate(self, ids: Sequence[int], max_new: int = 16, timeout: float = 120.0, **body: Any) -> httpx.Response:
        payload = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
        payload.update(body)
        return httpx.post(self.url + "/generate", json=payload, timeout=timeout)

    def wait_free(self, urls: Sequence[str], timeout: float = 30.0) -> None:
        """Every worker in ``urls`` reports free_slots == total_slots and no request in any queue."""
        deadline = time.monotonic() + timeout
        while True:
            infos = {u: self.info(u) for u in urls}
            bad = {
                u: {
                    k: i.get(k)
                    for k in (
                        "free_slots",
                        "total_slots",
                        "running",
                        "waiting",
                        "active_requests",
                        "bootstrap_queue",
                        "inflight_queue",
                        "prealloc_queue",
                        "transfer_queue",
                        "prebuilt_queue",
                    )
                }
                for u, i in infos.items()
                if i["free_slots"] != i["total_slots"]
                or i.get("active_requests", 0)
                or any(
                    i.get(q, 0)
                    for q in (
                        "bootstrap_queue",
                        "inflight_queue",
                        "prealloc_queue",
                        "transfer_queue",
                        "prebuilt_queue",
                        "running",
                        "waiting",
                    )
                )
            }
            if not bad:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still hold KV or requests after {timeout} s: {bad}")
            time.sleep(0.1)

    def log(self, name: str, n: int = 60) -> str:
        path = self.stdout_path if name == "local" else os.path.join(self.log_dir, f"{name}.log")
        try:
            with open(path, "rb") as f:
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
        except OSError:
            return ""


@contextlib.contextmanager
def start_local(
    args: Sequence[str], env: Optional[dict[str, str]] = None, timeout: float = 300.0, api_key: Optional[str] = None
) -> Iterator[LocalCluster]:
    """Run ``kvship local <args>`` until its router is ready; SIGINT it on exit.

    With ``api_key`` (given as ``--api-key``), the cluster's router calls send it."""
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="kvship-pd-test-")
    stdout_path = os.path.join(log_dir, "local.out")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [
        sys.executable,
        "-m",
        "kvship.app.cli",
        "local",
        "--port",
        str(port),
        "--log-dir",
        log_dir,
        "--shutdown-grace",
        "10",
        *args,
    ]
    headers = {}
    if api_key is not None:
        cmd += ["--api-key", api_key]
        headers["authorization"] = f"Bearer {api_key}"
    worker_key = secrets.token_urlsafe(32)
    full_env.setdefault("KVSHIP_WORKER_API_KEY", worker_key)  # (a key may begin with "-": not as a flag value)
    worker_key = full_env["KVSHIP_WORKER_API_KEY"]
    if "--no-debug-headers" not in args:
        cmd.append("--debug-headers")
    with open(stdout_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
        )
    cluster = LocalCluster(
        url=f"http://127.0.0.1:{port}",
        proc=proc,
        log_dir=log_dir,
        stdout_path=stdout_path,
        headers=headers,
        worker_headers={"authorization": f"Bearer {worker_key}"},
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvship local exited with {proc.returncode}:\n{cluster.log('local')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(cluster.url + "/readiness", timeout=2, headers=headers).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvship local not ready after {timeout} s:\n{cluster.log('local')}")
            time.sleep(0.3)
        yield cluster
    finally:
        stop_local(proc)


def stop_local(proc: subprocess.Popen, timeout: float = 60.0) -> Optional[int]:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0): look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

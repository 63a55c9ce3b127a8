"""KV transfer throughput per backend, beside a raw memcpy baseline of the same bytes.

Two processes: this one is prefill (source pool, KVSender), a spawned child is
decode (destination pool, KVReceiver).  A case's time runs from ``send()`` on
prefill until decode's ``poll()`` returns Success (both read CLOCK_MONOTONIC,
which is system-wide on Linux), so it includes the control messages, the aux
record and decode noticing the done signal: what a request pays.

Cases:
* ``sweep``: 1 MiB .. 256 MiB requests (8 layers, 8 KV heads, head dim 128,
  bf16, page size 16; pages contiguous on both sides: one descriptor per buffer).
* ``request``: one 4096-token prompt of SmolLM2-135M's shape (30 layers, 3 KV
  heads, head dim 64; float32 on CPU, bf16 on CUDA as the engine runs them), page
  size 16 and 1, destination pages contiguous or scattered (every page its own
  run: the worst case, 60 descriptors per page).

The baseline is ``torch`` copying the same number of bytes in one process (one
contiguous copy, best of several; one thread on CPU, like one transfer stream),
so ``ratio`` = backend GB/s / memcpy GB/s.

    python bench/kv_transfer.py --out docs/results/kv_transfer_cpu.json
    python bench/kv_transfer.py --device cuda --backends mooncake,nixl --out /tmp/out/kv_transfer_cuda.json

``--out`` gets the JSON, and the same path with ``.md`` the markdown table.
Self-contained: needs only torch, kvship, and the backends' packages.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _ensure_kvship() -> None:
    """Make ``kvship.engine`` importable from a bare checkout (e.g. on the GPU machine, not pip-installed)."""
    try:
        import kvship.engine  # noqa: F401

        return
    except ImportError:
        pass
    import importlib.util
    import types

    root = Path(__file__).resolve().parent.parent
    pkg = sys.modules.setdefault("kvship", types.ModuleType("kvship"))
    pkg.__path__ = []  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location(
        "kvship.engine", root / "engine" / "__init__.py", submodule_search_locations=[str(root / "engine")]
    )
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["kvship.engine"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]


_ensure_kvship()
logger = logging.getLogger("bench.kv_transfer")

SWEEP_LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16)
SMOL_LAYOUT = dict(num_layers=30, num_kv_heads=3, head_dim=64)


def _dtype(device: str, kind: str) -> torch.dtype:
    if kind == "sweep":
        return torch.bfloat16
    return torch.bfloat16 if device == "cuda" else torch.float32


def make_pool(spec: dict, device: str):
    from kvship.engine.mem.pools import KVPool

    return KVPool(
        spec["num_slots"],
        spec["page_size"],
        getattr(torch, spec["dtype"]),
        spec["num_kv_heads"],
        spec["head_dim"],
        spec["num_layers"],
        device,
    )


# both processes of the benchmark share this KV transfer secret (loopback only; docs/pd.md "KV plane authentication")
_SECRET = b"kvship-bench-kv-transfer-secret-0123"


def _token(room: int) -> str:
    return f"bench-room-token-{room}"


def _config(backend: str, ib_device: str | None):
    from kvship.engine.disagg.base import KVTransferConfig

    return KVTransferConfig(
        secret=_SECRET,
        backend=backend,
        bootstrap_port=0,
        ib_device=ib_device,
        bootstrap_timeout=120.0,
        waiting_timeout=120.0,
        transfer_threads=1,
    )


def _checksum(pool, pages, device):
    from kvship.engine.disagg.checksum import default_algorithm, kv_checksum

    return kv_checksum(pool.buffers(), np.asarray(pages), pool.page_size, default_algorithm(device))


# --- decode child ----------------------------------------------------------------


def _decode_main(conn, backend: str, device: str, ib_device: str | None) -> None:
    logging.basicConfig(level=logging.ERROR)
    from kvship.engine.disagg import KVPoll, create_kv_manager

    pool = mgr = None
    while True:
        msg = conn.recv()
        cmd = msg[0]
        try:
            if cmd == "setup":
                if mgr is not None:
                    mgr.close()
                pool = make_pool(msg[1], device)
                mgr = create_kv_manager("decode", pool, _config(backend, ib_device))
                conn.send(("ok", None))
            elif cmd == "recv":
                _, port, room, pages = msg
                r = mgr.create_receiver("127.0.0.1", port, room, _token(room))
                r.init(pages)
                while r.poll() == KVPoll.Bootstrapping:
                    time.sleep(0.0005)
                conn.send(("ok", int(r.poll())))
                while not r.poll().is_terminal:
                    time.sleep(20e-6)
                t1 = time.perf_counter()
                conn.send(("done", t1, int(r.poll()), r.failure_reason))
            elif cmd == "checksum":
                conn.send(("ok", _checksum(pool, msg[1], device)))
            elif cmd == "exit":
                if mgr is not None:
                    mgr.close()
                conn.send(("ok", None))
                os._exit(0)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("err", f"{type(e).__name__}: {e}"))


class DecodeChild:
    def __init__(self, backend: str, device: str, ib_device: str | None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, backend, device, ib_device), daemon=True)
        self.proc.start()

    def call(self, *msg, timeout: float = 300.0):
        self.conn.send(msg)
        return self.reply(timeout)

    def reply(self, timeout: float = 300.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"decode child silent for {timeout} s")
        out = self.conn.recv()
        if out[0] == "err":
            raise RuntimeError(f"decode child: {out[1]}")
        return out

    def close(self) -> None:
        try:
            self.call("exit", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# --- cases -------------------------------------------------------------------------


def build_cases(device: str, sizes_mib: list[int], tokens: int) -> list[dict]:
    cases = []
    sw = dict(SWEEP_LAYOUT, dtype="bfloat16")
    tok_bytes = 2 * sw["num_layers"] * sw["num_kv_heads"] * sw["head_dim"] * 2
    max_tokens = max(sizes_mib) * (1 << 20) // tok_bytes
    for mib in sizes_mib:
        n_tok = mib * (1 << 20) // tok_bytes
        n_pages = max(1, n_tok // sw["page_size"])
        pages = list(range(1, n_pages + 1))
        cases.append(
            dict(name=f"sweep {mib} MiB", kind="sweep", pool=dict(sw, num_slots=max_tokens + 64), src=pages, dst=pages)
        )
    dt = str(_dtype(device, "request")).removeprefix("torch.")
    for ps in (16, 1):
        n_pages = -(-tokens // ps)
        spec = dict(SMOL_LAYOUT, page_size=ps, dtype=dt, num_slots=2 * n_pages * ps)
        src = list(range(1, n_pages + 1))
        contiguous = list(range(n_pages + 1, 2 * n_pages + 1))
        scattered = [int(x) for x in np.random.default_rng(ps).permutation(np.arange(1, 2 * n_pages + 1))[:n_pages]]
        for label, dst in (("contiguous", contiguous), ("scattered", scattered)):
            cases.append(
                dict(name=f"SmolLM2 {tokens} tok, page {ps}, {label}", kind="request", pool=spec, src=src, dst=dst)
            )
    return cases


def payload_bytes(case: dict) -> int:
    p = case["pool"]
    elem = torch.empty((), dtype=getattr(torch, p["dtype"])).element_size()
    return 2 * p["num_layers"] * len(case["src"]) * p["page_size"] * p["num_kv_heads"] * p["head_dim"] * elem


def n_descriptors(case: dict) -> int:
    from kvship.engine.disagg.descriptors import page_runs

    return len(page_runs(np.asarray(case["src"]), np.asarray(case["dst"]))) * 2 * case["pool"]["num_layers"]


def memcpy_gbps(nbytes: int, device: str, min_repeats: int = 5, min_seconds: float = 0.3) -> float:
    """Best-of-N ``dst.copy_(src)`` of ``nbytes`` (warm buffers; at least ``min_seconds`` of samples)."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # one stream, like one transfer; also steadier on a shared host
    try:
        return _memcpy_gbps(nbytes, device, min_repeats, min_seconds)
    finally:
        torch.set_num_threads(threads)


def _memcpy_gbps(nbytes: int, device: str, min_repeats: int, min_seconds: float) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, spent, n = float("inf"), 0.0, 0
    while n < min_repeats or (spent < min_seconds and n < 200):
        n += 1
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return nbytes / best / 1e9


def run_backend(backend: str, cases: list[dict], device: str, repeats: int, ib_device: str | None) -> list[dict]:
    from kvship.engine.disagg import AuxInfo, KVPoll, create_kv_manager

    child = DecodeChild(backend, device, ib_device)
    rows = []
    room = 1 << 40
    try:
        from tqdm import tqdm

        bar = tqdm(cases, desc=f"{backend}", file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover - tqdm is a kvship dependency
        bar = cases
    last_spec, pool, mgr = None, None, None
    try:
        for case in bar:
            if case["pool"] != last_spec:
                if mgr is not None:
                    mgr.close()
                pool = make_pool(case["pool"], device)
                g = torch.Generator(device="cpu").manual_seed(3)
                for b in pool.buffers():
                    b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
                mgr = create_kv_manager("prefill", pool, _config(backend, ib_device))
                child.call("setup", case["pool"])
                last_spec = case["pool"]
            times, failure = [], None
            for rep in range(repeats + 1):  # first one warms connections and caches
                room += 1
                s = mgr.create_sender(room, _token(room))
                child.call("recv", mgr.bootstrap_port, room, case["dst"])
                while s.poll() == KVPoll.Bootstrapping:
                    time.sleep(0.0005)
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                s.send(case["src"], AuxInfo(1, 0.0, len(case["src"]) * case["pool"]["page_size"]))
                _, t1, state, reason = child.reply()
                while not s.poll().is_terminal:
                    time.sleep(0.0005)
                if state != int(KVPoll.Success):
                    failure = reason or s.failure_reason
                    break
                if rep:
                    times.append(t1 - t0)
            nbytes = payload_bytes(case)
            row = dict(
                backend=backend,
                case=case["name"],
                kind=case["kind"],
                payload_mib=round(nbytes / 2**20, 2),
                descriptors=n_descriptors(case),
            )
            if failure:
                row.update(error=failure)
            else:
                ok = child.call("checksum", case["dst"])[1] == _checksum(pool, case["src"], device)
                best, med = min(times), statistics.median(times)
                base = memcpy_gbps(nbytes, device)
                row.update(
                    best_ms=round(best * 1e3, 3),
                    median_ms=round(med * 1e3, 3),
                    gbps=round(nbytes / best / 1e9, 3),
                    median_gbps=round(nbytes / med / 1e9, 3),
                    memcpy_gbps=round(base, 2),
                    ratio=round(nbytes / best / 1e9 / base, 4),
                    verified=ok,
                )
            rows.append(row)
            logger.info("%s", row)
    finally:
        if mgr is not None:
            mgr.close()
        child.close()
    return rows


def to_markdown(result: dict) -> str:
    lines = [
        f"Device: {result['device_name']}; {result['note']}",
        "",
        "| backend | case | payload MiB | descriptors | best ms | GB/s (best) | GB/s (median) | memcpy GB/s | ratio "
        "| data verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['backend']} | {r['case']} | {r['payload_mib']} | {r['descriptors']} | — | "
                f"failed: {r['error']} | | | | |"
            )
            continue
        lines.append(
            f"| {r['backend']} | {r['case']} | {r['payload_mib']} | {r['descriptors']} | {r['best_ms']} | "
            f"{r['gbps']} | {r['median_gbps']} | {r['memcpy_gbps']} | {r['ratio']} | "
            f"{'yes' if r['verified'] else 'NO'} |"
        )
    for b, why in result["skipped"].items():
        lines.append(f"\n{b}: not run ({why})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--backends", default=None, help="comma list (default: tcp,mooncake,nixl on cpu; mooncake,nixl on cuda)"
    )
    ap.add_argument("--sizes-mib", default="1,4,16,64,256")
    ap.add_argument("--request-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ib-device", default=None, help="mooncake: RDMA device (protocol rdma); tcp when omitted")
    ap.add_argument("--only", choices=("sweep", "request"), default=None)
    ap.add_argument("--out", required=True, help="JSON path; the markdown table goes next to it (.md)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    if args.device == "cpu":
        # Debian's ibverbs-providers makes UCX crash at exit on CPU hosts; inherited by the decode child
        os.environ.setdefault("UCX_MODULES", "^ib")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    from kvship.engine.disagg.base import BackendUnavailableError, get_transfer_backend

    backends = (args.backends or ("mooncake,nixl" if args.device == "cuda" else "tcp,mooncake,nixl")).split(",")
    cases = build_cases(args.device, [int(x) for x in args.sizes_mib.split(",")], args.request_tokens)
    if args.only:
        cases = [c for c in cases if c["kind"] == args.only]
    rows, skipped = [], {}
    for b in backends:
        try:
            get_transfer_backend(b)
        except BackendUnavailableError as e:
            skipped[b] = str(e)
            print(f"skipping {b}: {e}", file=sys.stderr)
            continue
        rows += run_backend(b, cases, args.device, args.repeats, args.ib_device)
    dev_name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    )
    result = dict(
        device=args.device,
        device_name=dev_name,
        repeats=args.repeats,
        rows=rows,
        skipped=skipped,
        note="two processes on one host; time = send() on prefill until Success on decode; "
        "ratio = GB/s / same-size torch memcpy GB/s",
        versions={"python": platform.python_version(), "torch": torch.__version__},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = to_markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host-tier copy bandwidth against plain pinned copies (issue 35's goal: load-back >= 70% of host -> device),
for each I/O backend (``--hicache-io-backend``; docs/cache.md, "Copies"), side by side in one run.

Builds a KV pool of a given shape on ``--device`` (``cuda`` to measure; ``cpu`` runs the same code), a host
tier per backend beside it (pinned on CUDA), fills the host rows, and times, best of ``--repeat``:

* ``pinned h2d`` / ``pinned d2h``: one pinned host buffer of the load's size copied to / from the device;
* ``load-back``: ``HostTier.load_back`` of ``--pages`` scattered pages, ``start_loads`` and ``finish``, until
  the device is idle (``copy``: the copy thread gathers each layer into pinned staging and sends it on a side
  stream; ``kernel``: one ``copy_pages`` launch per layer reads the pinned host pool in place);
* ``write-back``: ``HostTier.write_back`` of the same number of scattered device pages and ``sync_writes``.

``--interference`` (CUDA): a bandwidth-bound GEMV stream (an 8B model's gate_up projection, batch 1) timed
alone and while load-backs run beside it on the tier's side stream: the slowdown a decode batch would see.
``--sweep`` (CUDA): ``copy_pages`` over every layer at a grid of ``programs`` x ``block`` (bandwidth and
interference each), to pick ``page_copy.DEFAULT_PROGRAMS`` / ``DEFAULT_BLOCK``.

    .venv/bin/python bench/hicache_loadback.py --device cuda [--layers 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvship.engine.mem.hicache import HostTier, bytes_per_token, layer_buffers
from kvship.engine.mem.pools import KVPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


class Gemv:
    """A stand-in decode: back-to-back batch-1 GEMVs of ``[28672, 4096]`` bf16 (235 MB read each)."""

    def __init__(self, device: torch.device) -> None:
        self.w = torch.randn(28672, 4096, dtype=torch.bfloat16, device=device)
        self.x = torch.randn(4096, dtype=torch.bfloat16, device=device)
        # a decode step's round trip through the host: inputs copied in, outputs copied out, the host waits
        self.h_in = torch.zeros(2048, dtype=torch.int32, pin_memory=True)
        self.d_in = torch.zeros(2048, dtype=torch.int32, device=device)
        self.h_out = torch.zeros(2048, dtype=torch.int32, pin_memory=True)

    def step_ms(self, steps: int = 20, gemvs: int = 8, zero_copy: bool = False) -> float:
        """Host ms per stand-in decode step: a small pinned host -> device copy, ``gemvs`` GEMVs, a small
        device -> host copy, the host waiting for it (what a scheduler does each step).  ``zero_copy``: the two
        small copies by a one-program kernel reading / writing the pinned buffers in place (no copy engine)."""
        from kvship.engine.mem.page_copy import copy_pages

        one = torch.zeros(1, dtype=torch.int64, device=self.w.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            if zero_copy:
                copy_pages([self.d_in.view(1, -1)], one, [self.h_in.view(1, -1)], one, 1, programs=1)
            else:
                self.d_in.copy_(self.h_in, non_blocking=True)
            for _ in range(gemvs):
                torch.mv(self.w, self.x)
            if zero_copy:
                copy_pages([self.h_out.view(1, -1)], one, [self.d_in.view(1, -1)], one, 1, programs=1)
            else:
                self.h_out.copy_(self.d_in, non_blocking=True)
            torch.cuda.current_stream().record_event().synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    def per_call_ms(self, calls: int = 40) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            torch.mv(self.w, self.x)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / calls


def interference(gemv: Gemv, start_copy, device: torch.device, rounds: int = 3) -> dict:
    """GEMV ms per call alone and while ``start_copy()`` (queued on another stream) runs; best of ``rounds``."""
    alone = min(gemv.per_call_ms() for _ in range(rounds))
    during = float("inf")
    for _ in range(rounds):
        _sync(device)
        start_copy()
        during = min(during, gemv.per_call_ms())
        _sync(device)
    steps = {}
    for zc in (False, True):
        step_alone = min(gemv.step_ms(zero_copy=zc) for _ in range(rounds))
        step_during = float("inf")
        for _ in range(rounds):
            _sync(device)
            start_copy()
            step_during = min(step_during, gemv.step_ms(zero_copy=zc))
            _sync(device)
        steps["zc_" if zc else ""] = (step_alone, step_during)
    (step_alone, step_during), (zc_alone, zc_during) = steps[""], steps["zc_"]
    return {
        "gemv_ms_alone": alone,
        "gemv_ms_during_copy": during,
        "slowdown": during / alone,
        "step_ms_alone": step_alone,
        "step_ms_during_copy": step_during,
        "step_slowdown": step_during / step_alone,
        "zero_copy_step_ms_alone": zc_alone,
        "zero_copy_step_ms_during_copy": zc_during,
        "zero_copy_step_slowdown": zc_during / zc_alone,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=4096, help="device pool (and host tier) size in pages")
    p.add_argument("--pages", type=int, default=1024, help="pages loaded back per run")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--io-backends",
        default=None,
        help="comma list of kernel, dma, copy (default: all three on CUDA, copy and dma elsewhere)",
    )
    p.add_argument("--interference", action="store_true", help="CUDA: GEMV slowdown while load-backs run")
    p.add_argument("--sweep", action="store_true", help="CUDA: copy_pages programs x block grid")
    p.add_argument("--rounds", type=int, default=3, help="GEMV timings alone and beside the copy (best of)")
    p.add_argument(
        "--grid",
        default="",
        help="--sweep-small's configs as programs:warps:block,... (default: 1-16 x 1-8 x 1024/4096)",
    )
    p.add_argument(
        "--sweep-small",
        action="store_true",
        help="CUDA: copy_pages with 1-16 programs x 1-8 warps, scattered and contiguous host pages",
    )
    p.add_argument(
        "--runs", type=int, default=0, help="pages in this many contiguous runs on both sides (0: scattered pages)"
    )
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    backends = (args.io_backends or ("kernel,dma,copy" if cuda else "copy,dma")).split(",")
    ps = args.page_size
    kv = KVPool(args.pool_pages * ps, ps, torch.bfloat16, args.kv_heads, args.head_dim, args.layers, args.device)
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(args.pool_pages - 1, generator=gen)[: args.pages] + 1  # page 0 unused
    if args.runs:  # --runs R: host and device pages in R contiguous runs (the copy engines' descriptors)
        pages = torch.cat([torch.arange(len(c)) + 1 + i * (args.pool_pages // args.runs)
                           for i, c in enumerate(torch.arange(args.pages).chunk(args.runs))])  # fmt: skip
    src = (pages[:, None] * ps + torch.arange(ps)).flatten()
    dst_pages = torch.randperm(args.pool_pages - 1, generator=gen)[: args.pages] + 1
    if args.runs:
        dst_pages = pages.flip(0).view(args.runs, -1).flip(1).flatten() if args.pages % args.runs == 0 else pages
    dst = dst_pages[:, None] * ps + torch.arange(ps)
    dst = dst.flatten()
    nbytes = src.numel() * bytes_per_token(kv)
    gb = nbytes / 1e9
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(
        f"device {device} ({name}); {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} bf16, "
        f"{args.pages} pages of {ps} tokens = {gb * 1e3:.1f} MB per copy",
        flush=True,
    )
    res: dict = {"device": name, "shape": vars(args), "mb_per_copy": gb * 1e3, "backends": {}}

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _best(lambda: target.copy_(pinned, non_blocking=True), device, args.repeat)
    d2h = _best(lambda: pinned.copy_(target, non_blocking=True), device, args.repeat)
    res["pinned_h2d_GBps"], res["pinned_d2h_GBps"] = gb / h2d, gb / d2h
    print(f"pinned host -> device copy: {gb / h2d:.1f} GB/s; device -> host: {gb / d2h:.1f} GB/s", flush=True)
    del target

    gemv = Gemv(device) if cuda and (args.interference or args.sweep) else None
    for backend in backends:
        t_build = time.perf_counter()
        host = HostTier(kv, args.pool_pages * ps, io_backend=backend)
        for layer in range(args.layers):  # any values: the copies' speed does not depend on them (normal_ on
            host.pool.k_buffer[layer].fill_(0.5 + layer)  # tens of GB of host rows alone took minutes)
            host.pool.v_buffer[layer].fill_(-0.5 - layer)
        print(f"[{backend}] host tier built in {time.perf_counter() - t_build:.1f} s", flush=True)

        def load() -> None:
            host.load_back(src, dst)
            loads = host.start_loads()
            assert loads is not None
            loads.finish()

        def write() -> None:
            slots = host.write_back(src)
            assert slots is not None
            host.sync_writes()
            host.free(slots)

        t_load = _best(load, device, args.repeat)
        t_write = _best(write, device, args.repeat)
        launch = []  # the scheduler thread's part of a load-back: queue it and start its copies
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            host.load_back(src, dst)
            loads = host.start_loads()
            launch.append(time.perf_counter() - t0)
            loads.finish()
            if cuda:
                torch.cuda.synchronize(device)
        row = {
            "start_loads_host_ms": 1e3 * min(launch),
            "load_back_GBps": gb / t_load,
            "load_back_vs_pinned_h2d": h2d / t_load,
            "write_back_GBps": gb / t_write,
            "write_back_vs_pinned_d2h": d2h / t_write,
        }
        print(
            f"[{backend}] load-back {gb / t_load:.1f} GB/s = {h2d / t_load:.0%} of the pinned copy; "
            f"write-back {gb / t_write:.1f} GB/s = {d2h / t_write:.0%} of the pinned copy; "
            f"start_loads {1e3 * min(launch):.2f} ms of host time",
            flush=True,
        )
        if gemv is not None and args.interference:

            def start_load() -> None:
                host.load_back(src, dst)
                host.start_loads()  # queued on the tier's side stream; the GEMVs run beside it

            row["interference"] = interference(gemv, start_load, device, args.rounds)
            host.drain()
            print(f"[{backend}] GEMV beside load-backs: {row['interference']}", flush=True)
        res["backends"][backend] = row
        del host

    if gemv is not None and args.sweep:
        from kvship.engine.mem.page_copy import copy_pages

        host = HostTier(kv, args.pool_pages * ps, io_backend="kernel")
        dev_layers, host_layers = layer_buffers(kv), host.pool.layers
        hp, dp = (src[::ps] // ps).to(device), (dst[::ps] // ps).to(device)
        side = torch.cuda.Stream(device)
        res["sweep"] = []
        for programs in (8, 16, 32, 64, 132, 264, 528):
            for block in (1024, 2048, 4096, 8192):

                def run(on=None, programs=programs, block=block) -> None:
                    with torch.cuda.stream(on) if on is not None else torch.cuda.stream(torch.cuda.current_stream()):
                        for layer in range(args.layers):
                            copy_pages(dev_layers[layer], dp, host_layers[layer], hp, ps, programs, block)

                t = _best(run, device, args.repeat)
                inter = interference(gemv, lambda run=run: run(side), device)
                row = {"programs": programs, "block": block, "load_GBps": gb / t, "vs_pinned_h2d": h2d / t}
                row["gemv_slowdown"] = inter["slowdown"]
                res["sweep"].append(row)
                print(f"sweep {row}", flush=True)
    if gemv is not None and args.sweep_small:
        from kvship.engine.mem.page_copy import copy_pages

        host = HostTier(kv, args.pool_pages * ps, io_backend="kernel")
        dev_layers, host_layers = layer_buffers(kv), host.pool.layers
        dp = (dst[::ps] // ps).to(device)
        layouts = {
            "scattered": (src[::ps] // ps).to(device),
            "contiguous": torch.arange(1, args.pages + 1, device=device),
        }
        side = torch.cuda.Stream(device)
        res["sweep_small"] = []
        grid = [tuple(int(x) for x in c.split(":")) for c in args.grid.split(",") if c] or [
            (p_, w, b) for p_ in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8) for b in (1024, 4096)
        ]
        for layout, hp in layouts.items():
            for programs, warps, block in grid:

                def run(on=None, programs=programs, block=block, warps=warps, hp=hp) -> None:
                    with torch.cuda.stream(on if on is not None else torch.cuda.current_stream()):
                        for layer in range(args.layers):
                            copy_pages(dev_layers[layer], dp, host_layers[layer], hp, ps, programs, block, warps)

                t = _best(run, device, args.repeat)
                inter = interference(gemv, lambda run=run: run(side), device, args.rounds)
                row = {"layout": layout, "programs": programs, "warps": warps, "block": block,
                       "load_GBps": gb / t, "vs_pinned_h2d": h2d / t, "gemv_slowdown": inter["slowdown"]}  # fmt: skip
                res["sweep_small"].append(row)
                print(f"sweep_small {row}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hicache_loadback.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Host-tier load-back bandwidth against a plain pinned host -> device copy (issue 35's goal: >= 70%).

Builds a KV pool of a given shape on ``--device`` (``cuda`` to measure; ``cpu`` runs the same code), a host
tier beside it (pinned on CUDA), fills the host rows, and times:

* ``pinned``: one pinned host buffer of the load's size copied to the device (``copy_``, non-blocking);
* ``load-back``: ``HostTier.load_back`` of ``--pages`` scattered pages, ``start_loads`` and ``finish`` (the copy
  thread gathers each layer into a pinned staging buffer and sends it on a side stream; docs/cache.md,
  "Load-back"), until the device is idle.

Best of ``--repeat`` runs each; prints GB/s and the ratio.

    .venv/bin/python bench/hicache_loadback.py --device cuda [--layers 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvship.engine.mem.hicache import HostTier, bytes_per_token
from kvship.engine.mem.pools import KVPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    args = p.parse_args()
    device = torch.device(args.device)
    ps = args.page_size
    kv = KVPool(args.pool_pages * ps, ps, torch.bfloat16, args.kv_heads, args.head_dim, args.layers, args.device)
    t_build = time.perf_counter()
    host = HostTier(kv, args.pool_pages * ps)
    for layer in range(args.layers):  # any values: the copies' speed does not depend on them (normal_ on tens of
        host.pool.k_buffer[layer].fill_(0.5 + layer)  # GB of host rows alone took minutes)
        host.pool.v_buffer[layer].fill_(-0.5 - layer)
    print(f"device pool and host tier built in {time.perf_counter() - t_build:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(args.pool_pages - 1, generator=gen)[: args.pages] + 1  # page 0 unused
    src = (pages[:, None] * ps + torch.arange(ps)).flatten()
    dst = (torch.randperm(args.pool_pages - 1, generator=gen)[: args.pages] + 1)[:, None] * ps + torch.arange(ps)
    dst = dst.flatten()
    nbytes = src.numel() * bytes_per_token(kv)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best_copy = best_load = float("inf")
    for _ in range(args.repeat):
        _sync(device)
        t0 = time.perf_counter()
        target.copy_(pinned, non_blocking=True)
        _sync(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        _sync(device)
        t0 = time.perf_counter()
        host.load_back(src, dst)
        loads = host.start_loads()
        assert loads is not None
        loads.finish()
        _sync(device)
        best_load = min(best_load, time.perf_counter() - t0)
    gb = nbytes / 1e9
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
        f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} bf16, {args.pages} pages of {ps} "
        f"tokens = {gb * 1e3:.1f} MB per load"
    )
    print(f"pinned host -> device copy: {gb / best_copy:.1f} GB/s")
    print(f"load-back (layer by layer): {gb / best_load:.1f} GB/s = {best_copy / best_load:.0%} of the pinned copy")


if __name__ == "__main__":
    main()

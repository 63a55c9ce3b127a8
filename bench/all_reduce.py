"""Tensor-parallel all-reduce: NCCL vs one-shot and two-shot over peer GPU memory, by size.

docs/parallel.md, "The all-reduce".  ``--tp-size N`` rank processes (one GPU
each, NCCL) all-reduce bf16 tensors of each ``--sizes`` byte count three ways:

* ``nccl``: ``torch.distributed.all_reduce`` (what the TP group does without
  peer memory);
* ``one_shot`` / ``two_shot``: ``P2PAllReduce`` (engine/parallel/p2p_all_reduce.py)
  forced onto one path, over a symmetric buffer as large as the largest size.

Each is timed as a decode step runs it: ``--calls`` all-reduces captured in one
CUDA graph, the replay timed with CUDA events after the ranks line up, the
median over ``--rounds`` replays, the slowest rank's figure.  Every path's
result is checked against NCCL's (largest difference, and whether it is bit
equal) and across ranks (every rank must hold the same bits).  The parent
process also times a GPU0 -> GPU1 copy of 1 GiB (the link's rate, what
dispatch/combine bandwidth is compared with).  Rank 0 prints the table and the
thresholds it implies (the largest size where one-shot beats both others, then
where two-shot beats NCCL); ``--out`` writes ``all_reduce_tp<N>.json`` / ``.md``.

    python bench/all_reduce.py --tp-size 2 --out /tmp/out      # two GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any, Callable

import torch

DEFAULT_SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20,
                 16 << 20, 32 << 20]  # fmt: skip
PATHS = ("nccl", "push", "one_shot", "two_shot")  # push: up to push_all_reduce.MAX_BYTES


def _graph_time(fn: Callable[[], Any], calls: int, rounds: int, line_up: Callable[[], None]) -> float:
    """Seconds per call: ``calls`` calls captured in one graph, median replay over ``rounds``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(rounds):
        line_up()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    del g
    return sorted(times)[len(times) // 2]


def _rank(rank: int, args: argparse.Namespace, init_method: str, out: Any) -> None:
    import torch.distributed as dist

    from kvship.engine.parallel.p2p_all_reduce import P2PAllReduce
    from kvship.engine.parallel.push_all_reduce import SUB_BYTES

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=args.tp_size, device_id=dev)
    group = dist.group.WORLD
    cpu = dist.new_group(backend="gloo")

    def agree(v: int) -> int:
        t = torch.tensor([v])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu)
        return int(t.item())

    top = max(args.sizes)
    p2p = P2PAllReduce.create(group, dev, args.tp_size, agree, thresholds=(top, top), push_max=1 << 20)
    flag = torch.zeros(1, device=dev)

    def line_up() -> None:
        torch.cuda.synchronize()
        dist.all_reduce(flag)
        torch.cuda.synchronize()

    rows = []
    for nbytes in args.sizes:
        n = nbytes // 2
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)
        x = torch.randn(n, generator=gen, device=dev).to(torch.bfloat16)
        ref = x.clone()
        dist.all_reduce(ref)
        row: dict[str, Any] = {"bytes": nbytes}
        for path in PATHS:
            if path != "nccl" and p2p is None:
                continue
            if path == "push" and (p2p.push is None or nbytes > p2p.push_max):
                continue
            t = x.clone()
            if path == "nccl":
                dist.all_reduce(t)
            else:
                p2p.all_reduce_(t, path)
            gathered = [torch.empty_like(t) for _ in range(args.tp_size)]
            dist.all_gather(gathered, t)
            row[f"{path}_max_diff"] = float((t.float() - ref.float()).abs().max())
            row[f"{path}_bit_equal_nccl"] = bool(torch.equal(t, ref))
            row[f"{path}_same_on_every_rank"] = all(torch.equal(gathered[0], g) for g in gathered)
            work = x.clone()
            if path == "nccl":
                fn = lambda w=work: dist.all_reduce(w)  # noqa: E731
            else:
                fn = lambda w=work, p=path: p2p.all_reduce_(w, p)  # noqa: E731
            sec = torch.tensor([_graph_time(fn, args.calls, args.rounds, line_up)], device=dev)
            dist.all_reduce(sec, op=dist.ReduceOp.MAX)
            row[f"{path}_us"] = float(sec.item()) * 1e6
        # the norm kernel is one program over part 0 of a slot: up to SUB_BYTES (push_all_reduce.py)
        if "push_us" in row and p2p.push.fits_sentinel(x):
            _time_sentinel(row, p2p, x, args, line_up, dev)
        if "push_us" in row and n % args.hidden == 0 and nbytes <= SUB_BYTES:
            _time_norm(row, p2p, x.view(-1, args.hidden), args, line_up, dev)
        rows.append(row)
    dist.barrier()
    if rank == 0:
        out.put({"p2p": p2p is not None, "rows": rows})
    dist.destroy_process_group()


def _time_sentinel(row: dict, p2p: Any, x: torch.Tensor, args: argparse.Namespace, line_up: Callable, dev) -> None:
    """The sentinel exchange (``all_reduce_sentinel_``, no flag) against the push kernel, plain and, where the
    size is whole rows of ``--hidden``, with the next RMSNorm inside (one row a program) against the push kernel
    then the norm kernel: times and bit equality with the push kernel's results."""
    import torch.distributed as dist

    from kvship.engine.layers.fused_ops_cuda import rmsnorm

    got = p2p.all_reduce_(x.clone(), "sentinel")
    row["sentinel_bit_equal_push"] = bool(torch.equal(got, p2p.all_reduce_(x.clone(), "push")))
    work = x.clone()
    fns = {"sentinel": lambda: p2p.all_reduce_(work, "sentinel")}
    if x.numel() % args.hidden == 0:
        rows = x.view(-1, args.hidden)
        gen = torch.Generator(device=dev).manual_seed(7)
        res = torch.randn(rows.shape, generator=gen, device=dev).to(torch.bfloat16)
        weight = (torch.rand(rows.shape[-1], generator=gen, device=dev) + 0.5).to(torch.bfloat16)
        if p2p.push.fits_sentinel_norm(rows, res, weight):
            a = p2p.push.all_reduce_sentinel_rmsnorm_(rows, res, weight, 1e-5)
            b = rmsnorm(p2p.all_reduce_(rows.clone(), "push"), weight, 1e-5, res)
            row["sentinel_norm_bit_equal_push"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
            wrows = work.view(-1, args.hidden)
            fns["sentinel_norm"] = lambda: p2p.push.all_reduce_sentinel_rmsnorm_(wrows, res, weight, 1e-5)
            fns["push_then_norm"] = lambda: rmsnorm(p2p.all_reduce_(wrows, "push"), weight, 1e-5, res)
    for name, fn in fns.items():
        sec = torch.tensor([_graph_time(fn, args.calls, args.rounds, line_up)], device=dev)
        dist.all_reduce(sec, op=dist.ReduceOp.MAX)
        row[f"{name}_us"] = float(sec.item()) * 1e6


def _time_norm(row: dict, p2p: Any, x: torch.Tensor, args: argparse.Namespace, line_up: Callable, dev) -> None:
    """The push all-reduce followed by the next block's residual add and RMSNorm: the norm kernel after it
    (``split``) against the push kernel that runs both (``fused``, ``all_reduce_rmsnorm_``); bit equality."""
    import torch.distributed as dist

    from kvship.engine.layers.fused_ops_cuda import rmsnorm

    gen = torch.Generator(device=dev).manual_seed(7)  # the same residual and weight on every rank
    res = torch.randn(x.shape, generator=gen, device=dev).to(torch.bfloat16)
    weight = (torch.rand(x.shape[-1], generator=gen, device=dev) + 0.5).to(torch.bfloat16)
    y, r = p2p.push.all_reduce_rmsnorm_(x, res, weight, 1e-5)
    want_y, want_r = rmsnorm(p2p.all_reduce_(x.clone(), "push"), weight, 1e-5, res)
    row["push_norm_bit_equal"] = bool(torch.equal(y, want_y) and torch.equal(r, want_r))
    work = x.clone()
    fns = {
        "split": lambda: rmsnorm(p2p.all_reduce_(work, "push"), weight, 1e-5, res),
        "fused": lambda: p2p.push.all_reduce_rmsnorm_(work, res, weight, 1e-5),
    }
    for name, fn in fns.items():
        sec = torch.tensor([_graph_time(fn, args.calls, args.rounds, line_up)], device=dev)
        dist.all_reduce(sec, op=dist.ReduceOp.MAX)
        row[f"push_norm_{name}_us"] = float(sec.item()) * 1e6


def _copy_rate() -> float:
    """GPU0 -> GPU1 bytes/s of a 1 GiB copy (one direction), CUDA events, median of 5."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    times = []
    for _ in range(5):
        with torch.cuda.device(0):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return n / sorted(times)[2]


def _thresholds(rows: list[dict]) -> dict[str, Any]:
    """The largest size where one-shot beats both others, then the largest where two-shot beats NCCL."""
    one = two = 0
    for r in rows:
        if "one_shot_us" not in r:
            return {}
        if r["one_shot_us"] <= min(r["two_shot_us"], r["nccl_us"]):
            one = r["bytes"]
        if r["two_shot_us"] <= r["nccl_us"] and r["two_shot_us"] < r["one_shot_us"]:
            two = r["bytes"]
    return {"one_shot_max": one, "two_shot_max": max(one, two)}


def _table(res: dict) -> str:
    lines = [
        f"tp {res['tp_size']}, bf16, {res['calls']} all-reduces per CUDA graph; GPU0->GPU1 copy "
        f"{res.get('copy_GBps', 0):.0f} GB/s; peer memory: {'yes' if res['p2p'] else 'no (NCCL only)'}",
        "",
        "| bytes | nccl us | push us | one-shot us | two-shot us | best x nccl | push / one-shot / two-shot = nccl "
        "bits | max diff (1s / 2s) | same bits on every rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "one_shot_us" not in r:
            lines.append(
                f"| {r['bytes']} | {r['nccl_us']:.1f} | - | - | - | 1.00 | - | - | {r['nccl_same_on_every_rank']} |"
            )
            continue
        push = "push_us" in r
        best = min(r["one_shot_us"], r["two_shot_us"], r["push_us"] if push else float("inf"))
        paths = ("push", "one_shot", "two_shot") if push else ("one_shot", "two_shot")
        same = r["nccl_same_on_every_rank"] and all(r[f"{p}_same_on_every_rank"] for p in paths)
        bits = " / ".join(
            str(r[f"{p}_bit_equal_nccl"]) if f"{p}_us" in r else "-" for p in ("push", "one_shot", "two_shot")
        )
        lines.append(
            f"| {r['bytes']} | {r['nccl_us']:.1f} | {r['push_us']:.1f} | "
            if push
            else f"| {r['bytes']} | {r['nccl_us']:.1f} | - | "
        )
        lines[-1] += (
            f"{r['one_shot_us']:.1f} | {r['two_shot_us']:.1f} | {r['nccl_us'] / best:.2f} | {bits} "
            f"| {r['one_shot_max_diff']:.3g} / {r['two_shot_max_diff']:.3g} | {same} |"
        )
    if res.get("thresholds"):
        lines += ["", f"implied thresholds: {res['thresholds']}"]
    sent = [r for r in res["rows"] if "sentinel_us" in r]
    if sent:
        lines += [
            "",
            "the sentinel exchange (no flag) against the push kernel:",
            "",
            "| bytes | push us | sentinel us | push / sentinel | = push bits | push, then norm kernel us | push + "
            "norm inside us | sentinel + norm inside us | = push bits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sent:
            fused = f"{r['push_norm_fused_us']:.1f}" if "push_norm_fused_us" in r else "-"
            norm = (
                f"{r['push_then_norm_us']:.1f} | {fused} | {r['sentinel_norm_us']:.1f} | "
                f"{r['sentinel_norm_bit_equal_push']}"
                if "sentinel_norm_us" in r
                else "- | - | - | -"
            )
            lines.append(
                f"| {r['bytes']} | {r['push_us']:.1f} | {r['sentinel_us']:.1f} | {r['push_us'] / r['sentinel_us']:.2f} "
                f"| {r['sentinel_bit_equal_push']} | {norm} |"
            )
    normed = [r for r in res["rows"] if "push_norm_fused_us" in r]
    if normed:
        lines += [
            "",
            f"push all-reduce then residual add + RMSNorm over rows of {res['hidden']}:",
            "",
            "| bytes | push, then norm kernel us | push with the norm inside us | split / fused | fused = split bits |",
            "|---|---|---|---|---|",
        ]
        for r in normed:
            lines.append(
                f"| {r['bytes']} | {r['push_norm_split_us']:.1f} | {r['push_norm_fused_us']:.1f} | "
                f"{r['push_norm_split_us'] / r['push_norm_fused_us']:.2f} | {r['push_norm_bit_equal']} |"
            )
    return "\n".join(lines)


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="bytes (bf16 elements x 2)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=4096, help="row width of the push + RMSNorm timing")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp_size:
        raise SystemExit(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, init_method, q)) for r in range(args.tp_size)]
    for p in procs:
        p.start()
    try:
        got = q.get(timeout=900)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    res = {"tp_size": args.tp_size, "calls": args.calls, "hidden": args.hidden, **got, "copy_GBps": _copy_rate() / 1e9,
           "thresholds": _thresholds(got["rows"])}  # fmt: skip
    res["gpu"] = torch.cuda.get_device_name(0)
    md = _table(res)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"all_reduce_tp{args.tp_size}.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, f"all_reduce_tp{args.tp_size}.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()

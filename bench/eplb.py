"""EPLB under a synthetic skew: per-rank expert load and MoE layer time, plain EP vs redundant experts.

docs/parallel.md, "Expert load balancing (EPLB)".  ``--ep-size`` rank processes
(gloo on CPU, NCCL with ``--device cuda``: one GPU per rank) each build the same
MoE layer twice from one seeded set of expert weights: the plain
``ParallelFusedMoE`` (E/N experts a rank) and an ``EPLBFusedMoE`` with
``--redundant`` extra slots.  The router logits are skewed: expert ``e`` gets
``--skew * log(1 / (rank(e) + 1))`` added (a Zipf-like popularity, shuffled over
the experts).  The EPLB layer runs one forward to count the load, rebalances
(weights moved between ranks, as a live server does), then both layers are timed
on the same batch.  Rank 0 prints, and with ``--out`` writes ``eplb_ep<N>.json``:

* ``rank_load_max_over_mean``: the (token, expert) pairs each rank computes, max
  over mean, for plain EP, EPLB's initial (load-blind) placement and after the
  rebalance;
* ``layer_ms``: the layer's forward (max over ranks), plain vs rebalanced, and the
  outputs' largest difference (replicas are exact copies: 0 up to summation order).

CPU figures only show the mechanism; they mean nothing for GPUs.  Two GPUs:
``python bench/eplb.py --device cuda --ep-size 2 --experts 128 --redundant 32 --topk 8 --hidden 2048
--inter 768 --tokens 4096 --out /tmp/eplb`` (the Qwen3-30B-A3B layer shape).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import time
from typing import Any

import torch


def _skew_bias(e: int, skew: float, seed: int) -> torch.Tensor:
    order = list(range(e))
    random.Random(seed).shuffle(order)
    bias = torch.empty(e)
    for popularity, expert in enumerate(order):
        bias[expert] = -skew * math.log(popularity + 1)
    return bias


def _fill(layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The loader's calls: every checkpoint expert, each rank keeps what its slots hold."""
    i = w2.shape[2]
    for ex in range(w13.shape[0]):
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, :i], (ex, "gate"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, i:], (ex, "up"))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[ex], (ex, "down"))


def _rank_load(slot_pairs: list[int], ranks: int) -> float:
    from kvship.engine.parallel.eplb import max_over_mean

    per = len(slot_pairs) // ranks
    return max_over_mean([sum(slot_pairs[r * per : (r + 1) * per]) for r in range(ranks)])


def _timed(fn: Any, iters: int, dev: torch.device) -> float:
    fn()  # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / iters


def _rank(rank: int, args: argparse.Namespace, init_method: str, out: Any) -> None:
    from kvship.engine.distributed.groups import init_distributed
    from kvship.engine.distributed.topology import Topology
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.layers.moe.topk import select_experts
    from kvship.engine.parallel.ep import ParallelFusedMoE
    from kvship.engine.parallel.eplb import EPLBFusedMoE, EPLBManager

    try:
        torch.set_num_threads(max(1, args.threads))
        dev = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        tp = init_distributed(Topology(tp_size=args.ep_size, rank=rank), init_method, dev, timeout_s=600).tp
        e, k, h, inter, n = args.experts, args.topk, args.hidden, args.inter, args.ep_size
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        runner = "triton" if dev.type == "cuda" else "torch"
        g = torch.Generator().manual_seed(args.seed)
        w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(dtype)
        w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(dtype)
        x = torch.randn(args.tokens, h, generator=g).to(dtype)
        logits = torch.randn(args.tokens, e, generator=g) + _skew_bias(e, args.skew, args.seed)
        x, logits = x.to(dev), logits.to(dev)
        with torch.device("meta"):  # the whole layers are never allocated: each rank holds its share only
            bases = [FusedMoE(e, k, h, inter, True, dtype=dtype, runner=runner) for _ in range(2)]
        with torch.device(dev):
            plain = ParallelFusedMoE(bases[0], tp, n, "all_reduce")
            eplb = EPLBFusedMoE(bases[1], tp, n, "all_reduce", "", args.redundant)
        _fill(plain, w13.to(dev), w2.to(dev))
        _fill(eplb, w13.to(dev), w2.to(dev))
        model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": eplb})])})
        manager = EPLBManager(model, tp, interval=0)
        _, ids = select_experts(logits, k, renormalize=True)
        per = e // n
        plain_pairs = torch.bincount((ids.reshape(-1).long() // per) * per, minlength=e).tolist()
        with torch.inference_mode():
            eplb(x, logits)  # the load window: initial placement
            initial = _rank_load(eplb.slot_load().tolist(), n)
            last = manager.rebalance()
            y_eplb = eplb(x, logits)  # counted with the new placement
            after = _rank_load(eplb.slot_load().tolist(), n)
            y_plain = plain(x, logits)
            t_plain = _timed(lambda: plain(x, logits), args.iters, dev)
            t_eplb = _timed(lambda: eplb(x, logits), args.iters, dev)
        times = tp.all_gather_object((t_plain, t_eplb))
        if rank == 0:
            res = {
                "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
                "ep_size": n,
                "shape": {"experts": e, "redundant": args.redundant, "topk": k, "hidden": h, "inter": inter},
                "tokens": args.tokens,
                "skew": args.skew,
                "rank_load_max_over_mean": {
                    "plain_ep": _rank_load(plain_pairs, n),
                    "eplb_initial": initial,
                    "eplb_rebalanced": after,
                },
                "rebalance": last,
                "layer_ms": {
                    "plain_ep": 1e3 * max(t[0] for t in times),
                    "eplb_rebalanced": 1e3 * max(t[1] for t in times),
                },
                "max_abs_diff": (y_eplb.float() - y_plain.float()).abs().max().item(),
            }
            out.put(("ok", res))
        else:
            out.put(("ok", None))
    except BaseException as exc:  # noqa: BLE001 - report to the parent, do not hang it
        import traceback

        out.put(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)


def main(argv: list[str] | None = None) -> dict:
    import multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--redundant", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--skew", type=float, default=1.2, help="Zipf-like exponent of the experts' popularity")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=None, help="directory for eplb_ep<N>.json")
    args = p.parse_args(argv)
    if (args.experts + args.redundant) % args.ep_size or args.experts % args.ep_size:
        raise SystemExit("--experts and --experts + --redundant must divide by --ep-size")
    if args.device == "cuda" and torch.cuda.device_count() < args.ep_size:
        raise SystemExit(f"--ep-size {args.ep_size} needs {args.ep_size} GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, init, q), daemon=True) for r in range(args.ep_size)]
    for proc in procs:
        proc.start()
    res = None
    try:
        for _ in procs:
            status, payload = q.get(timeout=900)
            if status == "error":
                raise SystemExit(payload)
            res = payload or res
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert res is not None
    lo, ms = res["rank_load_max_over_mean"], res["layer_ms"]
    print(
        f"EPLB {res['device']} ep={res['ep_size']} E={args.experts}+{args.redundant} top-{args.topk} "
        f"H={args.hidden} I={args.inter} tokens={args.tokens} skew={args.skew}"
    )
    print("| | plain EP | EPLB initial | EPLB rebalanced |\n|---|---|---|---|")
    print(f"| rank load max/mean | {lo['plain_ep']:.3f} | {lo['eplb_initial']:.3f} | {lo['eplb_rebalanced']:.3f} |")
    print(f"| layer ms | {ms['plain_ep']:.2f} | | {ms['eplb_rebalanced']:.2f} |")
    print(f"rebalance: {res['rebalance']}; max |diff| {res['max_abs_diff']:.2e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"eplb_ep{args.ep_size}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

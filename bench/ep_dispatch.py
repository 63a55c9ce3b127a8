"""Expert-parallel dispatch/combine and the MoE layer: ``all_reduce`` vs ``static`` vs two-batch overlap.

docs/parallel.md, "Dispatch" and "Two-batch overlap".  ``--ep-size N`` rank
processes (NCCL on N GPUs, else gloo on CPU) build the same MoE layer
(``ParallelFusedMoE``, E/N whole experts per rank) and, for each token count
``--m`` (default 4096), time on every rank and report rank 0's:

* communication alone: ``all_reduce`` (one all-reduce of ``[M, H]``, what the
  all-reduce dispatch adds to the experts) and ``static`` (pack, the two
  equal-split all-to-alls out, the one back, unpack, the all-gather; the
  experts replaced by the identity), with the bytes each rank sends and, on
  GPUs, GB/s;
* the whole layer: ``all_reduce``, ``static`` (its exchange over peer GPU
  memory where the group maps it, ``kvship.engine.parallel.p2p_exchange``),
  ``static_nccl`` (the same over NCCL), ``all_reduce_tbo`` and ``static_tbo`` (``--enable-two-batch-overlap``), with ratios to
  ``all_reduce``.  On GPUs the non-overlapped settings are timed as CUDA-graph
  replays (as decode runs them; both are capture-safe) and eager; the
  overlapped ones eager (that is where the product runs them).

With ``--libraries`` (GPUs; issue 33 asks for the libraries to be measured before our own kernels): the same
exchange through **mooncake.ep** (the Mooncake wheel's DeepEP-style low-latency ``Buffer``: each rank dispatches
its block of ``P`` tokens, one copy per (token, remote expert), the experts are the identity, ``combine`` returns
each token's weighted sum, then the blocks' all-gather as in ``static``), eager and, where it captures, in a CUDA
graph, checked against the tokens themselves (the routing weights sum to 1); and whether **NIXL's EP**
(``nixl_ep``) imports here.  A library that cannot run says why in the results instead of a time.

Every setting's output is checked against ``all_reduce``'s first.  On CPU the
figures say nothing about GPUs (gloo over loopback, the torch expert loop);
they show the bench runs.  Writes ``ep_dispatch_ep<N>.json`` / ``.md`` to
``--out``.

    python bench/ep_dispatch.py --ep-size 2 --out /tmp/out                       # two GPUs, Qwen3-30B-A3B layer
    python bench/ep_dispatch.py --ep-size 2 --shape small --m 1024 --out /tmp/o  # CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time
from typing import Any, Callable

import torch

# name -> (experts, top-k, hidden, expert width)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "small": (16, 4, 256, 128)}
# name -> (dispatch, two-batch overlap, the exchange over peer memory where the group has one)
SETTINGS = {"all_reduce": ("all_reduce", False, False), "static": ("static", False, True),
            "static_nccl": ("static", False, False), "all_reduce_tbo": ("all_reduce", True, False),
            "static_tbo": ("static", True, False)}  # fmt: skip


def _timer(fn: Callable[[], Any], iters: int, cuda: bool, comm) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after a warm-up; ranks start each call together."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        comm.all_reduce(torch.zeros(1, device="cuda" if cuda else "cpu"))  # line the ranks up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _graph(fn: Callable[[], Any], comm) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (NCCL collectives included), as a replay callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with comm.graph_capture(), torch.cuda.graph(g):
        fn()
    return g.replay


def _breakdown(comm, exchange, per_rank: int, x, weights, ids, iters: int) -> dict:
    """The static exchange's parts, each alone in a CUDA graph (microseconds): the packing kernel, the rows' all-to-all
    and the blocks' all-gather over peer memory and over NCCL, the partials' sum, and one pull of the rows' bytes from
    the peer's buffer (the link's rate for this copy)."""
    from kvship.engine.parallel.ep_dispatch import pack, row_bytes, unpack

    n, k, h = comm.size, ids.shape[1], x.shape[1]
    per = -(-x.shape[0] // n)
    rb = row_bytes(k, h, x.dtype)
    send = torch.empty((n * per, rb), dtype=torch.uint8, device=x.device)
    recv = torch.empty_like(send)
    block = torch.empty((per, h), dtype=x.dtype, device=x.device)
    whole = torch.empty((n * per, h), dtype=x.dtype, device=x.device)
    back = torch.randn((n * per, h), device=x.device).to(x.dtype)
    p = pack(x, weights, ids, n, comm.rank, per_rank)
    res = {"rows_bytes": send.numel()}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        res[name] = _timer(_graph(fn, comm), iters, True, comm) * 1e6

    timed("part_pack_us", lambda: pack(x, weights, ids, n, comm.rank, per_rank, out=send))
    timed("part_unpack_us", lambda: unpack(p, back, x.dtype))
    for tag, ex in (("p2p", exchange), ("nccl", None)):
        if tag == "p2p" and ex is None:
            continue
        comm.exchange = ex
        timed(f"part_a2a_{tag}_us", lambda: comm.all_to_all(recv, send))
        timed(f"part_gather_{tag}_us", lambda: comm.all_gather_into(whole, block))
    comm.exchange = exchange
    if exchange is not None:
        peer = exchange.peers[(comm.rank + 1) % n][: send.numel()]
        timed("part_pull_us", lambda: recv.view(-1).copy_(peer))
    return res


def _libraries(comm, x, weights, ids, num_experts: int, iters: int) -> dict:
    """mooncake.ep's dispatch + combine over this rank's block, then the all-gather (module docstring); NIXL EP's
    import.  Keys ``mooncake_*`` and ``nixl_ep_*``; a failure is recorded as ``*_error``, never raised."""
    import torch.distributed as dist

    res: dict[str, Any] = {}
    try:
        import nixl_ep  # noqa: F401

        res["nixl_ep_import"] = "ok"
    except Exception as e:  # the wheel ships builds for some torch versions only
        res["nixl_ep_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        from mooncake.mooncake_ep_buffer import Buffer
    except Exception as e:
        res["mooncake_error"] = f"import: {type(e).__name__}: {e}"[:300]
        return res
    n, r = comm.size, comm.rank
    m, h = x.shape
    per = max(1, -(-m // n))
    lo, hi = min(r * per, m), min((r + 1) * per, m)
    xb, ib = x[lo:hi].contiguous(), ids[lo:hi].to(torch.int64).contiguous()
    wb = weights[lo:hi].float().contiguous()
    active = torch.ones(n, dtype=torch.int32, device=x.device)
    block = torch.zeros((per, h), dtype=x.dtype, device=x.device)
    whole = torch.empty((n * per, h), dtype=x.dtype, device=x.device)
    timeout_us = 10_000_000
    try:
        buf = Buffer(comm.device_group or dist.group.WORLD, Buffer.get_ep_buffer_size_hint(per, h, n, num_experts))
        res["mooncake_path"] = "python fallback" if buf._use_fallback else "native kernels"
    except Exception as e:
        res["mooncake_error"] = f"Buffer: {type(e).__name__}: {e}"[:300]
        return res

    def call() -> torch.Tensor:
        recv, _count, handle, _event, _hook = buf.dispatch(xb, ib, active, per, num_experts, timeout_us, False)
        got, _event, _hook = buf.combine(recv, ib, wb, active, timeout_us, handle)
        block[: hi - lo].copy_(got)
        comm.all_gather_into(whole, block)
        return whole

    try:
        got = call()
        torch.cuda.synchronize()
        res["mooncake_max_diff_vs_x"] = float((got[:m].float() - x.float()).abs().max())
        res["mooncake_us"] = _timer(call, iters, True, comm) * 1e6
    except Exception as e:
        res["mooncake_error"] = f"run: {type(e).__name__}: {e}"[:300]
        return res
    per_rank_experts = num_experts // n
    remote = int((ib // per_rank_experts != r).sum())  # the (token, expert) copies that leave this rank
    res["mooncake_bytes_sent"] = 2 * remote * h * x.element_size() + (n - 1) * per * h * x.element_size()
    try:
        res["mooncake_graph_us"] = _timer(_graph(call, comm), iters, True, comm) * 1e6
    except Exception as e:
        res["mooncake_graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


def _rank(rank: int, args: argparse.Namespace, init_method: str, out: Any) -> None:
    from kvship.engine.distributed.groups import init_distributed
    from kvship.engine.distributed.topology import Topology
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.layers.moe.topk import select_experts
    from kvship.engine.parallel.ep import ParallelFusedMoE
    from kvship.engine.parallel.ep_dispatch import StaticDispatch

    cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ep_size))
    comm = init_distributed(Topology(tp_size=args.ep_size, rank=rank), init_method, dev, timeout_s=600).tp
    comm.enable_peer_exchange(dev)  # what a --ep-dispatch static worker does (NCCL on CPU: gloo has none)
    exchange = getattr(comm, "exchange", None)
    e, k, h, inter = SHAPES[args.shape]
    dtype = torch.bfloat16 if cuda else torch.float32
    with dev:
        layer = ParallelFusedMoE(
            FusedMoE(e, k, h, inter, renormalize=True, dtype=dtype, runner="triton" if cuda else "torch"),
            comm,
            args.ep_size,
        )
    with torch.no_grad():
        layer.w13_weight.normal_(0, h**-0.5)
        layer.w2_weight.normal_(0, inter**-0.5)
    rows = []
    with torch.inference_mode():
        for m in args.m:
            g = torch.Generator(device=dev).manual_seed(m)  # the same tokens and routing on every rank
            x = torch.randn(m, h, device=dev, dtype=dtype, generator=g)
            logits = torch.randn(m, e, device=dev, generator=g, dtype=dtype)
            weights, ids = select_experts(logits, k, renormalize=True)
            row: dict[str, Any] = {"m": m}
            # communication alone
            buf = x.clone()
            row["comm_all_reduce_us"] = _timer(lambda: comm.all_reduce(buf), args.iters, cuda, comm) * 1e6
            ident = StaticDispatch(comm, layer.num_local_experts, lambda rows, w, local: rows)
            row["comm_static_us"] = _timer(lambda: ident(x, weights, ids), args.iters, cuda, comm) * 1e6
            if cuda:  # the same exchange captured, as decode and prefill graphs run it
                row["comm_static_graph_us"] = (
                    _timer(_graph(lambda: ident(x, weights, ids), comm), args.iters, cuda, comm) * 1e6
                )
            comm.exchange = None  # NCCL's all_to_all_single and all-gather
            row["comm_static_nccl_us"] = _timer(lambda: ident(x, weights, ids), args.iters, cuda, comm) * 1e6
            if cuda:
                row["comm_static_nccl_graph_us"] = (
                    _timer(_graph(lambda: ident(x, weights, ids), comm), args.iters, cuda, comm) * 1e6
                )
            comm.exchange = exchange
            row["peer_exchange"] = exchange is not None
            if cuda:
                row.update(_breakdown(comm, exchange, layer.num_local_experts, x, weights, ids, args.iters))
            if cuda and args.libraries:
                row.update(_libraries(comm, x, weights, ids, e, args.iters))
            # bytes a rank sends to the others: rows + meta out, partials back, its block to all (static); a ring
            # all-reduce's reduce-scatter + all-gather
            per, others, row_b = -(-m // args.ep_size), args.ep_size - 1, h * x.element_size()
            row["static_bytes_sent"] = others * per * (3 * row_b + 2 * k * 4)
            row["all_reduce_bytes_sent"] = 2 * others * per * row_b
            # the whole layer
            ref = None
            for name, (dispatch, tbo, peer) in SETTINGS.items():
                layer.dispatch, layer.two_batch_overlap = dispatch, tbo
                comm.exchange = exchange if peer else None
                got = layer(x, logits)
                ref = got if ref is None else ref
                row[f"{name}_max_diff"] = float((got.float() - ref.float()).abs().max()) if m else 0.0
                row[f"{name}_us"] = _timer(lambda: layer(x, logits), args.iters, cuda, comm) * 1e6
                if cuda and not tbo:
                    replay = _graph(lambda: layer(x, logits), comm)
                    row[f"{name}_graph_us"] = _timer(replay, args.iters, cuda, comm) * 1e6
            comm.exchange = exchange
            rows.append(row)
    if rank == 0:
        out.put(rows)
    comm.all_reduce(torch.zeros(1, device=dev))  # nobody leaves while another still times


def _table(rows: list[dict], args: argparse.Namespace, cuda: bool) -> str:
    e, k, h, inter = SHAPES[args.shape]
    where = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()}, gloo)"
    lines = [
        f"EP dispatch: E={e} top-{k} H={h} I={inter}, --ep-size {args.ep_size} on {where} (rank 0, median of "
        f"{args.iters}; microseconds; ratio = all_reduce / setting, > 1 is faster)",
        "",
    ]
    if not cuda:
        lines += ["CPU figures: gloo over loopback and the torch expert loop; they say nothing about GPUs.", ""]
    lines += [
        "Communication alone: `static` over peer memory (where the group maps it) and over NCCL; GB/s = bytes a rank "
        "sends to the others (rows and meta out, partials back, its block to every rank) / time.",
        "",
        "| M | comm all_reduce | comm static | comm static, NCCL | static bytes / all_reduce bytes sent |",
        "|---|---|---|---|---|",
    ]

    def gbps(r: dict, key: str) -> str:
        return f"{r['static_bytes_sent'] / (r[key] * 1e-6) / 1e9:.1f} GB/s"

    for r in rows:
        cells = []
        for key in ("comm_static_us", "comm_static_nccl_us"):
            cell = f"{r[key]:.0f} ({r['comm_all_reduce_us'] / r[key]:.2f}x, {gbps(r, key)})"
            if f"{key[:-3]}_graph_us" in r:
                cell += f"; graph {r[f'{key[:-3]}_graph_us']:.0f} ({gbps(r, f'{key[:-3]}_graph_us')})"
            cells.append(cell)
        lines.append(
            f"| {r['m']} | {r['comm_all_reduce_us']:.0f} | {cells[0]} | {cells[1]} | "
            f"{r['static_bytes_sent'] / max(1, r['all_reduce_bytes_sent']):.2f} |"
        )
    lines += ["", f"peer-memory exchange: {'yes' if rows and rows[0].get('peer_exchange') else 'no (NCCL)'}"]
    if cuda and rows and "part_pack_us" in rows[0]:
        lines += [
            "",
            "The exchange's parts, each alone in a CUDA graph (us; GB/s on the rows' bytes, `rows` = N*P send rows):",
            "",
            "| M | rows MB | pack | all-to-all p2p | all-to-all NCCL | all-gather p2p | all-gather NCCL | sum partials "
            "| one pull of the rows from the peer |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            mb = r["rows_bytes"] / 1e6

            def cell(key: str, bw: bool = True) -> str:
                if key not in r:
                    return "-"
                return f"{r[key]:.0f}" + (f" ({r['rows_bytes'] / (r[key] * 1e-6) / 1e9:.0f} GB/s)" if bw else "")

            lines.append(
                f"| {r['m']} | {mb:.1f} | {cell('part_pack_us', False)} | {cell('part_a2a_p2p_us')} | "
                f"{cell('part_a2a_nccl_us')} | {cell('part_gather_p2p_us', False)} | {cell('part_gather_nccl_us', False)} "
                f"| {cell('part_unpack_us', False)} | {cell('part_pull_us')} |"
            )
    if rows and any(k.startswith(("mooncake", "nixl_ep")) for k in rows[0]):
        lines += [
            "",
            "Libraries (the same tokens; us, GB/s = bytes a rank sends / time; max |diff| against the tokens):",
            "",
        ]
        for r in rows:
            if "mooncake_us" in r:
                bw = r["mooncake_bytes_sent"] / (r["mooncake_us"] * 1e-6) / 1e9
                graph = (f"graph {r['mooncake_graph_us']:.0f} us" if "mooncake_graph_us" in r
                         else f"no graph: {r.get('mooncake_graph_error', '')[:120]}")  # fmt: skip
                lines.append(
                    f"- M {r['m']}: mooncake.ep ({r['mooncake_path']}) {r['mooncake_us']:.0f} us ({bw:.1f} GB/s), "
                    f"{graph}; static {r['comm_static_us']:.0f} us; max diff {r['mooncake_max_diff_vs_x']:.2e}"
                )
            else:
                lines.append(f"- M {r['m']}: mooncake.ep: {r.get('mooncake_error', '?')}")
        lines.append(f"- NIXL EP: {rows[0].get('nixl_ep_import') or rows[0].get('nixl_ep_error', '?')}")
    lines += ["", "| M | " + " | ".join(SETTINGS) + " | max diff vs all_reduce |", "|---" * (len(SETTINGS) + 2) + "|"]
    for r in rows:
        base = r["all_reduce_us"]
        cells = [f"{r[f'{n}_us']:.0f} ({base / r[f'{n}_us']:.2f}x)" for n in SETTINGS]
        diff = max(r[f"{n}_max_diff"] for n in SETTINGS)
        lines.append(f"| {r['m']} | " + " | ".join(cells) + f" | {diff:.2e} |")
        if cuda:
            graph = r["all_reduce_graph_us"]
            lines.append(
                f"| {r['m']} (graphs) | {graph:.0f} | {r['static_graph_us']:.0f} "
                f"({graph / r['static_graph_us']:.2f}x) | {r['static_nccl_graph_us']:.0f} "
                f"({graph / r['static_nccl_graph_us']:.2f}x) | - | - | |"
            )
    return "\n".join(lines)


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep-size", type=int, default=2)
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="default: qwen3-30b-a3b on GPUs, small on CPU"
    )
    ap.add_argument("--m", type=int, nargs="+", default=[4096])
    ap.add_argument("--iters", type=int, default=None, help="timed calls per setting (default 20 GPU, 3 CPU)")
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs are visible")
    ap.add_argument("--libraries", action="store_true", help="also mooncake.ep and NIXL EP (GPUs; module docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and torch.cuda.device_count() < args.ep_size:
        raise SystemExit(f"--ep-size {args.ep_size} needs {args.ep_size} GPUs, {torch.cuda.device_count()} visible")
    if SHAPES[args.shape or "small"][0] % args.ep_size:
        raise SystemExit(f"--ep-size {args.ep_size} must divide the shape's expert count")
    args.shape = args.shape or ("qwen3-30b-a3b" if cuda else "small")
    args.iters = args.iters or (20 if cuda else 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, init_method, q)) for r in range(args.ep_size)]
    for p in procs:
        p.start()
    try:
        rows = q.get(timeout=3600)
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    md = _table(rows, args, cuda)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ep_dispatch_ep{args.ep_size}.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, f"ep_dispatch_ep{args.ep_size}.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()

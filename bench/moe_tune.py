"""Tune the fused-MoE Triton kernels' launch configs for one expert shape on this GPU.

For each token count M, every candidate config (``candidates(m)``: tile
sizes, warps, stages) runs ``fused_experts`` on random routing, is checked
against the default config's output, and is timed in a CUDA graph rotating
over weight copies (as ``bench/moe_layer.py`` does); the fastest wins, then
the down GEMM's own tiles are tried with the winner's ``BLOCK_SIZE_M``.
Writes ``{M: config}`` as JSON named by ``kernel_config.config_file_name``
into ``--out`` (and into ``engine/layers/moe/configs/`` with ``--save``),
where ``kernel_config.get_config`` finds it.  Above 512 tokens every tile is
tried with the gate/up GEMM as two MMAs and as one (``"one_dot"``), the one-MMA
form also with its weight tiles fetched by TMA (``"tma"``), and the down GEMM's
tiles with and without TMA (on GPUs without it the TMA candidates time the
pointer path again).
``--toggle FLAG`` skips the search and A/Bs one flag of each saved
entry (``tma``, ``one_dot``, ``persistent``, or the down GEMM's as ``down.tma``, ``down.persistent``) in
alternating rounds.  Spaces take ``"persistent": [false, true]`` too (gate/up and down).  ``--space`` / ``--down-space`` replace the searched values (JSON, keys as in
``candidates`` and ``DOWN_SPACE``); ``--merge`` keeps the table's other
entries and replaces only the tuned ``M``.

    python bench/moe_tune.py --out /tmp/out --save     # Qwen3-30B-A3B shape by default
    python bench/moe_tune.py --m 4096 --merge --save --out /tmp/out \
        --space '{"BM": [128], "BN": [64, 128], "BK": [64], "G": [8], "W": [8], "S": [3, 4, 5], "one_dot": [true],
                  "tma": [false, true]}' \
        --down-space '{"BN": [128, 256], "BK": [64], "W": [8], "S": [3, 4], "tma": [false, true]}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_latency import environment, graph_time  # noqa: E402

from kvship.engine.layers.moe.kernel_config import (  # noqa: E402
    CONFIG_DIR,
    config_file_name,
    default_config,
    load_table,
)
from kvship.engine.layers.moe.topk import select_experts  # noqa: E402
from kvship.engine.layers.moe.triton_moe import fused_experts  # noqa: E402

DEFAULT_M = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192]


DOWN_SPACE = dict(BN=[32, 64, 128, 256], BK=[64, 128], W=[4, 8], S=[3, 4], tma=[False])
DOWN_SPACE_LARGE = dict(DOWN_SPACE, tma=[False, True])  # above 512 tokens


def search_space(m: int, num_experts: int, top_k: int) -> dict:
    if m * top_k <= 2 * num_experts:  # decode: a few tokens per expert, weight-bandwidth bound
        return dict(
            BM=[16], BN=[32, 64, 128], BK=[64, 128, 256], G=[1], W=[4], S=[2, 3, 4], one_dot=[False], tma=[False]
        )
    if m <= 512:
        return dict(BM=[16, 32, 64], BN=[64, 128], BK=[64, 128], G=[8], W=[4], S=[3, 4], one_dot=[False], tma=[False])
    return dict(
        BM=[64, 128],
        BN=[64, 128, 256],
        BK=[64, 128],
        G=[8],
        W=[4, 8],
        S=[3, 4, 5],
        one_dot=[False, True],
        tma=[False, True],
    )


def candidates(space: dict) -> list[dict]:
    out = []
    for bm, bn, bk, g, w, s, one, tma, persistent in itertools.product(
        *(space.get(k, [False]) for k in ("BM", "BN", "BK", "G", "W", "S", "one_dot", "tma", "persistent"))
    ):
        if bm * bn > 128 * 128 or (tma and not one):  # spills; TMA's gate/up is one MMA (its pointer fallback too)
            continue
        cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g, num_warps=w, num_stages=s)
        cfg = dict(cfg, one_dot=True, **({"tma": True} if tma else {})) if one else cfg
        out.append(dict(cfg, persistent=True) if persistent else cfg)
    return out


def down_candidates(space: dict, block_m: int) -> list[dict]:
    out = []
    for bn, bk, w, s, tma, persistent in itertools.product(
        *(space.get(k, [False]) for k in ("BN", "BK", "W", "S", "tma", "persistent"))
    ):
        if block_m * bn > 128 * 256 or (block_m * bn > 128 * 128 and w < 8):  # one fp32 accumulator
            continue
        down = dict(BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=w, num_stages=s)
        down = dict(down, tma=True) if tma else down
        out.append(dict(down, persistent=True) if persistent else down)
    return out


def _with_flag(cfg: dict, flag: str, value: bool) -> dict:
    """``cfg`` with ``flag`` (``"tma"``, or ``"down.tma"`` for the down GEMM's) set or removed."""
    if flag.startswith("down."):
        return dict(cfg, down=_with_flag(cfg.get("down", {}), flag.removeprefix("down."), value))
    out = {k: v for k, v in cfg.items() if k != flag}
    return dict(out, **{flag: True}) if value else out


def toggle(saved: dict, flag: str, run, timed, ref: torch.Tensor, m: int, rounds: int = 3) -> dict:
    """``--toggle``: ``saved`` with ``flag`` on and off, timed in alternating rounds (the median of each
    kept); the faster config is returned.  A variant whose output is off the default config's is dropped."""
    on, off = _with_flag(saved, flag, True), _with_flag(saved, flag, False)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for name, cfg in (("on", on), ("off", off)):
        out = run(cfg).float()
        if ((out - ref).norm() / ref.norm()).item() > 1e-2:
            print(f"M={m} {flag} {name}: wrong result", flush=True)
            return off if name == "on" else on
    for _ in range(rounds):
        for name, cfg in (("on", on), ("off", off)):
            times[name].append(timed(cfg))
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    pick = "on" if med["on"] < med["off"] else "off"
    print(f"M={m}: {flag} on {med['on'] * 1e6:.1f} us, off {med['off'] * 1e6:.1f} us -> {pick}", flush=True)
    return on if pick == "on" else off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=DEFAULT_M)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--save", action="store_true", help=f"also write the table into {CONFIG_DIR}")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop tuning new sizes after this long")
    ap.add_argument("--space", type=json.loads, default=None, help="JSON: the gate/up search space (all sizes)")
    ap.add_argument("--down-space", type=json.loads, default=None, help="JSON: the down GEMM's search space")
    ap.add_argument("--merge", action="store_true", help="keep the saved table's other entries")
    ap.add_argument(
        "--toggle",
        default=None,
        help='a config flag ("tma", "one_dot", "persistent"; "down.tma", "down.persistent" for the down GEMM): no search; each --m\'s saved entry timed with the flag on and '
        "off (alternating rounds, both checked against the default config), the faster kept",
    )
    args = ap.parse_args()
    t0 = time.time()
    e, k, h, inter = args.experts, args.topk, args.hidden, args.inter
    weights = [
        (
            torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h**-0.5,
            torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5,
        )
        for _ in range(args.copies)
    ]
    table: dict[str, dict] = {}
    for m in args.m:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent; stopping before M={m}", flush=True)
            break
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = select_experts(torch.randn(m, e, device="cuda", generator=g), k, renormalize=True)
        ref = fused_experts(x, *weights[0], w, ids, config=default_config(m, e, k)).float()
        t_default = graph_time(
            lambda i: fused_experts(x, *weights[i % args.copies], w, ids, default_config(m, e, k)), 6
        )
        if args.toggle:
            saved_cfg = (load_table(e, inter, torch.bfloat16, torch.cuda.get_device_name()) or {}).get(m)
            if saved_cfg is None or "gemv" in saved_cfg:
                print(f"M={m}: no aligned entry saved; --toggle skips it", flush=True)
                continue
            table[str(m)] = toggle(saved_cfg, args.toggle, lambda c: fused_experts(x, *weights[0], w, ids, config=c),
                                   lambda c: graph_time(lambda i: fused_experts(x, *weights[i % args.copies], w, ids, c), 6),
                                   ref, m)  # fmt: skip
            continue
        best, best_t = None, float("inf")
        space = dict(search_space(m, e, k), **(args.space or {}))
        for cfg in candidates(space):
            try:
                out = fused_experts(x, *weights[0], w, ids, config=cfg).float()
                if ((out - ref).norm() / ref.norm()).item() > 1e-2:
                    print(f"M={m} {cfg}: wrong result, skipped", flush=True)
                    continue
                t = graph_time(lambda i: fused_experts(x, *weights[i % args.copies], w, ids, cfg), 6)
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                print(f"M={m} {cfg}: {type(exc).__name__}", flush=True)
                continue
            print(f"M={m} {cfg}: {t * 1e6:.1f} us", flush=True)
            if t < best_t:
                best, best_t = cfg, t
        # then the down GEMM's own tiles, with the winner's BLOCK_SIZE_M
        if best is None:
            print(f"M={m}: no candidate ran", flush=True)
            continue
        down_space = DOWN_SPACE_LARGE if m > 512 else DOWN_SPACE
        for down in down_candidates(dict(down_space, **(args.down_space or {})), best["BLOCK_SIZE_M"]):
            cfg = dict(best, down=down)
            try:
                out = fused_experts(x, *weights[0], w, ids, config=cfg).float()
                if ((out - ref).norm() / ref.norm()).item() > 1e-2:
                    continue
                t = graph_time(lambda i: fused_experts(x, *weights[i % args.copies], w, ids, cfg), 6)
            except Exception as exc:  # noqa: BLE001
                print(f"M={m} {cfg}: {type(exc).__name__}", flush=True)
                continue
            print(f"M={m} {cfg}: {t * 1e6:.1f} us", flush=True)
            if t < best_t:
                best, best_t = cfg, t
        saved_cfg = (load_table(e, inter, torch.bfloat16, torch.cuda.get_device_name()) or {}).get(m)
        if saved_cfg is not None:  # the saved table's own entry, timed the same way
            t_saved = graph_time(lambda i: fused_experts(x, *weights[i % args.copies], w, ids, saved_cfg), 6)
            print(f"M={m}: saved table's entry {t_saved * 1e6:.1f} us {saved_cfg}", flush=True)
            if t_saved <= best_t:  # nothing searched beat it: it stays
                best, best_t = saved_cfg, t_saved
        table[str(m)] = best
        print(f"M={m}: default {t_default * 1e6:.1f} us, best {best_t * 1e6:.1f} us {best}", flush=True)
    name = config_file_name(e, inter, torch.bfloat16, torch.cuda.get_device_name())
    saved = os.path.join(CONFIG_DIR, name)
    if args.merge and os.path.isfile(saved):
        with open(saved) as f:
            table = dict(json.load(f), **table)
        table = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    targets = ([args.out] if args.out else []) + ([CONFIG_DIR] if args.save else [])
    for folder in targets:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(table, f, indent=1)
    if args.out:  # the same table under a plain name (some copy tools refuse '=' and ',')
        with open(os.path.join(args.out, "moe_tuned.json"), "w") as f:
            json.dump({"file": name, "table": table}, f, indent=1)
    print(json.dumps({"file": name, "env": environment(), "seconds": time.time() - t0}))


if __name__ == "__main__":
    main()

"""Greedy tokens of ``--tp-size N`` against ``--tp-size 1`` on dummy weights, beside the rerun noise of TP=1.

Dummy weights (``--load-format dummy``) are the same model at every TP size
(engine/loaders/dummy.py), but their logits are flat: N(0, 0.02) weights give
top-2 gaps that rounding can close, so even a correct TP=N may part from TP=1
after a few tokens.  This tells the two apart.  Three ``kvship serve`` workers
of the same model folder (a ``bench/decode_latency.py`` shape, config.json
only, plus a word-level tokenizer of its vocabulary) start together:

* A: ``--tp-size 1``; B: ``--tp-size 1`` again (the rerun noise); T: ``--tp-size N``
  (CUDA: A and B on GPU 0, T on GPUs 0..N-1; decode CUDA graphs, eager prefill).

One after the other, each answers one ``/generate`` call holding all ``--prompts`` random-id prompts
of ``--prompt-len`` tokens (one batch, so every run batches alike), greedy,
``--steps`` new tokens, with the top-2 logprobs per token.  Per prompt: the
first position where B, and where T, part from A.  Where T parts, it is
numeric noise when T took A's other top-2 token and A's top-2 gap there is
within ``2 * drift``, drift being the largest difference of the top logprob
between T and A over the positions where they still agree (each of the two
logits moves by up to the drift).  Verdict: "numeric noise of flat dummy
logits" when every prompt of T equals A, parts no earlier than the rerun B
does, or parts at such a near-tie; else "real divergence".

Writes ``tp_equality.json`` and ``tp_equality.md`` into ``--out``.

    python bench/tp_equality.py --shape llama3-8b --tp-size 2 --out "$OUT"     # 2 GPUs
    .venv/bin/python bench/tp_equality.py --device cpu --shape tiny --out /tmp/tpeq   # gloo, a tiny Llama shape
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shlex
import statistics
import sys
import tempfile
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from decode_latency import SHAPES, write_model_dir  # noqa: E402
from pd_ttft import write_wordlevel_tokenizer  # noqa: E402
from server_fixtures import enter_together, start_server  # noqa: E402

logger = logging.getLogger("tp_equality")

# --shape tiny: the llama3-8b config made tiny (CPU check of this harness)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=2048,
)
NOISE = "numeric noise of flat dummy logits"
REAL = "real divergence"


def model_dir(shape: str, root: str) -> tuple[str, int]:
    """The shape's folder (config.json and a word-level tokenizer) and its vocabulary size."""
    overrides = TINY if shape == "tiny" else {}
    path = write_model_dir("llama3-8b" if shape == "tiny" else shape, root, **overrides)
    vocab = int(overrides.get("vocab_size", SHAPES.get(shape, {}).get("vocab_size", 0)))
    write_wordlevel_tokenizer(path, vocab)
    return path, vocab


def worker_flags(args: argparse.Namespace, path: str, tp_size: int) -> list[str]:
    ctx = args.prompt_len + args.steps + 16
    flags = ["--model-path", path, "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype]
    flags += ["--tp-size", str(tp_size), "--context-length", str(ctx), "--disable-radix-cache"]
    flags += ["--max-running-requests", str(args.prompts), "--max-total-tokens", str(args.prompts * ctx + 1024)]
    if args.device == "cuda":  # decode graphs up to the batch; prefill eager (a shorter start-up)
        flags += ["--cuda-graph-max-bs", str(args.prompts), "--prefill-graph-max-tokens", "0"]
    return flags + shlex.split(args.worker_args)


def greedy_runs(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> dict[str, list[dict]]:
    """Runs A, B (--tp-size 1) and T (--tp-size N): started together, then asked one at a time; per run and
    prompt its ids and top-2 logprobs."""
    sizes = {"A": 1, "B": 1, "T": args.tp_size}
    # B on the last GPU where there are several: its rerun noise then spans GPUs too, and a float32 8B run fits
    # (A and T's rank 0 on GPU 0, B and T's rank 1 on GPU 1)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    base = {"A": 0, "B": max(gpus - 1, 0), "T": 0}
    managers = [
        start_server(
            worker_flags(args, path, n) + (["--base-gpu-id", str(base[name])] if gpus else []),
            timeout=args.start_timeout,
        )
        for name, n in sizes.items()
    ]
    sp = {"max_new_tokens": args.steps, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    runs = {}
    with contextlib.ExitStack() as stack:
        for name, srv in zip(sizes, enter_together(stack, managers)):
            logger.info("run %s (--tp-size %d): %d prompts in one call", name, sizes[name], len(prompts))
            r = srv.post("/generate", json=body, timeout=args.start_timeout)
            r.raise_for_status()
            runs[name] = [{"ids": o["output_ids"], "top2": o["meta_info"]["output_top_logprobs"]} for o in r.json()]
    return runs


def first_mismatch(a: dict, b: dict) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)


def drift(ref: list[dict], other: list[dict]) -> float:
    """Largest |top logprob of ``other`` - of ``ref``| over the positions where their ids still agree."""
    out = 0.0
    for a, b in zip(ref, other):
        end = first_mismatch(a, b)
        for j in range(len(a["ids"]) if end is None else end):
            out = max(out, abs(a["top2"][j][0][0] - b["top2"][j][0][0]))
    return out


def compare(a_run: list[dict], b_run: list[dict], t_run: list[dict]) -> dict[str, Any]:
    """Per-prompt first mismatches of B and T against A, T's classification and the verdict (module doc)."""
    t_drift = drift(a_run, t_run)
    rows = []
    for i, (a, b, t) in enumerate(zip(a_run, b_run, t_run)):
        rerun, at = first_mismatch(a, b), first_mismatch(a, t)
        row: dict[str, Any] = {"prompt": i, "rerun_first_mismatch": rerun, "tp_first_mismatch": at}
        if at is None:
            row["class"] = "same"
        else:
            top2 = {tok: lp for lp, tok, _ in a["top2"][at][:2]}  # an exact tie may list A's choice second
            gap = max(top2.values()) - min(top2.values())
            row.update(a_top2_gap=gap, tp_took_a_top2=t["ids"][at] in top2)
            if rerun is not None and at >= rerun:
                row["class"] = "as rerun"
            elif t["ids"][at] in top2 and gap <= 2 * t_drift:
                row["class"] = "near-tie"
            else:
                row["class"] = "diverged"
        rows.append(row)

    def summary(key: str) -> dict[str, Any]:
        parts = [r[key] for r in rows if r[key] is not None]
        return {"prompts_parting": len(parts), "median_first_mismatch": statistics.median(parts) if parts else None}

    return {
        "per_prompt": rows,
        "rerun": dict(summary("rerun_first_mismatch"), drift=drift(a_run, b_run)),
        "tp": dict(summary("tp_first_mismatch"), drift=t_drift),
        "verdict": REAL if any(r["class"] == "diverged" for r in rows) else NOISE,
    }


def markdown(res: dict[str, Any]) -> str:
    n, cmp_ = res["tp_size"], res["comparison"]
    lines = [
        f"{res['shape']}, dummy {res['dtype']} weights, {res['device']} ({res.get('gpu') or 'no GPU'}): "
        f"{res['prompts']} prompts x {res['prompt_len']} tokens, {res['steps']} greedy steps, one batch",
        "",
        f"| prompt | B (TP=1 rerun) parts from A at | TP={n} parts from A at | A's top-2 gap there | "
        f"TP={n} took A's top-2 | class |",
        "|---|---|---|---|---|---|",
    ]
    for r in cmp_["per_prompt"]:
        gap = f"{r['a_top2_gap']:.4f}" if "a_top2_gap" in r else "-"
        took = ("yes" if r["tp_took_a_top2"] else "no") if "tp_took_a_top2" in r else "-"
        rerun = "-" if r["rerun_first_mismatch"] is None else r["rerun_first_mismatch"]
        tp = "-" if r["tp_first_mismatch"] is None else r["tp_first_mismatch"]
        lines.append(f"| {r['prompt']} | {rerun} | {tp} | {gap} | {took} | {r['class']} |")
    for label, key in (("B vs A (rerun)", "rerun"), (f"TP={n} vs A", "tp")):
        s = cmp_[key]
        lines.append(
            f"\n{label}: {s['prompts_parting']} of {res['prompts']} prompts part, median first mismatch "
            f"{s['median_first_mismatch']}, top-logprob drift while equal {s['drift']:.3g}"
        )
    lines.append(f"\n**Verdict: {cmp_['verdict']}**")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    work = tempfile.mkdtemp(prefix="kvship-tp-equality-")
    path, vocab = model_dir(args.shape, work)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    runs = greedy_runs(args, path, prompts)
    gpu = None
    if args.device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0)
    res: dict[str, Any] = {
        "shape": args.shape,
        "tp_size": args.tp_size,
        "device": args.device,
        "gpu": gpu,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "comparison": compare(runs["A"], runs["B"], runs["T"]),
        "ids": {k: [o["ids"] for o in run] for k, run in runs.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tp_equality.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "tp_equality.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES) + ["tiny"])
    ap.add_argument("--tp-size", type=int, default=2, help="tensor-parallel size of run T")
    ap.add_argument("--prompts", type=int, default=8, help="prompts, all in one batch")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a worker may take to start")
    ap.add_argument("--worker-args", default="", help="extra `kvship serve` flags of every run (a shell string)")
    ap.add_argument("--out", default="bench_out")
    return ap


if __name__ == "__main__":
    sys.exit(main())

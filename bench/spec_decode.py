"""Speculative decoding cost at a real model shape on the GPU, with ORACLE acceptance (benchmark only).

Dummy weights make real acceptance meaningless, so this measures what a round
costs and what it would buy: a bench-only ``Speculator`` whose acceptance is an
oracle that accepts exactly ``k - 1`` drafts of a chain of ``k - 1`` per request,
so every round emits exactly ``k`` tokens (acceptance length ``k``).  Everything
else is the serving path: the real ``Scheduler``, the real verify forward
(TARGET_VERIFY over the tree masks, our Triton extend kernel), slot allocation,
the remap of accepted slots, stop checks and output chunks.  Plain decoding
(CUDA graphs, overlap on and off) runs in the same process as the baseline.

    python bench/spec_decode.py --batch-sizes 1,8,32 --accept-lengths 1,2,3,4,5,6

Prints a table of decode tok/s and the speedup over plain decoding with overlap
(the serving default); ``--out`` gets spec_decode.json.  Combine a speedup at
acceptance length ``a`` with a real acceptance length measured elsewhere
(e.g. SmolLM2 with n-gram or a draft model) to project a real-weight speedup.

``--eagle-random-head`` instead times real EAGLE rounds: a random one-layer
head of the target's shape (written to a temporary folder in the checkpoint
layout) drafts with the real ``EagleDrafter`` and the real verify and
acceptance (acceptance near 1: the head is random).  Per batch size it runs
the draft steps replayed from their CUDA graphs and run eagerly (the verify
graphs on in both) and prints, side by side, the draft time per round (the
entries extend + the draft steps + the one host read, median over rounds) and
the round time; ``--eagle-shape`` sets steps, top-k and verified tokens.

    python bench/spec_decode.py --eagle-random-head --batch-sizes 1,8,32 --attention-backend triton
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_latency import environment, scheduler_decode, write_model_dir  # noqa: E402

logger = logging.getLogger("spec_decode")


def oracle_speculator(k: int) -> Any:
    """A ``Speculator`` factory whose drafter proposes a chain of ``k - 1`` and whose oracle accepts all of it."""
    from kvship.decode.spec.drafter import SequenceDrafter
    from kvship.decode.spec.tree import DraftTree
    from kvship.decode.spec.verify import Accepted
    from kvship.decode.spec.worker import Speculator

    n_draft = max(k - 1, 0)

    class ChainDrafter(SequenceDrafter):
        k = n_draft  # draft tokens per round (the verify graphs are captured for k slots)

        def release_missing(self, open_rids: set[str]) -> None:
            """Stateless: nothing to release."""

        def propose_for(self, rid: str, seq: list[int]) -> DraftTree:
            return DraftTree.chain(seq[-1], [seq[-1]] * n_draft)

    class OracleSpeculator(Speculator):
        """BENCHMARK ONLY: accepts every draft, whatever the target says."""

        def accept(self, req: Any, tree: DraftTree, logits: torch.Tensor, argmax: Any = None) -> Accepted:
            slots = list(range(1, tree.size))
            bonus = int(logits[tree.size - 1].argmax()) if argmax is None else argmax[tree.size - 1]
            return Accepted(slots, [tree.all_tokens[s] for s in slots] + [bonus], tree.size - 1)

    return lambda sched: OracleSpeculator(sched, ChainDrafter())


def spec_decode(runner: Any, bs: int, input_len: int, output_len: int, k: int) -> dict[str, Any]:
    r = scheduler_decode(
        runner, bs, input_len, output_len, overlap=False, speculator=oracle_speculator(k), label=f"spec oracle k={k}"
    )
    r["accept_length"] = k
    r["round_ms"] = r.pop("step_ms")
    return r


def write_random_eagle_head(model_dir: str, root: str, seed: int = 0) -> str:
    """A random EAGLE head for the target at ``model_dir`` (the checkpoint layout, bf16), in ``root``."""
    from kvship.decode.spec.eagle_head import head_config, head_tensor_shapes, save_head
    from kvship.engine.model_config import ModelConfig

    cfg = head_config("eagle", ModelConfig.from_pretrained(model_dir))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in head_tensor_shapes(cfg).items():
        noise = torch.randn(shape, generator=g)
        tensors[name] = (1.0 + 0.1 * noise if "norm" in name else 0.02 * noise).to(torch.bfloat16)
    path = os.path.join(root, "eagle-random-head")
    save_head(path, cfg, tensors)
    return path


def eagle_decode(
    runner: Any, bs: int, input_len: int, output_len: int, head: str, shape: tuple[int, int, int], draft_graphs: bool
) -> dict[str, Any]:
    """Real EAGLE rounds through the scheduler: round time, and the drafter's time per round (median)."""
    import dataclasses

    from kvship.decode.spec.eagle import EagleDrafter
    from kvship.decode.spec.worker import Speculator

    steps, topk, tokens = shape
    sa = dataclasses.replace(
        runner.server_args,
        speculative_algorithm="eagle",
        speculative_draft_model_path=head,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
        disable_cuda_graph=not draft_graphs,  # the drafter's own graphs; the verify graphs follow the runner
    )
    drafter = EagleDrafter(sa)
    draft_s: list[float] = []
    inner = drafter.draft_trees

    def timed(reqs: list[Any]) -> Any:
        t0 = time.perf_counter()
        trees = inner(reqs)  # ends with the host read of the trees: synchronised
        draft_s.append(time.perf_counter() - t0)
        return trees

    drafter.draft_trees = timed  # type: ignore[method-assign]
    spec: dict[str, Any] = {}

    def factory(sched: Any) -> Speculator:
        spec["s"] = Speculator(sched, drafter)
        return spec["s"]

    label = f"eagle {steps}x{topk}-{tokens} draft {'graphs' if draft_graphs else 'eager'}"
    r = scheduler_decode(runner, bs, input_len, output_len, overlap=False, speculator=factory, label=label)
    if draft_graphs and (drafter.graphs is None or drafter.graphs.replays == 0):
        raise RuntimeError("the EAGLE draft graphs were not replayed (graphs off, or no captured size fits)")
    r["round_ms"] = r.pop("step_ms")
    r["draft_ms"] = sorted(draft_s)[len(draft_s) // 2] * 1e3 if draft_s else float("nan")
    r["accept_length"] = spec["s"].stats()["spec_accept_length"]
    return r


def kernel_profile(runner: Any, bs_list: list[int], ks: list[int], input_len: int, output_len: int) -> str:
    """Device time per decode step / spec round and its top kernels, from torch.profiler (plain: overlap off)."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for bs in bs_list:
        runs = [("plain (sync)", None)] + [(f"spec oracle k={k}", k) for k in ks]
        for label, k in runs:
            spec = None if k is None else oracle_speculator(k)
            scheduler_decode(runner, bs, input_len, 8, False, speculator=spec, label=label)  # warm (graphs)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                r = scheduler_decode(runner, bs, input_len, output_len, False, speculator=spec, label=label)
            steps = r.get("decode_steps") or max(1, round(r["generated"] / (bs * (k or 1))))
            events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
            total = sum(e.device_time_total for e in events)
            wall = r["decode_s"] * 1e6 / steps
            out.append(
                f"## batch {bs}, {label}: {steps} steps/rounds, wall {wall:.0f} us each, device (all kernels and "
                f"copies, prefill included) {total / steps:.0f} us each"
            )
            for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
                out.append(f"  {e.device_time_total / steps:8.1f} us/step  x{e.count / steps:5.1f}  {e.key[:110]}")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--accept-lengths", default="1,2,3,4,5,6")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--attention-backend", default="flashinfer", choices=("flashinfer", "triton"))
    ap.add_argument(
        "--kernel-profile",
        action="store_true",
        help="instead of the table: under torch.profiler, the device time per plain step (overlap off) and per "
        "oracle round at each --accept-lengths, with the kernels that take it (kernel_profile.txt)",
    )
    ap.add_argument(
        "--eagle-random-head",
        action="store_true",
        help="instead of the table: real EAGLE rounds with a random head, draft steps from CUDA graphs vs eager "
        "(draft ms and round ms per batch size; eagle.json)",
    )
    ap.add_argument("--eagle-shape", default="5,4,8", help="EAGLE steps, top-k and verified tokens (root included)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("spec_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    bs_list = [int(x) for x in args.batch_sizes.split(",")]
    ks = [int(x) for x in args.accept_lengths.split(",")]
    tmp = tempfile.mkdtemp()
    max_bs = max(bs_list)
    eagle_shape = tuple(int(x) for x in args.eagle_shape.split(","))
    ctx = args.input_len + args.output_len + max(ks + [eagle_shape[2]]) + 16
    runner = ModelRunner(
        ServerArgs(
            model_path=write_model_dir(args.shape, tmp),
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            attention_backend=args.attention_backend,
            context_length=ctx,
            max_total_tokens=max_bs * (ctx + 8) + 4096,
            max_running_requests=max_bs,
            cuda_graph_max_bs=max_bs,
        )
    )
    res: dict[str, Any] = {
        "env": environment(),
        "shape": args.shape,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "backend": args.attention_backend,
        "rows": [],
    }
    if args.eagle_random_head:
        head = write_random_eagle_head(runner.model_path, tmp)
        for bs in bs_list:
            for graphs in (True, False):
                r = eagle_decode(runner, bs, args.input_len, args.output_len, head, eagle_shape, graphs)
                res["rows"].append(r)
                logger.info("%s", r)
        by = {(r["batch"], "graphs" in r["mode"]): r for r in res["rows"]}
        lines = [
            f"EAGLE {args.eagle_shape} (steps, top-k, verified tokens), random head: acceptance ~1",
            "| batch | draft ms (graphs) | draft ms (eager) | round ms (graphs) | round ms (eager) | accept length |",
            "|---|---|---|---|---|---|",
        ]
        for bs in bs_list:
            g, e = by[(bs, True)], by[(bs, False)]
            lines.append(
                f"| {bs} | {g['draft_ms']:.2f} | {e['draft_ms']:.2f} | {g['round_ms']:.2f} | {e['round_ms']:.2f} | "
                f"{g['accept_length']:.2f} |"
            )
        print("\n".join(lines))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "eagle.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    if args.kernel_profile:
        text = kernel_profile(runner, bs_list, ks, args.input_len, min(args.output_len, 64))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kernel_profile.txt").write_text(text)
        print(text)
        return 0
    for bs in bs_list:
        base = {}
        for overlap in (True, False):
            r = scheduler_decode(runner, bs, args.input_len, args.output_len, overlap)
            base[overlap] = r["decode_tok_s"]
            res["rows"].append(r)
            logger.info("%s", r)
        for k in ks:
            r = spec_decode(runner, bs, args.input_len, args.output_len, k)
            r["speedup_vs_overlap"] = r["decode_tok_s"] / base[True]
            r["speedup_vs_sync"] = r["decode_tok_s"] / base[False]
            res["rows"].append(r)
            logger.info("%s", r)
    lines = [
        "| batch | mode | decode tok/s | round/step ms | x plain (overlap) | x plain (sync) |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['decode_tok_s']:.1f} | {r.get('round_ms', r.get('step_ms', 0)):.2f} | "
            f"{r.get('speedup_vs_overlap', 1.0 if r['mode'] == 'sched+overlap' else float('nan')):.2f} | "
            f"{r.get('speedup_vs_sync', float('nan')):.2f} |"
        )
    md = "\n".join(lines)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

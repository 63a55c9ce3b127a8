"""Real acceptance of speculative decoding with real weights: the embedded SmolLM2 on CPU.

For each drafter (n-gram chain, n-gram tree, a truncated-layer SmolLM2 as the
draft model, and with ``--eagle-head`` an EAGLE head trained by
bench/train_eagle.py as a chain and as a tree) and each held-out task (a
copy-heavy repeat-and-edit prompt, a code edit, short questions; none of them
in train_eagle's prompt set), greedy decoding with and without speculation,
side by side in one process: acceptance length (tokens emitted per request
per round), decode tokens/s, and that the speculative output equals the
plain output.

    python bench/spec_acceptance.py --max-new-tokens 96 --draft-layers 6 --eagle-head /tmp/smollm2-eagle
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any, Optional

logger = logging.getLogger("spec_acceptance")

TASKS = {
    "repeat-and-edit": (
        "Here is a list:\napple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango\n"
        "Write the same list again, but replace cherry with coconut and kiwi with kumquat."
    ),
    "code-edit": (
        "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
        "Rewrite this function exactly, but rename it to sum_all and the variable s to acc."
    ),
    "question": "What is the capital of France? Answer in two sentences.",
    "explain": "Why is the sky blue? Explain briefly.",
    "story": "Write the opening paragraph of a story about a lighthouse keeper.",
}


def run(sa: Any, runner: Any, prompt_ids: list[int], max_new: int) -> dict[str, Any]:
    """One greedy request on ``runner`` (the target, shared by every run: no prefix cache, so its pool ends empty)."""
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    out: list = []
    runner.hidden_capture = None  # a previous EAGLE run's capture
    sched = scheduler_for_mode("unified")(sa, runner, None, out.extend)
    sched.submit(GenerateRequest("r", prompt_ids, SamplingParams(max_new_tokens=max_new, temperature=0.0)))
    while sched.waiting or sched.chunked_req is not None or not sched.inbox.empty():
        sched.step()
    t0 = time.perf_counter()
    while sched.has_work():
        sched.step()
    dt = time.perf_counter() - t0
    ids = [t for c in out for t in c.token_ids]
    st = sched.get_stats()
    return {"ids": ids, "decode_s": dt, "tok_s": (len(ids) - 1) / dt, "accept_length": st.get("spec_accept_length")}


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--eagle-head", default=None, help="an EAGLE head folder (bench/train_eagle.py)")
    ap.add_argument("--only", default=None, help="comma-separated drafter name prefixes to run (default: all)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 on a shared box: no OpenMP spinning)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from smollm2_subset import write_subset

    from kvship.engine.config import ServerArgs
    from kvship.engine.embedded import embedded_model_path
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.tokenizer import load_tokenizer

    gguf = embedded_model_path()
    draft = os.path.join(tempfile.mkdtemp(), f"smollm2-{args.draft_layers}l.gguf")
    write_subset(gguf, draft, args.draft_layers)
    tok = load_tokenizer(gguf)
    base = ServerArgs(
        model_path=gguf,
        device="cpu",
        attention_backend="torch_native",
        max_total_tokens=4096,
        disable_radix_cache=True,
        num_threads=args.threads,
    )
    runner = ModelRunner(base)
    drafters = {
        "ngram chain (8)": dict(speculative_algorithm="ngram", speculative_num_draft_tokens=8),
        "ngram tree (8, 2 branches)": dict(
            speculative_algorithm="ngram", speculative_num_draft_tokens=8, speculative_eagle_topk=2
        ),
        f"draft: SmolLM2 first {args.draft_layers} layers (4)": dict(
            speculative_algorithm="draft", speculative_draft_model_path=draft, speculative_num_draft_tokens=4
        ),
    }
    if args.eagle_head:
        drafters["eagle chain (5 steps)"] = dict(
            speculative_algorithm="eagle",
            speculative_draft_model_path=args.eagle_head,
            speculative_num_steps=5,
            speculative_eagle_topk=1,
        )
        drafters["eagle tree (5 steps, top-4, 8 tokens)"] = dict(
            speculative_algorithm="eagle", speculative_draft_model_path=args.eagle_head
        )
    if args.only:
        keep = tuple(p.strip() for p in args.only.split(","))
        drafters = {k: v for k, v in drafters.items() if k.startswith(keep)}
    rows = []
    for task, text in TASKS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        plain = run(base, runner, ids, args.max_new_tokens)
        for name, kw in drafters.items():
            spec = run(dataclasses.replace(base, **kw), runner, ids, args.max_new_tokens)
            rows.append(
                {
                    "task": task,
                    "drafter": name,
                    "accept_length": spec["accept_length"],
                    "plain_tok_s": plain["tok_s"],
                    "spec_tok_s": spec["tok_s"],
                    "speedup": spec["tok_s"] / plain["tok_s"],
                    "equal": spec["ids"] == plain["ids"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print("| task | drafter | acceptance length | plain tok/s | spec tok/s | speedup | output equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['drafter']} | {r['accept_length']:.2f} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['equal']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

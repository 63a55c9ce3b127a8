"""Accuracy of the FP8 KV cache against the unquantized KV (docs/quantization.md, "Accuracy").

The embedded SmolLM2-135M (or ``--model-path``), fp32 on CPU by default, 32 chat prompts ("Write two sentences
about {topic}."), each run twice through ``ModelRunner``: with the model's KV dtype and with
``--kv-cache-dtype fp8_e4m3`` (the checkpoint has no KV scales: 1.0).

* the unquantized KV model's 32 greedy tokens per prompt; then both models are fed prompt + those tokens
  (teacher-forced, one extend) and compared at the 32 next-token positions: top-1 agreement and the mean
  KL(unquantized || fp8) of the next-token distributions;
* free-running greedy: how many 32-token continuations are identical, and their mean common prefix.

    .venv/bin/python bench/kv_fp8_accuracy.py [--prompts 32 --tokens 32 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Optional

import torch

from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardMode, build_forward_batch
from kvship.engine.model_runner import ModelRunner

TOPICS = [
    "the sea", "mountains", "coffee", "bicycles", "libraries", "winter", "volcanoes", "bees", "trains", "music",
    "the moon", "gardens", "rain", "chess", "bread", "rivers", "owls", "deserts", "clocks", "bridges", "snow",
    "cats", "forests", "lighthouses", "tea", "maps", "robots", "islands", "stars", "markets", "kites", "caves",
]  # fmt: skip


class Session:
    """Runs whole-sequence extends and greedy decoding on one ``ModelRunner`` (one request at a time)."""

    def __init__(self, runner: ModelRunner):
        self.r = runner

    def _forward(self, mode, row: int, tokens: list[int], prefix: int, slots: list[int], all_logits: bool):
        r = self.r
        last = slots[-1] if slots else -1
        locs = r.allocator.alloc_extend([prefix], [prefix + len(tokens)], [last])
        assert locs is not None, "KV pool exhausted"
        r.req_to_token_pool.write(row, prefix, locs)
        slots.extend(locs.tolist())
        n = len(tokens)
        fb = build_forward_batch(
            mode,
            input_ids=tokens,
            positions=list(range(prefix, prefix + n)),
            out_cache_loc=locs,
            req_pool_indices=[row],
            seq_lens=[prefix + n],
            seq_lens_cpu=[prefix + n],
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            device=r.device,
            extend_lens=[n] if mode == ForwardMode.EXTEND else None,
            prefix_lens=[prefix] if mode == ForwardMode.EXTEND else None,
            logits_indices=list(range(n)) if all_logits else None,
        )
        return r.forward(fb).next_token_logits.float()

    def run(self, prompt: list[int], greedy_tokens: int, forced: Optional[list[int]] = None):
        """Greedy continuation of ``prompt`` (``greedy_tokens``), or with ``forced`` the next-token log-probs at
        each position of ``prompt + forced`` that predicts one of ``forced``."""
        r = self.r
        row = r.req_to_token_pool.alloc()
        slots: list[int] = []
        try:
            if forced is not None:
                logits = self._forward(ForwardMode.EXTEND, row, prompt + forced, 0, slots, True)
                return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(forced)], -1)
            logits = self._forward(ForwardMode.EXTEND, row, prompt, 0, slots, False)
            out = []
            while True:
                tok = int(logits[-1].argmax())
                out.append(tok)
                if len(out) == greedy_tokens:
                    return out
                logits = self._forward(ForwardMode.DECODE, row, [tok], len(prompt) + len(out) - 1, slots, False)
        finally:
            r.allocator.free(slots)
            r.req_to_token_pool.free(row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from kvship.engine.model_runner import resolve_model_path
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(args.model_path))
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write two sentences about {t}."}], add_generation_prompt=True)
        for t in (TOPICS * (args.prompts // len(TOPICS) + 1))[: args.prompts]
    ]
    common = dict(model_path=args.model_path, device=args.device, dtype=args.dtype, max_total_tokens=4096)
    base = Session(ModelRunner(ServerArgs(**common)))
    fp8 = Session(ModelRunner(ServerArgs(**common, kv_cache_dtype="fp8_e4m3")))
    agree = total = identical = 0
    kls, prefixes = [], []
    for prompt in prompts:
        ref = base.run(prompt, args.tokens)
        lp_base, lp_fp8 = base.run(prompt, 0, ref), fp8.run(prompt, 0, ref)
        kls.append((lp_base.exp() * (lp_base - lp_fp8)).sum(-1))
        agree += int((lp_base.argmax(-1) == lp_fp8.argmax(-1)).sum())
        total += len(ref)
        got = fp8.run(prompt, args.tokens)
        identical += int(got == ref)
        prefixes.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref)))
    out = {
        "model": args.model_path or "embedded SmolLM2-135M-Instruct",
        "kv_dtype_base": str(base.r.kv_pool.dtype).removeprefix("torch."),
        "prompts": len(prompts),
        "tokens": args.tokens,
        "top1_agreement": agree / total,
        "mean_kl_nats": float(torch.cat(kls).mean()),
        "max_kl_nats": float(torch.cat(kls).max()),
        "identical_continuations": identical,
        "mean_common_prefix": sum(prefixes) / len(prefixes),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

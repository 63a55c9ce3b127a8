"""Structured-output overhead on the GPU: decode tokens/s of JSON-schema requests vs unconstrained ones.

One ``ModelRunner`` at a real model shape (``decode_latency.SHAPES``, dummy
bf16 weights, CUDA graphs) serves the real ``Scheduler`` (overlap on, as on
CUDA by default) at each batch size, in the same run, for each schema of
``--schemas``:

* ``json``: a typical schema (an object with a free-text string, an integer,
  an enum and an array of strings).  With dummy weights a request may close
  its JSON early, so the constrained pass runs first and the unconstrained
  pass then gives every request exactly the number of tokens its constrained
  twin produced (``ignore_eos``): both decode the same tokens in the same
  batch-size trajectory, and the time difference is the grammar's.
* ``long-string``: a string whose ``minLength`` is 4 x ``--output-len``
  characters, so no request can end early; a counted repetition is xgrammar's
  costliest case for accepting a token (about 1 ms a token on the host).

Reported per schema and batch: decode tok/s of both passes, the slowdown, the
mean batch, and grammar compile time (first compile, which builds the
tokenizer info, a new schema, and a cached look-up).

The tokenizer is given with ``--tokenizer`` (a Hugging Face folder or a
GGUF); its vocabulary may be smaller than the model's (the extra ids are
never allowed).  The mask work scales with the tokenizer's vocabulary, so say
which one ran.

    python bench/grammar_overhead.py --tokenizer /path/to/tokenizer --out /tmp/out
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
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_latency import SHAPES, write_model_dir  # noqa: E402

logger = logging.getLogger("grammar_overhead")


def schema(kind: str, output_len: int) -> str:
    if kind == "long-string":
        text: dict[str, Any] = {"type": "string", "minLength": 4 * output_len}
        return json.dumps(
            {
                "type": "object",
                "properties": {"text": text, "n": {"type": "integer"}},
                "required": ["text", "n"],
                "additionalProperties": False,
            }
        )
    return json.dumps(
        {
            "type": "object",
            "properties": {
                "summary": {"type": "string"},
                "score": {"type": "integer"},
                "label": {"enum": ["positive", "negative", "neutral"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["summary", "score", "label", "tags"],
            "additionalProperties": False,
        }
    )


def run(runner: Any, tok: Any, bs: int, input_len: int, max_news: list[int], schema_text: str | None) -> dict[str, Any]:
    """One pass: ``bs`` requests (request i may produce ``max_news[i]`` tokens), all constrained by
    ``schema_text`` or none; returns decode tok/s, step time, mean batch and each request's length."""
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.scheduler import Scheduler

    lengths: dict[str, int] = {}

    def sink(chunks: Any) -> None:
        for c in chunks:
            if c.finished:
                lengths[c.rid] = c.completion_tokens

    sa = dataclasses.replace(runner.server_args, disable_radix_cache=True, chunked_prefill_size=16384)
    sched = Scheduler(sa, runner, tok, sink)
    gen = torch.Generator().manual_seed(bs)
    extra = {"json_schema": schema_text} if schema_text else {}
    for i in range(bs):
        ids = torch.randint(3, tok.vocab_size, (input_len,), generator=gen).tolist()
        sp = SamplingParams(temperature=0.0, max_new_tokens=max_news[i], ignore_eos=True, **extra)
        sched.submit(GenerateRequest(f"b{bs}-{i}", ids, sp))
    while len(sched.grammar_queue) or sched.waiting or sched.chunked_req is not None or not sched.inbox.empty():
        sched.step(block_s=0.001)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gen0, steps0 = sched.counters["generation_tokens"], sched.counters["decode_steps"]
    t0 = time.perf_counter()
    while sched.has_work():
        sched.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    n = sched.counters["generation_tokens"] - gen0
    steps = sched.counters["decode_steps"] - steps0
    return {
        "batch": bs,
        "grammar": schema_text is not None,
        "decode_tok_s": n / decode_s,
        "step_ms": decode_s / max(steps, 1) * 1e3,
        "mean_batch": n / max(steps, 1),
        "decode_steps": steps,
        "chained_steps": sched.overlap.launched if sched.overlap is not None else 0,
        "lengths": [lengths.get(f"b{bs}-{i}", 0) for i in range(bs)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--out", default=".")
    p.add_argument("--schemas", nargs="+", default=["json", "long-string"], choices=["json", "long-string"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from kvship.engine.config import ServerArgs
    from kvship.engine.grammar import GrammarBackend
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    model_dir = write_model_dir(args.shape, tempfile.mkdtemp())
    max_bs = max(args.batch)
    ctx = args.input_len + args.output_len + 8
    runner = ModelRunner(
        ServerArgs(
            model_path=model_dir,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            attention_backend=args.attention_backend,
            context_length=ctx,
            max_total_tokens=max_bs * (ctx + 1) + 4096,
            max_running_requests=max_bs,
            cuda_graph_max_bs=max_bs,
        )
    )
    vocab = runner.model_config.vocab_size
    backend = GrammarBackend(tok, vocab, [tok.eos_token_id])
    key = ("json_schema", schema("long-string", args.output_len))
    t0 = time.perf_counter()
    backend.compile(key).result()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.compile(key).result()
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.compile(("json_schema", schema("json", args.output_len))).result()
    uncached = time.perf_counter() - t0
    res: dict[str, Any] = {
        "shape": args.shape,
        "gpu": torch.cuda.get_device_name(),
        "tokenizer_vocab": tok.vocab_size,
        "model_vocab": vocab,
        "attention_backend": args.attention_backend,
        "compile_first_s": first,
        "compile_uncached_s": uncached,
        "compile_cached_s": cached,
        "runs": [],
    }
    run(runner, tok, 1, args.input_len, [8], None)  # warm-up
    for kind in args.schemas:
        for bs in args.batch:
            constrained = run(runner, tok, bs, args.input_len, [args.output_len] * bs, schema(kind, args.output_len))
            plain = run(runner, tok, bs, args.input_len, [max(n, 1) for n in constrained["lengths"]], None)
            for r in (plain, constrained):
                r["schema"] = kind
                logger.info("%s", {k: v for k, v in r.items() if k != "lengths"})
                res["runs"].append(r)
    lines = [
        f"{res['shape']} on {res['gpu']}, {args.attention_backend} attention, tokenizer vocab {tok.vocab_size} "
        f"(model {vocab}); compile: first {first * 1e3:.0f} ms, new schema {uncached * 1e3:.1f} ms, "
        f"cached {cached * 1e6:.0f} us",
        "",
        "| schema | batch | plain tok/s | constrained tok/s | slowdown | mean batch | plain step ms | constrained step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in args.schemas:
        for bs in args.batch:
            a, b = (
                next(r for r in res["runs"] if r["schema"] == kind and r["batch"] == bs and r["grammar"] == g)
                for g in (False, True)
            )
            lines.append(
                f"| {kind} | {bs} | {a['decode_tok_s']:.0f} | {b['decode_tok_s']:.0f} | "
                f"{(1 - b['decode_tok_s'] / a['decode_tok_s']) * 100:.1f}% | {b['mean_batch']:.1f} | "
                f"{a['step_ms']:.2f} | {b['step_ms']:.2f} |"
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grammar_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "grammar_overhead.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

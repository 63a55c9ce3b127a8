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

``--host-profile`` (CPU only, no model): what the host pays per decode step
of ``--batch`` constrained requests (``json`` schema; ``--tokenizer``
defaults to the embedded SmolLM2's), on one trajectory of
``--profile-steps`` steps of random allowed tokens (a request whose JSON is
complete is replaced by a new one, so the rows cover every state).  Each
step is run twice on twin requests given the same tokens:

* baseline (the chained step before mask filling moved aside): tokens
  accepted one request at a time (``accept`` then ``terminated``), masks
  filled inline with xgrammar's batch filler, then the real
  ``Scheduler.process`` of the step's tokens and the hand-off to the output
  sink, one after the other;
* now: ``Req.feed_grammars`` (one ``batch_accept_token`` call), the fill
  started on a ``MaskFiller`` thread, ``Scheduler.process`` + hand-off
  meanwhile, then the join.

Also timed on the same states: a per-row fill (``GrammarMatcher.fill`` one
row at a time) against the batch filler, and how fast Python runs beside a
fill on the filler's thread (1.0 = the fill holds no GIL).  "hand-off" is
the part of the window until the filler's thread runs the fill (thread
wake-ups: long on a box whose cores are all busy); "max(fill, process)" is
the window with a free core for the fill.  The table gives medians in
microseconds and the ratio now / baseline of the same run:

    python bench/grammar_overhead.py --host-profile --batch 1 8 32 --out /tmp/out
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


class _HostOnlyRunner:
    """What ``Scheduler`` reads from a model runner, to time its host-side steps (it never runs a forward)."""

    def __init__(self, vocab: int, eos: list[int], max_reqs: int):
        from types import SimpleNamespace

        from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator

        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_config = SimpleNamespace(vocab_size=vocab, eos_token_ids=frozenset(eos))
        self.page_size = 1
        self.context_len = 1 << 20
        self.req_to_token_pool = ReqToTokenPool(max_reqs, 8, "cpu")
        self.kv_pool = KVPool(64, 1, torch.float32, 1, 1, 1, "cpu")
        self.allocator = TokenToKVPoolAllocator(self.kv_pool.num_slots, 1)
        self.attn_backend = None
        self.max_total_tokens = self.allocator.total_slots


class _Twin:
    """One side of the host profile: a scheduler (for ``process``) and its ``bs`` constrained requests."""

    def __init__(self, backend: Any, compiled: Any, schema_text: str, bs: int, vocab: int, eos: int):
        from kvship.engine.config import ServerArgs
        from kvship.engine.scheduler import Scheduler

        self.backend, self.compiled, self.schema_text = backend, compiled, schema_text
        self.sent: list[Any] = []
        sa = ServerArgs(device="cpu", sampling_backend="torch", disable_overlap_schedule=True)
        self.sched = Scheduler(sa, _HostOnlyRunner(vocab, [eos], 2 * bs + 2), None, self.sent.extend)
        self.made = 0
        self.reqs = [self._new() for _ in range(bs)]

    def _new(self) -> Any:
        from kvship.engine.io_struct import SamplingParams
        from kvship.engine.schedule_batch import Req

        sp = SamplingParams(temperature=0.0, max_new_tokens=1 << 30, json_schema=self.schema_text)
        req = Req(f"r{self.made}", [1, 2, 3], sp)
        self.made += 1
        req.grammar = self.backend.matcher(self.compiled)
        self.sched.reqs[req.rid] = req
        self.sched.queues.running.append(req)
        return req

    def pending(self, tokens: list[int]) -> Any:
        from kvship.engine.forward_batch import ForwardMode
        from kvship.engine.sampler import SampleOutput
        from kvship.engine.schedule_batch import ScheduleBatch
        from kvship.engine.scheduler.launch import Pending

        batch = ScheduleBatch(list(self.reqs), ForwardMode.DECODE, sample_mask=[True] * len(self.reqs))
        host = SampleOutput(next_token_ids=torch.tensor(tokens), logprobs=None, top_logprobs=None)
        index = {id(r): j for j, r in enumerate(self.reqs)}
        return Pending(batch, None, host, [0] * len(tokens), None, index)

    def replace_finished(self) -> None:
        self.reqs = [self._new() if r.finished else r for r in self.reqs]
        self.sent.clear()


def _pick(mask: torch.Tensor, rows: list[int], bs: int, eos: int, vocab: int, gen: torch.Generator) -> list[int]:
    """A random allowed token per request (not EOS while anything else is allowed)."""
    from kvship.engine.grammar.mask import unpack_bitmask

    allowed = unpack_bitmask(mask, vocab)
    out = [eos] * bs
    for i, j in enumerate(rows):
        ids = allowed[i].nonzero().flatten()
        if len(ids) > 1:
            ids = ids[ids != eos]
        out[j] = int(ids[torch.randint(len(ids), (1,), generator=gen)])
    return out


def _python_beside_fill(filler: Any, reqs: list[Any], vocab: int) -> float:
    """Speed of a pure-Python loop while fills run on the filler's thread, against alone (1.0: no GIL held)."""

    def loop() -> float:
        t0 = time.perf_counter()
        x = 0
        for k in range(20000):
            x += k
        return time.perf_counter() - t0

    alone = min(loop() for _ in range(5))
    beside = []
    for _ in range(5):
        fills = [filler.start(reqs, vocab) for _ in range(4)]
        beside.append(loop())
        for f in fills:
            f.wait()
    return alone / min(beside)


def host_profile(args: argparse.Namespace) -> int:
    """``--host-profile`` (see the module docstring)."""
    from kvship.engine.embedded import embedded_model_path
    from kvship.engine.grammar import GrammarBackend
    from kvship.engine.grammar.mask import MaskFiller, fill_bitmask
    from kvship.engine.schedule_batch import Req
    from kvship.engine.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)  # OpenMP threads spinning after small ops distort a shared box's timings
    tok = load_tokenizer(args.tokenizer or embedded_model_path())
    vocab, eos = tok.vocab_size, tok.eos_token_id
    backend = GrammarBackend(tok, vocab, [eos])
    schema_text = schema("json", args.output_len)
    compiled = backend.compile(("json_schema", schema_text)).result()
    filler = MaskFiller()
    load = os.getloadavg()
    res: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "torch_threads": args.threads,
        "loadavg_start": load,
        "tokenizer_vocab": vocab,
        "batches": [],
    }
    keys = ("accept_one_by_one", "accept_batch", "fill_per_row", "fill_batch", "process", "window_baseline")
    keys += ("window_now", "hand_off", "window_ideal", "step_baseline", "step_now")
    for bs in args.batch:
        gen = torch.Generator().manual_seed(args.seed + bs)
        base, now = (_Twin(backend, compiled, schema_text, bs, vocab, eos) for _ in range(2))
        rows, mask = fill_bitmask(base.reqs, vocab)
        t: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(args.profile_steps):
            tokens = _pick(mask, rows, bs, eos, vocab, gen)
            # baseline: one request at a time, then fill inline, then process
            t0 = time.perf_counter()
            skip = set()
            for r, tk in zip(base.reqs, tokens):
                accepted = bool(r.grammar.accept(tk))
                terminated = accepted and r.grammar.terminated
                r._grammar_fed = (tk, accepted, terminated)
                if not (accepted and not terminated):
                    skip.add(id(r))
            t1 = time.perf_counter()
            rows, mask = fill_bitmask(base.reqs, vocab, skip)
            t2 = time.perf_counter()
            base.sched.process(base.pending(tokens))
            base.sched.flush()
            t3 = time.perf_counter()
            t["accept_one_by_one"].append(t1 - t0)
            t["fill_batch"].append(t2 - t1)
            t["process"].append(t3 - t2)
            t["window_baseline"].append(t3 - t1)
            t["step_baseline"].append(t3 - t0)
            # the per-row fill, on the same states (a fill does not move a matcher)
            live = [r.grammar for r in base.reqs if id(r) not in skip]
            scratch = torch.empty_like(mask)
            t0 = time.perf_counter()
            for i, g in enumerate(live):
                g.fill(scratch, i)
            t["fill_per_row"].append(time.perf_counter() - t0)
            # now: one batch accept, the fill on the filler's thread while process runs
            t0 = time.perf_counter()
            ok = Req.feed_grammars(now.reqs, tokens)
            t1 = time.perf_counter()
            fill = filler.start(now.reqs, vocab, {id(r) for r, keep in zip(now.reqs, ok) if not keep})
            t["hand_off"].append(time.perf_counter() - t1)  # until the filler's thread runs the fill
            now.sched.process(now.pending(tokens))
            now.sched.flush()
            fill.wait()
            t2 = time.perf_counter()
            t["accept_batch"].append(t1 - t0)
            t["window_now"].append(t2 - t1)
            t["window_ideal"].append(max(t["fill_batch"][-1], t["process"][-1]))  # fill and process at once
            t["step_now"].append(t2 - t0)
            for twin in (base, now):
                twin.replace_finished()
            rows, mask = fill_bitmask(base.reqs, vocab)  # both twins are in the same states
        beside = _python_beside_fill(filler, now.reqs, vocab) if bs > 1 else None
        med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in t.items()}
        mean = {k: sum(v) / len(v) * 1e6 for k, v in t.items()}
        res["batches"].append(
            {"batch": bs, "median_us": med, "mean_us": mean, "python_beside_fill": beside, "requests": base.made}
        )
        logger.info("batch %d: %s", bs, {k: round(v) for k, v in med.items()})
    filler.close()
    backend.close()
    res["loadavg_end"] = os.getloadavg()
    lines = [
        f"host profile, {res['cpus']} CPUs, load average {load[0]:.1f} -> {res['loadavg_end'][0]:.1f}, "
        f"tokenizer vocab {vocab}, json schema, {args.profile_steps} steps; medians in us (means in the JSON)",
        "",
        "| batch | accept 1-by-1 | accept batch | ratio | fill per row | fill batch | ratio | process | "
        "window before | window now | ratio | of which hand-off | max(fill, process) | step before | step now | "
        "ratio | Python beside a fill |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in res["batches"]:
        m = b["median_us"]
        beside = "-" if b["python_beside_fill"] is None else f"{b['python_beside_fill']:.2f}"
        lines.append(
            f"| {b['batch']} | {m['accept_one_by_one']:.0f} | {m['accept_batch']:.0f} | "
            f"{m['accept_batch'] / m['accept_one_by_one']:.2f} | {m['fill_per_row']:.0f} | {m['fill_batch']:.0f} | "
            f"{m['fill_batch'] / m['fill_per_row']:.2f} | {m['process']:.0f} | {m['window_baseline']:.0f} | "
            f"{m['window_now']:.0f} | {m['window_now'] / m['window_baseline']:.2f} | {m['hand_off']:.0f} | "
            f"{m['window_ideal']:.0f} | "
            f"{m['step_baseline']:.0f} | "
            f"{m['step_now']:.0f} | {m['step_now'] / m['step_baseline']:.2f} | {beside} |"
        )
    _write_results(args.out, "grammar_host_profile", res, lines)
    return 0


def _write_results(out: str, stem: str, res: Any, lines: list[str]) -> None:
    """``{out}/{stem}.json`` (the figures) and ``.md`` (the table), and the table on stdout."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", default=None, help="required on CUDA; --host-profile: the embedded SmolLM2's")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--out", default=".")
    p.add_argument("--schemas", nargs="+", default=["json", "long-string"], choices=["json", "long-string"])
    p.add_argument("--host-profile", action="store_true", help="CPU: time the host's share of a constrained step")
    p.add_argument("--profile-steps", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="--host-profile: torch CPU threads (OpenMP)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.host_profile:
        return host_profile(args)
    if args.tokenizer is None:
        p.error("--tokenizer is required (except with --host-profile)")

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
    _write_results(args.out, "grammar_overhead", res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

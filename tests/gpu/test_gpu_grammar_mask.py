"""Structured output on CUDA: the grammar mask applied to device logits equals the CPU mask.

``apply_grammar_mask`` fills the bitmask on the host, copies it to the device
and unpacks it there; the result must equal the same call on CPU logits, for
a large vocabulary (Llama-3 size, not a multiple of 32), bf16 and fp32
logits, and rows that are not constrained must stay untouched.  The matchers
here are stand-ins that write random bitmasks (the CPU tests cover xgrammar's
own matchers); with xgrammar installed a JSON-schema matcher is checked too.
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import requires_cuda

from kvship.engine.grammar.mask import apply_grammar_mask, bitmask_words

pytestmark = [pytest.mark.gpu, requires_cuda]

VOCAB = 128_258


class RandomMatcher:
    """Writes one fixed random bitmask row (about ``density`` of the tokens allowed)."""

    def __init__(self, seed: int, density: float):
        g = torch.Generator().manual_seed(seed)
        allowed = torch.rand(VOCAB, generator=g) < density
        self.allowed = allowed
        padded = torch.zeros(bitmask_words(VOCAB) * 32, dtype=torch.int64)
        padded[:VOCAB] = allowed.long()
        weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
        words = (padded.view(-1, 32) * weights).sum(dim=1)
        self.row = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.row)


class R:
    def __init__(self, grammar):
        self.grammar = grammar


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_mask_equals_cpu_mask(dtype):
    reqs = [R(RandomMatcher(i, d)) if d else R(None) for i, d in enumerate([0.5, 0, 0.001, 0.9, 0, 1e-5, 0.3])]
    logits = torch.randn(len(reqs), VOCAB + 256, dtype=dtype)[:, :VOCAB]  # wider model rows, cut as launch does
    cpu = logits.clone()
    apply_grammar_mask(cpu, reqs)
    dev = logits.cuda()
    apply_grammar_mask(dev, reqs)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), cpu)
    for i, r in enumerate(reqs):
        if r.grammar is None:
            assert torch.equal(cpu[i], logits[i])
        else:
            assert torch.equal(torch.isfinite(cpu[i]), r.grammar.allowed)


def test_device_mask_with_an_xgrammar_matcher_equals_xgrammar_reference():
    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(['the quick brown fox {"a": 1}'] * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=320, stop_token_ids=[1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema('{"type": "object"}', strict_mode=False)

    class M:
        def __init__(self):
            self.m = xgr.GrammarMatcher(compiled)

        def fill(self, bitmask, row):
            self.m.fill_next_token_bitmask(bitmask, row)

    reqs = [R(M()), R(None), R(M())]
    logits = torch.randn(3, 320, device="cuda")
    ours = logits.clone()
    apply_grammar_mask(ours, reqs)
    ref = logits.clone()
    bm = xgr.allocate_token_bitmask(3, 320)
    reqs[0].grammar.fill(bm, 0)
    reqs[2].grammar.fill(bm, 2)
    xgr.apply_token_bitmask_inplace(ref, bm.cuda(), indices=[0, 2])
    assert torch.equal(ours, ref)


def test_constrained_requests_on_cuda_with_graphs_and_overlap_keep_plain_outputs(tmp_path):
    """A tiny model on CUDA (CUDA graphs, overlap on): constrained requests match their regex / schema and
    the plain greedy requests beside them decode the tokens they decode alone."""
    pytest.importorskip("xgrammar")
    import dataclasses
    import json
    import re

    import jsonschema
    from conftest import build_tiny_model
    from pd_fixtures import run_until_idle

    from kvship.engine.config import ServerArgs
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler
    from kvship.engine.tokenizer import load_tokenizer

    path = build_tiny_model(str(tmp_path), "llama", seed=3)
    tok = load_tokenizer(path)
    sa = ServerArgs(
        model_path=path,
        device="cuda",
        dtype="float32",  # batch sizes differ between the two runs: keep greedy ties out of it
        attention_backend="triton",
        max_total_tokens=16384,
        max_running_requests=32,
        context_length=1024,
        cuda_graph_max_bs=32,
        disable_radix_cache=True,
        sampling_backend="torch",
    )
    runner = ModelRunner(sa)
    ipv4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["a", "b"]}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    }
    plain = [
        GenerateRequest(
            f"p{i}", tok.encode(f"plain {i}"), SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
        )
        for i in range(6)
    ]
    constrained = [
        GenerateRequest(f"g{i}", tok.encode(f"grammar {i}"), SamplingParams(max_new_tokens=48, temperature=0.0, **kw))
        for i, kw in enumerate([{"regex": ipv4}, {"json_schema": json.dumps(schema)}] * 3)
    ]

    def serve(reqs):
        chunks: list = []
        sched = Scheduler(sa, runner, tok, chunks.extend)
        assert sched.overlap is not None  # overlap is on on CUDA
        for r in reqs:
            sched.submit(dataclasses.replace(r))
        run_until_idle(sched)
        out: dict = {}
        for c in chunks:
            out.setdefault(c.rid, []).extend(c.token_ids)
        return out, sched

    alone, sched = serve(plain)
    assert sched.overlap.launched > 0  # plain decodes were chained ahead
    mixed, _ = serve(plain + constrained)
    for r in plain:
        assert mixed[r.rid] == alone[r.rid], r.rid
    for i, r in enumerate(constrained):
        text = tok.decode(mixed[r.rid], skip_special_tokens=True)
        if i % 2 == 0:
            assert re.fullmatch(ipv4, text), text
        else:
            jsonschema.validate(json.loads(text), schema)

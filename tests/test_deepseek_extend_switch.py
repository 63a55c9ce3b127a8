"""The MLA extend switch (docs/deepseek.md, "Absorbed or decompressed extend").

An ``EXTEND`` of a DeepSeek model attends decompressed (``kv_b_proj`` over every latent row) or absorbed (over
the latent rows), whichever ``mla_extend_flops`` says is cheaper, once per forward; ``KVSHIP_MLA_EXTEND`` forces
either.  Here: the cost rule at DeepSeek-V3 / V2-Lite dims, and a tiny DeepSeek-V3 (float32) whose multi-turn /
prefix-cached runs give the same logits and greedy tokens with the switch forced absorbed, forced decompressed
and auto, on ``torch_native`` and on ``triton`` (Triton's interpreter on CPU, in a child pytest with
``TRITON_INTERPRET=1`` as tests/test_deepseek.py runs tests/test_mla_triton.py; natively on CUDA).  A spy on
the backend's two extend entry points checks which path each extend took, so a switch that did nothing fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import KVDriver
from deepseek_fixtures import build_tiny_deepseek
from pd_fixtures import run_until_idle
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

from kvship.common.envs import ENV
from kvship.engine.attention.mla import MLALayerSpec
from kvship.engine.config import ServerArgs
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_runner import ModelRunner
from kvship.engine.models.deepseek import extend_takes_absorbed, mla_extend_flops
from kvship.engine.scheduler import Scheduler

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
BACKENDS = [
    "torch_native",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not TRITON_HERE, reason="Triton MLA kernels: CUDA, or TRITON_INTERPRET=1 on CPU"),
    ),
]
PATHS = ("absorbed", "decompressed", "auto")
# float32 end to end; the two paths sum in different orders (measured ~1e-6 on logits of magnitude ~5)
ATOL = 1e-4
# greedy tokens per request through the scheduler: two decode steps after the extend over the cached prefix (more
# run the same decode kernel again: seconds each in Triton's interpreter)
MAX_NEW = 3

V3 = MLALayerSpec(0, 128, 512, 128, 64, 128, scaling=0.1)  # 128 heads, kv_lora_rank 512, nope 128, rope 64, v 128
V2_LITE = MLALayerSpec(0, 16, 512, 128, 64, 128, scaling=0.1)


# --- the cost rule --------------------------------------------------------------------------------------------
def test_mla_extend_flops_counts_both_paths_as_the_rule_says():
    s = MLALayerSpec(0, 2, 8, 4, 2, 3, scaling=1.0)  # H 2, r 8, nope 4, rope 2, v 3
    ext, seq = [3, 1], [10, 6]  # T = 4, S = 16, sum T_b S_b = 36
    dec, ab = mla_extend_flops(s, ext, seq)
    assert dec == 2 * 16 * 8 * 2 * (4 + 3) + 2 * 36 * 2 * (4 + 2 + 3)
    assert ab == 2 * 4 * 2 * 8 * (4 + 3) + 2 * 36 * 2 * (2 * 8 + 2)


@pytest.mark.parametrize("spec", [V3, V2_LITE], ids=["v3", "v2_lite"])
def test_short_extends_over_long_prefixes_absorb_and_fresh_prefills_decompress(spec):
    auto = lambda ext, seq: extend_takes_absorbed("auto", spec, ext, seq)  # noqa: E731
    assert auto([4], [8192 + 4]) and auto([1], [2048 + 1]) and auto([64], [4096 + 64])
    for n in (1, 16, 512, 8192):  # a fresh prefill: every position new, decompressing is cheaper
        assert not auto([n], [n])
    # over an 8k prefix the crossover lies at ~167 new tokens (1/T - 1/S = 768 / 131072; docs/deepseek.md)
    assert auto([160], [8192 + 160]) and not auto([170], [8192 + 170])
    assert auto([166], [8192 + 166]) and not auto([168], [8192 + 168])
    # a batch decides once, by its sums: a fresh 2k prefill outweighs a 4-token extend over 8k
    assert not auto([4, 2048], [8192 + 4, 2048]) and auto([4, 4], [8192 + 4, 4096 + 4])
    # the knob's forced values win over the rule
    assert extend_takes_absorbed("absorbed", spec, [512], [512])
    assert not extend_takes_absorbed("decompressed", spec, [4], [8192 + 4])


def test_mla_extend_knob_reads_its_three_values_and_refuses_others(monkeypatch):
    monkeypatch.delenv("KVSHIP_MLA_EXTEND", raising=False)
    assert ENV.MLA_EXTEND == "auto"
    for v in PATHS:
        monkeypatch.setenv("KVSHIP_MLA_EXTEND", v.upper())
        assert ENV.MLA_EXTEND == v
    monkeypatch.setenv("KVSHIP_MLA_EXTEND", "fast")
    with pytest.raises(ValueError, match="KVSHIP_MLA_EXTEND='fast': expected one of auto, absorbed, decompressed"):
        ENV.MLA_EXTEND


# --- the tiny model, each path --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    # two layers, the dense one and a MoE one: a forward takes one path in every layer, so a third layer would
    # only run the Triton kernels once more per forward (seconds each in the interpreter)
    return build_tiny_deepseek(
        str(tmp_path_factory.mktemp("ds_switch")), "v3_yarn_grouped", seed=30, num_hidden_layers=2
    )


def _runner(monkeypatch, path: str, backend: str, mode: str, **kw) -> tuple[ModelRunner, list[str]]:
    """A runner built under ``KVSHIP_MLA_EXTEND=mode`` and the log of its EXTEND attention calls (one entry per
    layer and forward: ``absorbed`` or ``decompressed``), from a spy on its backend's two extend entry points."""
    monkeypatch.setenv("KVSHIP_MLA_EXTEND", mode)
    sa = ServerArgs(
        model_path=path, device=DEVICE, dtype="float32", max_total_tokens=512, attention_backend=backend, **kw
    )
    runner = ModelRunner(sa)
    log: list[str] = []
    backend_obj = runner.attn_backend
    absorbed, decompressed = backend_obj.forward_extend, backend_obj.forward_extend_decompressed

    def spy_absorbed(*a, **kw):
        log.append("absorbed")
        return absorbed(*a, **kw)

    def spy_decompressed(*a, **kw):
        log.append("decompressed")
        return decompressed(*a, **kw)

    monkeypatch.setattr(backend_obj, "forward_extend", spy_absorbed)
    monkeypatch.setattr(backend_obj, "forward_extend_decompressed", spy_decompressed)
    return runner, log


def _turns(runner: ModelRunner, log: list[str]) -> tuple[list[torch.Tensor], list[list[str]]]:
    """Two requests over two turns: a cold prefill of 40 and of 9 tokens; then the first request's next turn of
    3 tokens over its 40 cached ones with a fresh 5-token request beside it, the second's of 2 over its 9;
    a decode step.  Logits of every new token, and the extend paths each forward took."""
    drv = KVDriver(runner)
    a, b, c = drv.new(), drv.new(), drv.new()
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 380, (n,), generator=g).tolist()  # noqa: E731
    out, paths = [], []
    try:
        for step in (
            lambda: drv.extend([a, b], [ids(40), ids(9)], all_logits=True),
            lambda: drv.extend([a, c], [ids(3), ids(5)], all_logits=True),
            lambda: drv.extend([b], [ids(2)], all_logits=True),
            lambda: drv.decode([a, b, c], ids(3)),
        ):
            del log[:]
            out.append(step())
            paths.append(sorted(set(log)))
    finally:
        for r in (a, b, c):
            drv.free(r)
    return out, paths


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_logits_agree_forced_absorbed_forced_decompressed_and_auto(backend, ds_path, monkeypatch):
    runs = {}
    for mode in PATHS:
        runner, log = _runner(monkeypatch, ds_path, backend, mode)
        runs[mode] = _turns(runner, log)
    extends = 3
    assert runs["absorbed"][1][:extends] == [["absorbed"]] * extends
    assert runs["decompressed"][1][:extends] == [["decompressed"]] * extends
    # auto (the tiny dims' crossover: absorbed while 1/T - 1/S > 24 / 1280): the cold prefills decompress, the
    # second turns absorb (3 + 5 new over 48 positions; 2 new over 11); one path per forward, every layer
    assert runs["auto"][1][:extends] == [["decompressed"], ["absorbed"], ["absorbed"]]
    for mode in ("absorbed", "auto"):
        for got, want in zip(runs[mode][0], runs["decompressed"][0]):
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < ATOL, mode


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cached_greedy_tokens_equal_on_every_extend_path(backend, ds_path, monkeypatch):
    """Through the scheduler (radix cache, page size 1): a second request sharing a 32-token prefix with a
    short new suffix hits the cache and extends over it; its greedy tokens are the same on every path."""
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 380, (32,), generator=g).tolist()
    prompts = [shared + [41, 42], shared + [50, 51, 52]]
    runs = {}
    for mode in PATHS:
        runner, log = _runner(monkeypatch, ds_path, backend, mode, page_size=1)
        chunks: list = []
        sched = Scheduler(runner.server_args, runner, None, chunks.extend)
        for i, p in enumerate(prompts):
            sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)))
            run_until_idle(sched)
        assert max(c.cached_tokens for c in chunks if c.rid == "r1") >= 32  # the shared prefix came from the cache
        runs[mode] = ([[t for c in chunks if c.rid == f"r{i}" for t in c.token_ids] for i in range(2)], set(log))
    assert runs["absorbed"][1] == {"absorbed"} and runs["decompressed"][1] == {"decompressed"}
    assert runs["auto"][1] == {"absorbed", "decompressed"}  # the cold prompt decompressed, the hit absorbed
    assert runs["absorbed"][0] == runs["decompressed"][0] == runs["auto"][0]
    assert all(len(t) == MAX_NEW for t in runs["auto"][0])


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the triton cases above run natively")
def test_extend_switch_triton_cases_pass_in_the_triton_interpreter(request):
    """This file's ``triton`` cases in a child pytest with ``TRITON_INTERPRET=1`` (set before triton is imported; the
    session's one such child, tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_deepseek_extend_switch.py").check(passed=2)

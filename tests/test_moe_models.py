"""Mixture-of-Experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) on tiny random checkpoints, against ``transformers``.

Each model is written by ``transformers`` ``save_pretrained`` (per-expert
checkpoint tensors, which our loader stacks) and run through our
ModelRunner with the ``torch`` MoE runner in float32; logits must agree
within ``ATOL``, greedy continuations through the real Scheduler must equal
``generate``.  The Triton runner is checked in tests/gpu/test_gpu_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from moe_fixtures import MOE_COMMON, SPECS, build_tiny_moe
from pd_fixtures import run_until_idle

from kvship.engine.config import ServerArgs
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.layers.moe.align import moe_align_block_size
from kvship.engine.layers.moe.layer import FusedMoE, count_rows_by_slot
from kvship.engine.layers.moe.runner import get_moe_runner
from kvship.engine.layers.moe.topk import select_experts
from kvship.engine.model_config import ModelConfig
from kvship.engine.model_runner import ModelRunner
from kvship.engine.models.llama import LlamaMLP
from kvship.engine.models.moe import SparseMoeBlock
from kvship.engine.scheduler import Scheduler

ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {k: build_tiny_moe(str(tmp_path_factory.mktemp(f"tiny_{k}")), k, seed=20 + i) for i, k in enumerate(SPECS)}


@pytest.fixture(scope="module")
def hf_moe(moe_dirs):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in moe_dirs.items()}


@pytest.fixture(scope="module")
def moe_runners(moe_dirs):
    return {
        k: ModelRunner(ServerArgs(model_path=p, device="cpu", max_total_tokens=1024, max_running_requests=8))
        for k, p in moe_dirs.items()
    }


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("key", list(SPECS))
def test_moe_prefill_and_decode_logits_match_transformers(key, moe_runners, hf_moe, kv_driver):
    ids, follow = _prompt(29, seed=1), _prompt(4, seed=2)
    drv = kv_driver(moe_runners[key])
    req = drv.new()
    try:
        prefill = drv.extend([req], [ids], all_logits=True)
        decode = [drv.decode([req], [t])[0] for t in follow]
    finally:
        drv.free(req)
    ref = _hf_logits(hf_moe[key], ids + follow)
    assert (prefill - ref[: len(ids)]).abs().max().item() < ATOL
    assert (torch.stack(decode) - ref[len(ids) :]).abs().max().item() < ATOL


def test_moe_layers_follow_sparse_step_mlp_only_layers_and_shared_expert(moe_runners):
    q3 = moe_runners["qwen3_moe"].model.model.layers
    assert [type(layer.mlp) for layer in q3] == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    assert q3[0].mlp.experts.w13_weight.shape == (8, 64, 64) and q3[0].mlp.experts.w2_weight.shape == (8, 64, 32)
    assert q3[0].mlp.experts.renormalize and not q3[0].mlp.has_shared_expert
    q2 = moe_runners["qwen2_moe"].model.model.layers
    assert [type(layer.mlp) for layer in q2] == [LlamaMLP, SparseMoeBlock, LlamaMLP]
    assert q2[1].mlp.has_shared_expert and not q2[1].mlp.experts.renormalize
    mx = moe_runners["mixtral"].model.model.layers
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in mx) and mx[0].mlp.experts.renormalize
    assert mx[0].mlp.experts.w13_weight.shape == (8, 96, 64)


def test_moe_stacked_experts_hold_each_checkpoint_expert(moe_dirs, moe_runners):
    from safetensors import safe_open

    experts = moe_runners["mixtral"].model.model.layers[2].mlp.experts
    with safe_open(f"{moe_dirs['mixtral']}/model.safetensors", "pt") as f:
        w1 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w1.weight")
        w3 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w3.weight")
        w2 = f.get_tensor("model.layers.2.block_sparse_moe.experts.5.w2.weight")
    assert torch.equal(experts.w13_weight[5], torch.cat([w1, w3]))
    assert torch.equal(experts.w2_weight[5], w2)


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral"])
def test_moe_greedy_through_the_scheduler_equals_transformers_generate(key, moe_dirs, hf_moe):
    sa = ServerArgs(model_path=moe_dirs[key], device="cpu", max_total_tokens=1024, chunked_prefill_size=16)
    runner = ModelRunner(sa)
    chunks = []
    sched = Scheduler(sa, runner, None, chunks.extend)
    prompts = [_prompt(n, seed=10 + n) for n in (3, 21)]
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8)))
    run_until_idle(sched)
    assert sched.idle()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf_moe[key].generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, pad_token_id=0
            )[0, len(p) :]
        got = [t for c in chunks if c.rid == f"r{i}" for t in c.token_ids]
        assert got == ref.tolist(), f"prompt {i}"


def test_moe_dummy_weights_load_and_give_finite_logits(moe_dirs, kv_driver):
    runner = ModelRunner(ServerArgs(model_path=moe_dirs["qwen2_moe"], load_format="dummy", max_total_tokens=64))
    logits = kv_driver(runner).greedy(_prompt(5, seed=3), 3)
    assert len(logits) == 3
    w13 = runner.model.model.layers[1].mlp.experts.w13_weight
    assert w13.std().item() == pytest.approx(0.02, rel=0.1)


def test_moe_checkpoint_missing_an_expert_is_an_error(moe_dirs):
    from kvship.engine.loaders.base import fill_from_checkpoint
    from kvship.engine.loaders.safetensors_loader import iterate_safetensors, safetensors_files
    from kvship.engine.models.moe import MoEForCausalLM

    cfg = ModelConfig.from_pretrained(moe_dirs["qwen3_moe"])
    model = MoEForCausalLM(cfg)
    tensors = [
        (n, t)
        for n, t in iterate_safetensors(safetensors_files(moe_dirs["qwen3_moe"]))
        if ".experts.3.up_proj" not in n
    ]
    with pytest.raises(ValueError, match=r"missing 2 weight\(s\).*experts\.w13_weight#3\.up"):
        fill_from_checkpoint(model, tensors, len(tensors), "test")


def test_moe_config_reads_expert_fields():
    base = dict(MOE_COMMON, architectures=["Qwen3MoeForCausalLM"], num_experts=128, moe_intermediate_size=768)
    cfg = ModelConfig.from_hf_dict(dict(base, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1))
    assert cfg.qk_norm and cfg.moe.num_experts == 128 and cfg.moe.top_k == 2 and cfg.moe.intermediate_size == 768
    assert cfg.moe.norm_topk_prob and not cfg.moe.is_sparse_layer(0) and cfg.moe.is_sparse_layer(1)
    mx = ModelConfig.from_hf_dict(dict(MOE_COMMON, architectures=["MixtralForCausalLM"], num_local_experts=8))
    assert mx.moe.num_experts == 8 and mx.moe.norm_topk_prob and mx.moe.intermediate_size == 128
    assert ModelConfig.from_hf_dict(dict(MOE_COMMON, architectures=["LlamaForCausalLM"])).moe is None


# --- the layer ----------------------------------------------------------------------
def _dense_reference(x, w13, w2, weights, ids):
    """Every token through each of its experts, one at a time (float64)."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = w13[ids[m, j]] @ x[m]
            out[m] += weights[m, j] * (w2[ids[m, j]] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("m", [0, 1, 5, 40])
def test_torch_runner_matches_per_token_reference_with_experts_that_get_no_tokens(m):
    g = torch.Generator().manual_seed(m)
    e, h, i, k = 6, 32, 24, 2
    x, w13, w2 = (
        torch.randn(m, h, generator=g),
        torch.randn(e, 2 * i, h, generator=g),
        torch.randn(e, h, i, generator=g),
    )
    logits = torch.randn(m, e, generator=g)
    logits[:, [0, 4]] = -30.0  # experts 0 and 4 never chosen
    weights, ids = select_experts(logits, k, renormalize=True)
    assert not ((ids == 0) | (ids == 4)).any()
    out = get_moe_runner("torch")(x, w13, w2, weights, ids)
    assert out.shape == (m, h)
    if m:
        assert torch.allclose(weights.sum(-1), torch.ones(m))
        assert (out.double() - _dense_reference(x, w13, w2, weights, ids)).abs().max().item() < 1e-3


def test_select_experts_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int32 and torch.allclose(w, p[:, :2])
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w, p[:, :2] / p[:, :2].sum())


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_block_size_groups_pairs_by_expert_in_padded_blocks(block_m):
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [5, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, ntp = moe_align_block_size(ids, block_m, num_experts=7)
    n = ids.numel()
    counts = {0: 1, 1: 3, 3: 3, 5: 1}
    assert ntp.item() == sum(-(-c // block_m) * block_m for c in counts.values())
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= ntp.item()
    flat = ids.reshape(-1)
    valid = sorted_ids[: ntp.item()]
    assert sorted(valid[valid < n].tolist()) == list(range(n)) and (sorted_ids[ntp.item() :] == n).all()
    for b in range(ntp.item() // block_m):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        real = block[block < n].long()
        assert real.numel() > 0 and (flat[real] == expert_ids[b]).all()  # no block for experts 2, 4, 6


def test_expert_load_leaves_out_padding_rows_of_a_graph_batch():
    """Under ``count_rows_by_slot`` (CUDA-graph capture) rows writing KV slot 0 are padding and add nothing to
    the expert load; the slots are read at run time (a replay with another batch counts its own rows); eager
    forwards after the block count every row."""
    layer = FusedMoE(6, 2, 16, 8, renormalize=True)
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    model = torch.nn.ModuleList([layer])
    x, logits = torch.randn(8, 16), torch.randn(8, 6)
    _, ids = select_experts(logits, 2, renormalize=True)
    slots = torch.zeros(8, dtype=torch.int64)
    with count_rows_by_slot(model, slots):
        slots[:5] = torch.arange(11, 16)  # a batch of 5 padded to 8
        layer(x, logits)
        want = torch.bincount(ids[:5].reshape(-1).long(), minlength=6)
        assert torch.equal(layer.expert_load(), want)
        slots[:7] = torch.arange(21, 28)  # the next replay: 7 real rows
        layer(x, logits)
        want += torch.bincount(ids[:7].reshape(-1).long(), minlength=6)
        assert torch.equal(layer.expert_load(), want) and int(want.sum()) == (5 + 7) * 2
    layer(x, logits)  # eager: every row is real
    assert int(layer.expert_load().sum()) == (5 + 7 + 8) * 2


def test_fused_moe_rejects_an_unknown_runner_and_a_bad_shard():
    layer = FusedMoE(4, 2, 16, 8, renormalize=False, runner="nope")
    with pytest.raises(ValueError, match="unknown MoE runner"):
        layer(torch.randn(1, 16), torch.randn(1, 4))
    with pytest.raises(ValueError, match="expert 4 is outside"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(8, 16), (4, "gate"))
    with pytest.raises(ValueError, match="expected \\(16, 8\\)"):
        layer.w2_weight.weight_loader(layer.w2_weight, torch.zeros(8, 16), (0, "down"))


# --- GGUF ------------------------------------------------------------------------------
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


@pytest.mark.parametrize("key", list(SPECS))
def test_moe_gguf_file_gives_the_safetensors_logits(key, moe_dirs, moe_runners, kv_driver, tmp_path):
    """llama.cpp's layout (stacked ``ffn_*_exps``, router ``ffn_gate_inp``, Mixtral as ``llama`` with
    experts and permuted q/k) loads into the same model as the safetensors folder."""
    from gguf_fixtures import write_gguf

    path = str(tmp_path / f"{key}.gguf")
    write_gguf(moe_dirs[key], path, GGUF_ARCH[key])
    cfg, hf_cfg = ModelConfig.from_pretrained(path), ModelConfig.from_pretrained(moe_dirs[key])
    assert cfg.architecture == hf_cfg.architecture and cfg.moe is not None
    moe, hf_moe_cfg = cfg.moe, hf_cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (
        hf_moe_cfg.num_experts,
        hf_moe_cfg.top_k,
        hf_moe_cfg.intermediate_size,
        hf_moe_cfg.norm_topk_prob,
    )
    assert moe.shared_expert_intermediate_size == hf_moe_cfg.shared_expert_intermediate_size
    layers = range(cfg.num_hidden_layers)
    assert [moe.is_sparse_layer(i) for i in layers] == [hf_moe_cfg.is_sparse_layer(i) for i in layers]
    ids = _prompt(23, seed=5)
    logits = []
    for runner in (ModelRunner(ServerArgs(model_path=path, max_total_tokens=256)), moe_runners[key]):
        drv = kv_driver(runner)
        req = drv.new()
        try:
            logits.append(drv.extend([req], [ids], all_logits=True))
        finally:
            drv.free(req)
    assert logits[0].shape == (len(ids), cfg.vocab_size)
    assert (logits[0] - logits[1]).abs().max().item() < ATOL


def test_moe_gguf_quantized_experts_dequantize_per_expert(moe_dirs, tmp_path):
    """Q8_0 stacked experts: each expert's matrix is that expert's rows of the dequantized stack."""
    import gguf
    from gguf_fixtures import write_gguf

    from kvship.engine.loaders.base import load_model
    from kvship.engine.loaders.gguf_file import dequantize_tensor, gguf_reader

    path = str(tmp_path / "q8.gguf")
    write_gguf(moe_dirs["qwen3_moe"], path, "qwen3moe", expert_quant="Q8_0")
    model = load_model(ModelConfig.from_pretrained(path), "auto", "cpu")
    tensors = {t.name: t for t in gguf_reader(path).tensors}
    assert tensors["blk.2.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    gate, up, down = (dequantize_tensor(tensors[f"blk.2.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down"))
    experts = model.model.layers[2].mlp.experts
    assert torch.equal(experts.w13_weight, torch.cat([gate, up], dim=1))
    assert torch.equal(experts.w2_weight, down)


# --- PD ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral"])
def test_moe_pd_over_tcp_equals_unified(key, moe_dirs):
    """Prefill worker -> KV over tcp -> decode worker, with a MoE model: the unified greedy tokens."""
    from pd_fixtures import InProcessPD, make_prompts, unified_greedy

    prompts = make_prompts(4, seed=3, lo=3, hi=40, vocab=380)
    kw = dict(chunked_prefill_size=16, max_total_tokens=1024)
    with InProcessPD(moe_dirs[key], backend="tcp", **kw) as pd:
        rids = [f"m{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, 8)
        pd.wait(rids)
        want = unified_greedy(moe_dirs[key], prompts, 8, **kw)
        assert [pd.tokens(r) for r in rids] == want
        assert pd.prefill.get_stats()["kv_transfers_ok"] == len(prompts)
        pd.wait_idle()

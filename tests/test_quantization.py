"""The quantization seam (engine/layers/quantization): registry, startup refusals, sharding by whole blocks,
and every weight-holding layer computing through its method.  FP8 formats: test_quantization_fp8.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import build_tiny_tokenizer

from kvship.engine.distributed.communicator import GlooCommunicator
from kvship.engine.forward_batch import ForwardMode, build_forward_batch
from kvship.engine.layers.quantization import (
    QuantMethod,
    Shard,
    get_quant_method,
    register_quant_method,
    resolve_quantization,
    supported_quant_methods,
)
from kvship.engine.layers.quantization.unquantized import UnquantizedMethod
from kvship.engine.loaders.base import load_model
from kvship.engine.model_config import ModelConfig

# a Llama whose projections are whole 128-blocks at --tp-size 2 except where a test says otherwise
BLOCKY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=64,
)


@register_quant_method("test_block128")
class Block128Method(UnquantizedMethod):
    """Test only: unquantized weights that declare 128x128 scale blocks (as block-128 FP8 will), and record
    which layers computed through them."""

    weight_block = (128, 128)
    used: list[str] = []

    def tensor_kind(self, name: str) -> str:
        return "block_scale" if name == "weight_scale_inv" else super().tensor_kind(name)

    def apply(self, layer, x):
        Block128Method.used.append(type(layer).__name__)
        return super().apply(layer, x)

    def embed(self, layer, ids):
        Block128Method.used.append(type(layer).__name__)
        return super().embed(layer, ids)

    def apply_moe(self, layer, runner, x, topk_weights, topk_ids, absent=False, config_experts=None):
        Block128Method.used.append(type(layer).__name__)
        return super().apply_moe(layer, runner, x, topk_weights, topk_ids, absent, config_experts)


def _model_dir(tmp_path, **cfg) -> str:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def test_registry_names_methods_and_refuses_unknown_ones():
    assert "unquantized" in supported_quant_methods() and "test_block128" in supported_quant_methods()
    assert isinstance(get_quant_method("unquantized"), UnquantizedMethod)
    assert get_quant_method("test_block128").name == "test_block128"
    with pytest.raises(ValueError, match=r"unsupported quantization method 'nvfp4'; supported: \[.*'unquantized'"):
        get_quant_method("nvfp4")
    assert issubclass(UnquantizedMethod, QuantMethod)


def test_config_json_quant_method_and_flag_resolve_or_are_refused(tmp_path):
    plain = ModelConfig.from_hf_dict(BLOCKY)
    assert plain.quantization == "unquantized"
    assert ModelConfig.from_hf_dict(BLOCKY, quantization="test_block128").quantization == "test_block128"
    awq = dict(BLOCKY, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(awq)
    assert "'awq' (config.json quantization_config.quant_method)" in str(e.value)
    assert "supported: [" in str(e.value) and "'unquantized'" in str(e.value)
    with pytest.raises(ValueError, match=r"'gptq' \(--quantization\)"):
        ModelConfig.from_hf_dict(BLOCKY, quantization="gptq")
    with pytest.raises(ValueError, match="without a quant_method"):
        ModelConfig.from_hf_dict(dict(BLOCKY, quantization_config={"bits": 8}))
    mismatch = dict(BLOCKY, quantization_config={"quant_method": "test_block128"})
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        ModelConfig.from_hf_dict(mismatch, quantization="unquantized")
    assert resolve_quantization(None, None) == "unquantized"


def test_serve_refuses_an_unknown_method_at_startup_naming_both(tmp_path):
    """config.json says awq and --quantization says gptq: the worker exits at startup with one error naming
    both and the supported methods (no weights read: the folder has none)."""
    path = _model_dir(tmp_path, **BLOCKY, quantization_config={"quant_method": "awq"})
    build_tiny_tokenizer().save_pretrained(path)
    cmd = [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", path, "--quantization", "gptq"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if "unsupported quantization method" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "'gptq' (--quantization)" in lines[0] and "'awq' (config.json" in lines[0]
    assert "'unquantized'" in lines[0]
    assert "Traceback" not in out


def test_shard_helper_splits_scales_with_their_blocks():
    m = get_quant_method("test_block128")
    w = torch.arange(512 * 256, dtype=torch.float32).view(512, 256)
    scales = torch.arange(4 * 2, dtype=torch.float32).view(4, 2)  # one per 128x128 block
    rows = Shard(0, 128, 256)
    assert torch.equal(m.shard(None, "weight", w, rows), w[128:384])
    assert torch.equal(m.shard(None, "weight_scale_inv", scales, rows), scales[1:3])
    cols = Shard(1, 128, 128)
    assert torch.equal(m.shard(None, "weight", w, cols), w[:, 128:256])
    assert torch.equal(m.shard(None, "weight_scale_inv", scales, cols), scales[:, 1:2])
    bias = torch.arange(512.0)
    assert torch.equal(m.shard(None, "bias", bias, rows), bias[128:384])
    assert torch.equal(m.shard(None, "bias", bias, cols), bias)  # a row-parallel layer's bias is whole
    m.check_shard("ok", rows)
    with pytest.raises(ValueError, match=r"layer 'x.down_proj'.*input columns \[96, 192\).*128x128"):
        m.check_shard("x.down_proj", Shard(1, 96, 96))
    get_quant_method("unquantized").check_shard("anything", Shard(1, 96, 96))  # no blocks, nothing to cut


def test_tp_size_that_cuts_a_block_is_refused_when_the_rank_builds_its_layers(tmp_path):
    # intermediate 384 = 3 blocks: --tp-size 2 gives each rank 192 rows of gate/up, cutting a block
    path = _model_dir(tmp_path, **dict(BLOCKY, intermediate_size=384))
    mc = ModelConfig.from_pretrained(path, quantization="test_block128")
    with pytest.raises(ValueError) as e:
        load_model(mc, "dummy", "cpu", tp=GlooCommunicator(rank=1, size=2))
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_up_proj" in msg and "[192, 384)" in msg and "128x128" in msg
    # the same model unquantized splits fine
    mc = ModelConfig.from_pretrained(path)
    load_model(mc, "dummy", "cpu", tp=GlooCommunicator(rank=1, size=2))


MOE = dict(
    BLOCKY,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    norm_topk_prob=True,
)


@pytest.mark.parametrize(
    "cfg, layers",
    [
        (BLOCKY, {"VocabEmbedding", "StackedLinear", "Linear", "LMHead"}),
        (MOE, {"VocabEmbedding", "StackedLinear", "Linear", "LMHead", "FusedMoE"}),
    ],
    ids=["llama", "qwen3_moe"],
)
def test_every_weight_holding_layer_computes_through_its_method(tmp_path, cfg, layers):
    """Embedding, q/k/v, o, gate/up, down (dense), experts (MoE), LM head: each computes through the method the
    model config names (no layer reads its weights around it), with the unquantized numbers; the MoE router
    through the unquantized method (quantized checkpoints keep it unquantized)."""
    path = _model_dir(tmp_path, **cfg)
    runs = {}
    for quant in (None, "test_block128"):
        mc = ModelConfig.from_pretrained(path, quantization=quant)
        model = load_model(mc, "dummy", "cpu", seed=3)
        modules = dict(model.named_modules())
        routers = {n for n in modules if n.endswith(".mlp.gate")}
        methods = {getattr(m, "quant_method", None) for n, m in modules.items() if n not in routers} - {None}
        assert {m.name for m in methods} == {mc.quantization}
        assert {modules[n].quant_method.name for n in routers} <= {"unquantized"}
        ids = torch.tensor([5, 7, 9])
        Block128Method.used.clear()
        runs[quant] = _forward_without_kv(model, ids)
    assert set(Block128Method.used) == layers
    assert torch.equal(runs[None], runs["test_block128"])  # same kernels, same numbers


def _forward_without_kv(model, ids):
    """The model over ``ids`` with a tiny torch_native KV pool (a real forward, prefill of one request)."""
    from kvship.engine.attention.base import AttentionContext, create_attention_backend
    from kvship.engine.mem.pools import KVPool, ReqToTokenPool

    mc = model.config
    r2t = ReqToTokenPool(2, 16, "cpu")
    pool = KVPool(16, 1, torch.float32, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers, "cpu")
    ctx = AttentionContext(
        device=torch.device("cpu"),
        dtype=torch.float32,
        kv_dtype=torch.float32,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        page_size=1,
        req_to_token_pool=r2t,
        max_running_requests=1,
        cuda_graph_bs=(),
    )
    backend = create_attention_backend("torch_native", ctx)
    row = r2t.alloc()
    slots = torch.arange(1, 1 + len(ids))
    r2t.write(row, 0, slots)
    fb = build_forward_batch(
        ForwardMode.EXTEND,
        input_ids=ids,
        positions=torch.arange(len(ids)),
        req_pool_indices=[row],
        seq_lens=[len(ids)],
        seq_lens_cpu=[len(ids)],
        out_cache_loc=slots,
        req_to_token_pool=r2t,
        kv_pool=pool,
        attn_backend=backend,
        extend_lens=[len(ids)],
        prefix_lens=[0],
    )
    with torch.inference_mode():
        backend.init_forward_metadata(fb)
        return model(fb.input_ids, fb.positions, fb).next_token_logits


def test_forward_batch_builder_derives_extend_fields_and_refuses_inconsistent_batches():
    common = dict(req_to_token_pool=None, kv_pool=None, attn_backend=None)
    fb = build_forward_batch(
        ForwardMode.EXTEND,
        input_ids=[1, 2, 3, 4, 5],
        positions=[4, 5, 6, 0, 1],
        out_cache_loc=[10, 11, 12, 13, 14],
        req_pool_indices=[0, 1],
        seq_lens=[7, 2],
        seq_lens_cpu=[7, 2],
        extend_lens=[3, 2],
        prefix_lens=[4, 0],
        **common,
    )
    assert fb.batch_size == 2 and fb.extend_start_loc.tolist() == [0, 3]
    assert fb.extend_seq_lens.tolist() == [3, 2] and fb.extend_prefix_lens.tolist() == [4, 0]
    assert fb.extend_seq_lens_cpu == [3, 2] and fb.input_ids.dtype == torch.int64
    assert fb.default_logits_indices().tolist() == [2, 4]
    with pytest.raises(ValueError, match="EXTEND needs extend_lens"):
        build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=[1],
            positions=[0],
            out_cache_loc=[1],
            req_pool_indices=[0],
            seq_lens=[1],
            seq_lens_cpu=[1],
            **common,
        )
    with pytest.raises(ValueError, match="not prefix \\+ new tokens"):
        build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=[1, 2],
            positions=[0, 1],
            out_cache_loc=[1, 2],
            req_pool_indices=[0],
            seq_lens=[3],
            seq_lens_cpu=[3],
            extend_lens=[2],
            prefix_lens=[0],
            **common,
        )
    with pytest.raises(ValueError, match="one token per request"):
        build_forward_batch(
            ForwardMode.DECODE,
            input_ids=[1, 2],
            positions=[0, 1],
            out_cache_loc=[1, 2],
            req_pool_indices=[0],
            seq_lens=[3],
            seq_lens_cpu=[3],
            **common,
        )

"""Block-128 FP8 DeepSeek-V3 (docs/deepseek.md, "FP8 block-128 weights") against a fake-quant reference.

A tiny random DeepSeek-V3 (q LoRA, YaRN, grouped ``noaux_tc`` routing with the
correction bias, shared experts, a dense first layer) is written in fp8
block-128 by the project's writer (every ``*_proj`` weight of the layers:
``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``,
dense / shared / routed experts' gate, up, down; ``weight_scale_inv`` per
128x128 block; routers unquantized).  Its dims are whole blocks where a
stacked projection needs it (``q_lora_rank`` 128 before ``kv_a``, MLP and
expert widths 128).

The reference is built here, independently of the engine: ``transformers``
with the checkpoint's tensors dequantized, every projection's input
quantize-dequantized per token-group of 128 (the ``fp8`` method's arithmetic,
docs/quantization.md) except ``kv_b_proj``'s, and each routed expert as
tests/test_quantization_fp8_moe.py builds it.  ``kv_b_proj`` is read dequantized
by both MLA paths (decompressed prefill, absorbed decode) with an unquantized
input, so the absorbed decode equals the reference's decompressed attention.  It is dequantized once, after
loading (``MLAAttention.kv_b_dense``): no forward dequantizes it again, and the outputs equal those of the
per-step dequantization it replaced, bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_VOCAB_SIZE, KVDriver, build_tiny_tokenizer
from deepseek_fixtures import DS_COMMON, SPECS
from safetensors import safe_open
from safetensors.torch import save_file
from test_quantization_fp8_moe import _dequant, _experts_forward, _qdq_groups

from kvship.engine.config import ServerArgs
from kvship.engine.layers.moe.layer import FusedMoE
from kvship.engine.layers.quantization.fp8 import Fp8Method
from kvship.engine.layers.quantization.writer import write_fp8_checkpoint
from kvship.engine.model_runner import ModelRunner

PROMPT = [5, 17, 33, 101, 7, 250, 64, 9, 12, 300, 41]
FOLLOW = [3, 77, 150]
# engine vs reference, both float32: only the order of float sums differs (measured ~3e-6); an activation on an
# e4m3 rounding boundary could round the other way and move logits by ~0.1 (test_quantization_fp8_moe.py): the
# seed's model has none
LOGIT_ATOL = 1e-3
SEED = 61
DIMS = dict(q_lora_rank=128, intermediate_size=128, moe_intermediate_size=128)


def _build_src(out_dir: str) -> str:
    import transformers

    cfg_name, model_name, overrides = SPECS["v3_yarn_grouped"]
    config = getattr(transformers, cfg_name)(**dict(DS_COMMON, **dict(overrides, **DIMS)))
    assert config.vocab_size == TINY_VOCAB_SIZE
    torch.manual_seed(SEED)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ds_fp8")
    src = _build_src(str(d / "src"))
    return {"src": src, "block": write_fp8_checkpoint(src, str(d / "block"), "fp8_block")}


def _engine_run(path: str) -> tuple[ModelRunner, torch.Tensor]:
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", max_total_tokens=256, max_running_requests=4))
    return runner, _logits(runner)


def _logits(runner: ModelRunner) -> torch.Tensor:
    """Logits of every ``PROMPT`` token (one prefill) and of each ``FOLLOW`` token (decode steps)."""
    drv = KVDriver(runner)
    req = drv.new()
    try:
        prefill = drv.extend([req], [PROMPT], all_logits=True)
        decode = [drv.decode([req], [t])[0] for t in FOLLOW]
    finally:
        drv.free(req)
    return torch.cat([prefill, torch.stack(decode)]).float()


def _reference_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    plain = {}
    for k, v in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        scale = tensors.get(k.removesuffix(".weight") + ".weight_scale_inv")
        plain[k] = _dequant(v, scale) if scale is not None else v.float()
    ref_dir = path + "_reference"
    os.makedirs(ref_dir, exist_ok=True)
    save_file(plain, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    hooked = 0
    for name, mod in model.named_modules():
        if (
            isinstance(mod, torch.nn.Linear)
            and name.endswith(("_proj", "_with_mqa"))
            and not name.endswith("kv_b_proj")
        ):
            mod.register_forward_pre_hook(lambda m, a: (_qdq_groups(a[0]),))
            hooked += 1
        if type(mod).__name__ == "DeepseekV3Experts":
            mod.forward = _experts_forward(mod, int(name.split(".")[2]), tensors)
    assert hooked == 3 * 4 + 3 * 3  # q_a, q_b, kv_a, o per layer; gate/up/down of the dense and shared MLPs
    with torch.no_grad():
        return model(torch.tensor([PROMPT + FOLLOW])).logits[0].float()


def test_fp8_block_deepseek_v3_matches_its_fake_quant_reference(paths):
    runner, got = _engine_run(paths["block"])
    attn = runner.model.model.layers[1].self_attn
    for proj in (attn.fused_qkv_a_proj, attn.q_b_proj, attn.kv_b_proj, attn.o_proj):
        assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv.dtype == torch.float32
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == 2 and all(m.w13_weight.dtype == torch.float8_e4m3fn for m in moe)
    assert runner.model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays unquantized
    want = _reference_logits(paths["block"])
    err = (got - want).abs().max().item()
    assert err < LOGIT_ATOL, err
    assert got[len(PROMPT) :].argmax(-1).tolist() == want[len(PROMPT) :].argmax(-1).tolist()
    _, plain = _engine_run(paths["src"])  # FP8 moved the logits: the test sees the quantization
    assert (plain - got).abs().max().item() > 10 * LOGIT_ATOL


def test_fp8_kv_b_proj_is_dequantized_once_after_loading_with_outputs_unchanged(paths, monkeypatch):
    """Each MLA layer's ``kv_b_dense`` is made at load (model dtype, equal to the dequantization every step used
    to run); forwards never dequantize ``kv_b_proj`` again and keep the same tensor; logits and greedy tokens equal,
    bit for bit, those of the per-step dequantization (the same runner with the dense copies dropped)."""
    runner = ModelRunner(
        ServerArgs(model_path=paths["block"], device="cpu", max_total_tokens=256, max_running_requests=4)
    )
    attns = [layer.self_attn for layer in runner.model.model.layers]
    kv_b = {id(a.kv_b_proj) for a in attns}
    calls: list = []
    dequantize = Fp8Method.dequantized_weight

    def counted(method, layer):
        if id(layer) in kv_b:
            calls.append(layer)
        return dequantize(method, layer)

    monkeypatch.setattr(Fp8Method, "dequantized_weight", counted)
    dense = [a.kv_b_dense for a in attns]
    for a, d in zip(attns, dense):
        assert d is not None and d.dtype == runner.model_config.dtype and d.shape == a.kv_b_proj.weight.shape
        assert torch.equal(d, dequantize(a.kv_b_proj.quant_method, a.kv_b_proj).to(d.dtype))
    got = _logits(runner)  # a prefill and three decode steps: both MLA paths
    tokens = KVDriver(runner).greedy(PROMPT, 6)
    assert calls == []  # no forward dequantized kv_b_proj
    assert all(a.kv_b_dense is d for a, d in zip(attns, dense))
    for a in attns:  # what ran before: kv_b_proj dequantized at every use
        monkeypatch.setattr(a, "kv_b_dense", None)
    want = _logits(runner)
    assert len(calls) >= len(attns) * (1 + len(FOLLOW))  # the per-step path ran
    assert torch.equal(got, want)
    assert KVDriver(runner).greedy(PROMPT, 6) == tokens


def test_unquantized_kv_b_proj_is_read_as_it_is_without_a_copy(paths):
    runner = ModelRunner(ServerArgs(model_path=paths["src"], device="cpu", max_total_tokens=64, max_running_requests=2))
    for layer in runner.model.model.layers:
        a = layer.self_attn
        assert a.kv_b_dense is None
        assert a._kv_b_weight(runner.model_config.dtype) is a.kv_b_proj.weight

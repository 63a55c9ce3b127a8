"""Our Llama-family models against ``transformers`` on tiny random checkpoints.

Every comparison runs our ModelRunner (torch_native attention reading K/V back
from the pool) and the Hugging Face reference in float32; logits must agree
within ``ATOL`` max abs.
"""

from __future__ import annotations

import pytest
import torch

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

ATOL = 1e-4
ARCHS = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 380, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    out = {}
    for key, path in tiny_model_dirs.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.eval()
        out[key] = m
    return out


@pytest.fixture(scope="module")
def runners(tiny_model_dirs):
    return {
        key: ModelRunner(ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=8))
        for key, path in tiny_model_dirs.items()
    }


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers_at_every_position(arch, runners, hf_models, kv_driver):
    ids = _prompt(37, seed=1)
    drv = kv_driver(runners[arch])
    req = drv.new()
    try:
        ours = drv.extend([req], [ids], all_logits=True)
    finally:
        drv.free(req)
    ref = _hf_logits(hf_models[arch], ids)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (len(ids), runners[arch].model_config.vocab_size)
    assert (ours - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_extend_over_cached_prefix_equals_one_shot_prefill(arch, runners, hf_models, kv_driver):
    ids = _prompt(41, seed=2)
    drv = kv_driver(runners[arch])
    req = drv.new()
    try:
        first = drv.extend([req], [ids[:17]], all_logits=True)
        second = drv.extend([req], [ids[17:]], all_logits=True)
    finally:
        drv.free(req)
    ref = _hf_logits(hf_models[arch], ids)
    assert (torch.cat([first, second]) - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_match_transformers_next_position_logits(arch, runners, hf_models, kv_driver):
    ids = _prompt(20, seed=3)
    follow = _prompt(5, seed=4)
    drv = kv_driver(runners[arch])
    req = drv.new()
    try:
        got = [drv.extend([req], [ids])[-1]]
        for tok in follow:
            got.append(drv.decode([req], [tok])[0])
    finally:
        drv.free(req)
    ref = _hf_logits(hf_models[arch], ids + follow)[len(ids) - 1 :]
    assert (torch.stack(got) - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_packed_batch_of_different_lengths_equals_each_request_alone(page_size, tiny_llama_dir, hf_models, kv_driver):
    runner = ModelRunner(
        ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1024, page_size=page_size, max_running_requests=8)
    )
    drv = kv_driver(runner)
    prompts = [_prompt(n, seed=10 + n) for n in (5, 23, 1, 40, 16, 17)]
    # a request that already has a cached prefix joins the packed extend with its remainder
    reqs = [drv.new() for _ in prompts]
    drv.extend([reqs[3]], [prompts[3][:9]])
    logits = drv.extend(reqs, [p if i != 3 else p[9:] for i, p in enumerate(prompts)], all_logits=True)
    # then three packed decode steps for everyone
    follow = [_prompt(3, seed=100 + i) for i in range(len(prompts))]
    dec = [drv.decode(reqs, [f[s] for f in follow]) for s in range(3)]
    for r in reqs:
        drv.free(r)
    assert runner.allocator.available_size() == runner.max_total_tokens

    off = 0
    hf = hf_models["llama"]
    for i, p in enumerate(prompts):
        n = len(p) - (9 if i == 3 else 0)
        ref = _hf_logits(hf, p + follow[i])
        assert (logits[off : off + n] - ref[len(p) - n : len(p)]).abs().max().item() < ATOL, f"request {i} extend"
        off += n
        for s in range(3):
            assert (dec[s][i] - ref[len(p) + s]).abs().max().item() < ATOL, f"request {i} decode {s}"


def test_page_size_16_places_tokens_on_request_owned_pages(tiny_llama_dir, kv_driver):
    runner = ModelRunner(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=256, page_size=16))
    drv = kv_driver(runner)
    a, b = drv.new(), drv.new()
    drv.extend([a, b], [_prompt(20, 1), _prompt(7, 2)])
    drv.decode([a, b], [5, 6])
    pages_a = {s // 16 for s in a.slots}
    pages_b = {s // 16 for s in b.slots}
    assert not pages_a & pages_b and 0 not in pages_a | pages_b
    assert len(pages_a) == 2 and len(pages_b) == 1
    drv.free(a)
    drv.free(b)


def test_llama3_rope_scaling_is_applied(tiny_llama_dir, runners, hf_models, kv_driver):
    """The tiny Llama's llama3 scaling matters: transformers without it disagrees with us."""
    from transformers import AutoModelForCausalLM

    cfg = runners["llama"].model_config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    ids = _prompt(200, seed=7)
    drv = kv_driver(runners["llama"])
    req = drv.new()
    try:
        ours = drv.extend([req], [ids], all_logits=True)
    finally:
        drv.free(req)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    plain.model.rotary_emb = type(plain.model.rotary_emb)(plain.config)
    assert (ours - _hf_logits(hf_models["llama"], ids)).abs().max().item() < ATOL
    assert (ours - _hf_logits(plain, ids)).abs().max().item() > 1e-2


def test_qwen2_bias_and_qwen3_qk_norm_are_loaded(runners):
    q2 = runners["qwen2"].model.model.layers[0].self_attn
    q3 = runners["qwen3"].model.model.layers[0].self_attn
    assert q2.qkv_proj.bias is not None and q2.qkv_proj.bias.abs().sum() > 0
    assert q2.o_proj.bias is None
    assert q3.qk_norm and q3.q_norm.weight.shape == (16,)
    assert runners["llama_tied"].model.lm_head.tied
    assert not runners["llama"].model.lm_head.tied


def test_unknown_architecture_is_a_clear_error():
    from kvship.engine.models.registry import get_model_class

    with pytest.raises(ValueError, match="unsupported model architecture"):
        get_model_class(["GPT2LMHeadModel"])


# --- ModelConfig from config.json variants ---------------------------------------------
def _cfg(**kw) -> dict:
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    base.update(kw)
    return base


def test_model_config_reads_old_style_rope_and_merges_eos_ids():
    from kvship.engine.model_config import ModelConfig

    cfg = ModelConfig.from_hf_dict(
        _cfg(
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
            eos_token_id=[7, 8],
            bos_token_id=1,
            torch_dtype="bfloat16",
        ),
        generation_config={"eos_token_id": 9},
        context_length=1000,
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert cfg.eos_token_ids == frozenset({7, 8, 9}) and cfg.bos_token_id == 1
    assert cfg.head_dim == 16 and cfg.context_len == 1000 and cfg.checkpoint_dtype == torch.bfloat16


def test_model_config_bias_flags_follow_the_architecture():
    from kvship.engine.model_config import ModelConfig

    q2 = ModelConfig.from_hf_dict(_cfg(architectures=["Qwen2ForCausalLM"]))
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    q3 = ModelConfig.from_hf_dict(_cfg(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 32
    ll = ModelConfig.from_hf_dict(_cfg(attention_bias=True))
    assert ll.attention_bias and ll.o_proj_bias
    mi = ModelConfig.from_hf_dict(_cfg(architectures=["MistralForCausalLM"], attention_bias=True, sliding_window=1024))
    assert not mi.attention_bias and mi.context_len == 1024  # clamped to the window


def test_unsupported_rope_scaling_is_a_clear_error():
    from kvship.engine.layers.rotary import RotaryEmbedding

    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        RotaryEmbedding(16, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})

"""Tiny random DeepSeek-V2 / V3 checkpoints written by ``transformers`` (tests/test_deepseek.py).

Every parameter is redrawn (norms near 1, the rest small noise, V3's
``e_score_correction_bias`` too), so routing, the correction bias and every
MLA projection matter to the logits.
"""

from __future__ import annotations

import torch
from conftest import TINY_VOCAB_SIZE, build_tiny_tokenizer

DS_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# key -> (config class, model class, overrides)
SPECS = {
    # V3 with q LoRA, YaRN (mscale softmax scale), 4 groups (2 kept), correction bias, first layer dense
    "v3_yarn_grouped": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=48,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
    # V3 without q LoRA (plain q_proj, as V2-Lite), one group, no dense layer, rotate-half RoPE
    "v3_no_q_lora": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rope_interleave=False,
        ),
    ),
    # V2-Lite shape: no q LoRA, softmax greedy routing, first layer dense
    "v2_lite": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            q_lora_rank=None,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
        ),
    ),
}


def build_tiny_deepseek(out_dir: str, key: str, seed: int, **config_overrides) -> str:
    """A tiny random ``SPECS[key]`` model written by ``transformers`` (per-expert tensors) plus the tiny tokenizer;
    ``config_overrides`` (e.g. ``num_hidden_layers=2``) replace config fields."""
    import transformers

    cfg_name, model_name, overrides = SPECS[key]
    config = getattr(transformers, cfg_name)(**{**DS_COMMON, **overrides, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
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

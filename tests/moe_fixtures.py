"""Tiny random Mixture-of-Experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) written by ``transformers``.

Shared by tests/test_moe_models.py (against ``transformers``) and
tests/test_moe_ep.py (expert parallelism, GGUF, metrics).
"""

from __future__ import annotations

import torch
from conftest import TINY_COMMON, build_tiny_tokenizer

MOE_COMMON = dict(TINY_COMMON, num_hidden_layers=3, num_experts_per_tok=2)
# key -> (config class, model class, overrides)
SPECS = {
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; renormalised top-k like Qwen3-30B-A3B
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    ),
    # every second layer sparse (decoder_sparse_step 2: layer 1 only), shared expert, plain top-k weights
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, intermediate_size=48)),
}


def build_tiny_moe(out_dir: str, key: str, seed: int, **extra) -> str:
    """A tiny random ``SPECS[key]`` model written by ``transformers`` (per-expert tensors) plus the tiny tokenizer."""
    import transformers

    cfg_name, model_name, overrides = SPECS[key]
    config = getattr(transformers, cfg_name)(**dict(MOE_COMMON, tie_word_embeddings=False, **dict(overrides, **extra)))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir

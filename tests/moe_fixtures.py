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


def _llamacpp_permute(w, n_head: int):
    """llama.cpp's converter layout for q/k rows of the ``llama`` architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def write_moe_gguf(hf_dir: str, out_path: str, arch: str, expert_quant: str | None = None) -> None:
    """A tiny MoE folder as a GGUF file laid out as llama.cpp's converter does: per-expert tensors stacked
    into ``blk.L.ffn_<part>_exps`` ``[E, rows, cols]`` (quantized with ``expert_quant``, e.g. ``Q8_0``,
    else F32), the router as ``ffn_gate_inp``, Qwen2-MoE's shared-expert gate as a vector, Mixtral as
    ``llama`` with ``expert_count`` (q/k rows permuted)."""
    import os
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    state = {k: v.numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    w = gguf.GGUFWriter(out_path, arch)
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_expert_count(num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, arr in sorted(state.items()):
        key = key.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", key)
        if m is not None:
            experts.setdefault((m.group(1), _EXPERT_PARTS[m.group(3)]), {})[int(m.group(2))] = arr
            continue
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            name = "output.weight"
        else:
            parts = key.split(".")
            layer, mod, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            name = f"blk.{layer}.{_GGUF_NAMES[mod]}.{kind}"
            if mod == "mlp.shared_expert_gate":
                arr = arr.reshape(-1)
            if arch == "llama" and mod == "self_attn.q_proj":
                arr = _llamacpp_permute(arr, cfg.num_attention_heads)
            elif arch == "llama" and mod == "self_attn.k_proj":
                arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    for (layer, part), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in range(num_experts)]).astype(np.float32)
        name = f"blk.{layer}.ffn_{part}_exps.weight"
        if expert_quant is None:
            w.add_tensor(name, stacked)
        else:
            qtype = gguf.GGMLQuantizationType[expert_quant]
            w.add_tensor(name, gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

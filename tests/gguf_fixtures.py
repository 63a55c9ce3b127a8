"""Writing tiny Hugging Face checkpoints as GGUF files (dense and MoE), as llama.cpp's converter lays them out."""

from __future__ import annotations


def llamacpp_permute(w, n_head: int):
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


def write_gguf(hf_dir: str, out_path: str, arch: str, expert_quant: str | None = None) -> None:
    """A tiny HF folder as an F32 GGUF file laid out as llama.cpp's converter does: llama3 rope scaling as
    ``rope_freqs``, q/k rows permuted for ``llama``.  MoE: per-expert tensors stacked into
    ``blk.L.ffn_<part>_exps`` ``[E, rows, cols]`` (quantized with ``expert_quant``, e.g. ``Q8_0``, else F32), the
    router as ``ffn_gate_inp``, Qwen2-MoE's shared-expert gate as a vector, Mixtral as ``llama`` with
    ``expert_count``."""
    import os
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    state = {k: v.numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    w = gguf.GGUFWriter(out_path, arch)
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
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
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.rope_parameters.get("rope_type", "default") == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        base_inv = 1.0 / (
            cfg.rope_parameters["rope_theta"] ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim)
        )
        scaled_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        w.add_tensor("rope_freqs.weight", (base_inv / scaled_inv.numpy()).astype(np.float32))
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
                arr = llamacpp_permute(arr, cfg.num_attention_heads)
            elif arch == "llama" and mod == "self_attn.k_proj":
                arr = llamacpp_permute(arr, cfg.num_key_value_heads)
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

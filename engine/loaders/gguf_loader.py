"""llama.cpp GGUF files, read with the ``gguf`` package.

Every tensor is dequantized (``gguf.quants.dequantize``) to float32 and cast
to the compute dtype, under its Hugging Face name (``GGUF -> HF`` mapping
below), so the model's own ``load_weights`` does the rest.

Mixture-of-Experts files (``qwen3moe``, ``qwen2moe``, ``llama`` with
experts, i.e. Mixtral) stack each layer's experts in one ``[E, rows, cols]``
tensor (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``); it is handed
out as one ``CheckpointSlice`` per expert under the Hugging Face per-expert
name (``mlp.experts.N.gate_proj.weight``...), which dequantizes only that
expert's rows when its layer keeps it, so an expert-parallel rank never reads
another rank's experts.  The router is ``ffn_gate_inp`` (``mlp.gate``);
Qwen2-MoE's shared expert is ``ffn_*_shexp`` and its gate
``ffn_gate_inp_shexp`` (a vector in the file, ``[1, H]`` here).

Two llama.cpp conventions are undone here:
* For the ``llama`` architecture the converter permutes the rows of
  ``attn_q`` / ``attn_k`` (per head, interleaving the two rotary halves for
  its RoPE kernel); ``unpermute_qk`` restores Hugging Face's layout.
* Tied embeddings: the file has no ``output.weight`` (the config says tied).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
from torch import nn

from kvship.engine.loaders.base import ModelLoader, fill_from_checkpoint, register_loader
from kvship.engine.loaders.gguf_file import (
    dequantize_block,
    dequantize_expert_block,
    dequantize_tensor,
    gguf_metadata_arch,
    gguf_reader,
)
from kvship.engine.loaders.lazy import CheckpointSlice, Loaded
from kvship.engine.model_config import ModelConfig

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# stacked experts: ``blk.L.ffn_<part>_exps.weight`` [E, rows, cols] -> ``model.layers.L.mlp.experts.N.<proj>.weight``
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# tensors that carry no parameter of ours (RoPE factors are read into ModelConfig)
_SKIP = {"rope_freqs.weight"}
# GGUF architectures whose q/k rows llama.cpp permuted
_PERMUTED_ARCHS = {"llama", "mistral"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name for a GGUF tensor (None for tensors we skip)."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    if gguf_name in _SKIP:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _PER_LAYER:
        raise ValueError(f"GGUF tensor '{gguf_name}' has no known Hugging Face counterpart")
    return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's per-head q/k row permutation (works for weights and biases)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iterate_gguf(reader: Any, model_config: ModelConfig, lazy: bool = False) -> Iterator[tuple[str, Loaded]]:
    """``(Hugging Face name, tensor)``; with ``lazy``, ``CheckpointSlice``s that dequantize only the rows
    (and keep only the columns) a weight loader takes."""
    arch = gguf_metadata_arch(reader)
    permuted = arch in _PERMUTED_ARCHS
    for t in reader.tensors:
        experts = _EXPERTS_RE.match(t.name)
        if experts is not None:
            yield from _expert_slices(t, int(experts.group(1)), experts.group(2), model_config)
            continue
        name = hf_name(t.name)
        if name is None:
            continue
        if len(t.shape) == 1 and name.endswith(".shared_expert_gate.weight"):  # a vector in llama.cpp's files
            yield name, dequantize_tensor(t).view(1, -1).to(model_config.dtype)
            continue
        if lazy:
            yield name, _lazy(t, name, permuted, model_config)
            continue
        w = dequantize_tensor(t)
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, model_config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, model_config.num_key_value_heads)
        yield name, w.to(model_config.dtype)


def _expert_slices(t: Any, layer: int, part: str, model_config: ModelConfig) -> Iterator[tuple[str, CheckpointSlice]]:
    """One lazy ``(Hugging Face name, slice)`` per expert of a stacked ``ffn_<part>_exps`` tensor."""
    num_experts, rows, cols = (int(x) for x in reversed(list(t.shape)))
    for e in range(num_experts):

        def read(ranges: tuple[slice, ...], e: int = e) -> torch.Tensor:
            return dequantize_expert_block(t, e, ranges)

        name = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
        yield name, CheckpointSlice((rows, cols), read, dtype=model_config.dtype)


def checkpoint_tensor_count(reader: Any) -> int:
    """Tensors ``iterate_gguf`` yields: one per expert of a stacked experts tensor."""
    n = 0
    for t in reader.tensors:
        if t.name in _SKIP:
            continue
        n += int(t.shape[-1]) if _EXPERTS_RE.match(t.name) else 1
    return n


def _lazy(t: Any, name: str, permuted: bool, model_config: ModelConfig) -> CheckpointSlice:
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    then = None
    if permuted and (".q_proj." in name or ".k_proj." in name):
        # llama.cpp permutes rows within each head, so a block of whole heads un-permutes on its own
        head_dim = model_config.head_dim
        then = lambda w: unpermute_qk(w, w.shape[0] // head_dim)  # noqa: E731
    return CheckpointSlice(shape, lambda ranges: dequantize_block(t, ranges), dtype=model_config.dtype, then=then)


@register_loader("gguf")
class GGUFLoader(ModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig, seed: int = 0, lazy: bool = False) -> None:
        reader = gguf_reader(model_config.model_path)
        n = checkpoint_tensor_count(reader)
        fill_from_checkpoint(model, iterate_gguf(reader, model_config, lazy), n, "Loading GGUF")

"""Per-layer FP8 KV-cache scales read from a checkpoint (docs/quantization.md, "FP8 KV cache").

A checkpoint quantized for an FP8 KV cache carries one fp32 scale per layer for K and one for V, under one of
these names (``N`` the layer):

* ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (vLLM / llm-compressor, fp8 checkpoints);
* ``model.layers.N.self_attn.k_proj.output_scale`` / ``v_proj.output_scale`` (older compressed-tensors);
* ``model.layers.N.self_attn.kv_scale`` (one scale for both, older fp8 checkpoints).

The model's loader skips these tensors (``KV_SCALE_SUFFIXES``); the model runner reads them here when the pool is
FP8.  A layer without one gets 1.0.

An MLA (DeepSeek) latent cache has one scale per layer for its one latent row (``read_latent_scales``): the
layer's K scale (``k_scale``, ``kv_scale`` or ``k_proj.output_scale``), as the latent row is the keys of absorbed
attention (and, its first ``kv_lora_rank`` columns, the values); a ``v_scale`` is not used (docs/deepseek.md,
"FP8 latent cache").
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Optional

logger = logging.getLogger(__name__)

# checkpoint tensors that are KV-cache scales, not model parameters (the model loaders skip them)
KV_SCALE_SUFFIXES = (
    "self_attn.k_scale",
    "self_attn.v_scale",
    "self_attn.kv_scale",
    "self_attn.k_proj.output_scale",
    "self_attn.v_proj.output_scale",
)
_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$"
)
_WHICH = {
    "k_scale": "k",
    "k_proj.output_scale": "k",
    "v_scale": "v",
    "v_proj.output_scale": "v",
    "kv_scale": "kv",
}


def read_kv_scales(model_path: str, num_layers: int) -> Optional[tuple[list[float], list[float]]]:
    """``(k_scales, v_scales)`` per layer from a safetensors folder, or None when it holds none (a GGUF file, a
    folder without weights).  ValueError for a scale that is not one positive finite number or a layer out of range."""
    found = _read(model_path, num_layers)
    if found is None:
        return None
    k, v = found
    n = sum(x is not None for x in k) + sum(x is not None for x in v)
    if n < 2 * num_layers:
        logger.warning("the checkpoint has KV scales for %d of %d K/V tensors; the others use 1.0", n, 2 * num_layers)
    return [1.0 if x is None else x for x in k], [1.0 if x is None else x for x in v]


def read_latent_scales(model_path: str, num_layers: int, extra_layers: int = 0) -> Optional[list[float]]:
    """An MLA latent cache's scale per layer (module docstring): each layer's K scale, 1.0 where it has none;
    None when the folder holds no K scale.  ``extra_layers``: the checkpoint's decoder layers past ``num_layers``
    (a DeepSeek checkpoint's MTP layers, stored as layers ``num_layers..``): their scales are allowed and
    returned too, after the model's.  ValueError as ``read_kv_scales``."""
    found = _read(model_path, num_layers + extra_layers)
    if found is None or all(x is None for x in found[0]):
        return None
    k = found[0]
    n = sum(x is not None for x in k[:num_layers])
    if n < num_layers:
        logger.warning("the checkpoint has latent KV scales for %d of %d layers; the others use 1.0", n, num_layers)
    return [1.0 if x is None else x for x in k]


def _read(model_path: str, num_layers: int) -> Optional[tuple[list[Optional[float]], list[Optional[float]]]]:
    """The K and V scales the folder holds per layer (None where a layer has none), or None without any."""
    from safetensors import safe_open

    from kvship.engine.loaders.safetensors_loader import INDEX_FILE, safetensors_files

    if not os.path.isdir(model_path):
        return None
    if not os.path.isfile(os.path.join(model_path, INDEX_FILE)) and not glob.glob(
        os.path.join(model_path, "*.safetensors")
    ):
        return None  # a folder without weights (--load-format dummy)

    k: list[Optional[float]] = [None] * num_layers
    v: list[Optional[float]] = [None] * num_layers
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _NAME.search(name)
                if m is None:
                    continue
                layer, which = int(m.group(1)), _WHICH[m.group(2)]
                if layer >= num_layers:
                    raise ValueError(f"KV scale '{name}' names layer {layer}; the model has {num_layers}")
                t = f.get_tensor(name)
                if t.numel() != 1:
                    raise ValueError(f"KV scale '{name}' has shape {tuple(t.shape)}; one per-tensor scale is read")
                x = float(t.float().reshape(()))
                if not (0 < x < float("inf")):
                    raise ValueError(f"KV scale '{name}' must be a positive finite number, got {x}")
                if which in ("k", "kv"):
                    k[layer] = x
                if which in ("v", "kv"):
                    v[layer] = x
    if all(x is None for x in k) and all(x is None for x in v):
        return None
    return k, v

"""Write an FP8 checkpoint from an unquantised Hugging Face folder (tests, and users trying a format).

``write_fp8_checkpoint(src, dst, fmt)`` copies the folder (tokenizer and
generation config included) and replaces every projection weight of the
decoder layers (``*_proj.weight``: q/k/v/o, gate/up/down) with float8_e4m3fn
weights and the format's scales, and adds config.json's
``quantization_config``.  The embedding, norms, LM head, biases and MoE
routers stay as they are (a MoE model's routers are listed in
``modules_to_not_convert`` / ``ignore``, as Qwen3 ``-FP8`` checkpoints list
them); each expert's gate/up/down is quantized like a dense projection.  Formats (docs/quantization.md, "Writing a checkpoint"):

* ``fp8_block``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``,
  ``weight_scale_inv`` per block, dynamic activations.
* ``fp8_channel``: ``quant_method: fp8``, ``weight_scale [out]``, dynamic
  activations.
* ``fp8_tensor_static``: ``quant_method: fp8``, ``activation_scheme:
  static``, scalar ``weight_scale`` and ``input_scale``.
* ``ct_channel``: compressed-tensors, weights per channel
  (``weight_scale [out, 1]``), dynamic per-token activations.
* ``ct_tensor_static``: compressed-tensors, per-tensor weights and static
  per-tensor activations (``weight_scale [1]``, ``input_scale [1]``).
* ``ct_block``: compressed-tensors, weights in 128x128 blocks
  (``strategy: block``, ``block_structure: [128, 128]``, ``weight_scale`` per
  block), dynamic activations per token and group of 128 columns (llm-compressor's
  ``FP8_BLOCK``).

Static ``input_scale``s are calibrated: the unquantised model (transformers)
runs ``calibration_ids`` and each projection's scale is the largest
``|input|`` it saw divided by 448; every MoE expert is calibrated on every
token reaching its layer (not only the tokens routed to it), so each expert
gets a scale.

Command line: ``python -m kvship.engine.layers.quantization.writer SRC DST FORMAT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvship.engine.layers.quantization import fp8_math as fm

FORMATS = ("fp8_block", "fp8_channel", "fp8_tensor_static", "ct_channel", "ct_tensor_static", "ct_block")
BLOCK = (128, 128)
DEFAULT_CALIBRATION = list(range(1, 65))


def quantization_config(fmt: str) -> dict:
    """config.json's ``quantization_config`` of format ``fmt``."""
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    if fmt in ("fp8_channel", "fp8_tensor_static"):
        act = "dynamic" if fmt == "fp8_channel" else "static"
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": act}
    if fmt in ("ct_channel", "ct_tensor_static", "ct_block"):
        channel = fmt == "ct_channel"
        spec = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None)
        if fmt == "ct_block":
            weights = dict(spec, strategy="block", block_structure=list(BLOCK), dynamic=False, observer="minmax")
            acts = dict(spec, strategy="group", group_size=BLOCK[1], dynamic=True, observer=None)
        else:
            weights = dict(spec, strategy="channel" if channel else "tensor", dynamic=False, observer="minmax")
            acts = dict(
                spec, strategy="token" if channel else "tensor", dynamic=channel, observer=None if channel else "minmax"
            )
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
        }
    raise ValueError(f"unknown FP8 checkpoint format {fmt!r}; known: {list(FORMATS)}")


def is_quantized_weight(name: str) -> bool:
    """The tensors a format quantizes: the decoder layers' projection weights, MoE experts' included (not the
    MoE router ``mlp.gate``, nor Qwen2-MoE's ``shared_expert_gate``); DeepSeek's ``kv_a_proj_with_mqa`` is a
    projection too (DeepSeek-V3's FP8 checkpoint stores it with block scales)."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quantize_weight(name: str, w: torch.Tensor, fmt: str, input_amax: Optional[float] = None) -> dict:
    """The checkpoint tensors of weight ``name`` (``...proj.weight``) in format ``fmt``."""
    base = name.removesuffix(".weight")
    if fmt in ("fp8_block", "ct_block"):
        q, s = fm.quantize_blocks(w, BLOCK)
        return {name: q, f"{base}.weight_scale_inv" if fmt == "fp8_block" else f"{base}.weight_scale": s}
    if fmt in ("fp8_channel", "ct_channel"):
        q, s = fm.quantize_channel(w)
        return {name: q, f"{base}.weight_scale": s if fmt == "fp8_channel" else s[:, None].contiguous()}
    if fmt in ("fp8_tensor_static", "ct_tensor_static"):
        if input_amax is None:
            raise ValueError(f"'{name}': format {fmt} needs a calibrated input amax")
        q, s = fm.quantize_tensor(w)
        inp = torch.tensor(max(input_amax, fm.ACT_EPS) / fm.FP8_MAX, dtype=torch.float32)
        if fmt == "ct_tensor_static":
            s, inp = s.reshape(1), inp.reshape(1)
        return {name: q, f"{base}.weight_scale": s, f"{base}.input_scale": inp}
    raise ValueError(f"unknown FP8 checkpoint format {fmt!r}; known: {list(FORMATS)}")


def calibrate_input_amax(src: str, ids: Sequence[int]) -> dict[str, float]:
    """``{projection weight name: max |input|}`` over the unquantised model (transformers, fp32) run on ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    amax: dict[str, float] = {}
    hooks = []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and is_quantized_weight(f"{mname}.weight"):

            def hook(_m, args, key=f"{mname}.weight"):
                amax[key] = max(amax.get(key, 0.0), float(args[0].detach().abs().amax()))

            hooks.append(mod.register_forward_pre_hook(hook))
        elif _is_stacked_experts(mod):
            hooks.append(mod.register_forward_pre_hook(lambda m, args, p=mname: _expert_amax(m, p, args[0], amax)))
    with torch.no_grad():
        model(torch.tensor([list(ids)]))
    for h in hooks:
        h.remove()
    return amax


def _is_stacked_experts(mod: torch.nn.Module) -> bool:
    """transformers' stacked experts module (``Qwen3MoeExperts``...): ``gate_up_proj [E, 2I, H]`` (gate rows,
    then up rows), ``down_proj [E, H, I]``, ``act_fn``; saved as ``<name>.<e>.{gate,up,down}_proj.weight``."""
    w13, w2 = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and hasattr(mod, "act_fn")


def _expert_amax(mod: torch.nn.Module, prefix: str, x: torch.Tensor, amax: dict[str, float]) -> None:
    """Every expert calibrated on every token of the layer (not only those routed to it: an expert the
    calibration prompt never routes to still gets a scale); ``amax`` as in ``calibrate_input_amax``."""
    x = x.detach().reshape(-1, x.shape[-1])
    inp = float(x.abs().amax())
    for e in range(mod.gate_up_proj.shape[0]):
        gate, up = torch.nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
        down_in = float((mod.act_fn(gate) * up).abs().amax())
        for proj, v in (("gate_proj", inp), ("up_proj", inp), ("down_proj", down_in)):
            key = f"{prefix}.{e}.{proj}.weight"
            amax[key] = max(amax.get(key, 0.0), v)


def write_fp8_checkpoint(src: str, dst: str, fmt: str, calibration_ids: Optional[Sequence[int]] = None) -> str:
    """Copy Hugging Face folder ``src`` to ``dst`` with its projection weights in FP8 format ``fmt`` (module
    docstring); returns ``dst``."""
    qc = quantization_config(fmt)
    static = fmt.endswith("_static")
    amax = calibrate_input_amax(src, calibration_ids or DEFAULT_CALIBRATION) if static else {}
    os.makedirs(dst, exist_ok=True)
    index = os.path.join(src, "model.safetensors.index.json")
    weight_map: dict[str, str] = {}
    routers: list[str] = []
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry.endswith(".safetensors"):
            out: dict[str, torch.Tensor] = {}
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    tensors = quantize_weight(name, t, fmt, amax.get(name)) if is_quantized_weight(name) else {name: t}
                    out.update({k: v.contiguous() for k, v in tensors.items()})
                    if name.endswith(".mlp.gate.weight"):
                        routers.append(name.removesuffix(".weight"))
            save_file(out, os.path.join(dst, entry), metadata={"format": "pt"})
            weight_map.update({k: entry for k in out})
        elif os.path.isfile(path) and entry not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(path, os.path.join(dst, entry))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if routers:  # MoE routers stay unquantized and are listed so, as Qwen3 -FP8 checkpoints do
        key = "ignore" if qc["quant_method"] == "compressed-tensors" else "modules_to_not_convert"
        qc[key] = sorted(set(qc.get(key) or ["lm_head"]) | set(routers))
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if os.path.isfile(index):
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    return dst


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description="Write an FP8 copy of an unquantized Hugging Face model folder")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("format", choices=FORMATS)
    a = p.parse_args(argv)
    print(write_fp8_checkpoint(a.src, a.dst, a.format))


if __name__ == "__main__":
    main()

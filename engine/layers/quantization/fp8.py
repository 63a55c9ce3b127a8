"""FP8 (e4m3) weights: the ``fp8`` and ``compressed-tensors`` checkpoint formats and ``--quantization fp8``.

A format is read from config.json's ``quantization_config`` (``parse_scheme``)
into an ``Fp8Scheme``: how weights are scaled (128x128 blocks or one scale per
output row; a per-tensor checkpoint scale is stored repeated over the rows it
covers, which is the same arithmetic) and how activations are quantised at
run time (per token-group of the block width, per token, or with the
checkpoint's static ``input_scale``).  ``--quantization fp8`` on an
unquantised checkpoint quantises each weight per output row as it is loaded.

``apply`` is the CPU reference of the GPU kernels (quantize-dequantize (QDQ),
``fp8_math``); the embedding and the LM head stay in the model dtype, as the
checkpoints keep them.  docs/quantization.md lists the key names, the
arithmetic and what is not done (GPU kernels, FP8 MoE experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.quantization import fp8_math as fm
from kvship.engine.layers.quantization.base import QuantMethod, Shard, WeightLoader, register_quant_method
from kvship.engine.layers.quantization.unquantized import UnquantizedMethod, dense_linear
from kvship.engine.loaders.lazy import Loaded, materialize

# entries of a checkpoint's list of unquantised modules that match what we keep unquantised anyway
_UNQUANTIZED_MODULES = {"lm_head", "re:.*lm_head", "model.embed_tokens", "re:.*embed_tokens"}
_SUPPORTED = (
    "fp8: weight_block_size [bn, bk] with activation_scheme 'dynamic', or per-tensor / per-channel weight_scale "
    "with activation_scheme 'dynamic' or 'static'; compressed-tensors: float 8-bit weights with strategy "
    "'channel' and dynamic 'token' activations, or 'tensor' weights with static 'tensor' activations"
)


@dataclass(frozen=True)
class Fp8Scheme:
    """``weight``: ``"block"`` (``weight_scale_inv`` per ``block``) or ``"channel"`` (``weight_scale`` per output
    row); ``activation``: ``"group"`` (dynamic, per token and ``block[1]`` columns), ``"token"`` (dynamic, per
    token) or ``"static"`` (``input_scale``); ``quantize_at_load``: weights arrive unquantised."""

    weight: str
    activation: str
    block: Optional[tuple[int, int]] = None
    quantize_at_load: bool = False

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.weight == "block" else "weight_scale"


def parse_scheme(method: str, qc: Optional[dict]) -> Fp8Scheme:
    """The scheme of config.json's ``quantization_config`` ``qc`` for ``method`` (``fp8`` or
    ``compressed-tensors``); ``qc`` None: ``--quantization fp8`` on an unquantised checkpoint.  ValueError
    naming what is not supported."""
    if qc is None:
        if method != "fp8":
            raise ValueError(f"--quantization {method} needs a checkpoint with its quantization_config")
        return Fp8Scheme("channel", "token", quantize_at_load=True)
    _check_ignored(method, qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore") or [])
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{method} checkpoint with an FP8 KV cache scheme: the FP8 KV cache is not supported yet")
    if method == "fp8":
        return _parse_fp8(qc)
    return _parse_compressed_tensors(qc)


def _check_ignored(method: str, modules: list) -> None:
    other = [m for m in modules if m not in _UNQUANTIZED_MODULES]
    if other:
        raise ValueError(
            f"{method} checkpoint leaves modules unquantized that kvship quantizes: {other[:5]} "
            "(only lm_head / embed_tokens may be listed)"
        )


def _parse_fp8(qc: dict) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    act = qc.get("activation_scheme", "dynamic")
    if fmt != "e4m3" or act not in ("dynamic", "static"):
        raise ValueError(f"unsupported fp8 quantization_config (fmt {fmt!r}, activation_scheme {act!r}); {_SUPPORTED}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("channel", "token" if act == "dynamic" else "static")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(f"fp8 weight_block_size must be [rows, columns], got {block!r}")
    if act != "dynamic":
        raise ValueError(f"fp8 with weight_block_size needs activation_scheme 'dynamic', got {act!r}")
    return Fp8Scheme("block", "group", (int(block[0]), int(block[1])))


def _parse_compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    fmt = qc.get("format", "float-quantized")
    if fmt != "float-quantized" or len(groups) != 1:
        raise ValueError(
            f"unsupported compressed-tensors config (format {fmt!r}, {len(groups)} config group(s)); one "
            f"float-quantized group is supported: {_SUPPORTED}"
        )
    (group,) = groups.values()
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    wkey = (w.get("type"), w.get("num_bits"), w.get("strategy"))
    akey = (a.get("type"), a.get("num_bits"), a.get("strategy"), bool(a.get("dynamic")))
    if wkey == ("float", 8, "channel") and akey == ("float", 8, "token", True):
        return Fp8Scheme("channel", "token")
    if wkey == ("float", 8, "tensor") and akey == ("float", 8, "tensor", False):
        return Fp8Scheme("channel", "static")
    raise ValueError(f"unsupported compressed-tensors scheme: weights {wkey}, input activations {akey}; {_SUPPORTED}")


def _is_vocab_layer(layer: nn.Module) -> bool:
    from kvship.engine.layers.embedding import LMHead, VocabEmbedding

    return isinstance(layer, (VocabEmbedding, LMHead))


class Fp8Method(QuantMethod):
    """FP8 weights of one ``Fp8Scheme`` (module docstring).  Parameters of a linear layer: ``weight``
    (float8_e4m3fn ``[out, in]``), ``weight_scale_inv`` (fp32 ``[ceil(out/bn), ceil(in/bk)]``, block) or
    ``weight_scale`` (fp32 ``[out]``; a buffer when quantised at load), ``input_scale`` (fp32 ``[out]``, static:
    each row holds its checkpoint projection's scale), ``bias`` in the model dtype."""

    def __init__(self, scheme: Optional[Fp8Scheme] = None) -> None:
        self.scheme = scheme or parse_scheme(self.name, None)
        # per instance: the checkpoint's block (None: no block scales)
        self.weight_block = self.scheme.block  # type: ignore[misc]
        self._dense = UnquantizedMethod()

    @classmethod
    def from_config(cls, config) -> "Fp8Method":
        return cls(parse_scheme(cls.name, config.quantization_config))

    # --- weights ---------------------------------------------------------------------------------
    def create_weights(
        self, layer: nn.Module, weights: dict[str, tuple[int, ...]], dtype: torch.dtype, loader: WeightLoader
    ) -> None:
        if _is_vocab_layer(layer):
            return self._dense.create_weights(layer, weights, dtype, loader)
        if "weight" not in weights:
            raise ValueError(
                f"'{self.name}' quantization does not support {type(layer).__name__} layers yet (FP8 MoE experts "
                "are pending, docs/quantization.md)"
            )
        out, inp = weights["weight"]
        s = self.scheme
        params = {"weight": ((out, inp), fm.FP8)}
        if "bias" in weights:
            params["bias"] = (weights["bias"], dtype)
        if s.weight == "block":
            bn, bk = s.block
            params["weight_scale_inv"] = ((-(-out // bn), -(-inp // bk)), torch.float32)
        elif not s.quantize_at_load:
            params["weight_scale"] = ((out,), torch.float32)
        if s.activation == "static":
            params["input_scale"] = ((out,), torch.float32)
        for name, (shape, dt) in params.items():
            p = nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
            p.weight_loader = loader  # type: ignore[attr-defined]
            setattr(layer, name, p)
        if s.quantize_at_load:  # scales made from the weights, not read: no checkpoint tensor fills them
            layer.register_buffer("weight_scale", torch.empty(out, dtype=torch.float32), persistent=False)

    def tensor_kind(self, name: str) -> str:
        return {"weight_scale_inv": "block_scale", "weight_scale": "channel_scale", "input_scale": "tensor_scale"}.get(
            name, super().tensor_kind(name)
        )

    def shard(self, layer: nn.Module, name: str, loaded: Loaded, shard: Shard) -> torch.Tensor:
        if name == "weight_scale" and _numel(loaded.shape) == 1:  # a per-tensor scale: whole on every rank
            return materialize(loaded)
        if name == "weight_scale" and len(loaded.shape) == 2:  # [out, 1] (compressed-tensors)
            loaded = materialize(loaded).reshape(-1)
        return super().shard(layer, name, loaded, shard)

    def accepts_shape(self, name: str, target: tuple[int, ...], loaded: tuple[int, ...]) -> bool:
        """Scales of fewer dimensions: a per-tensor scale (one value) fills every row it covers; ``[out, 1]``
        fills ``[out]``."""
        if name in ("weight_scale", "input_scale"):
            return _numel(loaded) == 1 or _numel(loaded) == _numel(target)
        return False

    def load(self, layer: nn.Module, name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
        with torch.no_grad():
            if name in ("weight_scale", "weight_scale_inv", "input_scale"):
                target.copy_(loaded.float().reshape(-1).expand(target.numel()).view_as(target))
                return
            if target.dtype != fm.FP8 or loaded.dtype == fm.FP8:
                target.copy_(loaded)
                return
            if not self.scheme.quantize_at_load:
                raise ValueError(
                    f"'{name}' is {loaded.dtype}; this '{self.name}' checkpoint should store float8_e4m3fn weights"
                )
            q, scale = fm.quantize_channel(loaded)
            target.copy_(q)
            param = layer.weight
            row0 = (target.storage_offset() - param.storage_offset()) // param.stride(0)
            layer.weight_scale[row0 : row0 + target.shape[0]] = scale

    # --- compute ---------------------------------------------------------------------------------
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """fp32 ``weight * scale`` of a quantized linear layer."""
        if self.scheme.weight == "block":
            return fm.dequant_blocks(layer.weight, layer.weight_scale_inv, self.scheme.block)
        return fm.dequant_channel(layer.weight, layer.weight_scale)

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` quantised and dequantised as the scheme says, fp32."""
        act = self.scheme.activation
        if act == "group":
            return fm.qdq_groups(x, self.scheme.block[1])
        if act == "token":
            return fm.qdq_tokens(x)
        return fm.qdq_static(x, layer.input_scale.amax())

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.weight.dtype != fm.FP8:  # the LM head
            return dense_linear(x, layer.weight, layer.bias)
        return fm.qdq_linear(self.quantize_input(layer, x), self.dequantized_weight(layer), layer.bias, x.dtype)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def apply_moe(self, layer, runner, x, topk_weights, topk_ids, absent=False, config_experts=None):
        # never reached: create_weights refuses MoE expert layers when the model is built
        raise ValueError(f"'{self.name}' quantization has no MoE expert kernels")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@register_quant_method("fp8")
class Fp8CheckpointMethod(Fp8Method):
    """``quant_method: "fp8"`` checkpoints (block-128, per-tensor, per-channel) and ``--quantization fp8``."""


@register_quant_method("compressed-tensors")
class CompressedTensorsFp8Method(Fp8Method):
    """``quant_method: "compressed-tensors"`` float8 checkpoints (per-channel dynamic, per-tensor static)."""

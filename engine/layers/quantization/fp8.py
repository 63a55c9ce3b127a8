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
checkpoints keep them.  MoE experts are stacked as ``w13_weight`` /
``w2_weight`` with their ``*_weight_scale_inv`` (block: ``apply_moe`` runs
``triton_moe_fp8`` under the ``triton`` runner, else ``moe_reference``) or
``*_weight_scale`` per row and, static, ``*_weight_input_scale`` (every other
format, ``--quantization fp8`` included: ``moe_channel_reference`` on every
device, no kernel yet).
docs/quantization.md lists the key names, the arithmetic ("MoE experts") and
what is not done.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_fp8_kernels
from kvship.engine.layers.quantization import fp8_math as fm
from kvship.engine.layers.quantization.base import (
    QuantizedInput,
    QuantMethod,
    Shard,
    WeightLoader,
    add_weights,
    register_quant_method,
)
from kvship.engine.layers.quantization.unquantized import UnquantizedMethod, dense_linear
from kvship.engine.loaders.lazy import Loaded, materialize

logger = logging.getLogger(__name__)

# entries of a checkpoint's list of unquantised modules that match what we keep unquantised anyway
_UNQUANTIZED_MODULES = {"lm_head", "re:.*lm_head", "model.embed_tokens", "re:.*embed_tokens"}
# MoE routers, which kvship keeps unquantized too (Qwen3 -FP8 checkpoints list every layer's ``mlp.gate``)
_ROUTER_RE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|shared_expert_gate)$")
_SCALE_KINDS = (("weight_scale_inv", "block_scale"), ("weight_scale", "channel_scale"), ("input_scale", "tensor_scale"))
_SUPPORTED = (
    "fp8: weight_block_size [bn, bk] with activation_scheme 'dynamic', or per-tensor / per-channel weight_scale "
    "with activation_scheme 'dynamic' or 'static'; compressed-tensors: float 8-bit weights with strategy "
    "'channel' and dynamic 'token' activations, 'tensor' weights with static 'tensor' activations, or 'block' "
    "weights (block_structure [rows, columns]) with dynamic 'group' activations of group_size columns"
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
    # the checkpoint's name of a block weight's scales (the parameter is ``weight_scale_inv`` whatever the format:
    # ``fp8`` stores them so, compressed-tensors as ``weight_scale``; the same multiplier, q * scale)
    block_scale_key: str = "weight_scale_inv"

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
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type"), kv.get("num_bits"), kv.get("strategy", "tensor")) != ("float", 8, "tensor"):
        # a per-tensor float8 scheme only ships k_scale / v_scale, which the FP8 KV cache reads (docs/quantization.md)
        raise ValueError(
            f"{method} checkpoint with an unsupported KV cache scheme {kv!r}: the FP8 KV cache reads float 8-bit "
            "per-tensor k_scale / v_scale (--kv-cache-dtype fp8_e4m3)"
        )
    if method == "fp8":
        return _parse_fp8(qc)
    return _parse_compressed_tensors(qc)


def _check_ignored(method: str, modules: list) -> None:
    other = [m for m in modules if m not in _UNQUANTIZED_MODULES and not _ROUTER_RE.match(m)]
    if other:
        raise ValueError(
            f"{method} checkpoint leaves modules unquantized that kvship quantizes: {other[:5]} "
            "(only lm_head / embed_tokens and MoE routers (mlp.gate) may be listed)"
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
    if wkey == ("float", 8, "block") and akey == ("float", 8, "group", True):
        block = w.get("block_structure")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"compressed-tensors block weights need block_structure [rows, columns], got {block!r}")
        bn, bk = int(block[0]), int(block[1])
        if a.get("group_size") != bk:
            raise ValueError(
                f"compressed-tensors block weights of {bk} columns need activation groups of group_size {bk}, got "
                f"{a.get('group_size')!r} (the FP8 kernels scale each weight block by its activation group)"
            )
        return Fp8Scheme("block", "group", (bn, bk), block_scale_key="weight_scale")
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
        if "w13_weight" in weights:
            return self._create_moe_weights(layer, weights, loader)
        if "weight" not in weights:
            raise ValueError(f"'{self.name}' quantization does not support {type(layer).__name__} layers")
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
        add_weights(layer, params, loader)
        if s.quantize_at_load:  # scales made from the weights, not read: no checkpoint tensor fills them
            layer.register_buffer("weight_scale", torch.empty(out, dtype=torch.float32), persistent=False)

    def _create_moe_weights(self, layer: nn.Module, weights: dict[str, tuple[int, ...]], loader: WeightLoader) -> None:
        """FP8 experts, each expert's checkpoint tensors stacked.  Block formats: ``w13_weight`` e4m3 ``[E, 2I, H]``
        with ``w13_weight_scale_inv`` fp32 ``[E, 2I/bn, ceil(H/bk)]`` (gate's blocks, then up's), ``w2_weight``
        ``[E, H, I]`` with ``w2_weight_scale_inv`` ``[E, ceil(H/bn), ceil(I/bk)]``.  Every other format
        (``_create_moe_channel_weights``): one scale per output row."""
        s = self.scheme
        if s.weight != "block":
            return self._create_moe_channel_weights(layer, weights, loader)
        (e, two_i, h), (_, _, inter) = weights["w13_weight"], weights["w2_weight"]
        bn, bk = s.block
        if inter % bn:
            raise ValueError(
                f"FP8 block experts need the expert width ({inter}) to be a multiple of the {bn}-row scale blocks: "
                "gate and up are stacked by whole blocks"
            )
        params = {
            "w13_weight": ((e, two_i, h), fm.FP8),
            "w13_weight_scale_inv": ((e, two_i // bn, -(-h // bk)), torch.float32),
            "w2_weight": ((e, h, inter), fm.FP8),
            "w2_weight_scale_inv": ((e, -(-h // bn), -(-inter // bk)), torch.float32),
        }
        add_weights(layer, params, loader)

    def _create_moe_channel_weights(
        self, layer: nn.Module, weights: dict[str, tuple[int, ...]], loader: WeightLoader
    ) -> None:
        """Per-channel / per-tensor experts: ``w13_weight`` e4m3 ``[E, 2I, H]`` with ``w13_weight_scale`` fp32
        ``[E, 2I]`` (gate's rows, then up's; a per-tensor checkpoint scale repeated over its projection's rows),
        ``w2_weight`` ``[E, H, I]`` with ``w2_weight_scale`` ``[E, H]``; static activations add
        ``w13_weight_input_scale`` ``[E, 2I]`` and ``w2_weight_input_scale`` ``[E, H]`` (each row its checkpoint
        projection's ``input_scale``).  Quantised at load: the weight scales are buffers, made, not read."""
        s = self.scheme
        (e, two_i, h), (_, _, inter) = weights["w13_weight"], weights["w2_weight"]
        params = {"w13_weight": ((e, two_i, h), fm.FP8), "w2_weight": ((e, h, inter), fm.FP8)}
        scales = {"w13_weight_scale": (e, two_i), "w2_weight_scale": (e, h)}
        if not s.quantize_at_load:
            params.update({name: (shape, torch.float32) for name, shape in scales.items()})
        if s.activation == "static":
            params["w13_weight_input_scale"] = ((e, two_i), torch.float32)
            params["w2_weight_input_scale"] = ((e, h), torch.float32)
        add_weights(layer, params, loader)
        if s.quantize_at_load:
            for name, shape in scales.items():
                layer.register_buffer(name, torch.empty(*shape, dtype=torch.float32), persistent=False)

    def checkpoint_name(self, name: str) -> str:
        """compressed-tensors block scales (``...weight_scale``) fill the ``weight_scale_inv`` parameters."""
        key = self.scheme.block_scale_key
        if self.scheme.weight == "block" and key != "weight_scale_inv" and name.endswith("." + key):
            return name[: -len(key)] + "weight_scale_inv"
        return name

    def tensor_kind(self, name: str) -> str:
        for suffix, kind in _SCALE_KINDS:
            if name == suffix or name.endswith("_" + suffix):  # ``w13_weight_scale_inv``: an expert's block scales
                return kind
        return super().tensor_kind(name)

    def shard(self, layer: nn.Module, name: str, loaded: Loaded, shard: Shard) -> torch.Tensor:
        # ``weight_scale``, or an expert's ``w13_weight_scale`` / ``w2_weight_scale``
        channel = self.tensor_kind(name) == "channel_scale"
        if channel and _numel(loaded.shape) == 1:  # a per-tensor scale: whole on every rank
            return materialize(loaded)
        if channel and len(loaded.shape) == 2:  # [out, 1] (compressed-tensors)
            loaded = materialize(loaded).reshape(-1)
        return super().shard(layer, name, loaded, shard)

    def accepts_shape(self, name: str, target: tuple[int, ...], loaded: tuple[int, ...]) -> bool:
        """Scales of fewer dimensions: a per-tensor scale (one value) fills every row it covers; ``[out, 1]``
        fills ``[out]``."""
        if self.tensor_kind(name) in ("channel_scale", "tensor_scale"):  # experts' ``w13_weight_scale``... too
            return _numel(loaded) == 1 or _numel(loaded) == _numel(target)
        return False

    def load(self, layer: nn.Module, name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
        with torch.no_grad():
            if self.tensor_kind(name).endswith("_scale"):
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
            # the scale rows of ``target``'s rows: ``weight`` -> ``weight_scale``; an expert's ``w13_weight``
            # region (expert e, rows r0...) -> ``w13_weight_scale[e, r0...]``
            param, scales = getattr(layer, name), getattr(layer, name + "_scale")
            offset = target.storage_offset() - param.storage_offset()
            if param.dim() == 3:
                scales, offset = scales[offset // param.stride(0)], offset % param.stride(0)
            row0 = offset // param.stride(-2)
            scales[row0 : row0 + target.shape[0]] = scale

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

    def input_group(self, layer: nn.Module) -> int:
        """128 for a block-128 layer with per-group activations (its decode input may come quantized from the
        attention's merge kernel: ``decode_attention_quant``), where the GPU kernels run; else 0."""
        s = self.scheme
        w = getattr(layer, "weight", None)
        if w is None or w.dtype != fm.FP8 or cuda_fp8_kernels(w) is None:
            return 0
        return s.block[1] if s.weight == "block" and s.activation == "group" and s.block[1] == 128 else 0

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedInput):
            return self._apply_quantized(layer, x)
        if layer.weight.dtype != fm.FP8:  # the LM head
            return dense_linear(x, layer.weight, layer.bias)
        kernels = cuda_fp8_kernels(x)
        if kernels is not None:
            y = self._kernel_linear(kernels, layer, x)
            if y is not None:
                return y
        return fm.qdq_linear(self.quantize_input(layer, x), self.dequantized_weight(layer), layer.bias, x.dtype)

    def _apply_quantized(self, layer: nn.Module, x: QuantizedInput) -> torch.Tensor:
        """``apply`` of an input a producer quantized by ``input_group`` (the product of the kernels; the reference
        of its dequantized values where they do not run)."""
        kernels = cuda_fp8_kernels(x.q)
        if kernels is not None:
            w, ws, act, block, group, static = self._kernel_args(kernels, layer)
            return kernels.fp8_linear_q(x.q, x.scales, w, ws, act, block, group, layer.bias, x.dtype)
        g = x.q.shape[1] // x.scales.shape[1]
        deq = (x.q.float().view(x.q.shape[0], -1, g) * x.scales[..., None]).view(x.q.shape)
        return fm.qdq_linear(deq, self.dequantized_weight(layer), layer.bias, x.dtype)

    def _kernel_args(self, kernels, layer: nn.Module) -> tuple:
        """``(weight, weight scales, activation code, block, group, static input scale)`` for the GPU kernels."""
        s = self.scheme
        static = layer.input_scale.amax().reshape(1) if s.activation == "static" else None
        if s.weight == "block":
            return layer.weight, layer.weight_scale_inv, kernels.ACT_CODES[s.activation], s.block, s.block[1], static
        return layer.weight, layer.weight_scale, kernels.ACT_CODES[s.activation], None, 128, static

    def _kernel_linear(self, kernels, layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The GPU kernels' ``x W^T + b`` (``fp8_kernels.fp8_linear``: no host synchronisation, capture-safe), or
        None where they do not take this layer (the reference runs)."""
        w, ws, act, block, group, static = self._kernel_args(kernels, layer)
        x2 = x.reshape(-1, x.shape[-1])
        y = kernels.fp8_linear(x2, w, ws, act, block, group, layer.bias, static)
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])

    def _fused_kernels(self, layer: nn.Module, x: torch.Tensor):
        """The FP8 kernels when ``layer``'s product runs on them for input ``x`` (rows of ``k`` columns after the
        producer), else None."""
        if layer.weight.dtype != fm.FP8:
            return None
        return cuda_fp8_kernels(x)

    def apply_silu_mul_input(self, layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """On CUDA: ``silu(g) * u`` computed and quantized by one kernel (``quantize_act(silu=True)``, no
        activation tensor), then the FP8 product; bit-equal to ``silu_and_mul`` then ``apply``."""
        kernels = self._fused_kernels(layer, x)
        if kernels is None:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        w, ws, act, block, group, static = self._kernel_args(kernels, layer)
        if x2.shape[1] % 2 or not kernels.applies(x2, w, block, group, k=x2.shape[1] // 2):
            return None
        xq, xs = kernels.quantize_act(x2, act, group, static, silu=True)
        y = kernels.fp8_linear_q(xq, xs, w, ws, act, block, group, layer.bias, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def apply_norm_input(self, layer, x, residual, norm_weight, eps, keep_normed):
        """On CUDA: ``rmsnorm(x + residual)`` computed and quantized by one kernel (``norm_quant``), then the FP8
        product; bit-equal to the norm layer then ``apply``."""
        kernels = self._fused_kernels(layer, x)
        if kernels is None:
            return None
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
        w, ws, act, block, group, static = self._kernel_args(kernels, layer)
        if (
            not x2.is_contiguous()
            or (r2 is not None and (not r2.is_contiguous() or r2.dtype != x2.dtype))
            or not kernels.applies(x2, w, block, group)
        ):
            return None
        xq, xs, res_out, h = kernels.norm_quant(x2, r2, norm_weight, eps, keep_normed, act, group, static)
        y = kernels.fp8_linear_q(xq, xs, w, ws, act, block, group, layer.bias, x.dtype)
        return (
            y.reshape(*shape[:-1], y.shape[-1]),
            res_out.view(shape),
            h.view(*shape[:-1], h.shape[-1]) if h is not None else None,
        )

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def apply_moe(self, layer, runner, x, topk_weights, topk_ids, absent=False, config_experts=None):
        """FP8 experts: the fused Triton kernels (``triton_moe_fp8``: ``fused_experts_fp8`` for block-128,
        ``fused_experts_fp8_channel`` for per-channel / per-tensor experts) where the layer runs the ``triton``
        runner, else the references ``moe_reference`` / ``moe_channel_reference`` (on CUDA a warning at the
        first forward says the reference is slow).  docs/quantization.md ("MoE experts")."""
        triton_runner = _is_triton_runner(runner)
        if self.scheme.weight != "block":
            static = self.scheme.activation == "static"
            args = (
                x, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale,
                layer.w13_weight_input_scale if static else None, layer.w2_weight_input_scale if static else None,
                topk_weights, topk_ids,
            )  # fmt: skip
            if triton_runner:
                from kvship.engine.layers.moe.triton_moe_fp8 import fused_experts_fp8_channel

                return fused_experts_fp8_channel(*args, absent=absent, config_experts=config_experts)
            if x.is_cuda:
                _warn_slow_moe_once(self.name)
            return moe_channel_reference(*args)
        args = (x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv)
        if triton_runner:
            from kvship.engine.layers.moe.triton_moe_fp8 import fused_experts_fp8

            return fused_experts_fp8(
                *args, self.scheme.block, topk_weights, topk_ids, absent=absent, config_experts=config_experts
            )
        return moe_reference(*args, self.scheme.block, topk_weights, topk_ids)


_warned_slow_moe: set[str] = set()


def _warn_slow_moe_once(method: str) -> None:
    if method not in _warned_slow_moe:
        _warned_slow_moe.add(method)
        logger.warning(
            "'%s' per-channel / per-tensor FP8 MoE experts run the torch reference on CUDA because the MoE runner "
            "is not 'triton' (KVSHIP_MOE_RUNNER): slow, and not CUDA-graph safe (use --disable-cuda-graph) "
            '(docs/quantization.md, "MoE experts")',
            method,
        )


def _is_triton_runner(runner: object) -> bool:
    """Whether ``runner`` is the ``triton`` MoE runner (its module is imported once such a runner exists)."""
    mod = sys.modules.get("kvship.engine.layers.moe.triton_moe")
    return mod is not None and isinstance(runner, mod.TritonMoERunner)


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference of the block-FP8 experts (the ``MoERunner`` contract; ids outside ``[0, E)`` add nothing):
    ``x`` quantised per token-group of ``block[1]`` (dequantised, fp32), each expert's dequantised gate/up
    weights, ``silu(gate) * up`` in fp32 quantised per token-group again, the dequantised down weights, the
    routing weight, every pair summed per token in fp32 and cast to ``x.dtype`` once.  Reads the routing on
    the host: not CUDA-graph safe."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the FP8 MoE reference reads the routing on the host and cannot be captured in a CUDA graph: use "
            "KVSHIP_MOE_RUNNER=triton (the default on CUDA) or --disable-cuda-graph"
        )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    group, inter, experts = block[1], w2.shape[2], w13.shape[0]
    xq = fm.qdq_groups(x, group)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        if not 0 <= e < experts:  # absent: another rank's expert
            continue
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = F.linear(xq[token], fm.dequant_blocks(w13[e], w13_scale[e], block))
        h = fm.qdq_groups(F.silu(h[:, :inter]) * h[:, inter:], group)
        y = F.linear(h, fm.dequant_blocks(w2[e], w2_scale[e], block))
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def moe_channel_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_input_scale: Optional[torch.Tensor],
    w2_input_scale: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The reference of per-channel / per-tensor FP8 experts (``moe_reference``'s contract), mirroring the dense
    layers of the same format: ``x`` quantised per token (input scales None: dynamic) or with expert e's static
    gate/up input scale (the larger of gate's and up's, as a dense stacked gate/up layer takes the largest of its
    rows), dequantised, fp32; ``h = x_deq @ (w13[e] * w13_scale[e] per row)^T``; ``a = silu(h[:, :I]) * h[:, I:]``
    in fp32 quantised per token again (or with down's static input scale); ``y = a_deq @ w2_deq[e]^T``; the
    routing weight; every pair summed per token in fp32 and cast to ``x.dtype`` once.  Reads the routing on the
    host: not CUDA-graph safe."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the FP8 MoE reference reads the routing on the host and cannot be captured in a CUDA graph: "
            "per-channel / per-tensor FP8 experts need --disable-cuda-graph"
        )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    static = w13_input_scale is not None
    inter, experts = w2.shape[2], w13.shape[0]
    xq = None if static else fm.qdq_tokens(x)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        if not 0 <= e < experts:  # absent: another rank's expert
            continue
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = fm.qdq_static(x[token], w13_input_scale[e].amax()) if static else xq[token]
        h = F.linear(xe, fm.dequant_channel(w13[e], w13_scale[e]))
        a = F.silu(h[:, :inter]) * h[:, inter:]
        a = fm.qdq_static(a, w2_input_scale[e].amax()) if static else fm.qdq_tokens(a)
        y = F.linear(a, fm.dequant_channel(w2[e], w2_scale[e]))
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


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

"""``--load-format dummy``: seeded random weights at the real shapes (benchmarks, no checkpoint needed).

The weights are a synthetic Hugging Face checkpoint that is never written:
``checkpoint_shapes(config)`` lists the tensors a checkpoint of the
architecture holds (names and full shapes), and the values of each are a
function of ``(seed, name)`` only.  They reach the model through its
``load_weights`` like safetensors' tensors do, as ``CheckpointSlice``s on a
tensor- or expert-parallel rank, so every rank gets exactly its block of the
``--tp-size 1`` weights: the same model at every TP / EP size, which makes a
TP=2 vs TP=1 token comparison on dummy weights meaningful.

Values: norm weights are 1, everything else is N(0, ``DUMMY_STD``), so
activations stay finite in every dtype.  They are drawn on the model's device
in the model's dtype, in blocks of whole rows (about ``BLOCK_ELEMENTS``
elements): block ``i`` of a tensor comes from a generator seeded with
``(seed, name, i)``, so a slice materialises only the row blocks it touches
(a column slice, which row-parallel layers take, draws whole rows and keeps
its columns), and nothing is ever drawn for the whole model at once.  The
values depend on the seed, the dtype and the device (CPU and CUDA generators
differ, CUDA's also with the GPU model), never on the TP / EP size.
``dummy_checkpoint(config, seed, device)`` yields the checkpoint as lazy slices.

FP8 (a config.json whose ``quantization_config`` is an ``fp8`` or
``compressed-tensors`` format, docs/quantization.md): the projection weights
are float8_e4m3fn, the same N(0, ``DUMMY_STD``) draws divided by one constant
scale ``DUMMY_FP8_SCALE``, and every scale tensor of the format holds that
constant (a static ``input_scale`` holds ``DUMMY_INPUT_SCALE``), so any block
of any tensor is a slice of the same model at every TP size.  MoE experts are
projections like the others (FP8); routers stay in the model dtype.  Under
``--quantization fp8`` (no quantization_config) the weights are drawn as
usual and quantized as they load.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator

import torch
from torch import nn

from kvship.engine.loaders.base import ModelLoader, fill_from_checkpoint, register_loader
from kvship.engine.loaders.lazy import CheckpointSlice
from kvship.engine.model_config import ModelConfig

DUMMY_STD = 0.02
# dummy FP8 checkpoints: the weights' scale (|w| up to 8 std before clamping) and static activation scale
DUMMY_FP8_SCALE = 8 * DUMMY_STD / 448.0
DUMMY_INPUT_SCALE = 16.0 / 448.0
# elements drawn per generator seed: a block of whole rows of a tensor
BLOCK_ELEMENTS = 1 << 22


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> full shape, for every tensor a checkpoint of ``config``'s model holds.

    One naming for the whole Llama family (``kvship.engine.models``; DeepSeek's
    MLA and shared-expert names for an ``mla`` config): MoE
    routers are ``mlp.gate`` and experts ``mlp.experts.<N>.{gate,up,down}_proj``
    (Qwen-MoE's names; the model reads Mixtral's as these).  A tied model has
    no ``lm_head.weight``.
    """
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        out[layer + "input_layernorm.weight"] = (h,)
        out[layer + "post_attention_layernorm.weight"] = (h,)
        attn = layer + "self_attn."
        if config.mla is not None:  # DeepSeek's MLA projections (kvship.engine.models.deepseek)
            out.update(_mla_shapes(attn, config))
        qkv = () if config.mla is not None else (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size))
        for proj, rows in qkv:
            out[f"{attn}{proj}_proj.weight"] = (rows, h)
            if config.attention_bias:
                out[f"{attn}{proj}_proj.bias"] = (rows,)
        if config.mla is None:
            out[attn + "o_proj.weight"] = (h, config.q_size)
        if config.o_proj_bias:
            out[attn + "o_proj.bias"] = (h,)
        if config.qk_norm:
            out[attn + "q_norm.weight"] = (config.head_dim,)
            out[attn + "k_norm.weight"] = (config.head_dim,)
        moe = config.moe
        if moe is None or not moe.is_sparse_layer(i):
            out.update(_mlp_shapes(layer + "mlp.", h, config.intermediate_size, config.mlp_bias))
            continue
        out[layer + "mlp.gate.weight"] = (moe.num_experts, h)
        for e in range(moe.num_experts):
            out.update(_mlp_shapes(f"{layer}mlp.experts.{e}.", h, moe.intermediate_size, bias=False))
        if moe.routing is not None:  # DeepSeekMoE: un-gated shared experts, V3's correction bias
            if moe.routing.has_correction_bias:
                out[layer + "mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
            if moe.shared_expert_intermediate_size:
                shared = moe.shared_expert_intermediate_size
                out.update(_mlp_shapes(layer + "mlp.shared_experts.", h, shared, bias=False))
        elif moe.shared_expert_intermediate_size:
            shared = moe.shared_expert_intermediate_size
            out.update(_mlp_shapes(layer + "mlp.shared_expert.", h, shared, config.mlp_bias))
            out[layer + "mlp.shared_expert_gate.weight"] = (1, h)
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    return out


def _mla_shapes(attn: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A DeepSeek layer's MLA tensors (Hugging Face names; docs/deepseek.md)."""
    mla, h, heads = config.mla, config.hidden_size, config.num_attention_heads
    out: dict[str, tuple[int, ...]] = {}
    if mla.q_lora_rank is None:
        out[attn + "q_proj.weight"] = (heads * mla.qk_head_dim, h)
    else:
        out[attn + "q_a_proj.weight"] = (mla.q_lora_rank, h)
        out[attn + "q_a_layernorm.weight"] = (mla.q_lora_rank,)
        out[attn + "q_b_proj.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
    out[attn + "kv_a_proj_with_mqa.weight"] = (mla.latent_dim, h)
    out[attn + "kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
    out[attn + "kv_b_proj.weight"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    out[attn + "o_proj.weight"] = (h, heads * mla.v_head_dim)
    return out


def _mlp_shapes(prefix: str, hidden: int, width: int, bias: bool) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for proj, shape in (("gate", (width, hidden)), ("up", (width, hidden)), ("down", (hidden, width))):
        out[f"{prefix}{proj}_proj.weight"] = shape
        if bias:
            out[f"{prefix}{proj}_proj.bias"] = shape[:1]
    return out


class SyntheticTensor:
    """One dummy checkpoint tensor: ``read(ranges)`` (a ``CheckpointSlice`` reader) draws only the row blocks
    ``ranges`` touches, in ``dtype`` on ``generator``'s device."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        seed: int,
        dtype: torch.dtype,
        generator: torch.Generator,
        fill: float | None = None,
    ) -> None:
        self.name, self.shape, self.seed, self.dtype = name, shape, seed, dtype
        self.generator = generator
        self.rows_per_block = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
        # a constant tensor: norm weights (1) and dummy FP8 scales
        self.fill = 1.0 if name.endswith("norm.weight") else fill

    def read(self, ranges: tuple[slice, ...]) -> torch.Tensor:
        out = torch.empty(tuple(r.stop - r.start for r in ranges), dtype=self.dtype, device=self.generator.device)
        if self.fill is not None:
            return out.fill_(self.fill)
        rows = ranges[0]
        per, row = self.rows_per_block, rows.start
        while row < rows.stop:  # one block at a time: never more than the slice and one block in memory
            i = row // per
            end = min(rows.stop, (i + 1) * per)
            block = self._block(i)[(slice(row - i * per, end - i * per),) + ranges[1:]]
            out[row - rows.start : end - rows.start] = block
            row = end
        return out

    def _block(self, i: int) -> torch.Tensor:
        per = self.rows_per_block
        rows = min(per, self.shape[0] - i * per)
        key = hashlib.blake2b(f"{self.seed}:{self.name}:{i}".encode(), digest_size=8).digest()
        self.generator.manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
        fp8 = self.dtype == torch.float8_e4m3fn
        out = torch.empty(
            (rows,) + self.shape[1:], dtype=torch.float32 if fp8 else self.dtype, device=self.generator.device
        )
        out.normal_(0.0, DUMMY_STD, generator=self.generator)
        return (out / DUMMY_FP8_SCALE).clamp_(-448.0, 448.0).to(self.dtype) if fp8 else out


def dummy_checkpoint(
    config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, CheckpointSlice]]:
    """``(name, CheckpointSlice)`` for every tensor of ``checkpoint_shapes(config)``: nothing is drawn until a
    slice is loaded, on ``device`` in ``config.dtype``."""
    generator = torch.Generator(device=device)
    for name, (shape, dtype, fill) in _with_fp8(config, checkpoint_shapes(config)).items():
        yield name, CheckpointSlice(shape, SyntheticTensor(name, shape, seed, dtype, generator, fill).read)


def _with_fp8(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """name -> (shape, dtype, constant or None): ``shapes`` in the model dtype, or, for an FP8 checkpoint format,
    its projection weights in float8_e4m3fn plus the format's scale tensors (module docstring)."""
    if config.quantization not in ("fp8", "compressed-tensors") or config.quantization_config is None:
        return {name: (shape, config.dtype, None) for name, shape in shapes.items()}
    from kvship.engine.layers.quantization.fp8 import parse_scheme
    from kvship.engine.layers.quantization.writer import is_quantized_weight

    scheme = parse_scheme(config.quantization, config.quantization_config)
    out: dict[str, tuple] = {}
    for name, shape in shapes.items():
        if not is_quantized_weight(name):
            out[name] = (shape, config.dtype, None)
            continue
        base = name.removesuffix(".weight")
        out[name] = (shape, torch.float8_e4m3fn, None)
        if scheme.weight == "block":
            scale_shape = tuple(-(-n // b) for n, b in zip(shape, scheme.block))
            out[f"{base}.weight_scale_inv"] = (scale_shape, torch.float32, DUMMY_FP8_SCALE)
        else:
            out[f"{base}.weight_scale"] = (shape[:1], torch.float32, DUMMY_FP8_SCALE)
        if scheme.activation == "static":
            out[f"{base}.input_scale"] = ((), torch.float32, DUMMY_INPUT_SCALE)
    return out


@register_loader("dummy")
class DummyLoader(ModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig, seed: int = 0, lazy: bool = False) -> None:
        device = next(model.parameters()).device
        tensors = dummy_checkpoint(model_config, seed, device)
        if not lazy:  # the whole model on one device: each tensor whole, one at a time
            tensors = ((name, whole.load()) for name, whole in tensors)
        with torch.no_grad():
            total = len(_with_fp8(model_config, checkpoint_shapes(model_config)))
            fill_from_checkpoint(model, tensors, total, "Generating dummy weights")

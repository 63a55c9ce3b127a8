"""What the engine needs to know about a model, independent of its file format.

``ModelConfig`` is built either from a Hugging Face folder (``config.json`` plus
an optional ``generation_config.json``) or from a GGUF file's metadata.  It is
model-agnostic: every dense decoder of the Llama family fits in it, and the
model class picked by ``architectures[0]`` reads what it needs.  Mixture-of-
Experts models (Qwen2/3-MoE, Mixtral) add one ``MoEConfig`` (``moe``); it is
None for dense models.  GGUF: ``qwen3moe``, ``qwen2moe`` and ``llama`` with
``llama.expert_count`` (Mixtral) files; their sparse layers are the ones with
a router tensor (``blk.N.ffn_gate_inp``).

Rules:
* ``context_len`` is the model's ``max_position_embeddings`` (GGUF:
  ``<arch>.context_length``), lowered to ``--context-length`` when given.  A
  longer ``--context-length`` than the model supports is an error.  Models
  with sliding-window attention are clamped to the window (no backend
  implements sliding windows yet, and within one window attention is exact).
* ``eos_token_ids`` is the union of config.json's ``eos_token_id`` (int or
  list) and generation_config.json's; for GGUF, ``tokenizer.ggml.eos_token_id``.
* ``dtype`` is the compute dtype (``ServerArgs.resolved_dtype``);
  ``checkpoint_dtype`` is what the checkpoint declares (informational).
* ``quantization`` is the weights' quantization method
  (``kvship.engine.layers.quantization``): config.json's
  ``quantization_config.quant_method`` and ``--quantization``, resolved by
  ``resolve_quantization``: a method kvship does not have is refused here,
  while the config is read at startup, naming it and the supported ones.
  GGUF files are dequantized at load: ``unquantized``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from kvship.engine.deepseek_config import DEEPSEEK_ARCHITECTURES, GroupedRouting, MLAConfig
from kvship.engine.layers.quantization.base import resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# GGUF ``general.architecture`` -> the Hugging Face architecture name we register models under.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's MoE routing: top-k weights renormalised (its ``norm_w``) unless ``<arch>.expert_weights_norm`` says
_GGUF_MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

# Architectures whose q/k/v projections carry a bias even when config.json does not say so.
_QKV_BIAS_ARCHS = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"}
# Architectures without any attention bias (config.json's attention_bias is ignored).
_NO_BIAS_ARCHS = {"MistralForCausalLM", "MixtralForCausalLM"}
# Architectures that RMS-normalise q and k per head before RoPE.
_QK_NORM_ARCHS = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
# Architectures whose sliding window applies only when config.json sets use_sliding_window.
_OPT_IN_WINDOW_ARCHS = {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}'; expected one of {sorted(_DTYPES)}") from None


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


@dataclass(frozen=True)
class MoEConfig:
    """The sparse-MLP part of a Mixture-of-Experts decoder (``ModelConfig.moe``; None for dense models).

    Layer ``i`` has experts unless ``i`` is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0``; its other layers are dense MLPs of
    ``ModelConfig.intermediate_size``.  Routing: softmax over the router's
    logits, the ``top_k`` largest, renormalised to sum to 1 when
    ``norm_topk_prob``.  ``shared_expert_intermediate_size`` > 0 adds Qwen2-MoE's
    shared expert (a dense MLP scaled by a sigmoid gate) to every sparse layer.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # DeepSeekMoE's grouped routing (kvship.engine.deepseek_config); None: softmax -> top-k above
    routing: Optional[GroupedRouting] = None

    def is_sparse_layer(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % max(self.decoder_sparse_step, 1) == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> Optional["MoEConfig"]:
        """From config.json (``num_experts`` or Mixtral's ``num_local_experts``); None without experts."""
        arch = (cfg.get("architectures") or [""])[0]
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        if num_experts <= 0:
            return None
        if arch in DEEPSEEK_ARCHITECTURES:  # DeepSeekMoE: dense first layers, un-gated shared experts
            if int(cfg.get("moe_layer_freq") or 1) != 1:
                raise ValueError(f"{arch}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (1 only)")
            width = int(cfg["moe_intermediate_size"])
            return cls(
                num_experts=num_experts,
                top_k=int(cfg["num_experts_per_tok"]),
                intermediate_size=width,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                mlp_only_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
                shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
                routing=GroupedRouting.from_hf_dict(cfg),
            )
        return cls(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            # Mixtral always renormalises its top-k weights
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) or arch == "MixtralForCausalLM",
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )

    @classmethod
    def from_gguf_metadata(cls, garch: str, meta: dict[str, Any], tensor_names: set[str]) -> Optional["MoEConfig"]:
        """From ``<arch>.expert_*`` keys; None without experts.  Sparse layers: those with a router tensor."""
        num_experts = int(meta.get(f"{garch}.expert_count") or 0)
        if num_experts <= 0:
            return None
        layers = int(meta[f"{garch}.block_count"])
        width = meta.get(f"{garch}.expert_feed_forward_length") or meta[f"{garch}.feed_forward_length"]
        norm = meta.get(f"{garch}.expert_weights_norm")
        return cls(
            num_experts=num_experts,
            top_k=int(meta[f"{garch}.expert_used_count"]),
            intermediate_size=int(width),
            norm_topk_prob=bool(_GGUF_MOE_NORM_TOPK.get(garch, True) if norm is None else norm),
            mlp_only_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
            shared_expert_intermediate_size=int(meta.get(f"{garch}.expert_shared_feed_forward_length") or 0),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one dense decoder model (see module docstring)."""

    model_path: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    context_len: int
    dtype: torch.dtype = torch.float32
    rope_scaling: Optional[dict] = field(default=None, compare=False, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always; Llama when config says so)
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias also covers it)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    hidden_act: str = "silu"
    sliding_window: Optional[int] = None
    eos_token_ids: frozenset[int] = frozenset()
    bos_token_id: Optional[int] = None
    checkpoint_dtype: Optional[torch.dtype] = None
    source_format: str = "hf"  # "hf" (config.json) or "gguf"
    moe: Optional[MoEConfig] = None  # Mixture-of-Experts models only
    quantization: str = "unquantized"  # the weights' quantization method (module docstring)
    # config.json's quantization_config (None: an unquantized checkpoint); the method reads its settings
    quantization_config: Optional[dict] = field(default=None, compare=False, hash=False)
    mla: Optional[MLAConfig] = None  # Multi-head Latent Attention (DeepSeek; kvship.engine.deepseek_config)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # --- construction ---------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        dtype: str | torch.dtype = "float32",
        context_length: Optional[int] = None,
        quantization: Optional[str] = None,
    ) -> "ModelConfig":
        """From a Hugging Face folder or a ``.gguf`` file (picked by the path); ``quantization`` is
        ``--quantization``."""
        if os.path.isfile(model_path) and model_path.endswith(".gguf"):
            cfg = cls.from_gguf(model_path, dtype=dtype, context_length=context_length)
            return replace(cfg, quantization=resolve_quantization(None, quantization))
        if os.path.isdir(model_path):
            return cls.from_hf_dir(model_path, dtype=dtype, context_length=context_length, quantization=quantization)
        raise FileNotFoundError(f"model path '{model_path}' is neither a folder nor a .gguf file")

    @classmethod
    def from_hf_dir(
        cls,
        model_dir: str,
        *,
        dtype: str | torch.dtype = "float32",
        context_length: Optional[int] = None,
        quantization: Optional[str] = None,
    ) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir} has no config.json")
        with open(path) as f:
            cfg = json.load(f)
        gen: dict = {}
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf_dict(
            cfg,
            model_path=model_dir,
            generation_config=gen,
            dtype=dtype,
            context_length=context_length,
            quantization=quantization,
        )

    @classmethod
    def from_hf_dict(
        cls,
        cfg: dict,
        *,
        model_path: str = "",
        generation_config: Optional[dict] = None,
        dtype: str | torch.dtype = "float32",
        context_length: Optional[int] = None,
        quantization: Optional[str] = None,
    ) -> "ModelConfig":
        archs = tuple(cfg.get("architectures") or ())
        if not archs:
            raise ValueError(f"config.json of {model_path or 'the model'} names no 'architectures'")
        arch = archs[0]
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params:
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        sliding = cfg.get("sliding_window")
        if arch in _OPT_IN_WINDOW_ARCHS and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = _as_id_set(cfg.get("eos_token_id")) | _as_id_set((generation_config or {}).get("eos_token_id"))
        bos = cfg.get("bos_token_id")
        if bos is None:
            bos = (generation_config or {}).get("bos_token_id")
        ckpt = cfg.get("torch_dtype") or cfg.get("dtype")
        attn_bias = bool(cfg.get("attention_bias", False)) and arch not in _NO_BIAS_ARCHS
        return cls(
            model_path=model_path,
            architectures=archs,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            context_len=_resolve_context_len(max_pos, context_length, sliding),
            dtype=parse_dtype(dtype),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attn_bias or arch in _QKV_BIAS_ARCHS,
            o_proj_bias=attn_bias and arch not in _QKV_BIAS_ARCHS,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in _QK_NORM_ARCHS,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=frozenset(eos),
            bos_token_id=int(bos) if bos is not None else None,
            checkpoint_dtype=_DTYPES.get(ckpt) if isinstance(ckpt, str) else None,
            source_format="hf",
            moe=MoEConfig.from_hf_dict(cfg),
            mla=MLAConfig.from_hf_dict(cfg),
            quantization=_resolved_quantization(cfg, quantization),
            quantization_config=cfg.get("quantization_config"),
        )

    @classmethod
    def from_gguf(
        cls, gguf_path: str, *, dtype: str | torch.dtype = "float32", context_length: Optional[int] = None
    ) -> "ModelConfig":
        from kvship.engine.loaders.gguf_file import gguf_metadata, gguf_reader, rope_freq_factors

        reader = gguf_reader(gguf_path)
        cfg = cls.from_gguf_metadata(
            gguf_metadata(reader),
            {t.name for t in reader.tensors},
            model_path=gguf_path,
            dtype=dtype,
            context_length=context_length,
        )
        factors = rope_freq_factors(reader)
        if factors is not None:
            cfg = replace(cfg, rope_scaling={"rope_type": "freq_factors", "freq_factors": factors})
        return cfg

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        tensor_names: set[str],
        *,
        model_path: str = "",
        dtype: str | torch.dtype = "float32",
        context_length: Optional[int] = None,
    ) -> "ModelConfig":
        """From GGUF key/values (``general.architecture``, ``<arch>.*``, ``tokenizer.ggml.*``).

        Facts the metadata does not state are read off ``tensor_names``: tied
        embeddings (no ``output.weight``) and projection biases.
        """
        garch = meta.get("general.architecture")
        if garch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture '{garch}' is not supported; known: {sorted(GGUF_ARCHITECTURES)}")
        arch = GGUF_ARCHITECTURES[garch]
        moe = MoEConfig.from_gguf_metadata(garch, meta, tensor_names)
        if garch == "llama" and moe is not None:  # llama.cpp writes Mixtral as llama with experts
            arch = "MixtralForCausalLM"

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{garch}.{key}", default)

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("attention.key_length", hidden // heads))
        vocab = get("vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", ()))
        max_pos = int(get("context_length", 2048))
        rope_scaling = None
        if get("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        sliding = get("attention.sliding_window")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            model_path=model_path,
            architectures=(arch,),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            context_len=_resolve_context_len(max_pos, context_length, int(sliding) if sliding else None),
            dtype=parse_dtype(dtype),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm=arch in _QK_NORM_ARCHS,
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=frozenset(_as_id_set(eos)),
            bos_token_id=int(bos) if bos is not None else None,
            source_format="gguf",
            moe=moe,
        )


def _resolved_quantization(cfg: dict, requested: Optional[str]) -> str:
    """The method (``resolve_quantization``), its settings checked here, at startup: an FP8 format kvship
    does not read is refused naming it (docs/quantization.md)."""
    method = resolve_quantization(_checkpoint_quant_method(cfg), requested)
    if method in ("fp8", "compressed-tensors"):
        from kvship.engine.layers.quantization.fp8 import parse_scheme

        parse_scheme(method, cfg.get("quantization_config"))  # every format parse_scheme reads, MoE experts included
    return method


def _checkpoint_quant_method(cfg: dict) -> Optional[str]:
    """config.json's ``quantization_config.quant_method`` (None without a quantization_config); a
    quantization_config that names no method is refused (it cannot be served as unquantized)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if not method:
        raise ValueError(f"config.json has a quantization_config without a quant_method: {qc!r}")
    return str(method)


def _resolve_context_len(max_pos: int, requested: Optional[int], sliding_window: Optional[int]) -> int:
    limit = max_pos
    if sliding_window is not None and sliding_window < limit:
        logger.warning("model uses a sliding window of %d tokens; limiting the context to it", sliding_window)
        limit = sliding_window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--context-length {requested} is longer than the model supports ({limit})")
    return requested

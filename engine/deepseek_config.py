"""The DeepSeek-specific parts of a model's shape: MLA attention (``MLAConfig``) and DeepSeekMoE routing
(``GroupedRouting``), read from config.json (docs/deepseek.md).

``ModelConfig.mla`` is an ``MLAConfig`` for models with Multi-head Latent
Attention (DeepSeek-V2/V2-Lite/V3, Kimi-K2, Moonlight) and None for every
other model; ``MoEConfig.routing`` is a ``GroupedRouting`` for DeepSeekMoE
and None for the softmax top-k of Qwen-MoE / Mixtral.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# architectures with MLA attention and DeepSeekMoE (one model class serves them: kvship.engine.models.deepseek)
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_V3 = "DeepseekV3ForCausalLM"


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention dims.

    Per token and layer the KV cache holds ONE latent row of ``latent_dim =
    kv_lora_rank + qk_rope_head_dim`` values: the normalised compressed KV
    ``c`` (``kv_lora_rank``) then the RoPE'd shared key ``k_pe``.  Query heads
    have ``qk_nope_head_dim + qk_rope_head_dim`` dims and values
    ``v_head_dim``; ``q_lora_rank`` None means a plain ``q_proj`` (V2-Lite).
    ``rope_interleave``: the rotary dims are pairs ``(x0, x1), (x2, x3)...``
    (DeepSeek's checkpoints; V3's config may turn it off).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self, rope_scaling: Optional[dict]) -> float:
        """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling."""
        scale = self.qk_head_dim**-0.5
        rs = rope_scaling or {}
        if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
            m = yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
            scale *= m * m
        return scale

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> Optional["MLAConfig"]:
        """From config.json; None for architectures without MLA."""
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in DEEPSEEK_ARCHITECTURES:
            return None
        q_lora = cfg.get("q_lora_rank")
        return cls(
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            q_lora_rank=int(q_lora) if q_lora else None,
            # V2's code always rotates interleaved pairs; V3's config says (default: interleaved)
            rope_interleave=bool(cfg.get("rope_interleave", True)) if arch == _V3 else True,
        )


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeekMoE's expert choice for router logits ``[M, E]`` (``kvship.engine.models.deepseek``):

    * ``scoring``: ``softmax`` (V2) or ``sigmoid`` (V3) of the logits, in float32;
    * ``topk_method``: ``greedy`` (the top-k scores), ``group_limited_greedy`` (V2: experts of the
      ``topk_group`` groups with the largest max score, of ``n_group``), ``noaux_tc`` (V3: groups ranked by
      the sum of their two largest ``score + e_score_correction_bias``, experts chosen by the biased score);
    * the weights are the unbiased scores of the chosen experts, renormalised when ``norm_topk_prob``,
      times ``routed_scaling_factor``.
    """

    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring function '{self.scoring}' is not supported (softmax, sigmoid)")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(
                f"MoE topk_method '{self.topk_method}' is not supported (greedy, group_limited_greedy, noaux_tc)"
            )
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> Optional["GroupedRouting"]:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in DEEPSEEK_ARCHITECTURES:
            return None
        v3 = arch == _V3
        return cls(
            scoring=str(cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
            topk_method=str(cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )

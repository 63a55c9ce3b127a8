"""DeepSeek's multi-token-prediction (MTP, "nextn") module as an EAGLE-style draft head (docs/deepseek.md, "MTP").

A DeepSeek-V3 checkpoint with ``num_nextn_predict_layers = n > 0`` stores its MTP module as decoder layer
index ``num_hidden_layers`` (``model.layers.<L>.*``; the target's loader never reads it)::

    enorm.weight, hnorm.weight [H]                x = eh_proj([enorm(embed(t)) ; hnorm(f)])
    eh_proj.weight [H, 2H]
    self_attn.* / mlp.* / input_layernorm /       one full DeepSeek decoder block (MLA, DeepSeekMoE or dense)
      post_attention_layernorm
    shared_head.norm.weight [H]                   out = shared_head.norm(block output)
    shared_head.head.weight [V, H]                logits = shared_head.head(out)
    embed_tokens.weight [V, H]                    (a copy of the target's embedding)

As for an EAGLE head (kvship.decode.spec.eagle_head), a draft *entry* at position ``j`` holds the token
``t_{j+1}`` and the target's final (normed) hidden state ``f_j``; its output predicts ``t_{j+2}`` and is the
next draft step's ``f``.  Only the first MTP layer is used, for every draft step (a chain of further MTP
layers, ``n > 1``, is not run).  ``embed_tokens`` and ``shared_head.head`` copies equal to the target's
embedding / LM head are shared with the target (no memory); a copy that differs is loaded as the head's
own.  The block's attention keeps its own one-layer latent pool (``MLAKVPool``) with an MLA backend, in the
target's KV dtype; an FP8 draft pool takes the MTP layer's own K scale from the checkpoint (1.0 without one;
docs/deepseek.md, "FP8 latent cache").
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from kvship.engine.attention.base import AttentionContext
from kvship.engine.deepseek_config import DEEPSEEK_ARCHITECTURES
from kvship.engine.forward_batch import ForwardBatch
from kvship.engine.layers.embedding import LMHead, VocabEmbedding
from kvship.engine.layers.linear import Linear
from kvship.engine.layers.moe.layer import FusedMoE
from kvship.engine.layers.rmsnorm import RMSNorm
from kvship.engine.mem.kv_scales import KV_SCALE_SUFFIXES, read_latent_scales
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.model_config import ModelConfig
from kvship.engine.models.deepseek import DeepseekDecoderLayer, DeepseekRotary, DeepseekV2ForCausalLM

# ``mlp.experts.<N>.<proj>.<weight | weight_scale_inv>`` of the MTP block
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight(?:_scale_inv)?)$")
_EXPERT_PARAM = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down")}
# not parameters: the RoPE table, and KV-cache scales (read by ``build_mtp_head`` for the draft pool)
_IGNORED = ("rotary_emb.inv_freq",) + KV_SCALE_SUFFIXES


def read_config(path: str) -> Optional[dict]:
    """``config.json`` of the folder at ``path`` when it is a DeepSeek checkpoint, else None."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        cfg = json.load(f)
    arch = (cfg.get("architectures") or [""])[0]
    return cfg if arch in DEEPSEEK_ARCHITECTURES else None


def mtp_layers(path: str) -> int:
    """How many MTP layers the DeepSeek checkpoint at ``path`` declares (0: none, or not a DeepSeek folder)."""
    cfg = read_config(path)
    return int((cfg or {}).get("num_nextn_predict_layers") or 0)


def check_mtp_target(path: str, variant: str, target: ModelConfig) -> None:
    """ValueError unless the checkpoint at ``path`` has an MTP module that can draft for ``target``."""
    if variant != "eagle":
        raise ValueError(
            f"{path} is a DeepSeek checkpoint: its MTP module drafts under --speculative-algorithm eagle "
            f"(not {variant}; docs/deepseek.md)"
        )
    cfg = read_config(path) or {}
    if mtp_layers(path) < 1:
        raise ValueError(
            f"{path} declares no MTP layer (num_nextn_predict_layers is 0): nothing to draft with "
            "(docs/deepseek.md, MTP)"
        )
    if target.mla is None:
        raise ValueError(f"the MTP module of {path} drafts for a DeepSeek (MLA) target only")
    for key, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if int(cfg.get(key, -1)) != want:
            raise ValueError(f"MTP checkpoint {path}: {key} {cfg.get(key)} != the target's {want}")


class _SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        if own_head:
            self.head = LMHead(config.vocab_size, config.hidden_size, config.dtype)


class DeepseekMTPHead(DeepseekDecoderLayer):
    """The MTP module (module docstring): a DeepSeek decoder block with ``enorm`` / ``hnorm`` / ``eh_proj``
    before it and ``shared_head`` after it; parameter names are the checkpoint's below ``model.layers.<L>.``.

    It has the interface of ``eagle_head.EagleHead`` that the EAGLE drafter and its tree loop use: ``cfg``,
    ``eagle3`` (False), ``project``, ``forward``, ``logits``, ``to_target_ids``, ``draft_attention``."""

    eagle3 = False

    def __init__(
        self,
        cfg: Any,
        target_config: ModelConfig,
        layer_index: int,
        target_embed: VocabEmbedding,
        target_head: LMHead,
        own: tuple[bool, bool],
        latent_scale: float = 1.0,
    ):
        mc = target_config
        mla = mc.mla
        assert mla is not None
        rotary = DeepseekRotary(
            mla.qk_rope_head_dim, max(mc.context_len + 64, 1), mc.rope_theta, mc.rope_scaling, mla.rope_interleave
        )
        super().__init__(mc, layer_index, rotary, kv_layer_id=0)
        self.rotary = rotary
        self.cfg = cfg
        self.layer_index = layer_index
        self.latent_scale = latent_scale  # the draft pool's FP8 dequantization scale (unused by other dtypes)
        h = mc.hidden_size
        self.enorm = RMSNorm(h, mc.rms_norm_eps, mc.dtype)
        self.hnorm = RMSNorm(h, mc.rms_norm_eps, mc.dtype)
        self.eh_proj = Linear(2 * h, h, dtype=mc.dtype)
        own_embed, own_head = own
        self.shared_head = _SharedHead(mc, own_head)
        # lists keep the target's modules out of this head's parameters
        self._embed = [target_embed]
        if own_embed:
            self.embed_tokens = VocabEmbedding(mc.vocab_size, h, mc.dtype)
            self._embed = [self.embed_tokens]
        self._head = [self.shared_head.head if own_head else target_head]

    # --- loading -----------------------------------------------------------
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from the MTP layer's tensors (names below ``model.layers.<L>.``); a missing or
        unknown tensor is an error."""
        params = dict(self.named_parameters())
        stacked = [(ck, pk, sid) for pk, ck, sid in DeepseekV2ForCausalLM.stacked_params_mapping]
        filled: set[str] = set()
        for name, t in tensors.items():
            if name.endswith(_IGNORED):
                continue
            m = _EXPERT_RE.match(name)
            if m is not None:
                prefix, part = _EXPERT_PARAM[m.group(2)]
                pname, shard = f"mlp.experts.{prefix}_{m.group(3)}", (int(m.group(1)), part)
            else:
                pname, shard = name, None
                for ck, pk, sid in stacked:
                    if f".{ck}." in name:
                        pname, shard = name.replace(f".{ck}.", f".{pk}."), sid
                        break
            p = params.get(pname)
            if p is None:
                raise ValueError(f"MTP tensor 'model.layers.{self.layer_index}.{name}' matches no parameter")
            p.weight_loader(p, t, shard) if shard is not None else p.weight_loader(p, t)
            filled.add(pname if shard is None else f"{pname}#{shard}")
        missing = self._expected() - filled
        if missing:
            raise ValueError(f"the MTP layer model.layers.{self.layer_index} lacks {sorted(missing)[:8]}")

    def _expected(self) -> set[str]:
        stacked: dict[str, list] = {}
        for pk, _, sid in DeepseekV2ForCausalLM.stacked_params_mapping:
            stacked.setdefault(pk, []).append(sid)
        moe: dict[str, list] = {}
        for mname, module in self.named_modules():
            if isinstance(module, FusedMoE):
                for attr, shards in module.expected_shards().items():
                    moe[f"{mname}.{attr}"] = shards
        out: set[str] = set()
        for name, _ in self.named_parameters():
            part = name.split(".")[-2] if "." in name else ""
            if name in moe:
                out.update(f"{name}#{s}" for s in moe[name])
            elif part in stacked:
                out.update(f"{name}#{s}" for s in stacked[part])
            else:
                out.add(name)
        return out

    # --- the EAGLE head interface ------------------------------------------
    def draft_attention(
        self, num_slots: int, target_runner: Any, r2t: Any, max_requests: int, graph_bs: tuple[int, ...]
    ) -> tuple[MLAKVPool, Any]:
        """The block's one-layer latent pool (page size 1) and an MLA backend (the target's
        ``--attention-backend``) reading it through ``r2t``.  ``graph_bs``: the draft graphs' batch sizes (given
        also when graphs are off), by which the ``triton`` backend picks its decode splits, so eager and replayed
        draft steps compute alike; with ``triton`` the drafter captures its draft steps in CUDA graphs
        (kvship.decode.spec.graphs.DraftGraphs), with ``torch_native`` they run eagerly."""
        from kvship.engine.attention.mla_registry import create_mla_attention_backend

        r = target_runner
        mla = r.model_config.mla
        pool = MLAKVPool(
            num_slots, 1, r.kv_dtype, mla.kv_lora_rank, mla.qk_rope_head_dim, 1, r.device, [self.latent_scale]
        )
        ctx = AttentionContext(
            device=r.device,
            dtype=r.dtype,
            kv_dtype=r.kv_dtype,
            num_heads=r.model_config.num_attention_heads,
            num_kv_heads=1,
            head_dim=mla.latent_dim,
            page_size=1,
            req_to_token_pool=r2t,
            max_running_requests=max_requests,
            cuda_graph_bs=graph_bs,
        )
        return pool, create_mla_attention_backend(r.server_args.attention_backend, ctx)

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The per-position feature: the target's final hidden state as it is."""
        return target_hidden

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for logits, hidden fed to the next draft step), one row per entry: the same tensor."""
        emb = self._embed[0](input_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(feats.to(emb.dtype))], dim=-1))
        h, residual = self.self_attn(positions, x, None, self.input_layernorm, fb)
        h, residual = self.mlp.forward_normed(self.post_attention_layernorm, h, residual)
        out, _ = self.shared_head.norm(h, residual)
        return out, out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head[0](hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


def _read_layer(path: str, layer_index: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of decoder layer ``layer_index``, named below ``model.layers.<i>.`` (only
    those are read)."""
    from safetensors import safe_open

    from kvship.engine.loaders.safetensors_loader import safetensors_files

    prefix = f"model.layers.{layer_index}."
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(f, framework="pt", device="cpu") as st:
            for k in st.keys():
                if k.startswith(prefix):
                    out[k[len(prefix) :]] = st.get_tensor(k)
    if not out:
        raise ValueError(f"{path} declares an MTP layer but holds no tensor {prefix}* (docs/deepseek.md, MTP)")
    return out


def _same(copy: Optional[torch.Tensor], weight: Optional[torch.Tensor]) -> bool:
    """The checkpoint's ``copy`` equals the target's ``weight`` (then the head shares it)."""
    if copy is None:
        return True
    if weight is None or tuple(copy.shape) != tuple(weight.shape):
        return False
    return bool(torch.equal(copy.to(weight.device, weight.dtype), weight))


def build_mtp_head(
    path: str, cfg: Any, target_model: nn.Module, target_config: ModelConfig, device: torch.device
) -> DeepseekMTPHead:
    """The first MTP layer of the DeepSeek checkpoint at ``path`` as a draft head for ``target_model``
    (``cfg``: the drafter's head config, ``eagle_head.EagleConfig``)."""
    check_mtp_target(path, "eagle", target_config)
    layer_index = int((read_config(path) or {})["num_hidden_layers"])
    tensors = _read_layer(path, layer_index)
    # the MTP layer's K scale for an FP8 draft pool (its latent rows; kvship.engine.mem.kv_scales), else 1.0
    scales = read_latent_scales(path, layer_index, mtp_layers(path))
    latent_scale = scales[layer_index] if scales is not None else 1.0
    embed, head = target_model.model.embed_tokens, target_model.lm_head
    own_embed = not _same(tensors.get("embed_tokens.weight"), getattr(embed, "weight", None))
    own_head = not _same(tensors.get("shared_head.head.weight"), getattr(head, "weight", None))
    if not own_embed:
        tensors.pop("embed_tokens.weight", None)
    if not own_head:
        tensors.pop("shared_head.head.weight", None)
    with torch.device(device):
        mtp = DeepseekMTPHead(cfg, target_config, layer_index, embed, head, (own_embed, own_head), latent_scale)
    mtp.load(tensors)
    mtp.self_attn.process_weights_after_loading()  # a quantized kv_b_proj dequantized once (docs/deepseek.md)
    return mtp.eval()

"""EAGLE and EAGLE-3 draft heads, read from the public checkpoint layout (docs/speculative.md).

A head drafts from the target's hidden state ``f_j`` at position ``j`` and the
token ``t_{j+1}``; its output predicts the next hidden state, whose logits
give candidates for ``t_{j+2}``.  A draft *entry* at position ``j`` therefore
holds ``(t_{j+1}, f_j)``, and the head's one decoder layer keeps K/V per entry.

EAGLE (one folder: ``config.json`` of a one-layer Llama plus the tensors)::

    fc.weight [H, 2H] (+ fc.bias)             x = fc([embed(t) ; f])
    layers.0.self_attn.{q,k,v,o}_proj.weight  one decoder layer, no input norm
    layers.0.post_attention_layernorm.weight  (layers.0.input_layernorm only if present)
    layers.0.mlp.{gate,up,down}_proj.weight   out = layer output (hidden + residual)
    [embed_tokens.weight] [lm_head.weight]    logits = lm_head(out); the target's when absent

EAGLE-3::

    fc.weight [H, n_aux * H_target]           f = fc([aux_0 ; aux_1 ; aux_2]) (the target's layer outputs)
    midlayer.input_layernorm.weight           on the token embedding
    midlayer.hidden_norm.weight               on the hidden state; q/k/v read [emb ; hid] (2H wide)
    midlayer.self_attn.* / mlp.* / post_attention_layernorm.weight
    norm.weight, lm_head.weight [V_draft, H]  logits over the draft vocabulary
    d2t [V_draft] (optional)                  target id = draft id + d2t[draft id]

``eagle_aux_hidden_state_layer_ids`` (top level or inside ``eagle_config``)
names the target layers whose outputs feed ``fc``; default ``(1, L // 2 - 1,
L - 4)`` of an ``L``-layer target (the inputs of layers 2, L/2 and L-3).  The
next draft step's hidden state is the layer output before the final norm.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvship.engine.attention.base import AttentionContext, create_attention_backend
from kvship.engine.forward_batch import ForwardBatch
from kvship.engine.layers.attention import Attention
from kvship.engine.layers.embedding import LMHead, VocabEmbedding
from kvship.engine.layers.linear import Linear, StackedLinear
from kvship.engine.layers.rmsnorm import RMSNorm
from kvship.engine.layers.rotary import RotaryEmbedding
from kvship.engine.mem.pools import KVPool, ReqToTokenPool
from kvship.engine.model_config import ModelConfig
from kvship.engine.models.deepseek_mtp import build_mtp_head, check_mtp_target
from kvship.engine.models.deepseek_mtp import read_config as read_deepseek_config
from kvship.engine.models.llama import LlamaMLP


def read_checkpoint(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE head folder (``*.safetensors`` or ``pytorch_model*.bin``), ``model.`` prefix
    dropped; with ``prefix`` only those whose name starts with it (safetensors files read no other tensor)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for k in st.keys():
                    if k.removeprefix("model.").startswith(prefix):
                        tensors[k] = st.get_tensor(k)
    else:
        files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
        if not files:
            raise FileNotFoundError(f"EAGLE head {path}: no *.safetensors or pytorch_model*.bin weights")
        for f in files:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.removeprefix("model.").startswith(prefix)}


@dataclass(frozen=True)
class EagleConfig:
    variant: str  # "eagle" or "eagle3"
    model: ModelConfig  # the head's decoder-layer shape (its config.json)
    aux_layer_ids: tuple[int, ...]  # eagle3: target layers feeding fc; () for eagle
    draft_vocab_size: int
    fc_in: int

    @classmethod
    def load(cls, path: str, variant: str, target: ModelConfig, dtype: torch.dtype) -> "EagleConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"EAGLE head {path}: no config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        if read_deepseek_config(path) is not None:  # a DeepSeek checkpoint: its MTP module is the head
            check_mtp_target(path, variant, target)
            return cls("eagle", target, (), target.vocab_size, 2 * target.hidden_size)
        if target.mla is not None:
            raise ValueError(
                f"{path} is no DeepSeek checkpoint: a DeepSeek target drafts with its checkpoint's MTP module "
                "(--speculative-draft-model-path <the DeepSeek checkpoint folder>; docs/deepseek.md)"
            )
        arch = (cfg.get("architectures") or ["LlamaForCausalLMEagle"])[0]
        if ("eagle3" in arch.lower()) != (variant == "eagle3"):
            raise ValueError(
                f"EAGLE head {path} is a {arch}: use --speculative-algorithm "
                f"{'eagle3' if 'eagle3' in arch.lower() else 'eagle'}"
            )
        cfg.setdefault("num_hidden_layers", 1)
        cfg.setdefault("vocab_size", target.vocab_size)
        mc = ModelConfig.from_hf_dict({**cfg, "architectures": [arch]}, model_path=path, dtype=dtype)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE head {path}: vocab_size {mc.vocab_size} != the target's {target.vocab_size}")
        if variant == "eagle":
            if mc.hidden_size != target.hidden_size:
                raise ValueError(
                    f"EAGLE head {path}: hidden_size {mc.hidden_size} != the target's {target.hidden_size}"
                )
            return cls(variant, mc, (), mc.vocab_size, 2 * mc.hidden_size)
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        n = target.num_hidden_layers
        if ids:
            aux = tuple(int(i) for i in ids)
            if len(set(aux)) != len(aux) or not all(0 <= i < n for i in aux):
                raise ValueError(f"EAGLE-3 head {path}: aux layers {list(aux)} are not distinct layers of 0..{n - 1}")
        else:  # small targets: clamped into the model, repeats dropped
            aux = tuple(dict.fromkeys(max(0, min(i, n - 1)) for i in (1, n // 2 - 1, n - 4)))
        target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"EAGLE-3 head {path}: target_hidden_size {target_hidden} != {target.hidden_size}")
        draft_vocab = int(cfg.get("draft_vocab_size") or mc.vocab_size)
        return cls(variant, mc, aux, draft_vocab, len(aux) * target_hidden)


class _EagleAttention(nn.Module):
    def __init__(self, mc: ModelConfig, input_size: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.q_size, self.kv_size = mc.q_size, mc.kv_size
        self.qkv_proj = StackedLinear(
            input_size, {"q": mc.q_size, "k": mc.kv_size, "v": mc.kv_size}, bias=mc.attention_bias, dtype=mc.dtype
        )
        self.o_proj = Linear(mc.q_size, mc.hidden_size, bias=mc.o_proj_bias, dtype=mc.dtype)
        self._rotary = [rotary]
        self.attn = Attention(0, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn.rope_and_forward(
            self._rotary[0],
            positions,
            q.reshape(-1, self.num_heads, self.head_dim),
            k.reshape(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim),
            fb,
        )
        return self.o_proj(out)


class _EagleLayer(nn.Module):
    def __init__(self, mc: ModelConfig, attn_in: int, rotary: RotaryEmbedding, norms: tuple[str, ...]):
        super().__init__()
        self.self_attn = _EagleAttention(mc, attn_in, rotary)
        self.mlp = LlamaMLP(mc)
        for name in norms:
            setattr(self, name, RMSNorm(mc.hidden_size, mc.rms_norm_eps, mc.dtype))
        self.has_input_norm = "input_layernorm" in norms


class EagleHead(nn.Module):
    """One EAGLE / EAGLE-3 head; the target's embedding and LM head are used where the checkpoint has none."""

    def __init__(
        self, cfg: EagleConfig, keys: set[str], target_embed: VocabEmbedding, target_head: LMHead, max_position: int
    ):
        super().__init__()
        mc = cfg.model
        self.cfg = cfg
        self.eagle3 = cfg.variant == "eagle3"
        h = mc.hidden_size
        self.rotary = RotaryEmbedding(mc.head_dim, max(max_position, 1), mc.rope_theta, mc.rope_scaling)
        fc_bias = "fc.bias" in keys
        self.fc = Linear(cfg.fc_in, h, bias=fc_bias, dtype=mc.dtype)
        if self.eagle3:
            self.midlayer = _EagleLayer(
                mc, 2 * h, self.rotary, ("input_layernorm", "hidden_norm", "post_attention_layernorm")
            )
            self.norm = RMSNorm(h, mc.rms_norm_eps, mc.dtype)
        else:
            norms = ("post_attention_layernorm",)
            if "layers.0.input_layernorm.weight" in keys:
                norms = ("input_layernorm", *norms)
            self.layers = nn.ModuleList([_EagleLayer(mc, h, self.rotary, norms)])
        # a list keeps the target's modules out of this head's parameters
        self._embed = [target_embed]
        if "embed_tokens.weight" in keys:
            self.embed_tokens = VocabEmbedding(mc.vocab_size, h, mc.dtype)
            self._embed = [self.embed_tokens]
        self._head = [target_head]
        if "lm_head.weight" in keys:
            self.lm_head = LMHead(cfg.draft_vocab_size, h, mc.dtype)
            self._head = [self.lm_head]
        elif cfg.draft_vocab_size != mc.vocab_size:
            raise ValueError("EAGLE-3 head with a reduced draft vocabulary but no lm_head.weight")
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)

    # --- loading -----------------------------------------------------------
    _STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"))
    _STACKED += (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
    _IGNORED = ("t2d", "rotary_emb.inv_freq")

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from the checkpoint; a missing or unknown tensor is an error."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, t in tensors.items():
            if name.endswith(self._IGNORED):
                continue
            if name == "d2t":
                if t.numel() != self.d2t.numel():
                    raise ValueError(f"d2t has {t.numel()} entries, draft vocabulary {self.d2t.numel()}")
                self.d2t.copy_(t.to(torch.int64))
                continue
            shard: object = None
            pname = name
            for ck, pk, sid in self._STACKED:
                if f".{ck}." in name:
                    pname, shard = name.replace(f".{ck}.", f".{pk}."), sid
                    break
            p = params.get(pname)
            if p is None:
                raise ValueError(f"EAGLE head tensor '{name}' matches no parameter")
            loaded = t.to(p.dtype)
            p.weight_loader(p, loaded, shard) if shard is not None else p.weight_loader(p, loaded)
            filled.add(pname if shard is None else f"{pname}#{shard}")
        want = set()
        for pname, _ in params.items():
            part = pname.split(".")[-2]
            if part == "qkv_proj":
                want |= {f"{pname}#q", f"{pname}#k", f"{pname}#v"}
            elif part == "gate_up_proj":
                want |= {f"{pname}#0", f"{pname}#1"}
            else:
                want.add(pname)
        missing = want - filled
        if missing:
            raise ValueError(f"EAGLE head checkpoint lacks {sorted(missing)}")

    # --- compute -----------------------------------------------------------
    def draft_attention(
        self, num_slots: int, target_runner: Any, r2t: ReqToTokenPool, max_requests: int, graph_bs: tuple[int, ...]
    ) -> tuple[KVPool, Any]:
        """The head's one-layer KV pool (page size 1) and the attention backend of its draft forwards (Triton
        on CUDA: the draft steps' decode attention is graph-capturable; torch_native elsewhere)."""
        r, mc = target_runner, self.cfg.model
        pool = KVPool(num_slots, 1, r.kv_dtype, mc.num_key_value_heads, mc.head_dim, 1, r.device)
        ctx = AttentionContext(
            device=r.device,
            dtype=r.dtype,
            kv_dtype=r.kv_dtype,
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            page_size=1,
            req_to_token_pool=r2t,
            max_running_requests=max_requests,
            cuda_graph_bs=graph_bs,
        )
        return pool, create_attention_backend(
            "triton" if torch.device(r.device).type == "cuda" else "torch_native", ctx
        )

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The per-position feature kept for drafting: the target's hidden state (EAGLE) or fc(aux) (EAGLE-3)."""
        return self.fc(target_hidden) if self.eagle3 else target_hidden

    def forward(
        self, input_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for logits, hidden fed to the next draft step), one row per entry."""
        emb = self._embed[0](input_ids)
        if self.eagle3:
            layer = self.midlayer
            residual = feats
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(feats)], dim=-1)
        else:
            layer = self.layers[0]
            x = self.fc(torch.cat([emb, feats.to(emb.dtype)], dim=-1))
            residual = x
            if layer.has_input_norm:
                x = layer.input_layernorm(x)
        h = layer.self_attn(positions, x, fb)
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
        if self.eagle3:
            return self.norm(h, residual)
        out = h + residual
        return out, out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits over the draft vocabulary (the target's for EAGLE)."""
        return self._head[0](hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.eagle3 else draft_ids


class FeatureProjection(nn.Module):
    """``EagleHead.project`` alone: what a prefill worker loads of a head to compute the per-slot features
    a decode worker's drafter reads (docs/speculative.md, "PD").  EAGLE: the target's final hidden state
    as it is (no weights); EAGLE-3: the head's ``fc`` over the auxiliary layers (only ``fc.*`` is read)."""

    def __init__(self, cfg: EagleConfig, fc_tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.eagle3 = cfg.variant == "eagle3"
        if self.eagle3:
            self.fc = Linear(cfg.fc_in, cfg.model.hidden_size, bias="fc.bias" in fc_tensors, dtype=cfg.model.dtype)
            if "fc.weight" not in fc_tensors:
                raise ValueError("EAGLE-3 head checkpoint lacks fc.weight")
            for name, p in self.fc.named_parameters():
                t = fc_tensors[f"fc.{name}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"EAGLE-3 head fc.{name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.weight_loader(p, t.to(p.dtype))

    def forward(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden) if self.eagle3 else target_hidden


def feature_kind(cfg: EagleConfig, fc: "nn.Module | None") -> str:
    """What a head's per-slot features are, for the PD handshake: equal kinds mean equal features.

    EAGLE: the target's final hidden state, whatever the head.  EAGLE-3: ``fc`` of the auxiliary layers,
    so the layer ids and a digest of ``fc``'s parameters (as loaded) name it."""
    if cfg.variant != "eagle3":
        return "eagle:final-hidden"
    import hashlib

    digest = hashlib.sha256()
    for _, p in sorted(fc.named_parameters()):  # type: ignore[union-attr]
        digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    layers = ",".join(str(i) for i in cfg.aux_layer_ids)
    return f"eagle3:layers={layers}:fc={digest.hexdigest()[:16]}"


def build_projection(path: str, variant: str, target_config: ModelConfig, device: torch.device) -> FeatureProjection:
    """The ``FeatureProjection`` of the head at ``path`` for a target of ``target_config``."""
    cfg = EagleConfig.load(path, variant, target_config, target_config.dtype)
    tensors = read_checkpoint(path, prefix="fc.") if variant == "eagle3" else {}
    with torch.device(device):
        proj = FeatureProjection(cfg, tensors)
    return proj.eval()


def build_head(
    path: str, variant: str, target_model: nn.Module, target_config: ModelConfig, device: torch.device
) -> EagleHead:
    """Load the head at ``path`` for a Llama-family target (``target_model.model.embed_tokens`` / ``lm_head``);
    a DeepSeek checkpoint's MTP module for a DeepSeek target (kvship.engine.models.deepseek_mtp)."""
    cfg = EagleConfig.load(path, variant, target_config, target_config.dtype)
    if read_deepseek_config(path) is not None:
        return build_mtp_head(path, cfg, target_model, target_config, device)  # type: ignore[return-value]
    tensors = read_checkpoint(path)
    with torch.device(device):
        head = EagleHead(
            cfg, set(tensors), target_model.model.embed_tokens, target_model.lm_head, target_config.context_len + 64
        )
    head.load(tensors)
    return head.eval()


def save_head(path: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write a head in the checkpoint layout above: ``config.json`` + ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


def head_config(variant: str, target: ModelConfig, **extra: object) -> dict:
    """A head's config.json for ``target``: one Llama layer of the target's shape (``extra`` overrides)."""
    cfg: dict = {
        "architectures": ["LlamaForCausalLMEagle3" if variant == "eagle3" else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "hidden_act": target.hidden_act,
    }
    if target.rope_scaling is not None:
        cfg["rope_scaling"] = dict(target.rope_scaling)
    cfg.update(extra)
    return cfg


def head_tensor_shapes(cfg: dict, n_aux: int = 3) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a head of ``cfg`` (from ``head_config``) has, without embedding."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    eagle3 = "eagle3" in cfg["architectures"][0].lower()
    pre = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * h if eagle3 else h
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, n_aux * h if eagle3 else 2 * h),
        f"{pre}self_attn.q_proj.weight": (q, attn_in),
        f"{pre}self_attn.k_proj.weight": (kv, attn_in),
        f"{pre}self_attn.v_proj.weight": (kv, attn_in),
        f"{pre}self_attn.o_proj.weight": (h, q),
        f"{pre}mlp.gate_proj.weight": (inter, h),
        f"{pre}mlp.up_proj.weight": (inter, h),
        f"{pre}mlp.down_proj.weight": (h, inter),
        f"{pre}post_attention_layernorm.weight": (h,),
    }
    if eagle3:
        shapes[f"{pre}input_layernorm.weight"] = (h,)
        shapes[f"{pre}hidden_norm.weight"] = (h,)
        shapes["norm.weight"] = (h,)
        shapes["lm_head.weight"] = (int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), h)
    else:
        shapes["fc.bias"] = (h,)
    return shapes

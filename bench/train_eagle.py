"""Train an EAGLE head for the embedded SmolLM2 by self-distillation, on CPU in minutes.

1. The target (the embedded SmolLM2 GGUF, our engine, greedy) answers a varied
   set of training prompts written below (instructions, questions, lists, code,
   rewriting), through the unified scheduler.
2. One target forward over each prompt + answer gives the final hidden state
   ``f_j`` of every position (``ForwardBatch.capture_hidden``, the same
   feature an EAGLE speculator reads at serving time).
3. The head (``fc`` over [embedding ; feature] -> one Llama decoder layer,
   the target's tied embedding / LM head) learns, for entry ``j`` =
   ``(t_{j+1}, f_j)``, to predict ``f_{j+1}`` (smooth L1) and the target's
   next-token distribution ``softmax(lm_head(f_{j+1}))`` (cross-entropy), with
   a little uniform noise on the input features so that it also drafts from
   its own predictions.  Its decoder layer starts from the target's last one.
4. The head is written in the public EAGLE checkpoint layout
   (``config.json`` + ``model.safetensors``; decode/spec/eagle_head.py), ready
   for ``--speculative-algorithm eagle --speculative-draft-model-path``.

The time budget (``--minutes``) bounds the training loop; the prompt set is
disjoint from bench/spec_acceptance.py's held-out tasks.

    python bench/train_eagle.py --out /tmp/smollm2-eagle --minutes 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("train_eagle")

_TOPICS = [
    "the water cycle",
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "how vaccines work",
    "the stock market",
    "machine learning",
    "the Roman Empire",
    "volcanoes",
    "climate change",
    "the human heart",
    "electric cars",
    "coffee",
    "the moon landing",
    "honey bees",
    "the internet",
    "earthquakes",
    "the printing press",
    "rainforests",
    "the immune system",
    "solar panels",
    "ancient Egypt",
    "chess",
    "the Olympic Games",
    "plate tectonics",
    "the periodic table",
    "jazz music",
    "recycling",
    "the Great Wall of China",
    "dinosaurs",
    "democracy",
    "the speed of light",
    "bread baking",
    "ocean tides",
    "the Renaissance",
    "antibiotics",
    "wind turbines",
    "penguins",
    "the Silk Road",
    "sleep",
]
_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write three short facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Summarize the history of {t} in a paragraph.",
    "Give a numbered list of five key terms about {t}, with one line each.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "Describe {t} in exactly three sentences.",
]
# copy-and-change and code prompts, none of them one of bench/spec_acceptance.py's held-out tasks
_LISTS = [
    "Monday, Tuesday, Wednesday, Thursday, Friday",
    "red, orange, yellow, green, blue, indigo, violet",
    "Paris, London, Berlin, Madrid, Rome, Vienna",
    "dog, cat, horse, cow, sheep, goat, pig",
    "January, February, March, April, May, June",
    "carrot, potato, onion, garlic, pepper, tomato",
]
_FUNCS = [
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "def first(items):\n    for item in items:\n        return item\n    return None\n",
    "def square_all(xs):\n    out = []\n    for x in xs:\n        out.append(x * x)\n    return out\n",
]
_EXTRA = [
    "List the days of the week, then list them again in reverse order.",
    "Write a Python function that returns the factorial of n, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a JavaScript function that sums an array of numbers.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Give me a shopping list for a pancake breakfast.",
    "Rewrite this sentence in the passive voice: The chef cooked a delicious meal.",
    "Count from one to twenty in words.",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "List five colors and a fruit of each color.",
    "Here is a list: red, green, blue, yellow. Write it again with each color in capitals.",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Give step-by-step instructions to boil an egg.",
    "Write a short email asking a colleague to reschedule a meeting.",
    "def add(a, b):\n    return a + b\n\nRewrite this function with type hints and a docstring.",
]


def training_prompts(limit: int) -> list[str]:
    """Up to ``limit`` prompts: the first 56 as in the first runs (16 topics x 5 templates, half of them, and
    the extras), then the copy/code prompts and the other topic x template pairs."""
    first_topics, first_templates = _TOPICS[:16], _TEMPLATES[:5]
    pairs = [(i, j) for i in range(len(_TOPICS)) for j in range(len(_TEMPLATES)) if (i + j) % 2 == 0]
    first = [first_templates[j].format(t=first_topics[i]) for i, j in pairs if i < 16 and j < 5]
    later = [_TEMPLATES[j].format(t=_TOPICS[i]) for i, j in pairs if i >= 16 or j >= 5]
    copies = [f"Here is a list: {lst}. Write it again in reverse order." for lst in _LISTS]
    copies += [f"Here is a list: {lst}. Write it again, one item per line, numbered." for lst in _LISTS]
    code = [f"{fn}\nRewrite this function exactly, adding a docstring." for fn in _FUNCS]
    code += [f"{fn}\nRewrite this function with type hints." for fn in _FUNCS]
    return (first + _EXTRA + copies + code + later)[:limit]


def generate(sa: Any, runner: Any, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy answers of the target, all prompts in one scheduler (its prefix cache off: the pool ends empty)."""
    import dataclasses

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    out: list = []
    sa = dataclasses.replace(sa, disable_radix_cache=True)
    sched = scheduler_for_mode("unified")(sa, runner, None, out.extend)
    for i, ids in enumerate(prompt_ids):
        sched.submit(GenerateRequest(f"g{i}", ids, SamplingParams(max_new_tokens=max_new, temperature=0.0)))
    done: set[str] = set()
    while len(done) < len(prompt_ids):
        n = len(out)
        sched.step()
        done |= {c.rid for c in out[n:] if c.finished}
    got: dict[str, list[int]] = {}
    for c in out:
        got.setdefault(c.rid, []).extend(c.token_ids)
    return [got.get(f"g{i}", []) for i in range(len(prompt_ids))]


def target_features(runner: Any, ids: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden state at every position of ``ids``: ``[len(ids), H]``."""
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch

    n = len(ids)
    row = runner.req_to_token_pool.alloc()
    locs = runner.allocator.alloc(n)
    try:
        runner.req_to_token_pool.write(row, 0, locs)
        fb = build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=ids,
            positions=torch.arange(n),
            req_pool_indices=[row],
            seq_lens=[n],
            seq_lens_cpu=[n],
            out_cache_loc=locs,
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
            extend_lens=[n],
            prefix_lens=[0],
            capture_hidden=(),
        )
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(fb)
            out = runner.model(fb.input_ids, fb.positions, fb)
        return out.hidden_states.float().clone()
    finally:
        runner.allocator.free(locs)
        runner.req_to_token_pool.free(row)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class TrainHead(nn.Module):
    """The EAGLE head's math (decode/spec/eagle_head.py, variant eagle) in plain trainable torch."""

    def __init__(self, mc: Any, last_layer: dict[str, torch.Tensor]):
        super().__init__()
        h, hd = mc.hidden_size, mc.head_dim
        self.nh, self.nkv, self.hd, self.eps = mc.num_attention_heads, mc.num_key_value_heads, hd, mc.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():  # start by passing the feature through (plus a little of the token)
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.weight[:, :h].normal_(0.0, 0.02)
            self.fc.bias.zero_()
        self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.float().clone()) for k, v in last_layer.items()})
        inv = 1.0 / (mc.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = torch.outer(pos.float(), self.inv_freq)
        cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None, :], torch.cat([f.sin(), f.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def forward(self, emb: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        p = self.p
        T = emb.shape[0]
        x = self.fc(torch.cat([emb, feats], dim=-1))
        q = (x @ p["self_attn_q_proj_weight"].T).view(T, self.nh, self.hd)
        k = (x @ p["self_attn_k_proj_weight"].T).view(T, self.nkv, self.hd)
        v = (x @ p["self_attn_v_proj_weight"].T).view(T, self.nkv, self.hd)
        pos = torch.arange(T)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        a = a.transpose(0, 1).reshape(T, -1) @ p["self_attn_o_proj_weight"].T
        r = x + a
        n = _rms(r, p["post_attention_layernorm_weight"], self.eps)
        m = (F.silu(n @ p["mlp_gate_proj_weight"].T) * (n @ p["mlp_up_proj_weight"].T)) @ p["mlp_down_proj_weight"].T
        return r + m

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight.detach(), "fc.bias": self.fc.bias.detach()}
        for k, v in self.p.items():
            name = k.replace("self_attn_", "self_attn.").replace("mlp_", "mlp.").replace("_weight", ".weight")
            out[f"layers.0.{name}"] = v.detach()
        return out


_LAST_LAYER_PARTS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def last_layer_weights(model: Any, mc: Any) -> dict[str, torch.Tensor]:
    """The target's last decoder layer in checkpoint names (fused q/k/v and gate/up split back)."""
    layer = model.model.layers[-1]
    q, k, v = layer.self_attn.qkv_proj.weight.detach().split([mc.q_size, mc.kv_size, mc.kv_size], dim=0)
    gate, up = layer.mlp.gate_up_proj.weight.detach().split([mc.intermediate_size] * 2, dim=0)
    return {
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": layer.self_attn.o_proj.weight.detach(),
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach(),
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": layer.mlp.down_proj.weight.detach(),
    }


def train(
    head: TrainHead,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    minutes: float,
    lr: float,
    noise: float,
    seed: int,
) -> dict[str, Any]:
    """Train until the time budget is spent; ``data``: (ids [L], features [L, H]) per sequence."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.cat([f for _, f in data]).std().item()  # features are large: regress them in units of their spread
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    deadline = time.monotonic() + minutes * 60
    steps, epoch, hist = 0, 0, []
    while time.monotonic() < deadline:
        epoch += 1
        order = torch.randperm(len(data), generator=g).tolist()
        tot, n_tok, hits = 0.0, 0, 0
        for i in order:
            if time.monotonic() >= deadline:
                break
            ids, f = data[i]
            emb = embed[ids[1:]]  # entry j: token t_{j+1}
            x = f[:-1]  # and feature f_j
            x = x + (torch.rand(x.shape, generator=g) - 0.5) * 2 * noise * scale
            want = f[1:]  # predict f_{j+1}
            out = head(emb, x)
            vloss = F.smooth_l1_loss(out / scale, want / scale)
            with torch.no_grad():
                tgt = torch.softmax(want @ lm_head.T, dim=-1)
            logp = torch.log_softmax(out @ lm_head.T, dim=-1)
            ploss = -(tgt * logp).sum(-1).mean()
            loss = vloss + 0.1 * ploss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            steps += 1
            tot += float(loss.detach()) * len(want)
            n_tok += len(want)
            hits += int((logp.argmax(-1) == tgt.argmax(-1)).sum())
        if n_tok:
            hist.append({"epoch": epoch, "loss": tot / n_tok, "top1": hits / n_tok})
            logger.info("epoch %d: loss %.4f, top-1 agreement %.3f", epoch, tot / n_tok, hits / n_tok)
    return {"steps": steps, "epochs": epoch, "history": hist}


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the head (config.json + model.safetensors)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.05, help="input-feature noise, in feature std units")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on a shared box: no OpenMP spinning)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from kvship.decode.spec.eagle_head import head_config, save_head
    from kvship.engine.config import ServerArgs
    from kvship.engine.embedded import embedded_model_path
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.tokenizer import load_tokenizer

    gguf = embedded_model_path()
    tok = load_tokenizer(gguf)
    sa = ServerArgs(model_path=gguf, device="cpu", attention_backend="torch_native", max_total_tokens=32768)
    prompts = training_prompts(args.prompts)
    prompt_ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    runner = ModelRunner(sa)
    mc = runner.model_config
    t0 = time.perf_counter()
    answers = generate(sa, runner, prompt_ids, args.max_new_tokens)
    t_gen = time.perf_counter() - t0
    logger.info("target answered %d prompts (%d tokens) in %.0f s", len(prompts), sum(map(len, answers)), t_gen)

    t0 = time.perf_counter()
    data = []
    for p, a in zip(prompt_ids, answers):
        ids = p + a
        data.append((torch.tensor(ids), target_features(runner, ids)))
    t_feat = time.perf_counter() - t0
    embed = runner.model.model.embed_tokens.weight.detach().float()
    lm_head = runner.model.lm_head.get_weight().detach().float()
    head = TrainHead(mc, last_layer_weights(runner.model, mc))
    stats = train(head, data, embed, lm_head, args.minutes, args.lr, args.noise, args.seed)
    cfg = head_config("eagle", mc, bias=True, eagle_trained_on=os.path.basename(gguf))
    save_head(args.out, cfg, head.checkpoint_tensors())
    report = {
        "prompts": len(prompts),
        "train_tokens": sum(len(ids) - 1 for ids, _ in data),
        "generate_s": round(t_gen, 1),
        "features_s": round(t_feat, 1),
        "train_minutes": args.minutes,
        **stats,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    last = stats["history"][-1] if stats["history"] else {}
    print(json.dumps({k: v for k, v in report.items() if k != "history"} | {"final": last}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

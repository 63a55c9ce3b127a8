"""DeepSeek's MTP module as the speculative draft (docs/deepseek.md, "MTP"): lossless, and the head it builds.

``transformers`` drops the MTP layer, so the tiny DeepSeek-V3 checkpoint gets it added to its safetensors
here (``add_mtp_layer``: ``model.layers.<L>.{enorm, hnorm, eh_proj, a full decoder block, shared_head}``
plus the embedding copy DeepSeek-V3 stores) and ``num_nextn_predict_layers: 1`` in its config.json.
``--speculative-algorithm eagle --speculative-draft-model-path <the checkpoint>`` drafts with it (CPU,
torch_native, eager).  A random MTP layer's drafts are mostly rejected, so these tests check the
token-for-token equality with plain greedy decoding, the KV bookkeeping, the head's numbers against a
reference built from ``transformers``' own DeepSeek-V3 decoder layer, and the refusals.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from deepseek_fixtures import build_tiny_deepseek
from pd_fixtures import Collector, InProcessPD, _server_args, run_until_idle, unified_greedy

from kvship.app.roles import scheduler_for_mode
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)

KEY = "v3_yarn_grouped"  # q LoRA, YaRN, grouped routing with the correction bias, a dense first layer
MAX_NEW = 16


def add_mtp_layer(model_dir: str, seed: int, own_head: bool = False) -> str:
    """Append an MTP layer (index ``num_hidden_layers``) to the checkpoint in ``model_dir``: the last decoder
    block's tensors with fresh noise, ``enorm`` / ``hnorm`` / ``eh_proj``, ``shared_head.norm``, and copies of
    the embedding and (unless ``own_head``: a different random one) the LM head, as DeepSeek-V3 stores them."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)

    def noise(shape, norm=False):
        r = torch.randn(shape, generator=g)
        return 1.0 + 0.1 * r if norm else 0.15 * r

    src = f"model.layers.{n - 1}."
    mtp = f"model.layers.{n}."
    for k in sorted(tensors):
        if k.startswith(src):
            t = tensors[k]
            fresh = noise(t.shape, "norm" in k)
            tensors[mtp + k[len(src) :]] = fresh if "correction_bias" not in k else 0.05 * fresh
    tensors[mtp + "enorm.weight"] = noise((h,), norm=True)
    tensors[mtp + "hnorm.weight"] = noise((h,), norm=True)
    tensors[mtp + "eh_proj.weight"] = noise((h, 2 * h))
    tensors[mtp + "shared_head.norm.weight"] = noise((h,), norm=True)
    head = tensors["lm_head.weight"]
    tensors[mtp + "shared_head.head.weight"] = noise(head.shape) if own_head else head.clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return model_dir


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> str:
    return add_mtp_layer(build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_mtp")), KEY, seed=51), seed=52)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 380, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _spec_run(model_dir: str, prompts, **kw):
    sa = _server_args(model_dir, speculative_algorithm="eagle", speculative_draft_model_path=model_dir, **kw)
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"u{i}", list(p), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
    run_until_idle(sched)
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"] and not sched.reqs
    drafter = sched.speculator.drafter
    drafter.release_missing(set())
    free, total = drafter.free_slots()
    assert free == total and not drafter.rows
    return [out.tokens(f"u{i}") for i in range(len(prompts))], st


@pytest.mark.parametrize(
    "shape",
    [
        dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
        dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
    ],
    ids=["tree-3x2-5", "chain-3"],
)
def test_mtp_speculative_decoding_gives_the_plain_greedy_tokens(mtp_dir, shape):
    prompts = _prompts(4, seed=3)
    want = unified_greedy(mtp_dir, prompts, MAX_NEW)
    got, st = _spec_run(mtp_dir, prompts, **shape)
    assert got == want
    assert st["spec_rounds"] > 0 and st["spec_draft_tokens"] >= st["spec_rounds"]
    # acceptance of this random MTP layer (a trained one's is a GPU measurement, docs/deepseek.md)
    accepted = st["spec_accepted_tokens"] / max(1, st["spec_draft_tokens"])
    print(f"MTP {shape}: {st['spec_rounds']} rounds, acceptance {accepted:.3f}")


def _hf_mtp_reference(model_dir: str, hf, tokens: list[int]) -> torch.Tensor:
    """Logits of entries ``j = 0 .. len(tokens) - 2`` (token ``t_{j+1}``, the target's final hidden state
    ``f_j``) through the checkpoint's MTP layer, built from ``transformers``' DeepSeek-V3 decoder layer."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = hf.config
    n = cfg.num_hidden_layers
    pre = f"model.layers.{n}."
    t = {
        k[len(pre) :]: v
        for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
        if k.startswith(pre)
    }
    layer = m.DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval()
    block = {
        k: v
        for k, v in t.items()
        if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    }
    ne = cfg.n_routed_experts  # transformers' layer stacks the experts: gate_up [E, 2I, H], down [E, H, I]
    ex = lambda e, p: block.pop(f"mlp.experts.{e}.{p}.weight")  # noqa: E731
    block["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([ex(e, "gate_proj"), ex(e, "up_proj")]) for e in range(ne)]
    )
    block["mlp.experts.down_proj"] = torch.stack([ex(e, "down_proj") for e in range(ne)])
    missing, unexpected = layer.load_state_dict(block, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))  # noqa: E731
    ids = torch.tensor([tokens])
    with torch.no_grad():
        f = hf.model(ids).last_hidden_state[0, :-1]  # f_0 .. f_{L-2}: final normed hidden states
        emb = hf.model.embed_tokens(ids[0, 1:])
        x = torch.cat([rms(emb, t["enorm.weight"]), rms(f, t["hnorm.weight"])], -1) @ t["eh_proj.weight"].T
        pos = torch.arange(x.shape[0])[None]
        pe = m.DeepseekV3RotaryEmbedding(config=cfg)(x[None], pos)
        mask = torch.full((x.shape[0], x.shape[0]), float("-inf")).triu(1)[None, None]
        h = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h = h[0] if isinstance(h, tuple) else h
        out = rms(h[0], t["shared_head.norm.weight"])
        return out @ t["shared_head.head.weight"].T, f


def test_mtp_head_logits_match_a_transformers_reference_in_extend_and_decode(mtp_dir):
    """The drafter's head over its own latent pool: the entries' extend (absorbed MLA over the draft pool) and
    one more entry by a decode step give the reference's logits (float32, 1e-4)."""
    from transformers import AutoModelForCausalLM

    from kvship.decode.spec.eagle_head import build_head
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch
    from kvship.engine.mem.pools import ReqToTokenPool

    hf = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    runner = ModelRunner(_server_args(mtp_dir, max_total_tokens=256, max_running_requests=4))
    head = build_head(mtp_dir, "eagle", runner.model, runner.model_config, runner.device)
    assert not hasattr(head, "embed_tokens") and not hasattr(head.shared_head, "head")  # equal copies: shared
    tokens = _prompts(1, seed=9)[0] + [7, 11]
    ref, feats = _hf_mtp_reference(mtp_dir, hf, tokens)
    r2t = ReqToTokenPool(4, 128, runner.device, host_mirror=False)
    pool, backend = head.draft_attention(64, runner, r2t, 4, ())
    row = r2t.alloc()
    e = len(tokens) - 2  # the last entry goes by a decode step
    slots = torch.arange(1, e + 2)
    r2t.req_to_token[row, : e + 1] = slots.to(torch.int32)

    def run(mode, ids, pos, locs, prefix, **kw):
        fb = build_forward_batch(
            mode, input_ids=ids, positions=pos, req_pool_indices=[row], seq_lens=[prefix + len(ids)],
            seq_lens_cpu=[prefix + len(ids)], out_cache_loc=locs, req_to_token_pool=r2t, kv_pool=pool,
            attn_backend=backend, device=runner.device, **kw,
        )  # fmt: skip
        with torch.inference_mode():
            backend.init_forward_metadata(fb)
            out, nxt = head(fb.input_ids, feats[pos], fb.positions, fb)
            return head.logits(out).float(), nxt

    ext, _ = run(
        ForwardMode.DRAFT_EXTEND, tokens[1 : e + 1], list(range(e)), slots[:e], 0, extend_lens=[e], prefix_lens=[0]
    )
    dec, _ = run(ForwardMode.DECODE, tokens[e + 1 : e + 2], [e], slots[e : e + 1], e)
    torch.testing.assert_close(ext, ref[:e], atol=1e-4, rtol=0)
    torch.testing.assert_close(dec, ref[e : e + 1], atol=1e-4, rtol=0)


def test_mtp_on_a_decode_worker_with_prompt_features_from_prefill_equals_unified(mtp_dir):
    """PD: the prefill worker (given the same flags) ships the prompt's features with the latent pages; the
    decode worker drafts with the MTP module from its first round."""
    prompts = _prompts(3, seed=5)
    want = unified_greedy(mtp_dir, prompts, MAX_NEW, page_size=1)
    spec = dict(speculative_algorithm="eagle", speculative_draft_model_path=mtp_dir, speculative_eagle_topk=2)
    with InProcessPD(mtp_dir, page_size=1, prefill_args=spec, decode_args=spec) as pd:
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, MAX_NEW)
        pd.wait(rids)
        pd.wait(rids, side="prefill")
        assert [pd.tokens(r) for r in rids] == want
        assert pd.decode.get_stats()["spec_rounds"] > 0
        assert pd.decode.kv_manager.layout.features_mismatch(pd.prefill.kv_manager.layout) is None
        pd.wait_idle()


def test_ngram_speculation_over_the_latent_cache_gives_the_plain_greedy_tokens(mtp_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (6,), generator=g).tolist() * 4 for _ in range(2)]  # repeats to look up
    want = unified_greedy(mtp_dir, prompts, MAX_NEW)
    sa = _server_args(mtp_dir, speculative_algorithm="ngram")
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"u{i}", p, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
    run_until_idle(sched)
    assert [out.tokens(f"u{i}") for i in range(len(prompts))] == want
    st = sched.get_stats()
    assert st["spec_draft_tokens"] > 0 and st["free_slots"] == st["total_slots"]


def test_mtp_flags_are_refused_by_name_where_they_cannot_draft(mtp_dir, tmp_path, tiny_llama_dir):
    from kvship.decode.spec.eagle_head import EagleConfig
    from kvship.engine.model_config import ModelConfig

    target = ModelConfig.from_pretrained(mtp_dir)
    with pytest.raises(ValueError, match="drafts under --speculative-algorithm eagle"):
        EagleConfig.load(mtp_dir, "eagle3", target, torch.float32)
    no_mtp = build_tiny_deepseek(str(tmp_path / "no_mtp"), KEY, seed=53)
    with open(os.path.join(no_mtp, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(no_mtp, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 0}, f)
    with pytest.raises(ValueError, match="declares no MTP layer"):
        EagleConfig.load(no_mtp, "eagle", target, torch.float32)
    with pytest.raises(ValueError, match="a DeepSeek target drafts with its checkpoint's MTP module"):
        EagleConfig.load(tiny_llama_dir, "eagle", target, torch.float32)
    with pytest.raises(ValueError, match="drafts for a DeepSeek .MLA. target only"):
        EagleConfig.load(mtp_dir, "eagle", ModelConfig.from_pretrained(tiny_llama_dir), torch.float32)

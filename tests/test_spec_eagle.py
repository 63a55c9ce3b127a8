"""EAGLE / EAGLE-3 draft heads are lossless: the same greedy tokens as plain decoding.

Randomly initialised heads written in the public checkpoint layout
(``decode/spec/eagle_head.py``) draft for tiny random transformers targets on
CPU (torch_native).  A random head's drafts are mostly rejected, so these
tests check the token-for-token equality, the KV bookkeeping (target and
draft pools full again after runs with aborts) and the flag rules; the
acceptance a trained head reaches is measured by bench/spec_acceptance.py
(docs/benchmarks.md).
"""

from __future__ import annotations

import json

import pytest
import torch
from pd_fixtures import Collector, InProcessPD, _server_args, run_until_idle, unified_greedy

from kvship.app.roles import scheduler_for_mode
from kvship.decode.spec.eagle_head import head_config, head_tensor_shapes, save_head
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_config import ModelConfig
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)


def write_random_head(path: str, target_dir: str, variant: str, seed: int = 0, **extra) -> str:
    target = ModelConfig.from_pretrained(target_dir)
    cfg = head_config(variant, target, **extra)
    n_aux = len(extra.get("eagle_aux_hidden_state_layer_ids", [])) or 3
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in head_tensor_shapes(cfg, n_aux).items():
        noise = torch.randn(shape, generator=g)
        tensors[name] = 1.0 + 0.1 * noise if "norm" in name else 0.2 * noise
    if variant == "eagle3" and cfg.get("draft_vocab_size", target.vocab_size) < target.vocab_size:
        n = cfg["draft_vocab_size"]
        hot = torch.sort(torch.randperm(target.vocab_size, generator=g)[:n]).values
        tensors["d2t"] = hot - torch.arange(n)  # target id = draft id + d2t[draft id]
    save_head(path, cfg, tensors)
    return path


@pytest.fixture(scope="module")
def eagle_head(tiny_llama_dir, tmp_path_factory) -> str:
    return write_random_head(str(tmp_path_factory.mktemp("eagle")), tiny_llama_dir, "eagle", seed=1)


@pytest.fixture(scope="module")
def eagle3_head(tiny_llama_dir, tmp_path_factory) -> str:
    return write_random_head(
        str(tmp_path_factory.mktemp("eagle3")),
        tiny_llama_dir,
        "eagle3",
        seed=2,
        draft_vocab_size=64,
        eagle_aux_hidden_state_layer_ids=[0, 1],
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 200, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _run(model_dir: str, prompts, max_new: int, **kw):
    sa = _server_args(model_dir, attention_backend="torch_native", **kw)
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"u{i}", list(p), SamplingParams(max_new_tokens=max_new, temperature=0.0)))
    run_until_idle(sched)
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"] and not sched.reqs
    drafter = sched.speculator.drafter
    drafter.release_missing(set())
    free, total = drafter.free_slots()
    assert free == total and not drafter.rows
    return [out.tokens(f"u{i}") for i in range(len(prompts))], st, out


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)],
    ids=["tree-5x4-8", "chain-3"],
)
def test_eagle_head_gives_the_plain_greedy_tokens(tiny_llama_dir, eagle_head, batch, shape):
    prompts = _prompts(batch, seed=batch)
    want = unified_greedy(tiny_llama_dir, prompts, 20, attention_backend="torch_native")
    got, st, _ = _run(
        tiny_llama_dir,
        prompts,
        20,
        speculative_algorithm="eagle",
        speculative_draft_model_path=eagle_head,
        **shape,
    )
    assert got == want
    assert st["spec_rounds"] > 0 and st["spec_draft_tokens"] >= st["spec_rounds"]


@pytest.mark.parametrize("batch", [1, 8])
def test_eagle3_head_with_reduced_vocabulary_gives_the_plain_greedy_tokens(tiny_llama_dir, eagle3_head, batch):
    prompts = _prompts(batch, seed=30 + batch)
    want = unified_greedy(tiny_llama_dir, prompts, 20, attention_backend="torch_native")
    got, st, _ = _run(
        tiny_llama_dir, prompts, 20, speculative_algorithm="eagle3", speculative_draft_model_path=eagle3_head
    )
    assert got == want and st["spec_rounds"] > 0


def test_eagle3_drafts_only_tokens_of_the_draft_vocabulary(tiny_llama_dir, eagle3_head):
    from safetensors.torch import load_file

    d2t = load_file(f"{eagle3_head}/model.safetensors")["d2t"]
    hot = set((torch.arange(d2t.numel()) + d2t).tolist())
    sa = _server_args(
        tiny_llama_dir,
        attention_backend="torch_native",
        speculative_algorithm="eagle3",
        speculative_draft_model_path=eagle3_head,
    )
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, Collector())
    sched.submit(GenerateRequest("r", _prompts(1, seed=4)[0], SamplingParams(max_new_tokens=2, temperature=0.0)))
    sched.step()  # prefill
    req = sched.reqs["r"]
    trees = sched.speculator.drafter.draft_trees([req])
    assert trees[0].tokens and set(trees[0].tokens) <= hot
    assert len(trees[0].tokens) == 7  # 8 verified tokens by default, the root included


def test_decode_worker_with_eagle_equals_unified(tiny_llama_dir, eagle_head):
    prompts = _prompts(4, seed=5)
    want = unified_greedy(tiny_llama_dir, prompts, 16, attention_backend="torch_native")
    with InProcessPD(
        tiny_llama_dir,
        attention_backend="torch_native",
        decode_args=dict(speculative_algorithm="eagle", speculative_draft_model_path=eagle_head),
    ) as pd:
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, 16)
        pd.wait(rids)
        pd.wait(rids, side="prefill")
        assert [pd.tokens(r) for r in rids] == want
        assert pd.decode.get_stats()["spec_rounds"] > 0
        pd.wait_idle()


def test_eagle_sampled_and_aborted_requests_leave_every_slot_free(tiny_llama_dir, eagle_head):
    sa = _server_args(
        tiny_llama_dir,
        attention_backend="torch_native",
        speculative_algorithm="eagle",
        speculative_draft_model_path=eagle_head,
    )
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    ps = _prompts(4, seed=21)
    sched.submit(GenerateRequest("hot", ps[0], SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9)))
    sched.submit(GenerateRequest("seeded", ps[1], SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)))
    sched.submit(GenerateRequest("gone", ps[2], SamplingParams(max_new_tokens=200, temperature=0.0)))
    sched.submit(GenerateRequest("stay", ps[3], SamplingParams(max_new_tokens=25, temperature=0.0)))
    for _ in range(5):
        sched.step()
    sched.abort("gone")
    run_until_idle(sched)
    assert len(out.tokens("hot")) == 30 and len(out.tokens("seeded")) == 12 and len(out.tokens("stay")) == 25
    assert out.finished("gone")[0].finish_reason["type"] == "abort"
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"] and st["spec_rounds"] > 0
    drafter = sched.speculator.drafter
    drafter.release_missing(set())
    assert drafter.free_slots()[0] == drafter.free_slots()[1]


def test_startup_refuses_inconsistent_eagle_flags(tiny_llama_dir, eagle_head, eagle3_head):
    with pytest.raises(ValueError, match="draft-model-path"):
        _server_args(tiny_llama_dir, speculative_algorithm="eagle").validate()
    with pytest.raises(ValueError, match="candidates"):
        _server_args(
            tiny_llama_dir,
            speculative_algorithm="eagle",
            speculative_draft_model_path=eagle_head,
            speculative_num_steps=2,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=6,
        ).validate()
    with pytest.raises(ValueError, match="num-steps goes with"):
        _server_args(tiny_llama_dir, speculative_algorithm="ngram", speculative_num_steps=3).validate()
    sa = _server_args(tiny_llama_dir, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head)
    assert sa.speculative_shape == (5, 4, 7)  # SGLang's defaults: 8 verified tokens, the root included
    sa = _server_args(
        tiny_llama_dir, speculative_algorithm="eagle", speculative_draft_model_path=eagle_head, speculative_num_steps=3
    )
    assert sa.speculative_shape == (3, 4, 7)
    sa = _server_args(
        tiny_llama_dir,
        speculative_algorithm="eagle",
        speculative_draft_model_path=eagle_head,
        speculative_eagle_topk=1,
    )
    assert sa.speculative_shape == (5, 1, 5)  # a chain: steps + 1 tokens
    wrong = _server_args(
        tiny_llama_dir,
        attention_backend="torch_native",
        speculative_algorithm="eagle",
        speculative_draft_model_path=eagle3_head,
    )
    with pytest.raises(ValueError, match="use --speculative-algorithm eagle3"):
        scheduler_for_mode("unified")(wrong, ModelRunner(wrong), None, Collector())


def test_served_eagle_reports_acceptance_in_meta_info_usage_and_metrics(tiny_llama_dir, eagle_head):
    """`kvship serve` takes the EAGLE flags; acceptance reaches meta_info, the OpenAI usage and /metrics."""
    import httpx
    from server_fixtures import start_server

    args = ["--model-path", tiny_llama_dir, "--attention-backend", "torch_native", "--max-total-tokens", "4096"]
    args += ["--speculative-algorithm", "eagle", "--speculative-draft-model-path", eagle_head]
    args += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5"]
    with start_server(args) as srv:
        r = httpx.post(
            f"{srv.url}/generate",
            json={"input_ids": _prompts(1, seed=9)[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
            timeout=60,
        )
        r.raise_for_status()
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] == 12 and 1.0 <= meta["spec_accept_length"] <= 5.0
        model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"model": model, "prompt": _prompts(1, seed=10)[0], "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        r.raise_for_status()
        assert 1.0 <= r.json()["usage"]["kvship_spec_accept_length"] <= 5.0
        # streams: the usage chunk (``stream_options.include_usage``) carries it too, on both OpenAI routes
        for route, body in (
            ("completions", {"prompt": _prompts(1, seed=11)[0]}),
            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            body |= {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{srv.url}/v1/{route}", json=body, timeout=60) as r:
                r.raise_for_status()
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            assert usage["completion_tokens"] == 8 and 1.0 <= usage["kvship_spec_accept_length"] <= 5.0, route
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        count = [ln for ln in metrics.splitlines() if ln.startswith("kvship:spec_accept_length_count")]
        assert count and float(count[0].split()[-1]) == 4.0


def _reference_chain(model, head_dir: str, seq: list[int], steps: int) -> list[int]:
    """EAGLE chain drafting written out in plain torch over transformers' target (no KV cache, no engine).

    Entry ``j`` = (token ``seq[j+1]``, the target's final hidden state at ``j``); each drafted token adds the
    entry (token, the head's output at the previous entry) and the whole causal sequence is run again.
    """
    import json

    import torch.nn.functional as F
    from safetensors.torch import load_file

    w = load_file(f"{head_dir}/model.safetensors")
    cfg = json.load(open(f"{head_dir}/config.json"))
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb_w = model.get_input_embeddings().weight
    head_w = model.get_output_embeddings().weight

    def rope(x, n):
        f = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        cos, sin = torch.cat([f.cos()] * 2, -1)[:, None], torch.cat([f.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    def head(tokens, feats):
        n = len(tokens)
        x = F.linear(torch.cat([emb_w[tokens], feats], -1), w["fc.weight"], w["fc.bias"])
        p = "layers.0."
        q = rope(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(n, nh, hd), n)
        k = rope(F.linear(x, w[p + "self_attn.k_proj.weight"]).view(n, nkv, hd), n).repeat_interleave(nh // nkv, 1)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(n, nkv, hd).repeat_interleave(nh // nkv, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        r = x + F.linear(a.transpose(0, 1).reshape(n, -1), w[p + "self_attn.o_proj.weight"])
        h = (
            r
            * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
            * w[p + "post_attention_layernorm.weight"]
        )
        m = F.linear(
            F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"]),
            w[p + "mlp.down_proj.weight"],
        )
        return r + m

    with torch.no_grad():
        f = model.model(torch.tensor([seq])).last_hidden_state[0]
        tokens, feats, out = list(seq[1:]), f[:-1], []
        for _ in range(steps):
            o = head(torch.tensor(tokens), feats)
            out.append(int(F.linear(o[-1], head_w).argmax()))
            tokens.append(out[-1])
            feats = torch.cat([feats, o[-1:]])
    return out


def test_eagle_chain_draft_equals_a_plain_torch_reference(tiny_llama_tied_dir, tmp_path):
    """The drafter's entries, positions, features and KV reuse give exactly the reference's chain."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_tied_dir, dtype=torch.float32).eval()
    head_dir = write_random_head(str(tmp_path / "h"), tiny_llama_tied_dir, "eagle", seed=7)
    sa = _server_args(
        tiny_llama_tied_dir,
        attention_backend="torch_native",
        speculative_algorithm="eagle",
        speculative_draft_model_path=head_dir,
        speculative_num_steps=4,
        speculative_eagle_topk=1,
    )
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, Collector())
    sched.submit(GenerateRequest("r", _prompts(1, seed=12)[0], SamplingParams(max_new_tokens=40, temperature=0.0)))
    drafter = sched.speculator.drafter
    sched.step()  # prefill: the target's features of the prompt
    for _ in range(3):  # a few rounds: entries are reused and extended with the verified positions' features
        req = sched.reqs["r"]
        tree = drafter.draft_trees([req])[0]
        assert tree.tokens == _reference_chain(model, head_dir, list(req.fill_ids), 4)
        assert tree.parents == [0, 1, 2, 3]
        sched.step()

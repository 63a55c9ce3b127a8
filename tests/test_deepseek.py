"""DeepSeek-V2 / V3 (MLA + DeepSeekMoE) on tiny random checkpoints, against ``transformers``.

Three configs (tests/deepseek_fixtures.py): V3 with q LoRA, YaRN, grouped
routing (4 groups, 2 kept), the correction bias and a dense first layer; V3
without q LoRA and rotate-half RoPE; V2-Lite's shape (softmax greedy
routing).  Our prefill runs the decompressed MLA path, decode the absorbed
one over the latent pool; both must match ``transformers`` within ``ATOL``
(float32), and greedy tokens through the real Scheduler (chunked prefill,
paged pool, radix cache) must equal ``generate``.
"""

from __future__ import annotations

import re

import pytest
import torch
from deepseek_fixtures import SPECS, build_tiny_deepseek
from pd_fixtures import run_until_idle
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

from kvship.engine.attention.mla import MLALayerSpec, MLATorchBackend
from kvship.engine.attention.mla_registry import create_mla_attention_backend
from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardMode, build_forward_batch
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import ReqToTokenPool
from kvship.engine.model_config import ModelConfig
from kvship.engine.model_runner import ModelRunner
from kvship.engine.models.deepseek import DeepseekMoE, check_mla_serving
from kvship.engine.models.llama import LlamaMLP
from kvship.engine.scheduler import Scheduler

# float32 end to end; measured differences are ~6e-6 on logits of magnitude ~5
ATOL = 1e-4


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        k: build_tiny_deepseek(str(tmp_path_factory.mktemp(f"ds_{k}")), k, seed=30 + i) for i, k in enumerate(SPECS)
    }


@pytest.fixture(scope="module")
def hf_ds(ds_dirs):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in ds_dirs.items()}


@pytest.fixture(scope="module")
def ds_runners(ds_dirs):
    return {
        k: ModelRunner(ServerArgs(model_path=p, device="cpu", max_total_tokens=1024, max_running_requests=8))
        for k, p in ds_dirs.items()
    }


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("key", list(SPECS))
def test_deepseek_prefill_and_absorbed_decode_logits_match_transformers(key, ds_runners, hf_ds, kv_driver):
    ids, follow = _prompt(29, seed=1), _prompt(4, seed=2)
    drv = kv_driver(ds_runners[key])
    req = drv.new()
    try:
        prefill = drv.extend([req], [ids], all_logits=True)
        decode = [drv.decode([req], [t])[0] for t in follow]
    finally:
        drv.free(req)
    with torch.no_grad():
        ref = hf_ds[key](torch.tensor([ids + follow])).logits[0].float()
    assert (prefill - ref[: len(ids)]).abs().max().item() < ATOL
    assert (torch.stack(decode) - ref[len(ids) :]).abs().max().item() < ATOL


def test_deepseek_config_reads_mla_dims_grouped_routing_and_dense_layers(ds_runners):
    cfg = ds_runners["v3_yarn_grouped"].model_config
    assert cfg.mla.kv_lora_rank == 32 and cfg.mla.latent_dim == 40 and cfg.mla.q_lora_rank == 48
    r = cfg.moe.routing
    assert (r.scoring, r.topk_method, r.n_group, r.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    assert r.routed_scaling_factor == 2.5 and cfg.moe.norm_topk_prob and cfg.moe.shared_expert_intermediate_size == 32
    # YaRN's mscale_all_dim enters the softmax scale squared
    assert cfg.mla.softmax_scale(cfg.rope_scaling) > cfg.mla.qk_head_dim**-0.5
    layers = ds_runners["v3_yarn_grouped"].model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, DeepseekMoE, DeepseekMoE]
    assert ds_runners["v3_no_q_lora"].model_config.mla.q_lora_rank is None
    v2 = ds_runners["v2_lite"].model_config.moe.routing
    assert (v2.scoring, v2.topk_method) == ("softmax", "greedy")


def test_latent_pool_holds_one_latent_row_per_token_and_sizes_by_it(ds_runners):
    runner = ds_runners["v3_yarn_grouped"]
    pool = runner.kv_pool
    assert isinstance(pool, MLAKVPool) and len(pool.buffers()) == 3
    assert pool.get_latent_buffer(0).shape == (1024 + 1, 1, 40)
    # one latent row per layer (fp32: 4 bytes), against K and V of 4 heads x 24 dims for an MHA pool
    assert MLAKVPool.bytes_per_token(3, 40, torch.float32) == 3 * 40 * 4
    mha = 2 * 3 * 4 * 24 * 4
    assert mha / MLAKVPool.bytes_per_token(3, 40, torch.float32) == pytest.approx(4.8)
    sized = ModelRunner(ServerArgs(model_path=runner.model_path, device="cpu", max_running_requests=4))
    assert sized.max_total_tokens == 65536  # the CPU default cap: 2 GiB holds far more latent rows


@pytest.mark.parametrize("key,page", [("v3_yarn_grouped", 1), ("v2_lite", 4)])
def test_deepseek_greedy_through_the_scheduler_equals_transformers_generate(key, page, ds_dirs, hf_ds):
    sa = ServerArgs(
        model_path=ds_dirs[key], device="cpu", max_total_tokens=1024, chunked_prefill_size=16, page_size=page
    )
    runner = ModelRunner(sa)
    chunks = []
    sched = Scheduler(sa, runner, None, chunks.extend)
    prompts = [_prompt(n, seed=10 + n) for n in (3, 21)]
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8)))
    run_until_idle(sched)
    assert sched.idle()
    for i, p in enumerate(prompts):
        got = [t for c in chunks if c.rid == f"r{i}" for t in c.token_ids]
        assert got == _hf_generate(hf_ds[key], p, 8), f"prompt {i}"


def test_deepseek_radix_cache_prefix_hit_equals_a_cold_run(ds_dirs):
    sa = ServerArgs(model_path=ds_dirs["v3_yarn_grouped"], device="cpu", max_total_tokens=1024, page_size=4)
    runner = ModelRunner(sa)
    chunks = []
    sched = Scheduler(sa, runner, None, chunks.extend)
    shared = _prompt(20, seed=5)
    first, second = shared + _prompt(3, seed=6), shared + _prompt(5, seed=7)
    sched.submit(GenerateRequest("warm", first, SamplingParams(temperature=0.0, max_new_tokens=4)))
    run_until_idle(sched)
    sched.submit(GenerateRequest("hit", second, SamplingParams(temperature=0.0, max_new_tokens=6)))
    run_until_idle(sched)
    hit = [c for c in chunks if c.rid == "hit"]
    assert max(c.cached_tokens for c in hit) >= 16  # the shared whole pages came from the radix cache
    cold_sa = ServerArgs(model_path=ds_dirs["v3_yarn_grouped"], device="cpu", max_total_tokens=1024, page_size=4)
    cold_chunks = []
    cold = Scheduler(cold_sa, ModelRunner(cold_sa), None, cold_chunks.extend)
    cold.submit(GenerateRequest("cold", second, SamplingParams(temperature=0.0, max_new_tokens=6)))
    run_until_idle(cold)
    assert [t for c in hit for t in c.token_ids] == [t for c in cold_chunks for t in c.token_ids]


def test_absorbed_extend_equals_decompressed_extend_over_a_cached_prefix():
    """The verify path (absorbed, over the latent pool) against prefill's (decompressed by kv_b_proj)."""
    g = torch.Generator().manual_seed(0)
    h, r, dn, dr, dv = 3, 16, 8, 4, 12
    spec = MLALayerSpec(0, h, r, dn, dr, dv, scaling=(dn + dr) ** -0.5)
    w = torch.randn(h, dn + dv, r, generator=g) * 0.3  # kv_b_proj per head: W_UK rows then W_UV rows
    pool = MLAKVPool(64, 1, torch.float32, r, dr, 1, "cpu")
    r2t = ReqToTokenPool(4, 64, "cpu")
    prefix, new = 9, 5
    slots = torch.arange(1, prefix + new + 1)
    r2t.write(0, 0, slots)
    pool.set_latent(0, slots[:prefix], torch.randn(prefix, r + dr, generator=g))

    def batch(backend):
        fb = build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=torch.zeros(new, dtype=torch.int64),
            positions=torch.arange(prefix, prefix + new),
            req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([prefix + new]),
            seq_lens_cpu=[prefix + new],
            out_cache_loc=slots[prefix:],
            req_to_token_pool=r2t,
            kv_pool=pool,
            attn_backend=backend,
            device="cpu",
            extend_lens=[new],
            prefix_lens=[prefix],
        )
        backend.init_forward_metadata(fb)
        return fb

    backend = MLATorchBackend(None)
    q = torch.randn(new, h, dn + dr, generator=g)
    latent = torch.randn(new, r + dr, generator=g)

    def decompress(c):
        kv = torch.einsum("sr,hxr->shx", c, w)
        return kv[..., :dn], kv[..., dn:]

    ref = backend.forward_extend_decompressed(q, latent, spec, batch(backend), decompress)
    qa = torch.cat([torch.einsum("thd,hdr->thr", q[..., :dn], w[:, :dn]), q[..., dn:]], dim=-1)
    absorbed = backend.forward_extend(qa, latent, None, spec, batch(backend))
    got = torch.einsum("thr,hvr->thv", absorbed, w[:, dn:])
    assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize(
    "override,what",
    [(dict(speculative_algorithm="draft", speculative_draft_model_path="/x", page_size=1), "algorithm draft")],
)
def test_deepseek_refuses_unsupported_modes_by_name(override, what, ds_dirs):
    sa = ServerArgs(model_path=ds_dirs["v2_lite"], device="cpu", max_total_tokens=64, **override)
    with pytest.raises(ValueError, match=r"DeepSeek \(MLA\) models do not support .*" + re.escape(what)):
        check_mla_serving(sa)
    if "speculative_algorithm" in override:  # the runner refuses before loading anything
        with pytest.raises(ValueError, match="--speculative-algorithm draft"):
            ModelRunner(sa)


def test_mla_backend_names_its_choices_for_other_backends():
    with pytest.raises(ValueError, match="has no MLA .* use --attention-backend torch_native"):
        create_mla_attention_backend("flashinfer", None)
    from kvship.engine.attention.base import AttentionContext
    from kvship.engine.mem.pools import ReqToTokenPool

    cpu = AttentionContext(
        device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32, num_heads=2, num_kv_heads=1,
        head_dim=24, page_size=1, req_to_token_pool=ReqToTokenPool(2, 8, "cpu"), max_running_requests=2,
        cuda_graph_bs=(),
    )  # fmt: skip
    # auto: triton on CUDA (where Triton imports), the torch reference elsewhere
    assert isinstance(create_mla_attention_backend("auto", cpu), MLATorchBackend)
    assert type(create_mla_attention_backend("auto", cpu)).__name__ == "MLATorchBackend"


def test_deepseek_config_without_q_lora_or_yarn_keeps_the_plain_scale():
    cfg = ModelConfig.from_hf_dict(
        dict(
            architectures=["DeepseekV2ForCausalLM"],
            vocab_size=10,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            kv_lora_rank=4,
            qk_nope_head_dim=4,
            qk_rope_head_dim=2,
            v_head_dim=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
        )
    )
    assert cfg.mla.q_lora_rank is None and cfg.mla.softmax_scale(cfg.rope_scaling) == 6**-0.5
    assert cfg.moe.routing.topk_method == "group_limited_greedy" and cfg.moe.mlp_only_layers == ()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/test_mla_triton.py runs the kernel natively")
def test_mla_triton_kernel_tests_pass_in_the_triton_interpreter(request):
    """tests/test_mla_triton.py in a child pytest with ``TRITON_INTERPRET=1`` (set before triton is imported; the
    session's one such child, tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_mla_triton.py").check(passed=16)

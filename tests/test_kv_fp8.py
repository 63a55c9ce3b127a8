"""The FP8 KV cache (``--kv-cache-dtype fp8_e4m3``, docs/quantization.md "FP8 KV cache") on CPU.

* A tiny Llama with FP8 KV gives the greedy tokens (and logits within 1e-4) of transformers' model whose K (after
  RoPE) and V are rounded through FP8 with the checkpoint's per-layer scales: the reference shares no code with
  the engine's attention or pool.
* The checkpoint's ``k_scale`` / ``v_scale`` are read under each name a checkpoint uses, 1.0 without them; a bad
  one is refused.
* The pool sizes itself by bytes: one byte per element, twice the tokens of bf16 for the same budget.
* PD with FP8 KV on tcp, mooncake and nixl equals unified token for token; a prefill whose KV dtype (or FP8
  scales) differ is refused with one error naming both.
* The embedded SmolLM2 under FP8 KV still answers "Paris" (slow).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import KVDriver
from pd_fixtures import InProcessPD, make_prompts, unified_greedy
from safetensors.torch import load_file, save_file

from kvship.engine.config import ServerArgs
from kvship.engine.disagg.wire import KVLayout
from kvship.engine.mem.pools import KVPool
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 17, 42, 99, 7, 23, 61, 140, 3, 77, 250, 12]
STEPS = 12
K_SCALES = (0.02, 0.03)
V_SCALES = (0.015, 0.025)


def _with_scales(src: str, dst: str, names: tuple[str, str] = ("self_attn.k_scale", "self_attn.v_scale")) -> str:
    """A copy of the tiny model folder ``src`` whose checkpoint carries per-layer K/V scales under ``names``."""
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES)):
        tensors[f"model.layers.{i}.{names[0]}"] = torch.tensor(k)
        if names[1]:
            tensors[f"model.layers.{i}.{names[1]}"] = torch.tensor([v])
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def scaled_llama(tiny_llama_dir, tmp_path_factory) -> str:
    return _with_scales(tiny_llama_dir, str(tmp_path_factory.mktemp("fp8kv") / "llama"))


def _runner(path: str, **kw) -> ModelRunner:
    args = dict(model_path=path, device="cpu", max_total_tokens=2048, kv_cache_dtype="fp8_e4m3")
    return ModelRunner(ServerArgs(**{**args, **kw}))


def _engine_run(runner: ModelRunner) -> dict:
    d = KVDriver(runner)
    req = d.new()
    logits = d.extend([req], [PROMPT], all_logits=True).float()
    d.free(req)
    return {"logits": logits, "greedy": d.greedy(PROMPT, STEPS)}


def _fp8_round(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def _reference_run(path: str) -> dict:
    """transformers' Llama with K rounded through FP8 after RoPE (its ``apply_rotary_pos_emb``) and V at
    ``v_proj``'s output, each layer with its checkpoint scales; greedy by re-running the whole sequence."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rope = modeling_llama.apply_rotary_pos_emb
    layer_of_call = []

    def rounded_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        return q, _fp8_round(k, K_SCALES[layer_of_call[-1]])

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, kw, i=i: layer_of_call.append(i), with_kwargs=True)
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, i=i: _fp8_round(out, V_SCALES[i]))
    modeling_llama.apply_rotary_pos_emb = rounded_rope
    try:
        ids = list(PROMPT)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
            out = []
            for _ in range(STEPS):
                tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
    return {"logits": logits, "greedy": out}


def test_fp8_kv_greedy_equals_a_reference_that_rounds_kv_through_fp8(scaled_llama):
    runner = _runner(scaled_llama)
    assert runner.kv_pool.k_buffer[0].dtype == torch.float8_e4m3fn and runner.kv_pool.k_buffer[0].element_size() == 1
    got, want = _engine_run(runner), _reference_run(scaled_llama)
    assert got["greedy"] == want["greedy"]
    assert torch.allclose(got["logits"], want["logits"], atol=1e-4), (got["logits"] - want["logits"]).abs().max()
    # the rounding is visible: the same model with float32 KV computes other logits
    plain = ModelRunner(ServerArgs(model_path=scaled_llama, device="cpu", max_total_tokens=2048))
    d = KVDriver(plain)
    req = d.new()
    assert not torch.allclose(d.extend([req], [PROMPT], all_logits=True).float(), got["logits"], atol=1e-3)


@pytest.mark.parametrize(
    "names",
    [
        ("self_attn.k_scale", "self_attn.v_scale"),
        ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
        ("self_attn.kv_scale", ""),
    ],
    ids=["k_scale", "output_scale", "kv_scale"],
)
def test_checkpoint_kv_scales_are_read_under_each_name(tiny_llama_dir, tmp_path, names):
    path = _with_scales(tiny_llama_dir, str(tmp_path / "m"), names)
    pool = _runner(path).kv_pool
    assert pool.k_scales == pytest.approx(list(K_SCALES))
    assert pool.v_scales == pytest.approx(list(K_SCALES if not names[1] else V_SCALES))
    # the scales are no model parameters: with the model's KV dtype they load and are ignored
    plain = ModelRunner(ServerArgs(model_path=path, device="cpu", max_total_tokens=256)).kv_pool
    assert plain.dtype == torch.float32 and plain.k_scales == [1.0, 1.0]


def test_fp8_kv_without_checkpoint_scales_uses_one(tiny_llama_dir):
    pool = _runner(tiny_llama_dir).kv_pool
    assert pool.k_scales == [1.0, 1.0] and pool.v_scales == [1.0, 1.0]


def test_a_bad_checkpoint_kv_scale_is_refused(tiny_llama_dir, tmp_path):
    path = _with_scales(tiny_llama_dir, str(tmp_path / "m"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.1, 0.2])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_scale' has shape \(2,\)"):
        _runner(path)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="positive finite"):
        _runner(path)


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_bytes(tiny_llama_dir):
    """The pool sizes itself by bytes per token (elements x element size): FP8 halves them."""
    bf16 = ModelRunner(ServerArgs(model_path=tiny_llama_dir, device="cpu", dtype="bfloat16", max_total_tokens=64))
    fp8 = _runner(tiny_llama_dir, dtype="bfloat16", max_total_tokens=64)
    assert bf16._bytes_per_token() == 2 * fp8._bytes_per_token()
    budget = 1 << 20
    assert budget // fp8._bytes_per_token() == 2 * (budget // bf16._bytes_per_token())
    nbytes = lambda pool: sum(b.numel() * b.element_size() for b in pool.buffers())  # noqa: E731
    assert nbytes(bf16.kv_pool) == 2 * nbytes(fp8.kv_pool)


def test_pool_quantizes_with_its_scale_and_reads_back_within_fp8_precision():
    pool = KVPool(16, 1, torch.float8_e4m3fn, 1, 8, 1, "cpu", k_scales=[0.5], v_scales=[2.0])
    k = torch.tensor([[1000.0, -1000.0, 0.3, 1.0, 0.0, 100.0, -3.3, 7.0]])
    pool.set_kv_buffer(0, torch.tensor([3]), k, k)
    read_k = pool.k_buffer[0][3, 0].float() * 0.5
    assert read_k[:2].tolist() == [224.0, -224.0]  # clamped at 448 * scale
    assert read_k[4] == 0 and torch.allclose(read_k[2:], k[0, 2:].clamp(-224, 224), rtol=2**-4)
    assert (pool.v_buffer[0][3, 0].float() * 2.0)[5] == 96.0  # 100 / 2 = 50 -> 48 (e4m3 step 4 at 32..64)


# --- PD ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_pd_with_fp8_kv_equals_unified(scaled_llama, backend):
    prompts = make_prompts(8, seed=31, lo=1, hi=60)
    kw = dict(page_size=16, chunked_prefill_size=32, kv_cache_dtype="fp8_e4m3")
    with InProcessPD(scaled_llama, backend=backend, **kw) as pd:
        assert pd.prefill.runner.kv_pool.k_scales == pytest.approx(list(K_SCALES))
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, 12)
        pd.wait(rids)
        want = unified_greedy(scaled_llama, prompts, 12, **kw)
        assert [pd.tokens(r) for r in rids] == want
        assert pd.decode.get_stats()["kv_transfers_ok"] == len(prompts)
        pd.wait_idle()
    # FP8 KV changed the answers (the test is not vacuous)
    assert want != unified_greedy(scaled_llama, prompts, 12, page_size=16, chunked_prefill_size=32)


def test_pd_with_another_kv_dtype_is_refused_naming_both(tiny_llama_dir):
    with InProcessPD(
        tiny_llama_dir, prefill_args=dict(kv_cache_dtype="fp8_e4m3"), decode_args=dict(kv_cache_dtype="auto")
    ) as pd:
        pd.submit("m", [5, 6, 7, 8, 9], to="decode")
        pd.wait(["m"], timeout=20)
        message = pd.finish("m")["message"]
        assert "kv_dtype float8_e4m3fn != float32" in message, message
        pd.wait_idle()


def test_kv_layout_refuses_other_fp8_scales():
    a = KVPool(32, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", k_scales=[0.1, 0.2], v_scales=[0.3, 0.4])
    b = KVPool(32, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", k_scales=[0.1, 0.2], v_scales=[0.3, 0.5])
    la, lb = KVLayout.from_pool(a), KVLayout.from_pool(b)
    assert la.mismatch(KVLayout.from_dict(dict(la.__dict__))) is None and la.element_size == 1
    assert "FP8 KV scales" in la.mismatch(lb) and "0.4" in la.mismatch(lb) and "0.5" in la.mismatch(lb)
    plain = KVLayout.from_pool(KVPool(32, 1, torch.bfloat16, 2, 16, 2, "cpu"))
    assert plain.kv_scales == () and la.mismatch(plain) == "kv_dtype float8_e4m3fn != bfloat16"


@pytest.mark.slow
def test_embedded_smollm2_under_fp8_kv_still_answers_paris(smollm2_path):
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    runner = ModelRunner(
        ServerArgs(model_path=None, max_total_tokens=512, max_running_requests=4, kv_cache_dtype="fp8_e4m3")
    )
    assert runner.kv_pool.dtype == torch.float8_e4m3fn
    out = KVDriver(runner).greedy(ids, 8, eos_ids=set(runner.model_config.eos_token_ids))
    assert "Paris" in tok.decode(out)


# --- HTTP workers, kvship local ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_decode_refuses_a_prefill_with_fp8_kv_with_a_503_naming_both_dtypes(tiny_llama_dir):
    """Two real workers: /get_server_info reports the quantization and KV dtype; decode's /generate answers 503
    naming both KV dtypes (the bootstrap layout check runs before the fingerprint's)."""
    import asyncio
    import contextlib

    import httpx
    import server_fixtures
    from pd_fixtures import KV_SECRET, room_token

    boot = server_fixtures.free_port()
    env = {"KVSHIP_KV_TRANSFER_SECRET": KV_SECRET.decode()}
    common = ["--model-path", tiny_llama_dir, "--max-total-tokens", "2048", "--max-running-requests", "8"]
    with contextlib.ExitStack() as stack:
        p, d = server_fixtures.enter_together(
            stack,
            [
                server_fixtures.start_server(
                    common
                    + [
                        "--mode",
                        "prefill",
                        "--kv-cache-dtype",
                        "fp8_e4m3",
                        "--quantization",
                        "fp8",
                        "--disaggregation-bootstrap-port",
                        str(boot),
                    ],
                    env=env,
                ),  # fmt: skip
                server_fixtures.start_server(common + ["--mode", "decode"], env=env),
            ],
        )
        pi, di = p.get("/get_server_info").json(), d.get("/get_server_info").json()
        assert (pi["quantization"], pi["kv_cache_dtype"]) == ("fp8", "fp8_e4m3")
        assert (di["quantization"], di["kv_cache_dtype"]) == ("unquantized", "float32")
        assert pi["fingerprint"] != di["fingerprint"]
        body = {
            "input_ids": list(range(3, 40)),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": 4343,
            "bootstrap_token": room_token(4343),
        }

        async def pair() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as c:
                p_task = asyncio.create_task(c.post(p.url + "/generate", json=body))
                try:
                    return await c.post(d.url + "/generate", json=body)
                finally:
                    p_task.cancel()
                    with contextlib.suppress(BaseException):
                        await p_task

        r = asyncio.run(pair())
        assert r.status_code == 503, r.text
        assert "kv_dtype float8_e4m3fn != float32" in r.json()["error"]["message"], r.text


def test_kvship_local_passes_quantization_and_kv_cache_dtype_to_every_worker():
    import argparse

    from kvship.app.local import WorkerFlags, add_parser, worker_argv
    from kvship.common.cli_args import dataclass_from_namespace

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    ns = parser.parse_args(["local", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    argv = worker_argv(dataclass_from_namespace(WorkerFlags, ns))
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"


def test_fingerprint_includes_the_quant_method_and_kv_dtype(tiny_llama_dir):
    from kvship.engine import fingerprint as F

    args = dict(dtype="float32", kv_dtype="float32", page_size=1, engine_version="1")
    base = F.compute_fingerprint(tiny_llama_dir, **args)
    assert base.parts["quantization"] == "unquantized"
    assert F.compute_fingerprint(tiny_llama_dir, **{**args, "quantization": "fp8"}).hex != base.hex
    assert F.compute_fingerprint(tiny_llama_dir, **{**args, "kv_dtype": "fp8_e4m3"}).hex != base.hex
    assert F.quantization_of(tiny_llama_dir, None) == "unquantized"
    assert F.quantization_of(tiny_llama_dir, "fp8") == "fp8"

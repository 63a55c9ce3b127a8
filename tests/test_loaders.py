"""Weight loaders: sharded safetensors, dummy weights, GGUF (tiny files we write, and the embedded SmolLM2)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf_fixtures import llamacpp_permute, write_gguf

from kvship.engine.config import ServerArgs
from kvship.engine.loaders.base import resolve_load_format
from kvship.engine.loaders.gguf_loader import unpermute_qk
from kvship.engine.model_config import ModelConfig
from kvship.engine.model_runner import ModelRunner

ATOL = 1e-4
# Our GGUF model vs transformers' own GGUF loader: both dequantize the same
# blocks to float32, so they should agree to float32 rounding.
GGUF_ATOL = 1e-3


def _logits(runner, kv_driver, ids):
    drv = kv_driver(runner)
    req = drv.new()
    try:
        return drv.extend([req], [ids], all_logits=True)
    finally:
        drv.free(req)


def _hf_logits(path, ids, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# --- safetensors ----------------------------------------------------------------
def test_sharded_safetensors_with_index_loads_the_same_model(tmp_path, tiny_qwen2_dir, kv_driver):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="40KB"
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    ids = list(range(5, 30))
    one = _logits(ModelRunner(ServerArgs(model_path=tiny_qwen2_dir, max_total_tokens=64)), kv_driver, ids)
    many = _logits(ModelRunner(ServerArgs(model_path=str(sharded), max_total_tokens=64)), kv_driver, ids)
    assert torch.equal(one, many)
    assert (many - _hf_logits(tiny_qwen2_dir, ids)).abs().max().item() < ATOL


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_llama_dir):
        if not name.endswith(".safetensors"):
            (broken / name).write_bytes(open(os.path.join(tiny_llama_dir, name), "rb").read())
    state = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 weight"):
        ModelRunner(ServerArgs(model_path=str(broken), max_total_tokens=64))


def test_checkpoint_with_wrong_shape_names_the_tensor(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes(open(os.path.join(tiny_llama_dir, "config.json"), "rb").read())
    state = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj"):
        ModelRunner(ServerArgs(model_path=str(broken), max_total_tokens=64))


def test_load_format_auto_picks_by_path_and_checks_explicit_choices(tiny_llama_dir, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_load_format("auto", tiny_llama_dir) == "safetensors"
    assert resolve_load_format("auto", str(gguf)) == "gguf"
    assert resolve_load_format("dummy", tiny_llama_dir) == "dummy"
    with pytest.raises(ValueError, match="needs a .gguf file"):
        resolve_load_format("gguf", tiny_llama_dir)
    with pytest.raises(ValueError, match="needs a folder"):
        resolve_load_format("safetensors", str(gguf))


# --- dummy --------------------------------------------------------------------------
def test_dummy_weights_have_real_shapes_finite_outputs_and_depend_on_seed(tiny_llama_dir, kv_driver):
    ids = list(range(3, 20))
    runs = {}
    for seed in (0, 0, 1):
        r = ModelRunner(ServerArgs(model_path=tiny_llama_dir, load_format="dummy", seed=seed, max_total_tokens=64))
        out = _logits(r, kv_driver, ids)
        assert out.shape == (len(ids), 384) and torch.isfinite(out).all()
        assert r.model.model.layers[0].self_attn.qkv_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
        runs.setdefault(seed, []).append(out)
    assert torch.equal(runs[0][0], runs[0][1])
    assert not torch.equal(runs[0][0], runs[1][0])
    assert not torch.allclose(runs[0][0], _hf_logits(tiny_llama_dir, ids), atol=1e-2)


# --- GGUF: tiny files written here ----------------------------------------------------
def test_unpermute_qk_inverts_llamacpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((3 * 64,)).astype(np.float32)
    assert not np.array_equal(llamacpp_permute(w, 3), w)
    assert np.array_equal(unpermute_qk(torch.from_numpy(llamacpp_permute(w, 3)), 3).numpy(), w)
    assert np.array_equal(unpermute_qk(torch.from_numpy(llamacpp_permute(b, 3)), 3).numpy(), b)


@pytest.mark.parametrize(
    "key,arch", [("llama", "llama"), ("llama_tied", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")]
)
def test_tiny_gguf_file_matches_its_safetensors_source(key, arch, tiny_model_dirs, tmp_path, kv_driver):
    src = tiny_model_dirs[key]
    path = str(tmp_path / f"{key}.gguf")
    write_gguf(src, path, arch)
    cfg = ModelConfig.from_pretrained(path)
    hf_cfg = ModelConfig.from_pretrained(src)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.attention_bias == hf_cfg.attention_bias and cfg.qk_norm == hf_cfg.qk_norm
    assert (cfg.rope_scaling is not None) == (hf_cfg.rope_scaling is not None)
    ids = list(range(3, 200, 2))  # long enough for llama3 scaling to matter
    ours = _logits(ModelRunner(ServerArgs(model_path=path, max_total_tokens=256)), kv_driver, ids)
    assert (ours - _hf_logits(src, ids)).abs().max().item() < ATOL


# --- GGUF: the embedded SmolLM2 ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_runner(smollm2_path):
    return ModelRunner(ServerArgs(model_path=None, max_total_tokens=512, max_running_requests=4))


@pytest.fixture(scope="module")
def smollm2_chat_ids(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return tok, list(ids)


def test_embedded_smollm2_config_comes_from_gguf_metadata(smollm2_runner, smollm2_path):
    cfg = smollm2_runner.model_config
    assert smollm2_runner.model_path == smollm2_path
    assert cfg.architectures == ("LlamaForCausalLM",) and cfg.source_format == "gguf"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.context_len == 8192
    assert cfg.eos_token_ids == frozenset({2}) and cfg.bos_token_id == 1


def test_embedded_smollm2_greedy_answer_names_paris(smollm2_runner, smollm2_chat_ids, kv_driver):
    tok, ids = smollm2_chat_ids
    out = kv_driver(smollm2_runner).greedy(ids, 8, eos_ids=set(smollm2_runner.model_config.eos_token_ids))
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_embedded_smollm2_logits_match_transformers_gguf_loader(
    smollm2_runner, smollm2_chat_ids, smollm2_path, kv_driver
):
    _, ids = smollm2_chat_ids
    ours = _logits(smollm2_runner, kv_driver, ids)
    ref = _hf_logits(os.path.dirname(smollm2_path), ids, gguf_file=os.path.basename(smollm2_path))
    assert (ours - ref).abs().max().item() < GGUF_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

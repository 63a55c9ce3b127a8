"""ModelRunner: sizing of the pools, the attributes the scheduler relies on, modes and dtypes."""

from __future__ import annotations

import pytest
import torch

from kvship.engine.attention.torch_native import TorchNativeAttnBackend
from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardMode
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.model_runner import CPU_KV_BUDGET_BYTES, CPU_MAX_DEFAULT_TOKENS, REQ_POOL_HEADROOM, ModelRunner


def test_runner_exposes_pools_backend_and_sizes_the_scheduler_uses(tiny_llama_dir):
    r = ModelRunner(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=1000, page_size=16, max_running_requests=5))
    assert r.device == torch.device("cpu") and r.dtype == torch.float32
    assert r.page_size == 16
    assert r.context_len == r.model_config.context_len == 2048
    assert isinstance(r.req_to_token_pool, ReqToTokenPool)
    assert isinstance(r.kv_pool, KVPool) and isinstance(r.allocator, TokenToKVPoolAllocator)
    assert isinstance(r.attn_backend, TorchNativeAttnBackend)
    # 1000 tokens round down to whole pages of 16
    assert r.max_total_tokens == r.allocator.total_slots == 992
    assert r.kv_pool.num_slots == 992
    assert r.req_to_token_pool.size == 5 + REQ_POOL_HEADROOM
    assert r.req_to_token_pool.max_context_len == r.context_len + 16
    assert r.kv_pool.num_layers == 2 and r.kv_pool.num_kv_heads == 2 and r.kv_pool.head_dim == 16
    assert r.model_config.eos_token_ids == frozenset({2}) and r.model_config.bos_token_id == 1


def test_cpu_kv_pool_defaults_to_two_gib_capped_at_65536_tokens(tiny_llama_dir):
    r = ModelRunner(ServerArgs(model_path=tiny_llama_dir))
    per_token = 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, head dim, fp32
    assert r.max_total_tokens == min(CPU_MAX_DEFAULT_TOKENS, CPU_KV_BUDGET_BYTES // per_token)


def test_context_length_flag_lowers_the_context_and_rejects_longer(tiny_llama_dir):
    r = ModelRunner(ServerArgs(model_path=tiny_llama_dir, context_length=100, max_total_tokens=256))
    assert r.context_len == 100
    with pytest.raises(ValueError, match="longer than the model supports"):
        ModelRunner(ServerArgs(model_path=tiny_llama_dir, context_length=4096, max_total_tokens=256))


def test_num_threads_flag_sets_torch_threads(tiny_llama_dir):
    before = torch.get_num_threads()
    try:
        ModelRunner(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=64, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a .gguf"):
        ModelRunner(ServerArgs(model_path=str(tmp_path / "nope"), max_total_tokens=64))
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelRunner(ServerArgs(model_path=str(tmp_path), max_total_tokens=64))


def test_torch_native_backend_refuses_cuda_graphs_clearly(tiny_llama_dir):
    r = ModelRunner(ServerArgs(model_path=tiny_llama_dir, max_total_tokens=64))
    assert r.attn_backend.supports_cuda_graph is False
    idx = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="does not support CUDA graphs"):
        r.attn_backend.init_cuda_graph_state(8, 8)
    with pytest.raises(RuntimeError, match="does not support CUDA graphs"):
        r.attn_backend.init_forward_metadata_capture_cuda_graph(1, 1, idx, idx, ForwardMode.DECODE)
    with pytest.raises(RuntimeError, match="does not support CUDA graphs"):
        r.attn_backend.init_forward_metadata_replay_cuda_graph(1, idx, idx, 1, ForwardMode.DECODE)


def test_bfloat16_runner_stays_close_to_float32(tiny_qwen3_dir, kv_driver):
    ids = list(range(3, 30))
    out = {}
    for dtype in ("float32", "bfloat16"):
        r = ModelRunner(ServerArgs(model_path=tiny_qwen3_dir, dtype=dtype, max_total_tokens=128))
        assert r.kv_pool.dtype == getattr(torch, dtype)
        drv = kv_driver(r)
        req = drv.new()
        out[dtype] = drv.extend([req], [ids], all_logits=True)
        assert out[dtype].dtype == torch.float32
    diff = (out["float32"] - out["bfloat16"]).abs().max().item()
    assert diff < 0.1, diff


def test_greedy_generation_is_repeatable_and_frees_every_slot(tiny_llama_tied_dir, kv_driver):
    r = ModelRunner(ServerArgs(model_path=tiny_llama_tied_dir, max_total_tokens=128, page_size=4))
    drv = kv_driver(r)
    a = drv.greedy([1, 5, 9, 44, 100], 12)
    b = drv.greedy([1, 5, 9, 44, 100], 12)
    assert a == b and len(a) == 12
    assert r.allocator.available_size() == r.max_total_tokens
    assert r.req_to_token_pool.available_size() == r.req_to_token_pool.size


@pytest.mark.gpu
def test_cuda_runner_matches_cpu_logits(tiny_llama_dir, kv_driver):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    ids = list(range(3, 40))
    out = {}
    for device in ("cpu", "cuda"):
        r = ModelRunner(
            ServerArgs(
                model_path=tiny_llama_dir,
                device=device,
                dtype="float32",
                attention_backend="torch_native",
                max_total_tokens=256,
            )
        )
        drv = kv_driver(r)
        req = drv.new()
        out[device] = drv.extend([req], [ids], all_logits=True).cpu()
    assert (out["cpu"] - out["cuda"]).abs().max().item() < 1e-3

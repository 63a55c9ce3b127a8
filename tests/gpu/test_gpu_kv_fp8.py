"""The FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on the GPU backends (docs/quantization.md, "FP8 KV cache").

* The triton and flashinfer backends with an FP8 pool compute what torch_native computes with the same FP8 pool
  (the reference read ``float(e4m3) * scale``), through the model runner: the scenario of
  test_gpu_attention_backends (extend, extend over a cached prefix mixed with a fresh request, decode steps),
  page sizes 1 and 16, on tiny models whose checkpoints carry non-unit per-layer ``k_scale`` / ``v_scale``.
  The reference attends in fp32 over ``float(e4m3) * scale``; the backends round P to bf16 and FlashInfer
  applies ``v_scale`` to its bf16 output.  Tolerance: relative Frobenius error of every step's logits 3e-2 in
  bf16, 1e-4 in float32 under the Triton interpreter (the pool is written by torch there: the interpreter's
  fp32 -> e4m3 cast is wrong at rounding carries).
* The Triton store kernel quantizes to the very bytes ``quantize_kv`` (torch) makes.
* CUDA-graph decode with an FP8 pool gives the greedy tokens of eager decode (triton, flashinfer, flashinfer
  with the Triton one-kernel decode).
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_common import HAS_CUDA, cuda_or_interpreter, requires_flashinfer
from test_gpu_attention_backends import TINY, assert_close, run_scenario

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, cuda_or_interpreter]

GRAPH_BS = [1, 2, 4, 8, 16]


def write_kv_scales(model_dir: str, num_layers: int, k: float, v: float) -> None:
    """Add ``self_attn.k_scale`` / ``v_scale`` (layer i: ``k * (1 + i/4)``, ``v * (1 + i/4)``) to the folder's
    checkpoint, as an FP8-KV checkpoint carries them."""
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for i in range(num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k * (1 + i / 4), dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v * (1 + i / 4), dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[str, str]:
    from conftest import build_tiny_model

    out = {}
    for name, spec in TINY.items():
        spec = dict(spec)
        d = build_tiny_model(str(tmp_path_factory.mktemp(name)), spec.pop("arch"), seed=spec.pop("seed"), **spec)
        write_kv_scales(d, 2, 0.02, 0.015)
        out[name] = d
    return out


def make_runner(
    model_path: str, backend: str, page_size: int, graphs: bool = False, kv_cache_dtype: str = "fp8_e4m3"
) -> ModelRunner:
    return ModelRunner(
        ServerArgs(
            model_path=model_path,
            device="cuda" if HAS_CUDA else "cpu",
            dtype="bfloat16" if HAS_CUDA else "float32",
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
            page_size=page_size,
            max_total_tokens=8192,
            max_running_requests=16,
            context_length=1024,
            disable_cuda_graph=not graphs,
            cuda_graph_bs=GRAPH_BS,
            cuda_graph_max_bs=16,
        )
    )


_REFS: dict[tuple[str, int, str], list[torch.Tensor]] = {}


def _reference(model_path: str, page_size: int, driver_cls, kv: str) -> list[torch.Tensor]:
    key = (model_path, page_size, kv)
    if key not in _REFS:
        ref = make_runner(model_path, "torch_native", page_size, kv_cache_dtype=kv)
        if kv == "fp8_e4m3":
            assert ref.kv_pool.dtype == torch.float8_e4m3fn and ref.kv_pool.k_scales[1] == pytest.approx(0.025)
        _REFS[key] = run_scenario(ref, driver_cls)
        del ref
        gc.collect()
    return _REFS[key]


def check(model_path: str, backend: str, page_size: int, driver_cls) -> None:
    want = _reference(model_path, page_size, driver_cls, "fp8_e4m3")
    runner = make_runner(model_path, backend, page_size)
    got = run_scenario(runner, driver_cls)
    del runner
    gc.collect()
    if not HAS_CUDA:
        assert_close(got, want, 1e-4)
        return
    # bf16 on the GPU: a backend's attention output differs from the reference's in bf16 rounding, and the next
    # layer's K/V then round to a neighbouring e4m3 value here and there (a jump of up to 1/16 of the value), so
    # two correct implementations differ by a fraction of the FP8 KV quantization error itself.  Bound: 3e-2, or
    # 0.75x the reference's own distance from the same model with a bf16 pool where that is larger (a wrong
    # scale or layout moves the logits by far more than the whole quantization error).
    unquantized = _reference(model_path, page_size, driver_cls, "auto")
    names = ["extend", "extend over prefix"] + [f"decode {i}" for i in range(len(want) - 2)]
    for name, g, w, u in zip(names, got, want, unquantized):
        assert g.shape == w.shape and torch.isfinite(g).all(), name
        rel = ((g - w).norm() / w.norm()).item()
        quant = ((w - u).norm() / u.norm()).item()
        assert rel < max(3e-2, 0.75 * quant), f"{name}: relative error {rel:.2e} (FP8 KV error {quant:.2e})"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model", sorted(TINY))
def test_triton_backend_with_fp8_kv_matches_torch_native(fp8_dirs, kv_driver, model, page_size):
    check(fp8_dirs[model], "triton", page_size, kv_driver)


@pytest.mark.parametrize("triton_decode", ["none", "1-64"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model", sorted(TINY))
def test_flashinfer_backend_with_fp8_kv_matches_torch_native(
    fp8_dirs, kv_driver, model, page_size, triton_decode, monkeypatch
):
    if not HAS_CUDA:
        pytest.skip("flashinfer needs CUDA")
    requires_flashinfer()
    monkeypatch.setenv("KVSHIP_FLASHINFER_TRITON_DECODE_BS", triton_decode)
    check(fp8_dirs[model], "flashinfer", page_size, kv_driver)


def test_triton_store_kernel_quantizes_like_torch():
    if not HAS_CUDA:
        pytest.skip("the store kernel runs on CUDA (the interpreter's e4m3 cast is wrong at rounding carries)")
    from kvship.engine.attention.triton_ops.kv_store import quantize_new_kv, store_kv
    from kvship.engine.mem.pools import KVPool, quantize_kv

    pool = KVPool(256, 1, torch.float8_e4m3fn, 2, 64, 2, "cuda", k_scales=[0.02, 1.0], v_scales=[0.013, 0.5])
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(100, 128, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16) * 3
    v = torch.randn(100, 128, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16) * 3
    k[0, :4] = torch.tensor([1e4, -1e4, 0.0, 125.7 * 0.02], dtype=torch.bfloat16)  # clamps, zero, a carry
    loc = torch.arange(1, 101, device="cuda")
    for layer in (0, 1):
        ks, vs = pool.scales(layer)
        store_kv(pool, layer, loc, k, v)
        want_k = quantize_kv(k, ks).view(torch.uint8).view(100, 2, 64)
        want_v = quantize_kv(v, vs).view(torch.uint8).view(100, 2, 64)
        assert torch.equal(pool.k_buffer[layer][1:101].view(torch.uint8), want_k)
        assert torch.equal(pool.v_buffer[layer][1:101].view(torch.uint8), want_v)
        k8, v8 = quantize_new_kv(pool, layer, loc + 100, k, v)
        assert torch.equal(k8.view(torch.uint8), want_k) and torch.equal(v8.view(torch.uint8), want_v)
        assert torch.equal(pool.k_buffer[layer][101:201].view(torch.uint8), want_k)


def _greedy(runner: ModelRunner, driver_cls, bs: int, steps: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(500 + bs)
    vocab = runner.model_config.vocab_size
    d = driver_cls(runner)
    reqs = [d.new() for _ in range(bs)]
    prompts = [torch.randint(3, vocab, (5 + 7 * i,), generator=gen).tolist() for i in range(bs)]
    logits = d.extend(reqs, prompts)
    out: list[list[int]] = [[] for _ in range(bs)]
    for _ in range(steps):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits = d.decode(reqs, toks)
    for r in reqs:
        d.free(r)
    return out


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flashinfer+triton-decode"])
def test_cuda_graph_decode_with_fp8_kv_equals_eager(fp8_dirs, kv_driver, backend, monkeypatch):
    if not HAS_CUDA:
        pytest.skip("CUDA graphs need CUDA")
    if backend.startswith("flashinfer"):
        requires_flashinfer()
    monkeypatch.setenv("KVSHIP_FLASHINFER_TRITON_DECODE_BS", "1-8" if backend.endswith("decode") else "none")
    backend = backend.split("+")[0]
    model = fp8_dirs["qwen3_hd128_gqa4"]
    graph = make_runner(model, backend, 16, graphs=True)
    eager = make_runner(model, backend, 16, graphs=False)
    cgr = graph.cuda_graph_runner
    assert cgr is not None
    for bs in (1, 3, 16):
        before = cgr.replays
        got = _greedy(graph, kv_driver, bs)
        assert cgr.replays - before == 24, "decode steps did not replay graphs"
        assert got == _greedy(eager, kv_driver, bs), f"bs {bs}: graph and eager FP8-KV decode differ"
    del graph, eager
    gc.collect()
    torch.cuda.empty_cache()

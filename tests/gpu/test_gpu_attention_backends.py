"""The triton and flashinfer backends compute what torch_native computes, through the model runner.

Each case runs the same scenario on a backend's runner and on a torch_native
runner built from the same weights, on the same device and dtype:
1. extend of three fresh prompts (logits of every token);
2. extend over a cached prefix for those three plus a fresh request in the same
   batch (prefix and no-prefix rows mixed; one row extends by a single token);
3. six decode steps of all four.
Page sizes 1 and 16 (prompt lengths are not page multiples).

Tolerance, relative Frobenius error of every step's logits: 2e-2 in bf16 on a
GPU (both sides round attention outputs to bf16; the rest of the model is
shared), 1e-4 in float32 under the Triton interpreter on CPU.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from gpu_common import HAS_CUDA, cuda_or_interpreter, interpreter_mode, requires_flashinfer

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, cuda_or_interpreter]

TINY = {
    # group 2, head dim 64: FlashInfer's CUDA-core decode kernel
    "llama_hd64_gqa2": dict(
        arch="llama",
        seed=11,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # group 4, head dim 128, q/k norm: FlashInfer's tensor-core decode
    "qwen3_hd128_gqa4": dict(
        arch="qwen3",
        seed=12,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    from conftest import build_tiny_model

    out = {}
    for name, spec in TINY.items():
        spec = dict(spec)
        out[name] = build_tiny_model(
            str(tmp_path_factory.mktemp(name)), spec.pop("arch"), seed=spec.pop("seed"), **spec
        )
    return out


def smollm2_gguf() -> str:
    """The SmolLM2 GGUF to test on: $KVSHIP_SMOLLM2_GGUF (the device carries a layer subset) or the embedded one."""
    path = os.environ.get("KVSHIP_SMOLLM2_GGUF")
    if path:
        return path
    from kvship.engine.embedded import embedded_model_path

    try:
        return embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


def make_runner(model_path: str, backend: str, page_size: int) -> ModelRunner:
    dev = "cuda" if HAS_CUDA else "cpu"
    return ModelRunner(
        ServerArgs(
            model_path=model_path,
            device=dev,
            dtype="bfloat16" if HAS_CUDA else "float32",
            attention_backend=backend,
            page_size=page_size,
            max_total_tokens=8192,
            max_running_requests=16,
            context_length=1024,
            disable_cuda_graph=True,
        )
    )


def run_scenario(runner: ModelRunner, driver_cls, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    d = driver_cls(runner)
    a, b, c = d.new(), d.new(), d.new()
    out = [d.extend([a, b, c], [toks(37), toks(5), toks(130)], all_logits=True).float().cpu()]
    fresh = d.new()
    out.append(d.extend([a, b, c, fresh], [toks(20), toks(1), toks(17), toks(9)], all_logits=True).float().cpu())
    reqs = [a, b, c, fresh]
    for _ in range(6):
        out.append(d.decode(reqs, toks(len(reqs))).float().cpu())
    for r in reqs:
        d.free(r)
    return out


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    names = ["extend", "extend over prefix"] + [f"decode {i}" for i in range(len(want) - 2)]
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"{name}: non-finite logits"
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < tol, f"{name}: relative error {rel:.2e} >= {tol:.0e}"


_REFS: dict[tuple[str, int], list[torch.Tensor]] = {}


def reference(model_path: str, page_size: int, driver_cls) -> list[torch.Tensor]:
    key = (model_path, page_size)
    if key not in _REFS:
        runner = make_runner(model_path, "torch_native", page_size)
        _REFS[key] = run_scenario(runner, driver_cls)
        del runner
        gc.collect()
    return _REFS[key]


def check_backend(model_path: str, backend: str, page_size: int, driver_cls, tol: float) -> None:
    want = reference(model_path, page_size, driver_cls)
    runner = make_runner(model_path, backend, page_size)
    got = run_scenario(runner, driver_cls)
    del runner
    gc.collect()
    assert_close(got, want, tol)


def _tol() -> float:
    return 2e-2 if HAS_CUDA else 1e-4


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model", sorted(TINY))
def test_triton_backend_matches_torch_native_on_tiny_models(tiny_dirs, kv_driver, model, page_size):
    check_backend(tiny_dirs[model], "triton", page_size, kv_driver, _tol())


@pytest.mark.parametrize("triton_decode", ["none", "1-64"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model", sorted(TINY))
def test_flashinfer_backend_matches_torch_native_on_tiny_models(
    tiny_dirs, kv_driver, model, page_size, triton_decode, monkeypatch
):
    """Also with every decode batch on the Triton one-kernel decode (``KVSHIP_FLASHINFER_TRITON_DECODE_BS``)."""
    if not HAS_CUDA:
        pytest.skip("flashinfer needs CUDA")
    requires_flashinfer()
    monkeypatch.setenv("KVSHIP_FLASHINFER_TRITON_DECODE_BS", triton_decode)
    check_backend(tiny_dirs[model], "flashinfer", page_size, kv_driver, _tol())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_match_torch_native_on_smollm2(kv_driver, backend, page_size):
    if interpreter_mode():
        pytest.skip("SmolLM2 is too large for the Triton interpreter")
    if backend == "flashinfer":
        requires_flashinfer()
    check_backend(smollm2_gguf(), backend, page_size, kv_driver, 3e-2)

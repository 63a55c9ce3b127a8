"""Decode-shaped matmul kernels (engine/layers/skinny_gemm_cuda.py) against float64 references.

GPU: bf16 inputs, relative Frobenius error <= 1e-2.  CPU: ``TRITON_INTERPRET=1``
with float32 inputs, <= 1e-5.  Outputs are poisoned with NaN first, so an
element a program forgot to write fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_common import HAS_CUDA, cuda_or_interpreter, kernel_device

pytestmark = [pytest.mark.gpu, cuda_or_interpreter]


@pytest.fixture
def pdl_off(monkeypatch):
    """The RMSNorm-in-GEMV kernel declines under programmatic dependent launch (on by default on Hopper), so its
    tests pin PDL off, and leave the per-device PDL cache as they found it (empty)."""
    from kvship.engine.layers import fused_dispatch

    monkeypatch.setenv("KVSHIP_PDL", "0")
    fused_dispatch._PDL.clear()
    yield
    fused_dispatch._PDL.clear()


@pytest.fixture(scope="module")
def sg():
    from kvship.engine.layers import skinny_gemm_cuda

    return skinny_gemm_cuda


def _dtype() -> torch.dtype:
    return torch.bfloat16 if HAS_CUDA else torch.float32


def _tol() -> float:
    return 1e-2 if HAS_CUDA else 1e-5


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    assert not torch.isnan(out).any(), "kernel left NaN (unwritten or bad math)"
    ref = ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def _silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    g = x[:, :d].double()
    return g * torch.sigmoid(g) * x[:, d:].double()


# (m, n, k, act, bias, config) -- config None: what pick_config chooses; tiles are small for the interpreter
CASES = [
    (1, 96, 256, 0, False, ("gemv", 1, 4, 64, 4)),
    (1, 100, 200, 0, True, ("gemv", 1, 8, 64, 4)),  # N and K not multiples of the tile: masked path
    (1, 64, 128, 1, False, ("gemv", 1, 2, 128, 8)),  # SiLU-and-mul fused into the input
    (2, 72, 192, 1, True, ("gemv", 2, 8, 64, 8)),
    (3, 64, 128, 0, False, ("gemv", 4, 4, 32, 4)),  # 3 rows in a 4-row tile
    (7, 48, 96, 0, True, ("gemv", 8, 2, 32, 4)),
    (5, 64, 128, 0, False, ("mma", 16, 16, 32, 4)),  # tensor-core kernel with most rows padding
    (20, 80, 160, 1, False, ("mma", 16, 16, 32, 4)),  # two row blocks, fused activation
    (33, 64, 96, 0, True, ("mma", 32, 32, 32, 4)),  # uneven K
    (64, 96, 128, 0, False, ("mma", 64, 32, 64, 4)),
]


def _cfg(sg, spec):
    kind, bm, bn, bk, warps = spec
    return sg.SkinnyConfig(kind == "mma", bm, bn, bk, num_warps=warps, num_stages=1 if kind == "gemv" else 2)


@pytest.mark.parametrize("m,n,k,act,bias,spec", CASES)
def test_linear_matches_reference(sg, m, n, k, act, bias, spec):
    dev, dt = kernel_device(), _dtype()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, 2 * k if act else k, generator=g).to(dev, dt)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dev, dt)
    b = torch.randn(n, generator=g).to(dev, dt) if bias else None
    xin = _silu_mul_ref(x) if act else x.double()
    ref = xin.cpu() @ w.double().cpu().t() + (b.double().cpu() if bias else 0)
    y = torch.full((m, n), float("nan"), dtype=dt, device=dev)
    sg.launch(x, w, b, y, sg.ACT_SILU_MUL if act else sg.ACT_NONE, _cfg(sg, spec))
    assert _rel(y, ref) < _tol()


@pytest.mark.parametrize(
    "m,n,k,bias,residual", [(1, 96, 256, False, True), (1, 100, 200, True, False), (3, 64, 128, False, True)]
)
@pytest.mark.parametrize("keep_normed", [False, True])
def test_norm_linear_equals_rmsnorm_then_linear(sg, monkeypatch, pdl_off, m, n, k, bias, residual, keep_normed):
    """The RMSNorm computed in the GEMV's input (a pre-norm block's entry) gives the norm layer then the matmul:
    the same residual sum, the same normalised rows when asked, the product within the matmul tolerance; and
    it declines what it cannot run (more rows than its tile, a mismatched norm weight)."""
    from kvship.engine.layers.fused_ops_cuda import rmsnorm

    dev, dt = kernel_device(), _dtype()
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(dev, dt)
    res = torch.randn(m, k, generator=g).to(dev, dt) if residual else None
    nw = (torch.rand(k, generator=g) + 0.5).to(dev, dt)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dev, dt)
    b = torch.randn(n, generator=g).to(dev, dt) if bias else None
    monkeypatch.setattr(sg, "pick_config", lambda m_, n_, k_: _cfg(sg, ("gemv", sg.bucket(m_), 4, 64, 4)))
    y, res_out, normed = sg.norm_linear(x, res, nw, 1e-6, w, b, keep_normed)
    if res is None:
        want_h, want_res = rmsnorm(x, nw, 1e-6), x
    else:
        want_h, want_res = rmsnorm(x, nw, 1e-6, res)
    ref = want_h.double().cpu() @ w.double().cpu().t() + (b.double().cpu() if bias else 0)
    assert _rel(y, ref) < _tol()
    assert torch.equal(res_out, want_res)
    if keep_normed:
        tol = 1e-2 if HAS_CUDA else 1e-6  # bf16: one ulp (the sum of squares runs in another order)
        assert torch.allclose(normed.float(), want_h.float(), rtol=tol, atol=tol)
    else:
        assert normed is None
    assert sg.norm_linear(x, res, nw[:-1], 1e-6, w) is None
    monkeypatch.setattr(sg, "pick_config", lambda m_, n_, k_: _cfg(sg, ("mma", 16, 16, 32, 4)))
    assert sg.norm_linear(x, res, nw, 1e-6, w) is None  # the tensor-core kernel does not take the norm


def test_pick_config_table_and_fallbacks(sg):
    # the tuned H100 table: GEMV at batch 1, cuBLAS where it won
    assert sg.pick_config(1, 4096, 4096) == sg.SkinnyConfig(False, 1, 2, 2048, num_warps=4)
    assert not sg.pick_config(1, 6144, 4096).mma
    assert sg.pick_config(4, 28672, 4096) is None
    assert sg.pick_config(3, 6144, 4096) is None  # bucket 4
    assert sg.pick_config(12, 4096, 4096).mma  # bucket 16
    assert sg.pick_config(65, 4096, 4096) is None  # beyond the kernels: cuBLAS
    # an untuned shape: GEMV at batch 1 only
    assert sg.pick_config(1, 1000, 768) == sg.SkinnyConfig(False, 1, 2, 1024, num_warps=4)
    assert sg.pick_config(2, 1000, 768) is None
    for (n, k, b), cfg in sg.TUNED.items():
        assert cfg is None or cfg.mma or cfg.block_m >= b, f"GEMV config for bucket {b} of ({n}, {k}) is too short"


def test_applies_rejects_what_it_cannot_run(sg, monkeypatch):
    dev, dt = kernel_device(), _dtype()
    w = torch.randn(64, 128, device=dev, dtype=dt)
    assert sg.applies(torch.randn(1, 128, device=dev, dtype=dt), w)
    assert not sg.applies(torch.randn(65, 128, device=dev, dtype=dt), w)  # too many rows
    assert not sg.applies(torch.randn(1, 64, device=dev, dtype=dt), w)  # wrong K
    assert sg.applies(torch.randn(1, 256, device=dev, dtype=dt), w, sg.ACT_SILU_MUL)
    assert not sg.applies(torch.randn(1, 128, device=dev, dtype=dt), w.t().contiguous().t())  # K-major weight
    assert not sg.applies(torch.randn(2, 3, 128, device=dev, dtype=dt), w)  # not 2-D
    if HAS_CUDA:
        assert not sg.applies(torch.randn(1, 128, device=dev), w.float())  # float32: cuBLAS
    monkeypatch.setenv("KVSHIP_DISABLE_SKINNY_GEMM", "1")
    assert not sg.applies(torch.randn(1, 128, device=dev, dtype=dt), w)
    with pytest.raises(ValueError, match="block_m"):
        sg.launch(
            torch.randn(3, 128, device=dev, dtype=dt),
            w,
            None,
            torch.empty(3, 64, device=dev, dtype=dt),
            sg.ACT_NONE,
            sg.SkinnyConfig(False, 2, 8, 64),
        )


@pytest.mark.skipif(not HAS_CUDA, reason="the model-level path runs on CUDA tensors only")
def test_layers_use_the_kernels_at_decode_batch_sizes(sg, monkeypatch):
    """Linear / MLP / LM head on CUDA give F.linear's result at decode sizes (same call sites the model uses), and
    the kernel that ran is the one ``pick_config`` chose: the GEMV, the tensor-core MMA kernel, or none (cuBLAS)."""
    from kvship.engine.layers.activation import GatedActivation
    from kvship.engine.layers.linear import Linear, gated_linear

    launched: list[tuple[str, int, tuple[int, int], int]] = []
    real_launch = sg.launch

    def recording_launch(x, w, bias, y, act, cfg):
        launched.append(("mma" if cfg.mma else "gemv", x.shape[0], tuple(w.shape), act))
        return real_launch(x, w, bias, y, act, cfg)

    monkeypatch.setattr(sg, "launch", recording_launch)

    def expected(m: int, w: torch.Tensor, act: int) -> list[tuple[str, int, tuple[int, int], int]]:
        cfg = sg.pick_config(m, *w.shape)
        return [] if cfg is None else [("mma" if cfg.mma else "gemv", m, tuple(w.shape), act)]

    dt = torch.bfloat16
    lin = Linear(4096, 4096, dtype=dt).cuda()
    down = Linear(14336, 4096, dtype=dt).cuda()
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        down.weight.normal_(0, 0.02)
    seen: set[str] = set()
    for m in (1, 2, 3, 8, 16, 40, 64, 100):
        x = torch.randn(m, 4096, device="cuda", dtype=dt)
        launched.clear()
        assert _rel(lin(x), F.linear(x.float(), lin.weight.float())) < 1e-2
        assert launched == expected(m, lin.weight, sg.ACT_NONE), f"m={m}: wrong kernel for o_proj"
        seen.update(k for k, *_ in launched or [("cublas",)])
        gu = torch.randn(m, 2 * 14336, device="cuda", dtype=dt)
        act = GatedActivation("silu")
        launched.clear()
        assert _rel(gated_linear(down, act, gu), F.linear(act(gu).float(), down.weight.float())) < 1e-2
        assert launched == expected(m, down.weight, sg.ACT_SILU_MUL), f"m={m}: wrong kernel for down_proj"
        seen.update(k for k, *_ in launched or [("cublas",)])
    assert seen == {"gemv", "mma", "cublas"}, f"the sizes above must exercise every path, saw {seen}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_tied"])
def test_model_decode_through_the_kernels(arch, tiny_model_dirs, kv_driver, monkeypatch, pdl_off):
    """Whole-model decode steps with every batch-1 projection on these kernels (q/k/v, o, gate/up, down with the
    SiLU-and-mul fused in, LM head).  CPU (interpreter, float32): logits equal transformers within 1e-4.  CUDA (bf16):
    logits equal the same model on cuBLAS (``KVSHIP_DISABLE_SKINNY_GEMM=1``) within bf16 noise."""
    from kvship.engine.config import ServerArgs
    from kvship.engine.layers import linear as linear_mod
    from kvship.engine.layers import rmsnorm as rmsnorm_mod
    from kvship.engine.layers import skinny_gemm_cuda
    from kvship.engine.model_runner import ModelRunner

    calls = {"linear": 0, "silu": 0, "norm": 0}
    real_linear, real_norm_linear = skinny_gemm_cuda.linear, skinny_gemm_cuda.norm_linear

    def counted_linear(*a, **kw):
        out = real_linear(*a, **kw)
        calls["linear"] += out is not None
        calls["silu"] += out is not None and kw.get("act") == skinny_gemm_cuda.ACT_SILU_MUL
        return out

    def counted_norm_linear(*a, **kw):  # a pre-norm block's entry: the RMSNorm inside the GEMV's input
        out = real_norm_linear(*a, **kw)
        calls["linear"] += out is not None
        calls["norm"] += out is not None
        return out

    monkeypatch.setattr(skinny_gemm_cuda, "linear", counted_linear)
    monkeypatch.setattr(skinny_gemm_cuda, "norm_linear", counted_norm_linear)
    if not HAS_CUDA:  # the interpreter runs the kernels on CPU tensors
        monkeypatch.setattr(linear_mod, "cuda_skinny_gemm", lambda t: skinny_gemm_cuda)
        monkeypatch.setattr(rmsnorm_mod, "cuda_skinny_gemm", lambda t: skinny_gemm_cuda)
    dev = "cuda" if HAS_CUDA else "cpu"
    dtype = "bfloat16" if HAS_CUDA else "float32"
    path = tiny_model_dirs[arch]
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 380, (9,), generator=g).tolist()
    follow = torch.randint(3, 380, (4,), generator=g).tolist()

    def run() -> torch.Tensor:
        runner = ModelRunner(
            ServerArgs(
                model_path=path,
                device=dev,
                dtype=dtype,
                max_total_tokens=256,
                max_running_requests=2,
                attention_backend="torch_native",
                disable_cuda_graph=True,
            )
        )
        drv = kv_driver(runner)
        req = drv.new()
        try:
            drv.extend([req], [prompt])
            return torch.stack([drv.decode([req], [t])[0] for t in follow]).float().cpu()
        finally:
            drv.free(req)

    ours = run()
    # per decode step: q/k/v and gate/up (their RMSNorm inside), o and down (activation fused) in every layer,
    # plus the LM head
    layers = 2
    assert calls["linear"] >= (4 * layers + 1) * len(follow) and calls["silu"] >= layers * len(follow)
    assert calls["norm"] >= 2 * layers * len(follow)
    if HAS_CUDA:
        monkeypatch.setenv("KVSHIP_DISABLE_SKINNY_GEMM", "1")
        ref = run()
        assert (ours - ref).abs().max().item() < 5e-2 * max(1.0, ref.abs().max().item())
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + follow])).logits[0, len(prompt) :].float()
        assert (ours - ref).abs().max().item() < 1e-4

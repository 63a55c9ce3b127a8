"""The split-KV MLA decode kernel (engine/attention/mla_triton.py) against the torch reference backend.

Runs under Triton's interpreter on CPU (``TRITON_INTERPRET=1``: tests/test_deepseek.py starts it in a
child pytest) or natively on CUDA.  float32; the sums run in another order than SDPA's, so 1e-5.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton MLA kernel: needs CUDA, or TRITON_INTERPRET=1 on CPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, buf, r2t, rows, lens, r, scale):
    out = []
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        lat = buf[r2t[row, :n].long(), 0].float()  # [n, D]
        s = torch.einsum("hd,nd->hn", q[b].float(), lat) * scale
        out.append(torch.softmax(s, dim=-1) @ lat[:, :r])
    return torch.stack(out)


@pytest.mark.parametrize("heads,r,p,splits", [(4, 32, 8, 4), (20, 32, 16, 8), (3, 24, 8, 1)])
def test_split_kv_mla_decode_equals_the_reference(heads, r, p, splits):
    from kvship.engine.attention.mla_triton import mla_decode

    g = torch.Generator().manual_seed(heads + r)
    lens = torch.tensor([1, 7, 45, 70])  # shorter and longer than the splits and the 32-token blocks
    slots = torch.randperm(200, generator=g)[: int(lens.sum())] + 1  # scattered slots; 0 is the padding slot
    r2t = torch.zeros((6, 80), dtype=torch.int32)
    rows = torch.tensor([5, 0, 3, 2])
    off = 0
    for row, n in zip(rows.tolist(), lens.tolist()):
        r2t[row, :n] = slots[off : off + n].to(torch.int32)
        off += n
    buf = torch.randn((201, 1, r + p), generator=g)
    q = torch.randn((4, heads, r + p), generator=g)
    scale = (r + p) ** -0.5
    args = [t.to(DEVICE) for t in (q, buf, r2t, rows, lens)]
    got = mla_decode(*args[:3], args[3], args[4], r, scale, num_splits=splits)
    ref = _reference(q, buf, r2t, rows, lens, r, scale)
    assert got.shape == (4, heads, r)
    assert torch.allclose(got.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_mla_decode_refuses_mismatched_latent_rows():
    from kvship.engine.attention.mla_triton import mla_decode

    with pytest.raises(ValueError, match="do not match queries"):
        mla_decode(
            torch.zeros(1, 2, 40),
            torch.zeros(4, 1, 36),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            32,
            1.0,
        )


def test_triton_mla_backend_decodes_like_the_torch_backend(tmp_path, kv_driver):
    """A tiny DeepSeek-V3 through the model runner: ``--attention-backend triton`` (this kernel for decode)
    gives the torch_native backend's logits at every decode step."""
    from deepseek_fixtures import build_tiny_deepseek

    from kvship.engine.attention.mla_triton import MLATritonBackend
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    path = build_tiny_deepseek(str(tmp_path), "v3_yarn_grouped", seed=30)
    runs = {}
    for backend in ("torch_native", "triton"):
        sa = ServerArgs(model_path=path, device=DEVICE, max_total_tokens=256, attention_backend=backend)
        runner = ModelRunner(sa)
        drv = kv_driver(runner)
        reqs = [drv.new(), drv.new()]
        drv.extend(reqs, [list(range(5, 22)), list(range(40, 45))])
        runs[backend] = [drv.decode(reqs, [7 + i, 9 + i]) for i in range(2)]
        if backend == "triton":
            assert isinstance(runner.attn_backend, MLATritonBackend)
    for a, b in zip(runs["torch_native"], runs["triton"]):
        assert (a - b).abs().max().item() < 1e-4

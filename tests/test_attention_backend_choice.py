"""A model whose head dim FlashInfer's kernels lack never reaches them (docs/gpu.md, "Using it").

``--attention-backend auto`` passes FlashInfer by for it, and an explicit ``flashinfer`` is refused when the
backend is built, before anything touches a device or a FlashInfer kernel.  CPU only: FlashInfer is not
installed here, so the constructor check runs against an empty stand-in module in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvship.engine.attention.backend_choice import (
    FLASHINFER_HEAD_DIMS,
    auto_attention_backend,
    flashinfer_head_dim_error,
    flashinfer_head_dim_ok,
)
from kvship.engine.config import ServerArgs


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_flashinfer_takes_its_kernel_head_dims(head_dim):
    assert flashinfer_head_dim_ok(head_dim)


@pytest.mark.parametrize("head_dim", [8, 16, 32, 80, 96, 112, 192, 512])
def test_flashinfer_refuses_other_head_dims(head_dim):
    assert not flashinfer_head_dim_ok(head_dim)


def test_refusal_names_the_head_dim_the_supported_ones_and_the_way_out():
    msg = flashinfer_head_dim_error(16)
    assert "head_dim is 16" in msg
    assert "64, 128, 256" in msg
    assert "--attention-backend triton" in msg


@pytest.mark.parametrize(
    "device, head_dim, flashinfer, triton, want",
    [
        ("cuda", 128, True, True, "flashinfer"),
        ("cuda", 64, True, False, "flashinfer"),
        ("cuda", 16, True, True, "triton"),  # the tiny test model: FlashInfer would fail mid-request
        ("cuda", 96, True, True, "triton"),
        ("cuda", 16, True, False, "torch_native"),
        ("cuda", 128, False, True, "triton"),
        ("cuda", 128, False, False, "torch_native"),
        ("cpu", 128, True, True, "torch_native"),
        ("cpu", 16, True, True, "torch_native"),
    ],
)
def test_auto_picks_flashinfer_only_for_head_dims_it_takes(device, head_dim, flashinfer, triton, want):
    assert auto_attention_backend(device, head_dim, flashinfer, triton) == want


@pytest.fixture
def flashinfer_and_triton_findable(tmp_path: Path, monkeypatch) -> None:
    """Empty ``flashinfer`` and ``triton`` packages first on sys.path: ``find_spec`` finds them (nothing
    imports them), as on a CUDA machine with both installed."""
    for name in ("flashinfer", "triton"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_server_args_auto_on_cuda_skips_flashinfer_for_head_dim_16(flashinfer_and_triton_findable):
    sa = ServerArgs(device="cuda", attention_backend="auto")
    assert sa.resolved_attention_backend(16) == "triton"
    assert sa.resolved_attention_backend(128) == "flashinfer"


def test_server_args_explicit_flashinfer_is_kept_for_any_head_dim():
    # only auto falls back; an explicit choice reaches the backend, which refuses it (below)
    assert ServerArgs(device="cuda", attention_backend="flashinfer").resolved_attention_backend(16) == "flashinfer"
    assert ServerArgs(device="cpu", attention_backend="auto").resolved_attention_backend(16) == "torch_native"


def test_attention_backend_help_names_flashinfer_head_dims():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--attention-backend" in a.option_strings]
    assert "/".join(map(str, FLASHINFER_HEAD_DIMS)) in action.help


_CONSTRUCT = textwrap.dedent("""
    import sys, types
    import torch

    sys.modules["flashinfer"] = types.ModuleType("flashinfer")  # not installed here; the module imports it
    from kvship.engine.attention.base import AttentionContext, create_attention_backend
    from kvship.engine.mem.pools import ReqToTokenPool

    for head_dim in (16, 96, 64):
        ctx = AttentionContext(
            device=torch.device("cpu"), dtype=torch.bfloat16, kv_dtype=torch.bfloat16, num_heads=4,
            num_kv_heads=2, head_dim=head_dim, page_size=1, req_to_token_pool=ReqToTokenPool(2, 8, "cpu"),
            max_running_requests=2,
        )
        try:
            create_attention_backend("flashinfer", ctx)
        except ValueError as e:
            print(f"{head_dim}: {e}")
        else:
            print(f"{head_dim}: built")
""")


def test_explicit_flashinfer_refuses_head_dim_16_before_touching_device_or_kernels():
    res = subprocess.run([sys.executable, "-c", _CONSTRUCT], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in res.stdout.strip().splitlines())
    assert lines["16"] == flashinfer_head_dim_error(16)
    assert lines["96"] == flashinfer_head_dim_error(96)
    # a head dim it takes passes the check and meets the next one (this CPU device), not a head-dim refusal
    assert lines["64"] == "the flashinfer attention backend needs a CUDA device"

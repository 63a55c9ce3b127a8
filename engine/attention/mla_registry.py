"""Which MLA attention backend a DeepSeek model gets for ``--attention-backend`` (docs/deepseek.md).

``torch_native``: the reference (kvship.engine.attention.mla); ``triton``: its Triton kernels
(kvship.engine.attention.mla_triton: split-KV decode, extend, tree verify, CUDA graphs), imported only when
asked for.  ``auto``: ``triton`` on a CUDA device where Triton imports, else ``torch_native``.
"""

from __future__ import annotations

import importlib.util
import os

from kvship.engine.attention.base import AttentionContext
from kvship.engine.attention.mla import MLATorchBackend

# the --attention-backend names a DeepSeek model accepts
MLA_BACKENDS = ("torch_native", "triton")


def create_mla_attention_backend(name: str, ctx: AttentionContext) -> MLATorchBackend:
    """The MLA backend for ``--attention-backend name`` (``auto``: module docstring); ValueError naming the
    MLA backends for any other name, and for ``triton`` where its kernel cannot run (no Triton; a CPU device
    outside Triton's interpreter, ``TRITON_INTERPRET=1``, which tests use)."""
    if name == "auto":
        name = (
            "triton" if ctx.device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch_native"
        )
    if name not in MLA_BACKENDS:
        raise ValueError(
            f"attention backend '{name}' has no MLA (DeepSeek) path; use --attention-backend "
            f"{' or '.join(MLA_BACKENDS)} (docs/deepseek.md)"
        )
    if name == "torch_native":
        return MLATorchBackend(ctx)
    if ctx.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton MLA backend needs a CUDA device; use --attention-backend torch_native")
    try:
        from kvship.engine.attention.mla_triton import MLATritonBackend
    except ImportError as e:
        raise ValueError(f"the triton MLA backend is unavailable here: {e}") from e
    return MLATritonBackend(ctx)

"""Which attention backend a model gets, decided before any backend module (or torch) is imported.

FlashInfer's paged decode and prefill kernels exist for the head dims in ``FLASHINFER_HEAD_DIMS`` only; a
model of another head dim must not reach them (it would start, then fail inside FlashInfer's merge kernel
in the middle of a request).  So:

* ``--attention-backend flashinfer`` with such a model is refused when the backend is built
  (``FlashInferAttnBackend``, ValueError with ``flashinfer_head_dim_error``): the worker exits at startup;
* ``--attention-backend auto`` passes FlashInfer by for it (``auto_attention_backend``): ``triton`` on CUDA
  where Triton imports, else ``torch_native``.

DeepSeek (MLA) models choose among their own backends (``mla_registry``); none of this applies to them.
User-facing rules: docs/gpu.md, "Using it".
"""

from __future__ import annotations

# head dims FlashInfer's kernels take (the FlashInfer backend refuses any other; ``auto`` skips it)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_head_dim_ok(head_dim: int) -> bool:
    """Whether FlashInfer's attention kernels take a model of ``head_dim``."""
    return head_dim in FLASHINFER_HEAD_DIMS


def flashinfer_head_dim_error(head_dim: int) -> str:
    """The startup error for ``--attention-backend flashinfer`` with a model of ``head_dim`` FlashInfer lacks."""
    dims = ", ".join(str(d) for d in FLASHINFER_HEAD_DIMS)
    return (
        f"the flashinfer attention backend cannot run this model: its head_dim is {head_dim}, FlashInfer's "
        f"kernels take head_dim {dims}; use --attention-backend triton (or auto, which picks triton for it)"
    )


def auto_attention_backend(device_type: str, head_dim: int, flashinfer_available: bool, triton_available: bool) -> str:
    """The backend ``--attention-backend auto`` means for a (non-MLA) model of ``head_dim`` on ``device_type``:
    ``flashinfer`` on CUDA when it is installed and takes ``head_dim``, else ``triton`` on CUDA when it is
    installed, else ``torch_native``."""
    if device_type == "cuda":
        if flashinfer_available and flashinfer_head_dim_ok(head_dim):
            return "flashinfer"
        if triton_available:
            return "triton"
    return "torch_native"

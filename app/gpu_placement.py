"""Which GPUs each worker of ``kvship local`` runs on (``--gpu-placement``, docs/pd.md "kvship local").

``spread`` (the default) gives every worker its own ``--base-gpu-id``: prefill
workers first, then decode, each on the next ``--tp-size`` consecutive GPUs,
starting again at ``--base-gpu-id`` once the visible GPUs are taken (workers
then share them).  ``shared`` puts every worker on ``--base-gpu-id``.  Off
CUDA nothing is placed.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def spread_gpus(tp_sizes: Sequence[int], num_gpus: int, base_gpu_id: int = 0) -> list[int]:
    """Each worker's ``--base-gpu-id`` for ``--gpu-placement spread``, given the workers' TP sizes in start order.

    Worker ``i`` takes the ``tp_sizes[i]`` consecutive GPUs after the previous worker's; when its group would
    pass the last visible GPU it starts again at ``base_gpu_id``, and from there on workers share GPUs (each
    then needs ``--max-total-tokens``, see docs/pd.md "kvship local").  ``ValueError`` when one worker's group
    does not fit between ``base_gpu_id`` and the last GPU at all.
    """
    out: list[int] = []
    nxt = base_gpu_id
    for tp in tp_sizes:
        if base_gpu_id + tp > num_gpus:
            need = base_gpu_id + tp
            raise ValueError(f"--tp-size {tp} from --base-gpu-id {base_gpu_id} needs {need} GPUs, {num_gpus} visible")
        if nxt + tp > num_gpus:
            nxt = base_gpu_id
        out.append(nxt)
        nxt += tp
    return out


def worker_gpus(cfg: Any, flags: Any, device: str, num_gpus: Optional[int] = None) -> Optional[list[int]]:
    """Every worker's ``--base-gpu-id`` in start order (prefill workers, then decode), or None off CUDA.

    ``flags``: the pass-through worker flags (their ``tp_size`` and ``base_gpu_id``).  ``num_gpus`` defaults
    to the GPUs this process sees (``torch.cuda.device_count()``: ``CUDA_VISIBLE_DEVICES`` applies, and the
    children inherit it)."""
    if device != "cuda":
        return None
    tp_sizes = [cfg.prefill_tp_size or flags.tp_size] * cfg.prefill
    tp_sizes += [cfg.decode_tp_size or flags.tp_size] * cfg.decode
    if cfg.gpu_placement == "shared":
        return [flags.base_gpu_id] * len(tp_sizes)
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count()
    return spread_gpus(tp_sizes, num_gpus, flags.base_gpu_id)

"""Which GPUs each worker of ``kvship local`` runs on (``--gpu-placement``, docs/pd.md "kvship local").

``spread`` (the default) gives every worker its own ``--base-gpu-id``: prefill
workers first, then decode, each on the next ``--tp-size`` consecutive GPUs,
starting again at ``--base-gpu-id`` once the visible GPUs are taken (workers
then share them).  A worker spanning ``--nnodes`` N is N node processes, each
placed like a worker of ``--tp-size x --pp-size / N`` GPUs (node 0 first), so its nodes
never share a GPU while enough are visible.  ``shared`` puts every node on
``--base-gpu-id``.  Off CUDA nothing is placed.
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


def worker_layout(cfg: Any, role: str, tp_size: int, nnodes: int, pp_size: int = 1) -> tuple[int, int]:
    """(``--tp-size``, ``--nnodes``) of each ``role`` worker of ``kvship local``: the role's own flags
    (``--prefill-tp-size``, ``--decode-nnodes``, ...; 0 = the shared ``tp_size`` / ``nnodes``).  ValueError when
    its ``tp x pp_size`` ranks do not split evenly over its nodes."""
    tp = (cfg.prefill_tp_size if role == "prefill" else cfg.decode_tp_size) or tp_size
    n = (cfg.prefill_nnodes if role == "prefill" else cfg.decode_nnodes) or nnodes
    if n < 1 or (tp * pp_size) % n:
        sizes = f"--tp-size {tp}" + (f" x --pp-size {pp_size}" if pp_size > 1 else "")
        raise ValueError(
            f"a {role} worker's {sizes} ranks do not split evenly over its {n} nodes "
            f"(--{role}-nnodes / --nnodes); each node runs world / nnodes ranks"
        )
    return tp, n


def worker_gpus(
    cfg: Any, flags: Any, device: str, num_gpus: Optional[int] = None, pp_size: int = 1
) -> Optional[list[int]]:
    """Every worker node's ``--base-gpu-id`` in start order (prefill workers, then decode; a worker's nodes
    from node 0 on), or None off CUDA.

    ``flags``: the pass-through worker flags (their ``tp_size``, ``nnodes`` and ``base_gpu_id``); ``pp_size``:
    their pipeline stages (a worker has ``tp x pp_size`` ranks, one GPU each).  ``num_gpus``
    defaults to the GPUs this process sees (``torch.cuda.device_count()``: ``CUDA_VISIBLE_DEVICES`` applies, and
    the children inherit it)."""
    if device != "cuda":
        return None
    tp_sizes: list[int] = []  # one entry per node process
    for role, count in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        pp = cfg.prefill_pp_size if role == "prefill" and cfg.prefill_pp_size else pp_size  # --prefill-pp-size
        tp, nnodes = worker_layout(cfg, role, flags.tp_size, flags.nnodes, pp)
        tp_sizes += [tp * pp // nnodes] * (nnodes * count)
    if cfg.gpu_placement == "shared":
        return [flags.base_gpu_id] * len(tp_sizes)
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count()
    return spread_gpus(tp_sizes, num_gpus, flags.base_gpu_id)

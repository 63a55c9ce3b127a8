"""Two independent branches of a layer on two CUDA streams (docs/deepseek.md, "Two streams").

At decode sizes a layer's kernels are latency-bound: each reads a few MB and spends part of its time
starting and draining, with the GPU's bandwidth half used.  Where a layer has two branches that share
only their input (DeepSeekMoE's shared experts and its router + routed experts; MLA's absorbed query
and the norm / rotary / latent-store kernel), ``beside`` runs one of them on a side stream so their
kernels overlap: the side stream waits for the current stream (the branches' input is ready), the two
branches are issued, and the current stream waits for the side stream before anything reads the
side branch's output.  CUDA-graph capture records the fork and the join as graph edges, so a replay
keeps the overlap.

A branch issues no collective (the caller arranges that: under tensor parallelism both branches leave
their partial sums, summed and all-reduced once after the join), since two collectives of one group on
two streams could run in different orders on different ranks.  Memory: the side branch's tensors come
from the side stream's pool; they are read on the current stream only after the join, and the side
stream's next work waits for the current stream first, so a block is never reused while a read of it
is pending.  On CPU, above ``KVSHIP_SIDE_STREAM_TOKENS`` tokens, or with it 0, the branches run one
after the other on the current stream.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from kvship.common.envs import ENV

A = TypeVar("A")
B = TypeVar("B")

_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream_limit() -> int:
    """``KVSHIP_SIDE_STREAM_TOKENS`` (a layer reads it once, when it is built)."""
    return ENV.SIDE_STREAM_TOKENS


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(idx)
    if stream is None:
        stream = _STREAMS[idx] = torch.cuda.Stream(device=idx)
    return stream


def beside(side: Callable[[], A], main: Callable[[], B], like: torch.Tensor, limit: int) -> tuple[A, B]:
    """``(side(), main())``; on CUDA, for a ``like`` of at most ``limit`` rows, ``side`` runs on a side stream
    while ``main`` runs on the current one (module docstring).  Neither may issue a collective."""
    if not like.is_cuda or limit <= 0 or like.shape[0] > limit:
        return side(), main()
    current = torch.cuda.current_stream(like.device)
    stream = _side_stream(like.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        a = side()
    b = main()
    current.wait_stream(stream)
    return a, b


def partials_comm(shared: torch.nn.Module, experts: torch.nn.Module) -> tuple[bool, Optional[object]]:
    """Whether a MoE block's shared MLP and routed experts can run as two collective-free branches, and the
    communicator that then sums their partial outputs once (None: one rank holds both).  ``shared`` is a
    ``LlamaMLP`` (its ``output_comm``), ``experts`` a ``FusedMoE`` (its ``reduce_comm``; a parallel one
    whose dispatch exchanges rows, or a shared MLP summed by another group, keeps its own collectives and
    the branches run as before)."""
    mlp_comm = shared.output_comm()
    moe_comm = experts.reduce_comm
    tp = getattr(experts, "tp", None)
    if mlp_comm is None and moe_comm is None:
        return tp is None or tp.size == 1, None
    return mlp_comm is moe_comm, mlp_comm

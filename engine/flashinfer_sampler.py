"""FlashInfer sampling kernels behind the sampler seam (``--sampling-backend flashinfer``).

Only ``_sample_probs`` differs from the torch sampler: penalties, the greedy
fast path (``argmax``), temperature and logprobs stay in ``Sampler.__call__``.
The kernels draw by rejection sampling over the unsorted probabilities (no
vocab sort) with per-row parameters passed as tensors (``top_k`` int32, the
form that needs only FlashInfer's ``sampling`` module):

* top-k and top-p: ``top_k_top_p_sampling_from_probs`` with
  ``filter_apply_order="top_k_first"`` -- top-p over the top-k renormalised
  mass, the torch sampler's rule; one of them: ``top_k_sampling_from_probs`` /
  ``top_p_sampling_from_probs``;
* min-p (after any top-k / top-p): ``top_k_renorm_probs`` / ``top_p_renorm_probs``
  then ``min_p_sampling_from_probs`` (min-p is relative to the row's largest
  probability, which renormalisation scales like every other entry);
* nothing to filter: ``sampling_from_probs``.

Randomness: unseeded rows draw from the sampler's CUDA generator (FlashInfer
advances its Philox offset each call, host-side, no device sync).  FlashInfer
ties a row's random stream to its position in the batch, so rows of requests
with a ``seed`` are drawn by the torch sampler's per-request generators
instead; that keeps a seeded request's tokens independent of what else shares
its batch.
"""

from __future__ import annotations

import flashinfer.sampling as fs
import torch

from kvship.engine.sampler import SamplingBatchInfo, TorchSampler, register_sampling_backend


@register_sampling_backend("flashinfer")
class FlashInferSampler(TorchSampler):
    name = "flashinfer"

    def __init__(self, device: torch.device | str, seed: int = 0):
        super().__init__(device, seed)
        if self.device.type != "cuda":
            raise ValueError("the flashinfer sampling backend needs a CUDA device")

    def _flashinfer_sample(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        gen = self.generator
        top_k = info.top_ks.to(torch.int32)
        if info.need_min_p:
            if info.need_top_k:
                probs = fs.top_k_renorm_probs(probs, top_k)
            if info.need_top_p:
                probs = fs.top_p_renorm_probs(probs, info.top_ps)
            ids = fs.min_p_sampling_from_probs(probs, info.min_ps, generator=gen)
        elif info.need_top_k and info.need_top_p:
            ids = fs.top_k_top_p_sampling_from_probs(
                probs, top_k, info.top_ps, filter_apply_order="top_k_first", generator=gen
            )
        elif info.need_top_k:  # rows without top-k carry k = vocab, which the kernel treats as "keep all"
            ids = fs.top_k_sampling_from_probs(probs, top_k, generator=gen)
        elif info.need_top_p:
            ids = fs.top_p_sampling_from_probs(probs, info.top_ps, generator=gen)
        else:
            ids = fs.sampling_from_probs(probs, generator=gen)
        return ids.to(torch.int64)

    def _sample_probs(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        ids = self._flashinfer_sample(probs.contiguous(), info)
        seeded = [i for i, g in enumerate(info.generators) if g is not None]
        if seeded:
            torch_ids = super()._sample_probs(probs, info)
            rows = torch.tensor(seeded, dtype=torch.int64, device=ids.device)
            ids[rows] = torch_ids[rows]
        return ids

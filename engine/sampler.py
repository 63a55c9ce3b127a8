"""Batched next-token sampling.

``SamplingBatchInfo.from_reqs`` turns the sampling parameters of the requests
that sample this step into tensors; a ``Sampler`` turns ``[bs, vocab]``
logits into one token per row.

Pipeline of ``Sampler.__call__`` (one step):
1. penalties (``kvship.engine.penalties``) on a float32 copy of the logits;
2. rows that are greedy (temperature 0 or top_k 1) take ``argmax``; a batch of
   greedy rows only takes that fast path and nothing else;
3. other rows: ``softmax(logits / temperature)``, then top-k, top-p (over the
   top-k renormalised mass, as Hugging Face and vLLM do) and min-p (relative
   to the row's largest probability) zero out tokens, and one token is drawn
   from what is left by ``_sample_probs`` (the backend's part);
4. logprobs, when asked: ``log_softmax`` of the **raw** logits (before
   penalties, temperature and filtering -- SGLang's default convention), for
   the chosen token and the top-k alternatives.

Randomness: requests with a ``seed`` draw from their own ``torch.Generator``
(``Req.generator``), re-seeded every step from ``(seed, number of tokens
generated so far)``, so the same seed and prompt give the same tokens whatever
else shares the batch, and a request recomputed after retraction draws what
it would have drawn.  Unseeded rows share the sampler's generator.

Backends: ``create_sampler(ServerArgs.sampling_backend, ...)`` picks the
implementation from a registry (``torch`` here; a FlashInfer backend registers
itself under ``flashinfer`` from ``kvship.engine.flashinfer_sampler``).
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from kvship.engine.penalties import PenaltyInfo

logger = logging.getLogger(__name__)

_MASK64 = (1 << 63) - 1


def step_seed(seed: int, step: int) -> int:
    """Seed of a request's generator for its ``step``-th generated token."""
    return (seed * 6364136223846793005 + (step + 1) * 1442695040888963407) & _MASK64


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] float32 (1.0 on greedy rows)
    top_ks: torch.Tensor  # [bs] int64 (vocab size where disabled)
    top_ps: torch.Tensor  # [bs] float32
    min_ps: torch.Tensor  # [bs] float32
    greedy_mask: torch.Tensor  # [bs] bool
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    generators: list[Optional[torch.Generator]]  # per row; None = the sampler's shared generator
    penalties: Optional[PenaltyInfo]
    return_logprob: bool
    top_logprobs_nums: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @classmethod
    def from_reqs(cls, reqs: Sequence, vocab_size: int, device: torch.device | str) -> "SamplingBatchInfo":
        """Build from ``Req`` objects (``sampling_params``, ``output_ids``, ``generator``, logprob fields).

        Seeded requests get their ``generator`` created here (on ``device``)
        and re-seeded for this step.
        """
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k in (-1, 0) or p.top_k >= vocab_size else int(p.top_k) for p in params]
        top_ps = [float(p.top_p) for p in params]
        min_ps = [float(p.min_p) for p in params]
        sampled = [not g for g in greedy]
        generators: list[Optional[torch.Generator]] = []
        for r, p in zip(reqs, params):
            if p.seed is None or p.is_greedy:
                generators.append(None)
                continue
            if r.generator is None or r.generator.device != device:
                r.generator = torch.Generator(device=device)
            # step index over the whole answer, so a resumed stream draws what the unbroken one would
            r.generator.manual_seed(step_seed(int(p.seed), r.prior_output_len + len(r.output_ids)))
            generators.append(r.generator)
        penalties = PenaltyInfo.build(
            [r.prompt_ids for r in reqs],
            [r.generated_ids for r in reqs],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.repetition_penalty for p in params],
            vocab_size,
            device,
        )
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            is_all_greedy=all(greedy),
            need_top_k=any(s and k < vocab_size for s, k in zip(sampled, top_ks)),
            need_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_ps)),
            need_min_p=any(s and m > 0.0 for s, m in zip(sampled, min_ps)),
            generators=generators,
            penalties=penalties,
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_nums=[min(int(r.top_logprobs_num), vocab_size) if r.return_logprob else 0 for r in reqs],
        )


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: Optional[torch.Tensor] = None  # [bs] float32, chosen token
    top_logprobs: Optional[torch.Tensor] = None  # [bs, k] float32
    top_logprob_ids: Optional[torch.Tensor] = None  # [bs, k] int64

    def to_lists(
        self, top_nums: Sequence[int]
    ) -> tuple[list[int], Optional[list[float]], Optional[list[list[tuple[int, float]]]]]:
        """(token ids, chosen logprobs, per-row top-k (id, logprob) lists cut to ``top_nums``)."""
        ids = self.next_token_ids.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        tops = None
        if self.top_logprobs is not None and self.top_logprob_ids is not None:
            vals, tids = self.top_logprobs.tolist(), self.top_logprob_ids.tolist()
            tops = [list(zip(tids[i][:n], vals[i][:n])) for i, n in enumerate(top_nums)]
        return ids, lps, tops


class Sampler(ABC):
    """Turns logits into tokens; backends implement ``_sample_probs`` only."""

    name = "base"

    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        raw = logits.float()
        if raw.shape[0] != info.batch_size:
            raise ValueError(f"sampler: {raw.shape[0]} logits rows for {info.batch_size} requests")
        work = info.penalties.apply(raw) if info.penalties is not None else raw
        greedy_ids = torch.argmax(work, dim=-1)
        if info.is_all_greedy:
            ids = greedy_ids
        else:
            probs = torch.softmax(work / info.temperatures, dim=-1)
            ids = torch.where(info.greedy_mask, greedy_ids, self._sample_probs(probs, info))
        out = SampleOutput(next_token_ids=ids)
        if info.return_logprob:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
            k = max(info.top_logprobs_nums, default=0)
            if k > 0:
                out.top_logprobs, out.top_logprob_ids = torch.topk(logprobs, k, dim=-1)
        return out

    @abstractmethod
    def _sample_probs(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """One token id per row of ``probs`` ([bs, vocab], rows sum to 1), after the
        row's top-k / top-p / min-p filters, drawing from ``info.generators``."""


def exponential_noise(
    shape: tuple[int, int],
    generators: Sequence[Optional[torch.Generator]],
    shared: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise, each seeded row from its own generator, the others from ``shared``."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_(min=1e-10)


def filter_probs(probs_sort: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero out, in place, tokens of descending-sorted ``probs_sort`` rejected by top-k / top-p / min-p."""
    vocab = probs_sort.shape[-1]
    if info.need_top_k:
        ranks = torch.arange(vocab, device=probs_sort.device).unsqueeze(0)
        probs_sort.masked_fill_(ranks >= info.top_ks.unsqueeze(1), 0.0)
    if info.need_top_p:
        total = probs_sort.sum(dim=-1, keepdim=True)
        before = (torch.cumsum(probs_sort, dim=-1) - probs_sort) / total
        # keep the smallest prefix whose mass reaches top_p (Hugging Face's rule; the first
        # token always stays); rows with top_p == 1 keep everything despite rounding
        limit = torch.where(info.top_ps >= 1.0, torch.full_like(info.top_ps, 2.0), info.top_ps)
        probs_sort.masked_fill_(before >= limit.unsqueeze(1), 0.0)
    if info.need_min_p:
        probs_sort.masked_fill_(probs_sort < probs_sort[:, :1] * info.min_ps.unsqueeze(1), 0.0)
    return probs_sort


class TorchSampler(Sampler):
    """Pure torch (CPU and GPU): sort-based filters, exponential-race draw.

    Drawing ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks token ``i`` with
    probability ``p_i / sum(p)``, so filtered rows need no renormalisation and
    every row can use its own generator.
    """

    name = "torch"

    def _sample_probs(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        noise = exponential_noise(tuple(probs.shape), info.generators, self.generator, probs.device)
        if info.need_top_k or info.need_top_p:
            probs_sort, order = torch.sort(probs, dim=-1, descending=True)
            filter_probs(probs_sort, info)
            # each token keeps its own noise (``noise[token]``, as on the unsorted path), so a seeded row
            # draws the same token whether or not another row of the batch needs the sorted path
            choice = torch.argmax(probs_sort / noise.gather(1, order), dim=-1, keepdim=True)
            return order.gather(1, choice).squeeze(1)
        if info.need_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < top * info.min_ps.unsqueeze(1), 0.0)
        return torch.argmax(probs / noise, dim=-1)


_REGISTRY: dict[str, Callable[..., Sampler]] = {"torch": TorchSampler}
_LAZY_MODULES = {"flashinfer": "kvship.engine.flashinfer_sampler"}


def register_sampling_backend(name: str) -> Callable[[Callable[..., Sampler]], Callable[..., Sampler]]:
    def deco(factory: Callable[..., Sampler]) -> Callable[..., Sampler]:
        _REGISTRY[name] = factory
        return factory

    return deco


def _load(name: str) -> None:
    if name not in _REGISTRY and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])


def create_sampler(backend: str, device: torch.device | str, seed: int = 0) -> Sampler:
    """The sampler for ``--sampling-backend`` (``auto``: flashinfer on CUDA when it loads, else torch)."""
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            try:
                _load("flashinfer")
            except ImportError as e:
                logger.info("flashinfer sampling unavailable (%s); using torch sampling", e)
        backend = "flashinfer" if device.type == "cuda" and "flashinfer" in _REGISTRY else "torch"
    try:
        _load(backend)
    except ImportError as e:
        raise ValueError(f"sampling backend '{backend}' is unavailable here: {e}") from e
    if backend not in _REGISTRY:
        raise ValueError(f"unknown sampling backend '{backend}'; known: {sorted(set(_REGISTRY) | set(_LAZY_MODULES))}")
    return _REGISTRY[backend](device, seed)

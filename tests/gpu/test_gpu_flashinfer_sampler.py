"""FlashInfer sampling draws from the distribution the torch sampler defines, and is seed-deterministic.

Distribution check: one fixed 48-token distribution, 65536 draws (many rows
of the same logits per call), per filter setting; Pearson's chi-square of the
draw counts against the exact filtered distribution (computed with the torch
sampler's own ``filter_probs``) must stay under the 1e-4 upper quantile
(Wilson-Hilferty), and no draw may fall outside the filtered support.  The
torch sampler is held to the same test, so both agree with one law.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_common import requires_cuda, requires_flashinfer

from kvship.engine.sampler import SamplingBatchInfo, TorchSampler, filter_probs

pytestmark = [pytest.mark.gpu, requires_cuda]

VOCAB = 48
ROWS = 8192
CALLS = 8


def make_info(
    bs: int, temperature: float = 1.0, top_k: int = VOCAB, top_p: float = 1.0, min_p: float = 0.0, generators=None
) -> SamplingBatchInfo:
    dev = torch.device("cuda")
    return SamplingBatchInfo(
        temperatures=torch.full((bs, 1), temperature, device=dev),
        top_ks=torch.full((bs,), top_k, dtype=torch.int64, device=dev),
        top_ps=torch.full((bs,), top_p, device=dev),
        min_ps=torch.full((bs,), min_p, device=dev),
        greedy_mask=torch.zeros(bs, dtype=torch.bool, device=dev),
        is_all_greedy=False,
        need_top_k=top_k < VOCAB,
        need_top_p=top_p < 1.0,
        need_min_p=min_p > 0.0,
        generators=list(generators) if generators is not None else [None] * bs,
        penalties=None,
        return_logprob=False,
        top_logprobs_nums=[0] * bs,
    )


def expected_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    probs = torch.softmax(logits.double() / info.temperatures[:1].double(), dim=-1)
    probs_sort, order = torch.sort(probs, dim=-1, descending=True)
    one = make_info(1, float(info.temperatures[0]), int(info.top_ks[0]), float(info.top_ps[0]), float(info.min_ps[0]))
    filter_probs(probs_sort, one)
    out = torch.zeros_like(probs).scatter_(1, order, probs_sort)[0]
    return out / out.sum()


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(dof), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def draw_counts(sampler, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    counts = torch.zeros(VOCAB, dtype=torch.int64, device="cuda")
    batch = logits.expand(ROWS, VOCAB).contiguous()
    for _ in range(CALLS):
        ids = sampler(batch, info).next_token_ids
        counts += torch.bincount(ids, minlength=VOCAB)
    return counts.cpu()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    n = int(counts.sum())
    outside = int(counts[probs == 0].sum())
    assert outside == 0, f"{label}: {outside} draws outside the filtered support"
    expected = probs * n
    keep = expected >= 5
    obs = counts[keep].double()
    exp = expected[keep]
    # lump the thin tail into one bin so every bin expects >= 5
    tail_obs, tail_exp = counts[~keep & (probs > 0)].sum().double(), expected[~keep & (probs > 0)].sum()
    if tail_exp >= 5:
        obs = torch.cat([obs, tail_obs[None]])
        exp = torch.cat([exp, tail_exp[None]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(1, obs.numel() - 1)
    assert stat < chi2_critical(dof), (
        f"{label}: chi-square {stat:.1f} over {dof} dof (critical {chi2_critical(dof):.1f})"
    )


SETTINGS = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=10),
    "top_p": dict(top_p=0.8),
    "top_k_top_p": dict(temperature=0.9, top_k=12, top_p=0.85),
    "min_p": dict(min_p=0.05),
    "top_k_top_p_min_p": dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_flashinfer_sampling_matches_the_torch_samplers_distribution(setting):
    requires_flashinfer()
    from kvship.engine.flashinfer_sampler import FlashInferSampler

    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(1, VOCAB, generator=gen) * 2.0).cuda()
    info = make_info(ROWS, **SETTINGS[setting])
    probs = expected_probs(logits, make_info(1, **SETTINGS[setting])).cpu()
    assert_matches(draw_counts(FlashInferSampler("cuda", seed=1), logits, info), probs, f"flashinfer/{setting}")
    assert_matches(draw_counts(TorchSampler("cuda", seed=1), logits, info), probs, f"torch/{setting}")


def test_flashinfer_sampling_is_deterministic_for_a_seed():
    requires_flashinfer()
    from kvship.engine.flashinfer_sampler import FlashInferSampler

    logits = torch.randn(64, 1000, device="cuda") * 2
    info = make_info(64, temperature=0.8, top_k=50, top_p=0.9)
    info.need_top_k = True

    def run(seed: int) -> list[list[int]]:
        s = FlashInferSampler("cuda", seed=seed)
        return [s(logits, info).next_token_ids.tolist() for _ in range(3)]

    a, b, c = run(123), run(123), run(124)
    assert a == b
    assert a != c
    assert a[0] != a[1] or a[1] != a[2], "consecutive steps drew identical batches"


def test_seeded_request_draws_the_same_token_wherever_it_sits_in_the_batch():
    requires_flashinfer()
    from kvship.engine.flashinfer_sampler import FlashInferSampler

    torch.manual_seed(0)
    row = torch.randn(1, 1000, device="cuda") * 2
    others = torch.randn(7, 1000, device="cuda") * 2
    sampler = FlashInferSampler("cuda", seed=5)
    picks = []
    for pos in (0, 3, 7):
        logits = torch.cat([others[:pos], row, others[pos:]])
        gens = [None] * 8
        g = torch.Generator(device="cuda")
        g.manual_seed(99)
        gens[pos] = g
        info = make_info(8, temperature=1.0, top_k=40, generators=gens)
        info.need_top_k = True
        picks.append(int(sampler(logits, info).next_token_ids[pos]))
    assert picks[0] == picks[1] == picks[2]

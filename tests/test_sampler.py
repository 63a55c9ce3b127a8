"""Sampler: greedy, seeds, top-k / top-p / min-p against known distributions, penalties, logprobs."""

import importlib.util
import math

import pytest
import torch

from kvship.engine.io_struct import SamplingParams
from kvship.engine.penalties import PenaltyInfo
from kvship.engine.sampler import SamplingBatchInfo, TorchSampler, create_sampler, filter_probs
from kvship.engine.schedule_batch import Req

V = 32


def reqs_for(params_list, prompts=None, outputs=None, logprob=False, top=0):
    out = []
    for i, p in enumerate(params_list):
        r = Req(f"r{i}", prompts[i] if prompts else [1, 2, 3], p, return_logprob=logprob, top_logprobs_num=top)
        if outputs:
            r.output_ids = list(outputs[i])
        out.append(r)
    return out


def sample(logits, reqs, seed=0):
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[-1], "cpu")
    return TorchSampler("cpu", seed)(logits, info)


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def known_logits(probs, rows):
    base = torch.full((V,), -1e9)
    base[: len(probs)] = torch.log(torch.tensor(probs))
    return base.repeat(rows, 1)


def test_greedy_batch_takes_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    out = sample(logits, reqs_for([SamplingParams(temperature=0.0)] * 5))
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_1_equals_greedy_in_a_mixed_batch_and_through_the_filter():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.0)] * 3
    out = sample(logits, reqs_for(params))
    ids = out.next_token_ids.tolist()
    assert [ids[i] for i in (0, 2, 4)] == logits.argmax(-1)[[0, 2, 4]].tolist()
    # the filter alone, with no greedy shortcut, leaves only the top token
    info = SamplingBatchInfo.from_reqs(reqs_for([SamplingParams(top_k=2)] * 6), V, "cpu")
    info.top_ks.fill_(1)
    probs = torch.softmax(logits, -1)
    picked = TorchSampler("cpu", 3)._sample_probs(probs, info)
    assert picked.tolist() == logits.argmax(-1).tolist()


def test_same_seed_gives_identical_tokens_regardless_of_batch_neighbours():
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    run_a = sample(logits[:1], reqs_for([p]), seed=0).next_token_ids.tolist()
    others = [SamplingParams(temperature=1.0)] * 3
    run_b = sample(torch.cat([logits[3:4], logits[1:3], logits[:1]]), reqs_for(others + [p]), seed=99)
    assert run_b.next_token_ids.tolist()[3] == run_a[0]

    # a whole seeded sequence repeats exactly
    def seq(seed):
        r = reqs_for([SamplingParams(temperature=1.0, seed=seed)])
        toks = []
        for step in range(40):
            tid = sample(logits[step % 4 : step % 4 + 1], r).next_token_ids.item()
            r[0].output_ids.append(tid)
            toks.append(tid)
        return toks

    assert seq(7) == seq(7)
    assert seq(7) != seq(8)


@pytest.mark.parametrize(
    "p", [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, min_p=0.05, seed=5)]
)
def test_a_seeded_row_draws_the_same_token_next_to_rows_that_need_top_k_or_top_p(p):
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    for step in range(20):
        r = reqs_for([p], outputs=[[0] * step])
        alone = sample(logits[:1], r).next_token_ids.item()
        mixed = sample(
            logits, reqs_for([p, SamplingParams(temperature=1.0, top_k=5, top_p=0.8)], outputs=[[0] * step, []])
        )
        assert mixed.next_token_ids[0].item() == alone, step


def test_unfiltered_sampling_follows_the_softmax_distribution():
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 10000
    out = sample(known_logits(probs, n), reqs_for([SamplingParams(temperature=1.0)] * n), seed=5)
    counts = torch.bincount(out.next_token_ids, minlength=V).tolist()
    assert sum(counts[4:]) == 0
    assert chi_square(counts[:4], probs) < 16.27  # df=3, p=0.001


def test_top_p_keeps_the_smallest_prefix_reaching_p_and_samples_it_proportionally():
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 10000
    out = sample(known_logits(probs, n), reqs_for([SamplingParams(temperature=1.0, top_p=0.65)] * n), seed=6)
    counts = torch.bincount(out.next_token_ids, minlength=V).tolist()
    assert set(i for i, c in enumerate(counts) if c) == {0, 1}
    assert chi_square(counts[:2], [0.4 / 0.7, 0.3 / 0.7]) < 10.83  # df=1, p=0.001
    # exact support on the filter: p=0.7 reached by the first two tokens exactly
    info = SamplingBatchInfo.from_reqs(reqs_for([SamplingParams(top_p=0.75)]), 4, "cpu")
    kept = filter_probs(torch.tensor([[0.4, 0.3, 0.2, 0.1]]), info)
    assert (kept > 0).tolist() == [[True, True, True, False]]


def test_min_p_drops_tokens_below_the_scaled_maximum():
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 10000
    out = sample(known_logits(probs, n), reqs_for([SamplingParams(temperature=1.0, min_p=0.6)] * n), seed=7)
    counts = torch.bincount(out.next_token_ids, minlength=V).tolist()
    # threshold 0.24: keep 0.4 and 0.3
    assert set(i for i, c in enumerate(counts) if c) == {0, 1}
    assert chi_square(counts[:2], [0.4 / 0.7, 0.3 / 0.7]) < 10.83


def test_top_k_with_temperature_samples_the_renormalised_top_tokens():
    probs = [0.5, 0.25, 0.15, 0.1]
    n = 10000
    out = sample(known_logits(probs, n), reqs_for([SamplingParams(temperature=0.5, top_k=2)] * n), seed=8)
    counts = torch.bincount(out.next_token_ids, minlength=V).tolist()
    assert set(i for i, c in enumerate(counts) if c) == {0, 1}
    sharp = [0.5**2, 0.25**2]  # temperature 0.5 squares the probabilities
    assert chi_square(counts[:2], [s / sum(sharp) for s in sharp]) < 10.83


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    info = PenaltyInfo.build(
        [[1]], [[2, 2, 3]], frequency=[0.5], presence=[0.25], repetition=[2.0], vocab_size=4, device="cpu"
    )
    got = info.apply(logits)
    # repetition over prompt+output {1,2,3}: -1 -> -2, 0.5 -> 0.25, 0 -> 0;
    # then token 2 (count 2): 0.25 - 2*0.5 - 0.25 = -1.0, token 3 (count 1): 0 - 0.5 - 0.25 = -0.75
    assert torch.allclose(got, torch.tensor([[2.0, -2.0, -1.0, -0.75]]))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 0.0]]))  # raw logits untouched
    assert PenaltyInfo.build([[1]], [[2]], [0.0], [0.0], [1.0], 4, "cpu") is None


def test_penalties_change_the_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    plain = sample(logits, reqs_for([SamplingParams(temperature=0.0)], outputs=[[5]]))
    assert plain.next_token_ids.item() == 5
    pen = sample(logits, reqs_for([SamplingParams(temperature=0.0, frequency_penalty=0.5)], outputs=[[5]]))
    assert pen.next_token_ids.item() == 6


def test_logprobs_are_log_softmax_of_raw_logits_with_sorted_top_alternatives():
    torch.manual_seed(3)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    reqs = reqs_for(params, logprob=True, top=4)
    reqs[2].top_logprobs_num = 2
    out = sample(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    ids = out.next_token_ids
    assert torch.allclose(out.logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    ids_l, lps, tops = out.to_lists(SamplingBatchInfo.from_reqs(reqs, V, "cpu").top_logprobs_nums)
    assert [len(t) for t in tops] == [4, 4, 2]
    for row, top in enumerate(tops):
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        assert top[0][0] == int(raw[row].argmax())
        assert math.isclose(top[0][1], float(raw[row].max()), rel_tol=1e-6)


def test_create_sampler_picks_torch_on_cpu_and_rejects_unknown_backends():
    assert isinstance(create_sampler("auto", "cpu"), TorchSampler)
    assert isinstance(create_sampler("torch", "cpu"), TorchSampler)
    with pytest.raises(ValueError):
        create_sampler("nope", "cpu")
    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ValueError, match="unavailable"):
            create_sampler("flashinfer", "cpu")

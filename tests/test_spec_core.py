"""Speculative decoding's model-free core (decode/spec): draft trees, acceptance rules, n-gram drafting."""

from __future__ import annotations

import math

import pytest
import torch

from kvship.decode.spec.ngram import NgramDrafter
from kvship.decode.spec.tree import DraftTree
from kvship.decode.spec.verify import accept_greedy, accept_sampled


def _branched() -> DraftTree:
    #        root(9)
    #       /       \
    #     1:5       2:6
    #    /   \        \
    #  3:7   4:8      5:3
    return DraftTree(9, [5, 6, 7, 8, 3], [0, 0, 1, 1, 2])


def test_tree_mask_lets_each_slot_see_itself_and_its_ancestors_only():
    t = _branched()
    m = t.mask()
    assert m.shape == (6, 6)
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}}
    for i, cols in want.items():
        assert {j for j in range(6) if m[i, j]} == cols, i
    assert t.depths() == [0, 1, 1, 2, 2, 2]
    assert t.positions(40) == [40, 41, 41, 42, 42, 42]
    assert t.first_child() == [1, 3, 5, -1, -1, -1]
    assert t.next_sibling() == [-1, 2, -1, 4, -1, -1]
    assert t.path_to(4) == [1, 4]


def test_tree_rejects_children_listed_before_their_parent():
    with pytest.raises(ValueError):
        DraftTree(1, [2, 3], [2, 0])


def test_greedy_acceptance_follows_the_targets_argmax_down_the_tree():
    t = _branched()
    # target argmax per slot: at root 6 (-> slot 2), at slot 2 -> 3 (-> slot 5), at slot 5 -> 11 (bonus)
    target = [6, 7, 3, 0, 0, 11]
    a = accept_greedy(t, target)
    assert a.slots == [2, 5] and a.tokens == [6, 3, 11] and a.bonus_slot == 5 and a.length == 3
    # nothing matches at the root: one token, from the root's logits
    a = accept_greedy(t, [4, 0, 0, 0, 0, 0])
    assert a.slots == [] and a.tokens == [4] and a.bonus_slot == 0


def test_greedy_acceptance_of_a_chain_equals_plain_greedy_decoding():
    # a "model" whose next token is a fixed function of the previous one
    nxt = {9: 5, 5: 7, 7: 2, 2: 4, 4: 1}
    chain = DraftTree.chain(9, [5, 7, 3, 4])  # third draft wrong
    a = accept_greedy(chain, [nxt.get(t, 0) for t in chain.all_tokens])
    assert a.tokens == [5, 7, 2]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs * n
    keep = exp > 0
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum())


@pytest.mark.parametrize("temperature_probs", ["peaked", "flat"])
def test_sampled_acceptance_emits_tokens_distributed_as_the_target(temperature_probs):
    """Chi-square over 6000 seeded rounds: the first emitted token ~ the target's distribution at the root,
    and the second (below an accepted first draft) ~ the target's distribution there.  df = 5; the critical
    value at p = 0.001 is 20.52, so a correct sampler fails this test once in a thousand seeds (the seed is fixed)."""
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(6, 6, generator=g) * (3.0 if temperature_probs == "peaked" else 0.5)
    probs = torch.softmax(logits, dim=-1)
    tree = DraftTree(0, [2, 4, 1], [0, 0, 1])  # two candidates at the root, one below the first
    first = torch.zeros(6)
    second = torch.zeros(6)
    trials = 6000
    for _ in range(trials):
        a = accept_sampled(tree, probs[:4], generator=g)
        first[a.tokens[0]] += 1
        if a.slots[:1] == [1]:
            second[a.tokens[1]] += 1
    crit = 20.52
    assert _chi_square(first, probs[0]) < crit
    assert second.sum() > 300
    assert _chi_square(second, probs[1]) < crit


def test_sampled_acceptance_takes_a_certain_draft():
    probs = torch.zeros(3, 5)
    probs[0, 3] = 1.0
    probs[1, 2] = 1.0
    probs[2, 4] = 1.0
    a = accept_sampled(DraftTree.chain(1, [3, 2]), probs)
    assert a.tokens == [3, 2, 4] and not math.isnan(a.length)


def test_ngram_drafts_the_continuation_of_the_longest_repeated_suffix():
    d = NgramDrafter(num_draft_tokens=4, max_n=3)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    t = d.propose(seq)
    assert t.root == 3 and t.tokens == [4, 5, 9, 9] and t.parents == [0, 1, 2, 3]
    assert d.propose([7, 8, 6]).tokens == []  # nothing repeats: empty draft


def test_ngram_branches_are_distinct_continuations_most_recent_first():
    d = NgramDrafter(num_draft_tokens=4, max_n=2, branches=2)
    seq = [1, 2, 5, 6, 1, 2, 7, 8, 1, 2]
    t = d.propose(seq)
    assert t.tokens == [7, 8, 5, 6] and t.parents == [0, 1, 0, 3]


def test_padding_a_tree_adds_root_children_that_never_change_the_greedy_outcome():
    t = DraftTree.chain(9, [5, 7])
    p = t.padded(6)
    assert p.size == 6 and p.tokens == [5, 7, 9, 9, 9] and p.parents == [0, 1, 0, 0, 0]
    target = [5, 7, 2, 0, 0, 0]
    assert accept_greedy(p, target).tokens == accept_greedy(t, target[:3]).tokens == [5, 7, 2]


def _random_trees(seed: int, k: int, count: int) -> list[DraftTree]:
    rng = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(count):
        parents = [int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, k)]
        trees.append(DraftTree(5, [7] * (k - 1), parents))
    return trees


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_tree_arrays_from_parents_equal_the_draft_trees(k):
    """The verify graph's positions and tree mask, built from the parent slots alone (``tree_build``), are the
    ``DraftTree``'s: chains, bushes and random trees, several per batch, each with its own prefix."""
    from kvship.decode.spec.tree_build import build_tree_arrays

    trees = _random_trees(k, k, 5) + [DraftTree(5, [7] * (k - 1), list(range(k - 1)))]  # + a chain
    prefix = [0, 3, 17, 1, 250, 9]
    parents = torch.tensor([t.all_parents for t in trees], dtype=torch.int32)
    pos = torch.full((len(trees) * k + 3,), -1, dtype=torch.int64)
    mask = torch.full((len(trees) * k * k + 3,), 9, dtype=torch.uint8)
    build_tree_arrays(parents, torch.tensor(prefix, dtype=torch.int32), pos, mask)
    assert pos[: len(trees) * k].tolist() == [q for t, p in zip(trees, prefix) for q in t.positions(p)]
    want = torch.cat([t.mask().reshape(-1).to(torch.uint8) for t in trees])
    assert torch.equal(mask[: len(trees) * k * k], want)
    assert pos[-3:].tolist() == [-1] * 3 and mask[-3:].tolist() == [9] * 3  # nothing written past the trees

"""TokenToKVPoolAllocator: pages, partial pages, exhaustion, free, double free."""

import pytest
import torch

from kvship.engine.mem.pools import TokenToKVPoolAllocator


def test_page1_alloc_hands_out_distinct_slots_and_never_the_padding_slot():
    a = TokenToKVPoolAllocator(num_slots=8, page_size=1)
    assert a.total_slots == 8 and a.available_size() == 8
    got = a.alloc(5)
    assert got is not None and got.dtype == torch.int64
    slots = got.tolist()
    assert len(set(slots)) == 5 and 0 not in slots
    assert all(1 <= s <= 8 for s in slots)
    assert a.available_size() == 3


def test_page16_extend_fills_partial_last_page_before_taking_a_new_one():
    ps = 16
    a = TokenToKVPoolAllocator(num_slots=4 * ps, page_size=ps)
    first = a.alloc_extend([0], [20], [-1])  # 20 tokens -> 2 pages, second one partial
    assert first is not None and first.numel() == 20
    assert a.available_size() == 2 * ps
    # slot layout rule: position p lives at page*ps + p % ps
    assert [s % ps for s in first.tolist()] == [p % ps for p in range(20)]
    pages = {s // ps for s in first.tolist()}
    assert len(pages) == 2
    # continue the same request: 5 more tokens stay on its partial page
    more = a.alloc_extend([20], [25], [int(first[-1])])
    assert more.tolist() == list(range(int(first[-1]) + 1, int(first[-1]) + 6))
    assert a.available_size() == 2 * ps
    # decode up to the page boundary, then one more token takes a new page
    last = int(more[-1])
    for seq in range(26, 33):
        d = a.alloc_decode([seq], [last])
        assert int(d[0]) == last + 1
        last = int(d[0])
    assert a.available_size() == 2 * ps
    d = a.alloc_decode([33], [last])
    assert int(d[0]) % ps == 0 and int(d[0]) // ps not in pages
    assert a.available_size() == ps


def test_partial_page_without_last_loc_is_an_error():
    a = TokenToKVPoolAllocator(num_slots=64, page_size=16)
    with pytest.raises(ValueError):
        a.alloc_extend([5], [9], [-1])


@pytest.mark.parametrize("ps", [1, 16])
def test_exhaustion_returns_none_and_allocates_nothing(ps):
    a = TokenToKVPoolAllocator(num_slots=4 * ps, page_size=ps)
    assert a.alloc_extend([0], [3 * ps], [-1]) is not None
    before = a.available_size()
    assert a.alloc_extend([0, 0], [ps, ps], [-1, -1]) is None
    assert a.available_size() == before
    assert a.alloc(before + 1) is None
    assert a.available_size() == before


@pytest.mark.parametrize("ps", [1, 16])
def test_free_restores_every_slot(ps):
    a = TokenToKVPoolAllocator(num_slots=16 * ps, page_size=ps)
    total = a.available_size()
    x = a.alloc_extend([0, 0], [ps * 2 + 3, 5], [-1, -1])
    assert x is not None and a.available_size() < total
    a.free(x)
    assert a.available_size() == total
    # everything can be handed out again
    assert a.alloc(total) is not None and a.available_size() == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_double_free_raises(ps):
    a = TokenToKVPoolAllocator(num_slots=4 * ps, page_size=ps)
    x = a.alloc(ps)
    a.free(x)
    with pytest.raises(ValueError, match="twice"):
        a.free(x)


def test_freeing_the_padding_page_raises():
    a = TokenToKVPoolAllocator(num_slots=16, page_size=1)
    with pytest.raises(ValueError):
        a.free([0])

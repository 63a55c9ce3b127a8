"""Approximate radix tree over request *text* (not tokens), one per worker, for ``cache_aware`` routing.

"Approximate" because the router cannot see a worker's real KV cache: it
remembers which texts it sent to the worker and assumes their KV is still
cached there.  ``match(text)`` returns how many leading characters of ``text``
the tree holds; ``insert(text)`` records a text and refreshes the LRU time of
its path.  The tree keeps at most ``max_size`` characters of edge labels; when
an insert passes that, least recently used leaves are dropped until the tree
is back under ``evict_to`` x ``max_size`` (so eviction cost is amortized over
many inserts).  Not thread-safe; the router calls it from the event loop only.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional


def common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]`` (string compares in C)."""
    n = min(len(edge), len(text) - start)
    if n <= 0:
        return 0
    if text.startswith(edge if n == len(edge) else edge[:n], start):
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("edge", "children", "parent", "last_access")

    def __init__(self, edge: str, parent: Optional["_Node"], last_access: int):
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = last_access


class ApproxRadixTree:
    def __init__(self, max_size: int, evict_to: float = 0.9):
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self.evict_to = evict_to
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.size = 0  # characters on all edges

    def match(self, text: str) -> int:
        """Characters of ``text``'s longest prefix held by the tree (read-only)."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            k = common_prefix_len(child.edge, text, i)
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        """Record ``text`` and mark its whole path most recently used; evict if over ``max_size``."""
        now = next(self._clock)
        node, i, n = self.root, 0, len(text)
        node.last_access = now
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, now)
                node.children[text[i]] = leaf
                self.size += n - i
                break
            k = common_prefix_len(child.edge, text, i)
            if k < len(child.edge):
                # split child: node -> mid (edge[:k]) -> child (edge[k:])
                mid = _Node(child.edge[:k], node, now)
                node.children[text[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_access = now
            i += k
            node = child
        if self.size > self.max_size:
            self._evict(int(self.max_size * self.evict_to))

    def _evict(self, target: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        tie = itertools.count()
        stack = [self.root]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd is not self.root:
                heap.append((nd.last_access, next(tie), nd))
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))

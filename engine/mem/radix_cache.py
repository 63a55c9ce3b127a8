"""Prefix caches: token ids -> KV slots, shared between requests.

Two implementations of one contract (``BasePrefixCache``):

* ``RadixCache`` -- a radix tree over token ids.  Each edge holds a run of
  token ids (its ``key``) and the KV slots that hold their K/V (its ``value``,
  an int64 CPU tensor).  When ``page_size > 1`` keys are matched and inserted
  in whole pages only, so every node owns whole KV pages and freeing a node
  frees exactly its pages.
* ``NoPrefixCache`` -- ``--disable-radix-cache``: never matches anything and
  frees a request's slots when it finishes.

Ownership of a request's KV slots (positions ``0 .. kv_allocated_len-1`` of its
``req_to_token`` row):

* ``[0, cache_protected_len)`` belong to the cache; the request holds a lock
  on ``last_node`` so they cannot be evicted while it runs.
* ``[cache_protected_len, kv_allocated_len)`` belong to the request; it frees
  them (or hands them to the cache) when it finishes.

The request-level operations (``cache_finished_req``, ``cache_unfinished_req``,
``release_req``) keep that split.  They read these attributes of the request:
``req_pool_idx``, ``fill_ids``, ``kv_committed_len`` (positions whose K/V is
computed), ``kv_allocated_len``, ``cache_protected_len``, ``last_node``,
``prefix_indices`` and ``last_loc``.

Nothing here touches CUDA: tree values live on the CPU; only the
``req_to_token`` row is read or written on the model's device.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvship.engine.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass
class MatchResult:
    """``indices``: KV slots of the matched prefix (int64 CPU, one per token).

    ``last_node``: the node the match ends at; pass it to ``inc_lock_ref`` to
    pin the whole matched path.
    """

    indices: torch.Tensor
    last_node: Any

    @property
    def length(self) -> int:
        return int(self.indices.numel())


class BasePrefixCache(ABC):
    """The contract every prefix cache keeps.

    When returned indices are safe to use: ``match_prefix`` returns slots
    that stay valid only until the next call that may evict (``evict``, or
    an allocation the caller backs with eviction).  A caller that keeps
    them longer must ``inc_lock_ref(last_node)`` first; locked nodes (and
    their ancestors) are never evicted, and the indices stay valid until
    the matching ``dec_lock_ref``.

    ``insert(key, value)`` hands the slots in ``value`` to the cache for
    every token of ``key`` that was not cached yet, and returns how many
    leading tokens *were* already cached: the caller still owns
    ``value[:returned]`` and must free what it does not otherwise keep.
    Keys are truncated to whole pages.

    ``evictable_size()`` counts cached slots in unlocked nodes (freeable by
    ``evict``); ``protected_size()`` counts slots in locked nodes.
    """

    page_size: int

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of unlocked leaves, least recently used first.

        Returns the number of slots freed (less when not enough are evictable).
        """

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    # --- request-level operations (see the module docstring) -------------
    @abstractmethod
    def cache_finished_req(self, req: Any) -> None:
        """The request is done (finished or retracted): keep its computed KV
        in the cache where possible, free the rest, unlock, free its row."""

    @abstractmethod
    def cache_unfinished_req(self, req: Any) -> None:
        """A chunk of the request's prompt was computed: share it through the
        cache now; the request keeps running on the cached slots."""

    def release_req(self, req: Any) -> None:
        """Drop the request without caching anything (its KV may be invalid,
        e.g. after a failed forward): free owned slots, unlock, free the row."""
        if req.req_pool_idx is None:
            return
        owned = self.req_to_token_pool.read_host(req.req_pool_idx, req.cache_protected_len, req.kv_allocated_len)
        self.allocator.free(owned)
        self._finish_release(req)

    # shared plumbing ------------------------------------------------------
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator

    def _finish_release(self, req: Any) -> None:
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()


class NoPrefixCache(BasePrefixCache):
    """``--disable-radix-cache``: the same interface, caching nothing."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(_EMPTY, None)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        return 0  # nothing is cached: the caller keeps (and frees) every slot

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cache_finished_req(self, req: Any) -> None:
        self.release_req(req)

    def cache_unfinished_req(self, req: Any) -> None:
        return None


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: Optional["TreeNode"]):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "TreeNode") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class RadixCache(BasePrefixCache):
    """Radix tree prefix cache with reference-count locks and LRU eviction."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller frees nothing: use at start-up only)."""
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # --- keys ----------------------------------------------------------------
    def _child_key(self, key: Sequence[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _aligned(self, key: Sequence[int]) -> list[int]:
        n = len(key) // self.page_size * self.page_size
        return list(key[:n])

    def _match_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Common prefix length of a and b, in whole pages."""
        ps = self.page_size
        n = min(len(a), len(b))
        i = 0
        if ps == 1:
            while i < n and a[i] == b[i]:
                i += 1
            return i
        while i + ps <= n and a[i : i + ps] == b[i : i + ps]:
            i += ps
        return i

    def _touch(self, node: TreeNode) -> None:
        node.last_access = next(self._clock)

    # --- tree operations -----------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        key = self._aligned(key)
        node = self.root
        self._touch(node)
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            self._touch(child)
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
                values.append(child.value)
                node = child
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else _EMPTY
        return MatchResult(indices, node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n].clone(), child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {self._child_key(child.key[n:]): child}
        assert child.parent is not None
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        return upper

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        key = self._aligned(key)
        value = value[: len(key)].to(torch.int64)
        if value.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        node = self.root
        self._touch(node)
        done = 0
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                leaf = TreeNode(rest, value[done:].clone(), node)
                self._touch(leaf)
                node.children[self._child_key(rest)] = leaf
                self._evictable += len(rest)
                return done
            self._touch(child)
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            done += n
            node = child
        return done

    def inc_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Any) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                if node is not self.root and node.lock_ref == 0:
                    out.append(node)
            else:
                stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = self._leaves()
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # --- request-level operations ------------------------------------------
    def _req_slots(self, req: Any, end: int) -> torch.Tensor:
        return self.req_to_token_pool.read_host(req.req_pool_idx, 0, end)

    def cache_finished_req(self, req: Any) -> None:
        if req.req_pool_idx is None:
            return
        slots = self._req_slots(req, req.kv_allocated_len)
        aligned = req.kv_committed_len // self.page_size * self.page_size
        already = self.insert(req.fill_ids[:aligned], slots[:aligned])
        # slots the cache already had a copy of, then the request's unshared tail
        self.allocator.free(slots[req.cache_protected_len : already])
        self.allocator.free(slots[aligned:])
        self._finish_release(req)

    def cache_unfinished_req(self, req: Any) -> None:
        aligned = req.kv_committed_len // self.page_size * self.page_size
        if aligned <= req.cache_protected_len:
            return
        slots = self._req_slots(req, aligned)
        already = self.insert(req.fill_ids[:aligned], slots)
        self.allocator.free(slots[req.cache_protected_len : already])
        match = self.match_prefix(req.fill_ids[:aligned])
        if match.length != aligned:
            raise RuntimeError(f"radix cache: re-match after insert found {match.length} of {aligned} tokens")
        # point the request at the cache's copies of the duplicated pages
        self.req_to_token_pool.write(
            req.req_pool_idx, req.cache_protected_len, match.indices[req.cache_protected_len : aligned]
        )
        self.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_indices = match.indices
        req.cache_protected_len = aligned
        if req.kv_allocated_len == aligned:
            req.last_loc = int(match.indices[-1])


def create_prefix_cache(
    disable: bool, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int
) -> BasePrefixCache:
    """``RadixCache`` unless ``disable`` (``--disable-radix-cache``)."""
    cls = NoPrefixCache if disable else RadixCache
    return cls(req_to_token_pool, allocator, page_size)

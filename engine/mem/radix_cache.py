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

Tiers (docs/cache.md).  With a host tier (``HostTier``, ``--hicache-size-gb`` /
``--hicache-ratio``) a node is a ``gpu`` node (``value`` holds device slots)
or a ``host`` node (``value`` is None, ``host_value`` holds host slots); a gpu
node whose ``host_value`` also holds host slots is *backed up* (its pages are
on both tiers).  Invariant: the gpu nodes form a subtree that contains the
root, host nodes hang below it (a gpu node is evicted only once none of its
children is on the gpu; a load-back or an insert brings a whole path back
from the top).  ``match_prefix`` reports the host part of a match
(``host_len``) without loading it; ``load_back`` loads it (``load_ahead``
starts the copies before the request's extend; docs/cache.md, "Load-ahead").
A load-back locks the path it fills until its copies are settled
(``poll_loads``; ``HostTier.settled``), and marks those nodes with their
``LayerLoads`` once started: ``loading`` tells admission a match reaches pages
still being copied.  Host slots are
freed by ``evict_host`` (least recently used first: host leaves leave the
cache, backed-up nodes lose their host copy and stay gpu nodes).  The host
tier's ``write_policy`` (``--hicache-write-policy``) decides when pages are
copied to host:

* ``write_back``: ``evict`` copies gpu leaves to host (evicting host pages
  when the host pool is full; dropping the KV when even that fails); an
  insert over host nodes frees their host copy; a load-back keeps it (the
  node is backed up: evicting it again copies nothing, and ``evict_host``
  takes the copy back when the host pool needs the room).
* ``write_through``: ``insert`` copies the pages it adds to the tree to host
  at once (when the host pool is full it evicts host leaves, least recently
  used first, and else skips the copy: that node is written back when it is
  evicted, as above); ``evict`` frees a backed-up leaf's device slots
  without a copy; a load-back or an insert over host nodes keeps their host
  copy (they become backed up).

Without a host tier nothing of this is used and every node is on the gpu.
``host_size`` counts the host slots of host and backed-up nodes;
``evictable_size`` and ``protected_size`` count device slots only.  KV
events (``events``) name each change of a page's tiers: ``stored`` with the
tier it joined, ``removed`` with the tier it left, or with none when it left
the cache (a move is a removal, then a store).

Shared tier (``StorageTier``, ``--hicache-storage``; docs/cache.md).  Pages
that leave the cache from its last tier (host leaves evicted from a full host
pool, or device leaves dropped when there is no host tier or it has no room)
are written to the store first, by their page hash.  ``load_back`` of a match
that reached the end of the tree (every host node of it loaded) asks the
store for the key's next pages and loads the leading ones it holds into new
device pages, which join the tree as a device leaf.  The store is never
needed for correctness: a miss or a failure loads fewer pages.

Nothing here touches CUDA: tree values live on the CPU; only the
``req_to_token`` row is read or written on the model's device (and the host
tier's copies, ``kvship.engine.mem.hicache``).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from kvship.engine.mem.hicache_events import page_hashes
from kvship.engine.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.mem.hicache import HostTier
    from kvship.engine.mem.hicache_events import KVEventLog
    from kvship.engine.mem.hicache_store import StorageTier

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass
class MatchResult:
    """``indices``: KV slots of the matched prefix (int64 CPU, one per token).

    ``last_node``: the node the match ends at; pass it to ``inc_lock_ref`` to
    pin the whole matched path.

    ``host_len``: how many more tokens of the key are cached on the host tier
    (in ``host_nodes``, path order); ``load_back`` brings them to the device.

    ``key``: the page-aligned key that was matched (``load_back`` asks the
    shared tier for its pages past the tree).
    """

    indices: torch.Tensor
    last_node: Any
    host_len: int = 0
    host_nodes: tuple = ()
    key: Sequence[int] = ()

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
    ``evict``); ``protected_size()`` counts slots in locked nodes.  Both count
    device slots only; ``host_size()`` counts the host tier's.

    ``load_back(match, max_tokens)`` brings up to ``max_tokens`` of a match's
    host part to the device (it may evict unlocked device nodes to make room)
    and returns the longer match; the indices of the match it was given stay
    valid.  Without a host tier it returns the match unchanged.
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

    def host_size(self) -> int:
        return 0

    def load_back(self, match: MatchResult, max_tokens: int) -> MatchResult:
        return match

    @property
    def consults_storage(self) -> bool:
        """A shared tier is attached: ``load_back`` may extend a match with no host part."""
        return False

    def prefetch(self, key: Sequence[int]) -> bool:
        """Have the shared tier read ahead the pages of ``key`` (a queued prompt) past what this cache holds, so
        that its admission finds them in host memory (docs/cache.md, "Shared tier").  True when a read-ahead
        was queued."""
        return False

    def load_ahead(self, match: MatchResult, max_tokens: int) -> bool:
        """Start loading up to ``max_tokens`` of ``match``'s host part now, on its own (docs/cache.md,
        "Load-ahead"): True when copies started.  Until they are done the loaded path is locked and
        ``loading`` is True for every match that reaches it; a later ``match_prefix`` then finds those pages
        on the device.  False (nothing started) without a host tier or while other load-backs are queued."""
        return False

    def loading(self, match: MatchResult) -> bool:
        """Whether ``match`` reaches pages whose started load-back is still copying (its request waits: only the
        extend that admitted a load-back waits for its copies)."""
        return False

    def poll_loads(self) -> None:
        """Unlock the paths of the load-backs that are done.  Every load-back locks the pages it fills from
        ``load_back`` / ``load_ahead`` until then, so nothing evicts and reuses them while they are written."""

    def loads_in_flight(self) -> bool:
        """Load-backs hold locked device pages (``poll_loads`` has not seen them done)."""
        return False

    def settle_loads(self) -> bool:
        """Wait for every started load-ahead and unlock its path (blocking): what a scheduler short of KV does
        before it retracts or aborts a request, since the pages those copies fill cannot be evicted until they are
        done.  Whether any path was unlocked."""
        return False

    def lock_cost(self, match: MatchResult) -> int:
        """Evictable device tokens that locking ``match``'s path takes out of reach (a load-back locks it at
        once: ``load_back`` / ``load_ahead``'s ``max_tokens`` should leave room for them)."""
        return 0

    def take_loads(self) -> Optional[Any]:
        """The host-tier load-backs queued since the last call, started (``kvship.engine.mem.hicache.LayerLoads``:
        the forward that reads them calls ``wait(layer_id)`` before each layer's attention and ``finish()``
        after); None when there are none.  The launcher calls it before every extend forward."""
        return None

    def tier_stats(self) -> dict:
        """Host-tier figures for the scheduler's stats (empty without a host tier)."""
        return {}

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
    __slots__ = ("children", "parent", "key", "value", "host_value", "lock_ref", "last_access", "hashes", "loads")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional["TreeNode"]):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # device slots; None while the node lives on the host tier
        self.host_value: Optional[torch.Tensor] = None
        self.hashes: Optional[list[int]] = None  # the page hash chain of key (KV events), computed when needed
        self.lock_ref = 0
        self.last_access = 0
        self.loads: Optional[Any] = None  # the started load-back filling ``value`` (None once it is settled)

    def __lt__(self, other: "TreeNode") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access

    @property
    def on_host(self) -> bool:
        """A host node (its pages only in host memory)."""
        return self.value is None

    @property
    def backed_up(self) -> bool:
        """A gpu node whose pages are in host memory too (``write_through``)."""
        return self.value is not None and self.host_value is not None


class RadixCache(BasePrefixCache):
    """Radix tree prefix cache with reference-count locks and LRU eviction (across tiers with ``host``)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int,
        host: Optional["HostTier"] = None,
        events: Optional["KVEventLog"] = None,
        storage: Optional["StorageTier"] = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.host = host
        # --hicache-write-policy write_through: pages are copied to host when cached (module docstring)
        self.write_through = host is not None and host.write_policy == "write_through"
        self.storage = storage  # the shared tier (--hicache-storage; docs/cache.md), None when off
        self.events = events  # pages stored / removed, per tier (docs/cache.md, "KV events")
        self._clock = itertools.count(1)
        self._loading: frozenset = frozenset()  # ids of host nodes a load-back is about to read
        # load-backs whose copies may still run, their paths locked: queued (node lists, not started yet), and
        # started ((LayerLoads, last node), every node marked with its LayerLoads) until poll_loads sees them done
        self._queued: list[tuple[int, list[TreeNode]]] = []  # (the last node's load ticket, the nodes)
        self._ahead: list = []
        self.host_hits = 0  # tokens loaded back from the host tier
        self.ahead_hits = 0  # of those, tokens loaded ahead of their request's extend
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller frees nothing: use at start-up only)."""
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._host = 0

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
        key = full_key = self._aligned(key)
        node = self.root
        self._touch(node)
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            if child.on_host:  # the rest of the path lives on the host tier
                host_len, host_nodes = self._match_host(child, key)
                indices = torch.cat(values) if values else _EMPTY
                return MatchResult(indices, node, host_len, host_nodes, full_key)
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
        return MatchResult(indices, node, key=full_key)

    def _match_host(self, child: TreeNode, key: list[int]) -> tuple[int, tuple]:
        """The host-tier part of a match, starting at ``child`` (a host node whose first page matches)."""
        nodes: list[TreeNode] = []
        total = 0
        while child is not None:
            self._touch(child)
            n = self._match_len(child.key, key)
            whole = n == len(child.key)
            if not whole:
                child = self._split(child, n)
            nodes.append(child)
            total += n
            key = key[n:]
            if not whole or not key:
                break
            child = child.children.get(self._child_key(key))
        return total, tuple(nodes)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens; returns the new upper node (on the same tier)."""
        upper = TreeNode(child.key[:n], None if child.value is None else child.value[:n].clone(), child.parent)
        if child.host_value is not None:
            upper.host_value = child.host_value[:n].clone()
            child.host_value = child.host_value[n:].clone()
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.loads = child.loads
        upper.children = {self._child_key(child.key[n:]): child}
        assert child.parent is not None
        child.parent.children[self._child_key(child.key)] = upper
        child.parent = upper
        child.key = child.key[n:]
        if child.value is not None:
            child.value = child.value[n:].clone()
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[: n // self.page_size], child.hashes[n // self.page_size :]
        return upper

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        key = self._aligned(key)
        value = value[: len(key)].to(torch.int64)
        if value.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        node = self.root
        self._touch(node)
        done = 0
        first_host: Optional[int] = None  # where the path reached the host tier: the cache owns value[first_host:]
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                leaf = TreeNode(rest, value[done:].clone(), node)
                self._touch(leaf)
                node.children[self._child_key(rest)] = leaf
                self._evictable += len(rest)
                self._emit_stored(leaf, "gpu")
                self._write_through(leaf)
                return done if first_host is None else first_host
            self._touch(child)
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            if child.on_host:  # the caller computed these pages again: keep its device copy (and the host one
                # with write-through)
                if first_host is None:
                    first_host = done
                self._host_to_gpu(child, value[done : done + n].clone())
            done += n
            node = child
        return done if first_host is None else first_host

    def _host_to_gpu(self, node: TreeNode, slots: torch.Tensor, loaded: bool = False) -> None:
        """``node`` (unlocked, on host) now lives in the device ``slots``; its host pages stay (the node is
        backed up) with write-through or when ``loaded`` (the device pages are copies of them), else they are
        freed."""
        assert self.host is not None and node.host_value is not None
        node.value = slots
        self._evictable += len(node.key)
        if not (self.write_through or loaded):
            self._emit_removed(node, "host")
            self.host.free(node.host_value)
            node.host_value = None
            self._host -= len(node.key)
        self._emit_stored(node, "gpu")

    def _write_through(self, node: TreeNode) -> None:
        """With write-through, copy ``node``'s new device pages to host (module docstring): when the host pool
        is short, host leaves are evicted first; when it still is, the copy is skipped."""
        if not self.write_through:
            return
        assert self.host is not None and node.host_value is None
        k = len(node.key)
        host_slots = self.host.write_back(node.value)
        if host_slots is None:
            self.evict_host(k - self.host.available_size(), backed_up=False)
            host_slots = self.host.write_back(node.value)
        if host_slots is None:
            return
        node.host_value = host_slots
        self._host += k
        self._emit_stored(node, "host")

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

    def _is_gpu_leaf(self, node: TreeNode) -> bool:
        """An unlocked device node none of whose children is on the device (evictable now)."""
        return (
            node is not self.root
            and node.value is not None
            and node.lock_ref == 0
            and not any(c.value is not None for c in node.children.values())
        )

    def _gpu_leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            on_gpu = [c for c in node.children.values() if c.value is not None]
            if on_gpu:
                stack.extend(on_gpu)
            elif self._is_gpu_leaf(node):
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> int:
        """Free device slots (see ``BasePrefixCache.evict``); with a host tier the KV moves there."""
        if num_tokens <= 0:
            return 0
        heap = self._gpu_leaves()
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            k = len(leaf.key)
            self._evictable -= k
            freed += k
            parent = leaf.parent
            assert parent is not None
            if leaf.backed_up:  # write-through made its host copy: only the device slots go
                self._emit_removed(leaf, "gpu")
                self.allocator.free(leaf.value)
                leaf.value = None
            elif not self._write_back(leaf):
                self._save(leaf)  # the KV leaves the cache: the shared tier keeps a copy
                self.allocator.free(leaf.value)
                self._drop_subtree(leaf)
            if self._is_gpu_leaf(parent):
                heapq.heappush(heap, parent)
        return freed

    def _write_back(self, leaf: TreeNode) -> bool:
        """Move ``leaf``'s KV to the host tier (evicting host leaves if needed); False when it cannot."""
        if self.host is None:
            return False
        k = len(leaf.key)
        host_slots = self.host.write_back(leaf.value)
        if host_slots is None:
            self.evict_host(k - self.host.available_size())
            host_slots = self.host.write_back(leaf.value)
        if host_slots is None:
            return False
        self._emit_removed(leaf, "gpu")
        self.allocator.free(leaf.value)
        leaf.value = None
        leaf.host_value = host_slots
        self._host += k
        self._emit_stored(leaf, "host")
        return True

    def _drop_subtree(self, node: TreeNode) -> None:
        """Unlink ``node`` (its device slots already freed) and free its host descendants."""
        self._emit_removed(node)
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            stack.extend(d.children.values())
            self._emit_removed(d)
            self._save(d)
            self._free_host(d)
        assert node.parent is not None
        del node.parent.children[self._child_key(node.key)]
        node.parent = None

    def _save(self, node: TreeNode) -> None:
        """Write ``node``'s pages (from whichever tier holds them) to the shared tier, if any."""
        if self.storage is None:
            return
        if node.value is not None:
            self.storage.save(self._node_hashes(node), node.value, self.storage.pool)
        elif self.host is not None and node.host_value is not None:
            self.host.sync_writes()  # the host rows of a write-back still in flight
            self.storage.save(self._node_hashes(node), node.host_value, self.host.pool)

    def _free_host(self, node: TreeNode) -> None:
        assert self.host is not None and node.host_value is not None
        self.host.free(node.host_value)
        node.host_value = None
        self._host -= len(node.key)

    # --- KV events -------------------------------------------------------------
    def _node_hashes(self, node: TreeNode) -> list[int]:
        """The page hash chain of ``node``'s key (computed down from the nearest ancestor that has it)."""
        path = []
        while node is not self.root and node.hashes is None:
            path.append(node)
            node = node.parent
        parent = 0 if node is self.root or not node.hashes else node.hashes[-1]
        for n in reversed(path):
            n.hashes = page_hashes(n.key, self.page_size, parent)
            parent = n.hashes[-1] if n.hashes else parent
        return path[0].hashes if path else node.hashes  # type: ignore[return-value]

    def _emit_stored(self, node: TreeNode, tier: str) -> None:
        if self.events is not None:
            self.events.stored(self._node_hashes(node), tier)

    def _emit_removed(self, node: TreeNode, tier: Optional[str] = None) -> None:
        """``node``'s pages left ``tier`` (None: the cache)."""
        if self.events is not None:
            self.events.removed(self._node_hashes(node), tier)

    def cached_pages(self) -> dict[int, str]:
        """Every cached page: hash -> its fastest tier (what a KV event mirror's ``pages`` holds; for checks)."""
        out: dict[int, str] = {}
        for h, tier in self.cached_page_tiers():
            if tier == "gpu" or h not in out:
                out[h] = tier
        return out

    def cached_page_tiers(self) -> set[tuple[int, str]]:
        """Every cached page on every tier that holds it: {(hash, tier)} (what the KV events describe)."""
        out: set[tuple[int, str]] = set()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            tiers = (["gpu"] if node.value is not None else []) + (["host"] if node.host_value is not None else [])
            for h in self._node_hashes(node):
                out.update((h, t) for t in tiers)
        return out

    def evict_host(self, num_tokens: int, backed_up: bool = True) -> int:
        """Free at least ``num_tokens`` host slots, least recently used first: of host leaves (they leave the
        cache) and, when ``backed_up``, of backed-up nodes (they lose their host copy, stay on the device);
        returns how many."""
        if num_tokens <= 0 or self.host is None:
            return 0
        heap, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.on_host and not node.children and id(node) not in self._loading:
                heap.append(node)
            elif backed_up and node.backed_up:
                heap.append(node)
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            freed += len(leaf.key)
            if leaf.backed_up:  # the device copy stays cached
                self._emit_removed(leaf, "host")
                self._free_host(leaf)
                continue
            self._emit_removed(leaf)
            self._save(leaf)
            self._free_host(leaf)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            leaf.parent = None  # detached: a match that still holds it cannot load it back
            if parent.on_host and not parent.children and id(parent) not in self._loading:
                heapq.heappush(heap, parent)
        return freed

    @property
    def consults_storage(self) -> bool:
        return self.storage is not None

    def prefetch(self, key: Sequence[int]) -> bool:
        if self.storage is None:
            return False
        key = self._aligned(key)
        held = self._held_pages(key)
        if held * self.page_size >= len(key):
            return False
        return self.storage.prefetch(page_hashes(key, self.page_size)[held:])

    def _held_pages(self, key: list[int]) -> int:
        """Whole pages of ``key`` the tree holds on any tier (a read-only walk: no touch, no split)."""
        node, n = self.root, 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            m = self._match_len(child.key, key)
            n += m
            if m < len(child.key):
                break
            node, key = child, key[m:]
        return n // self.page_size

    def take_loads(self) -> Optional[Any]:
        if self.host is None:
            return None
        loads = self.host.start_loads()
        self._claim_started()
        return loads

    def _claim_started(self) -> None:
        """Queued load-backs that have started (here, or inside the tier: a drain, a write-back short of host
        pages) are marked with their ``LayerLoads``; those already done unlock."""
        left = []
        for ticket, nodes in self._queued:
            state = self.host.load_state(ticket)
            if state == "queued":
                left.append((ticket, nodes))
            elif state == "done":
                self.dec_lock_ref(nodes[-1])
            else:  # started: locked and marked until poll_loads sees it done
                for node in nodes:
                    node.loads = state
                self._ahead.append((state, nodes[-1]))
        self._queued = left

    def load_ahead(self, match: MatchResult, max_tokens: int) -> bool:
        if self.host is None or not match.host_nodes or self.host.has_queued():
            return False  # (queued loads belong to the extend being built: they ride in it)
        loaded = self._load_back_host(match, max_tokens)
        if loaded.last_node is match.last_node:
            return False
        self.take_loads()
        self.ahead_hits += loaded.length - match.length
        return True

    def loading(self, match: MatchResult) -> bool:
        if not (self._ahead or self._queued):
            return False
        self.poll_loads()
        node = match.last_node
        while node is not None:
            if node.loads is not None:
                return True
            node = node.parent
        return False

    def loads_in_flight(self) -> bool:
        return bool(self._ahead or self._queued)

    def settle_loads(self) -> bool:
        if not self._ahead:
            return False
        before = len(self._ahead)
        for loads, _ in self._ahead:
            loads.finish()  # the copies are written (CUDA: the current stream is ordered after them)
        self.poll_loads()
        return len(self._ahead) < before

    def lock_cost(self, match: MatchResult) -> int:
        node, n = match.last_node, 0
        while node is not None and node is not self.root:
            n += len(node.key) if node.lock_ref == 0 else 0
            node = node.parent
        return n

    def poll_loads(self) -> None:
        if self._queued:
            self._claim_started()
        if not self._ahead:
            return
        left = []
        for loads, last in self._ahead:
            if not self.host.settled(loads):
                left.append((loads, last))
                continue
            node = last
            while node is not None:  # (a split gave the upper part the same loads)
                if node.loads is loads:
                    node.loads = None
                node = node.parent
            self.dec_lock_ref(last)
        self._ahead = left

    def load_back(self, match: MatchResult, max_tokens: int) -> MatchResult:
        """See ``BasePrefixCache``: the leading whole pages of ``match``'s host part that fit ``max_tokens`` (a
        host node that fits in part is split there; the copies are queued, ``take_loads`` starts them); then,
        when the match reached the end of the tree, the key's next pages the shared tier holds."""
        loaded = self._load_back_host(match, max_tokens)
        if self.storage is None or loaded.host_len or loaded.length >= len(loaded.key):
            return loaded
        return self._load_from_storage(loaded, max_tokens - (loaded.length - match.length))

    def _load_from_storage(self, match: MatchResult, max_tokens: int) -> MatchResult:
        """Extend ``match`` (which ends where the tree ends for its key) by the store's pages of the key."""
        assert self.storage is not None
        ps = self.page_size
        rest = match.key[match.length :]
        n_pages = min(len(rest), max(0, max_tokens)) // ps
        if n_pages == 0:
            return match
        node = match.last_node
        parent = 0 if node is self.root else self._node_hashes(node)[-1]
        hashes = page_hashes(rest[: n_pages * ps], ps, parent)
        n_pages = self.storage.lookup(hashes)
        if n_pages == 0:
            return match
        n = n_pages * ps
        self.inc_lock_ref(node)  # the device path above stays put while room is made
        try:
            slots = self.allocator.alloc(n)
            if slots is None:
                self.evict(n - self.allocator.available_size())
                slots = self.allocator.alloc(n)
        finally:
            self.dec_lock_ref(node)
        # every rank of a multi-rank worker evicts the same nodes, so their allocations agree
        if slots is None:
            return match
        got = self.storage.load(hashes[:n_pages], slots)
        if got < n_pages:
            self.allocator.free(slots[got * ps :])
            slots = slots[: got * ps]
        if got == 0:
            return match
        n = got * ps
        key = list(match.key[: match.length + n])
        value = torch.cat([match.indices, slots])
        if self.insert(key, value) != match.length:
            raise RuntimeError("radix cache: the pages loaded from the shared tier were already cached")
        m = self.match_prefix(key)
        if m.length != len(key):
            raise RuntimeError(f"radix cache: re-match after a shared-tier load found {m.length} of {len(key)} tokens")
        return MatchResult(m.indices, m.last_node, 0, (), match.key)

    def _load_back_host(self, match: MatchResult, max_tokens: int) -> MatchResult:
        if self.host is None or not match.host_nodes:
            return match
        nodes: list[TreeNode] = []
        rest = list(match.host_nodes)  # the host nodes of the match not loaded (path order)
        n = 0
        while rest:
            node = rest[0]
            if node.parent is None or not node.on_host:
                break
            if n + len(node.key) > max_tokens:  # the whole pages of it that fit: split it there
                k = (max_tokens - n) // self.page_size * self.page_size
                if k > 0:
                    nodes.append(self._split(node, k))
                    n += k
                break
            nodes.append(rest.pop(0))
            n += len(node.key)
        if not nodes:
            return match
        self.inc_lock_ref(match.last_node)  # the device path above stays put while room is made
        self._loading = frozenset(id(x) for x in nodes)
        try:
            slots = self.allocator.alloc(n)
            if slots is None:
                self.evict(n - self.allocator.available_size())
                slots = self.allocator.alloc(n)
        finally:
            self._loading = frozenset()
            self.dec_lock_ref(match.last_node)
        if slots is None:  # (a node split above stays split: the same pages, in two nodes)
            return MatchResult(match.indices, match.last_node, match.host_len, tuple(nodes + rest), match.key)
        off = 0
        for node in nodes:
            k = len(node.key)
            part = slots[off : off + k].clone()
            off += k
            ticket = self.host.load_back(node.host_value, part)
            self._host_to_gpu(node, part, loaded=True)
        # until the copies are done nothing may evict (and reuse) these device pages: locked from here
        self.inc_lock_ref(nodes[-1])
        self._queued.append((ticket, nodes))
        self.host_hits += n
        return MatchResult(torch.cat([match.indices, slots]), nodes[-1], match.host_len - n, tuple(rest), match.key)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def host_size(self) -> int:
        return self._host

    def tier_stats(self) -> dict:
        out = {} if self.storage is None else self.storage.stats()
        if self.host is None:
            return out
        return out | {
            "host_write_policy": self.host.write_policy,
            "host_total_slots": self.host.total_slots,
            "host_free_slots": self.host.available_size(),
            "host_cached_slots": self._host,
            "host_hit_tokens": self.host_hits,
            "host_load_ahead_tokens": self.ahead_hits,
            "host_loads_in_flight": len(self._ahead) + len(self._queued),
            "host_bytes_written": self.host.bytes_written,
            "host_bytes_loaded": self.host.bytes_loaded,
        }

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
    disable: bool,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    page_size: int,
    host: Optional["HostTier"] = None,
    events: Optional["KVEventLog"] = None,
    storage: Optional["StorageTier"] = None,
) -> BasePrefixCache:
    """``RadixCache`` (with the host tier ``host``, the KV event log ``events`` and the shared tier ``storage``,
    if any) unless ``disable`` (``--disable-radix-cache``)."""
    if disable:
        if host is not None or events is not None or storage is not None:
            raise ValueError(
                "the host and shared KV tiers and KV events need the radix cache (no --disable-radix-cache)"
            )
        return NoPrefixCache(req_to_token_pool, allocator, page_size)
    return RadixCache(req_to_token_pool, allocator, page_size, host, events, storage)

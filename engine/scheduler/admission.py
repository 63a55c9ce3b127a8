"""Admission: which waiting requests join the next extend batch, and how much of each.

* ``check_prompt``: the prompt rules every entry point applies (the HTTP
  front end before tokenized requests reach the scheduler, the scheduler
  itself for direct submitters): non-empty, shorter than the context, fits
  the KV pool.
* ``RequestQueues``: the scheduler's request state (waiting, running, the
  one chunked request, every unfinished request by id).  A request is in at
  most one of waiting / running / chunked.
* ``Admission.build_extend``: orders the waiting queue by the policy,
  matches each prompt against the prefix cache and binds the match to a
  ``req_to_token`` row (locking it in the cache), and takes requests while
  ``--max-prefill-tokens``, ``--chunked-prefill-size``, ``--max-running-requests``
  and the ``KVBudget`` allow.  A prompt that does not fit the chunk budget is
  computed over several steps as the single chunked request.  An idle server
  always admits its first request.  ``busy`` (the pipeline loop): requests of
  batches in flight; the chunked request waits while its chunk is in flight,
  and newly admitted requests in flight count as running.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from kvship.engine.forward_batch import ForwardMode
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.engine.scheduler.kv_budget import KVBudget
from kvship.engine.scheduler.policy import PrefillBudget, SchedulePolicy


@dataclass(frozen=True)
class PromptProblem:
    """Why a prompt cannot be served: a user-facing message and an OpenAI-style error code."""

    message: str
    code: str


def ids_in_vocab(ids: Sequence[int], vocab_size: int) -> bool:
    """Whether every id is in ``[0, vocab_size)`` (an empty prompt: yes; a non-integer: no).  Two C-level
    passes (``min``, ``max``): a 4096-id prompt costs ~0.1 ms, against ~0.5 ms for a per-id generator, on the
    path from a request's arrival to its admission."""
    try:
        return not ids or (0 <= min(ids) and max(ids) < vocab_size)
    except TypeError:
        return False


def check_prompt(n_prompt: int, context_len: int, kv_slots: int) -> Optional[PromptProblem]:
    """The prompt-length rules (see the module docstring); None when the prompt is fine."""
    if n_prompt == 0:
        return PromptProblem("the prompt is empty", "empty_prompt")
    if n_prompt >= context_len:
        return PromptProblem(
            f"the prompt has {n_prompt} tokens but this model's maximum context length is "
            f"{context_len} tokens (the prompt must leave room for at least one new token)",
            "context_length_exceeded",
        )
    if n_prompt + 1 > kv_slots:
        return PromptProblem(
            f"the prompt has {n_prompt} tokens but the KV cache holds only {kv_slots} (--max-total-tokens)",
            "context_length_exceeded",
        )
    return None


@dataclass
class RequestQueues:
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked_req: Optional[Req] = None
    reqs: dict[str, Req] = field(default_factory=dict)  # every unfinished request, by rid

    def num_active(self) -> int:
        return len(self.running) + (1 if self.chunked_req is not None else 0)

    def detach(self, req: Req) -> None:
        """Remove ``req`` from every queue (it is finishing)."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.reqs.pop(req.rid, None)


class Admission:
    """Builds extend batches (see the module docstring); owns no request state itself."""

    def __init__(
        self,
        queues: RequestQueues,
        budget: KVBudget,
        policy: SchedulePolicy,
        req_to_token_pool: Any,
        counters: Counter,
        *,
        max_running: int,
        max_prefill_tokens: int,
        chunk_size: Optional[int],
        load_ahead: float = 0.0,
    ):
        self.q = queues
        self.budget = budget
        self.cache = budget.cache
        self.policy = policy
        self.req_to_token_pool = req_to_token_pool
        self.counters = counters
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.load_ahead = load_ahead  # KVSHIP_HICACHE_LOAD_AHEAD (0: off)

    def build_extend(self, busy: Optional[Mapping[int, Req]] = None) -> Optional[ScheduleBatch]:
        """The next extend batch, or None when no waiting request can be admitted now."""
        q, kv = self.q, self.budget
        self.cache.poll_loads()  # load-aheads that are done unlock their paths (also after their request left)
        if not q.waiting and q.chunked_req is None:
            return None
        running = q.running
        if busy:
            if q.chunked_req is not None and id(q.chunked_req) in busy:
                return None  # its previous chunk is still in flight
            in_running = {id(r) for r in q.running}
            running = q.running + [r for k, r in busy.items() if k not in in_running]  # admitted, in flight
        ps = kv.page_size
        limits = PrefillBudget(
            page_size=ps,
            rem_input=self.max_prefill_tokens,
            rem_chunk=self.chunk_size,
            rem_memory=kv.memory_left(running),
        )
        reqs: list[Req] = []
        if q.chunked_req is not None:
            req = q.chunked_req
            n = limits.fit(len(req.fill_ids) - req.kv_committed_len, first=True)
            if n == 0:
                return None
            req.extend_input_len = n
            limits.take(n, 0)
            reqs.append(req)
            if req.kv_committed_len + n < len(req.fill_ids):
                return ScheduleBatch(reqs, ForwardMode.EXTEND)
        n_active = len(running) + len(reqs)
        if (
            not q.waiting
            or n_active >= self.max_running
            or self.req_to_token_pool.available_size() == 0
            or (limits.rem_memory < ps and running)
        ):
            # nothing more can join (skip ordering the queue, which costs a prefix match per request)
            return ScheduleBatch(reqs, ForwardMode.EXTEND) if reqs else None
        for req in self.policy.order(q.waiting):
            if n_active >= self.max_running:
                break
            fill = req.fill_ids
            match = self.cache.match_prefix(fill[:-1])  # at least one token is computed for logits
            if self.cache.loading(match):
                continue  # its prefix pages are still being loaded ahead: it joins a later extend
            # a load-back locks its path at once (the device prefix above the loaded pages too): room for both
            room = max(0, limits.rem_memory - self.cache.lock_cost(match)) if match.host_len else limits.rem_memory
            if self._loads_ahead(match, len(fill)) and self.cache.load_ahead(match, room):
                limits.refresh(kv.memory_left(running))  # the loading path is locked
                continue
            # prefix pages on the host tier (or, past the tree, in the shared store): load instead of computing
            if match.host_len or self.cache.consults_storage:
                match = self.cache.load_back(match, max(0, room))
            remaining = len(fill) - match.length
            n = limits.fit(remaining, first=not reqs)
            if n == 0:
                break
            # an idle server always admits its first request (not while load-aheads hold pages it cannot evict)
            alone = not reqs and not running and not self.cache.loads_in_flight()
            reserve = 0
            if n == remaining:  # the prompt completes here: reserve room for its decoding
                reserve = kv.reserve([req])
                if kv.round_up(n) + reserve > limits.rem_memory and not alone:
                    break
            idx = self.req_to_token_pool.alloc()
            if idx is None:
                break
            self.bind_prefix(req, idx, match)
            limits.take(n, reserve)
            limits.refresh(kv.memory_left(running))  # locking the matched path made it unevictable
            if limits.rem_memory < 0 and not alone:
                self.unbind_prefix(req)
                break
            self.count_admission(req)
            req.extend_input_len = n
            q.waiting.remove(req)
            reqs.append(req)
            n_active += 1
            if n < remaining:
                q.chunked_req = req
                break
        if not reqs:
            # load-backs of requests that did not fit after all: started and waited for on the current stream,
            # so their pages unlock at the next poll on every rank alike
            loads = self.cache.take_loads()
            if loads is not None:
                loads.finish()
            return None
        return ScheduleBatch(reqs, ForwardMode.EXTEND)

    def _loads_ahead(self, match: Any, n_fill: int) -> bool:
        """Whether ``match``'s host part is worth loading before the request's extend rather than during it: at
        least ``load_ahead`` times the tokens the extend computes (docs/cache.md, "Load-ahead")."""
        if not self.load_ahead or not match.host_len:
            return False
        return match.host_len >= self.load_ahead * (n_fill - match.length - match.host_len)

    def bind_prefix(self, req: Req, idx: int, match: Any) -> None:
        """Give ``req`` a req_to_token row holding its cached prefix (locked in the cache)."""
        self.cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = idx
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = match.length
        req.last_loc = int(match.indices[-1]) if match.length else -1
        if match.length:
            self.req_to_token_pool.write(idx, 0, match.indices)

    def unbind_prefix(self, req: Req) -> None:
        """Undo ``bind_prefix`` (the request stays waiting)."""
        self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()

    def count_admission(self, req: Req, from_cache: bool = True) -> None:
        """Count ``req``'s prompt once, at its first admission (``from_cache``: its cached prefix too)."""
        if not req.admitted:
            req.admitted = True
            self.counters["prompt_tokens"] += len(req.origin_input_ids)
            if from_cache:
                req.cached_tokens = min(req.cache_protected_len, len(req.origin_input_ids))
                self.counters["cached_tokens"] += req.cached_tokens

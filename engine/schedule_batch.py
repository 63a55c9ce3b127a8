"""Scheduler-side batch types.

Data flow:  ``Req`` (one request; CPU state owned by the scheduler thread)
         -> ``ScheduleBatch`` (the requests of one step; allocates their KV
            slots and writes ``req_to_token``)
         -> ``ForwardBatch`` (tensors on the model's device, see
            ``kvship.engine.forward_batch`` for the layout rules kept here)
         -> ``ModelRunner.forward`` -> logits -> ``Sampler``.

KV bookkeeping of a ``Req`` (see ``kvship.engine.mem.radix_cache`` for who
owns which slots):

* ``fill_ids`` = prompt + generated tokens: the sequence whose K/V the
  request needs.  The newest generated token never has K/V yet: it is the
  next decode step's input.
* ``kv_committed_len`` positions have computed K/V; ``kv_allocated_len`` have
  slots in ``req_to_token`` (more than committed only while a forward is in
  flight or after it failed).
* ``cache_protected_len`` leading positions are shared with the prefix cache
  and pinned through ``last_node``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch

from kvship.engine.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from kvship.engine.grammar.backend import GrammarMatcher
from kvship.engine.io_struct import FinishReason, GenerateRequest, SamplingParams, TokenChunk

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.mem.radix_cache import BasePrefixCache

# stop strings are searched in the decoded text of this many trailing tokens per stop-string character
_STOP_TAIL_TOKENS_PER_CHAR = 4


class Req:
    """One generation request as the scheduler tracks it."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        eos_token_ids: Iterable[int] = (),
        max_new_tokens: Optional[int] = None,
        created_time: Optional[float] = None,
        prior_output_len: int = 0,
    ):
        self.rid = rid
        self.origin_input_ids: list[int] = list(origin_input_ids)
        self.output_ids: list[int] = []
        # a resumed stream: the last ``prior_output_len`` input ids are earlier output (io_struct.Resumed)
        self.prior_output_len = min(max(int(prior_output_len), 0), len(self.origin_input_ids))
        self.sampling_params = sampling_params
        self.max_new_tokens = sampling_params.max_new_tokens if max_new_tokens is None else max_new_tokens
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_strs = list(sampling_params.stop)
        self._stop_tail = _STOP_TAIL_TOKENS_PER_CHAR * max((len(s) for s in self.stop_strs), default=0) + 2
        self.created_time = time.time() if created_time is None else created_time

        # KV state (reset by reset_kv_state on finish / retract)
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = torch.empty((0,), dtype=torch.int64)
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.last_loc = -1
        # the step being built
        self.extend_input_len = 0
        self.is_chunked = False  # this extend does not reach the end of fill_ids

        # accounting
        self.cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.spec_rounds = 0  # speculative verify rounds of this request and the tokens they emitted
        self.spec_round_tokens = 0
        self.admitted = False
        self.retractions = 0
        self.finished_reason: Optional[FinishReason] = None
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.sent_len = 0  # output tokens already handed to the output sink
        self.finish_sent = False
        self.generator: Optional[torch.Generator] = None  # per-request RNG (seeded requests; made by the sampler)
        # structured output: the request's grammar matcher (``kvship.engine.grammar``), set before it is scheduled
        self.grammar: Any = None
        # (token, accepted, terminated): fed ahead by a chained step (``feed_grammars``)
        self._grammar_fed: Optional[tuple[int, bool, bool]] = None

    @classmethod
    def from_generate_request(
        cls, greq: GenerateRequest, eos_token_ids: Iterable[int], max_new_tokens: Optional[int] = None
    ) -> "Req":
        return cls(
            greq.rid,
            greq.input_ids,
            greq.sampling_params,
            return_logprob=greq.return_logprob,
            top_logprobs_num=greq.top_logprobs_num,
            stream=greq.stream,
            eos_token_ids=eos_token_ids,
            max_new_tokens=max_new_tokens,
            created_time=greq.created_time,
            prior_output_len=greq.resumed.output_len if greq.resumed is not None else 0,
        )

    # --- sequences -------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def generated_ids(self) -> list[int]:
        """The answer's ids so far: a resumed stream's earlier output, then this worker's output."""
        if not self.prior_output_len:
            return self.output_ids
        return self.origin_input_ids[-self.prior_output_len :] + self.output_ids

    @property
    def prompt_ids(self) -> list[int]:
        """The input ids that are the user's prompt (without a resumed stream's earlier output)."""
        return self.origin_input_ids[: len(self.origin_input_ids) - self.prior_output_len]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_kv_state(self) -> None:
        self.req_pool_idx = None
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.last_loc = -1
        self.extend_input_len = 0
        self.is_chunked = False

    # --- generation ------------------------------------------------------------
    def append_token(
        self,
        token_id: int,
        tokenizer: Any = None,
        logprob: Optional[float] = None,
        top_logprobs: Optional[list[tuple[int, float]]] = None,
    ) -> None:
        """Append one generated token, record its logprobs, then check the stop conditions.

        A constrained request's grammar accepts the token first: a token the
        grammar refuses aborts the request, one that ends the grammar stops it.
        A token ``feed_grammars`` gave the grammar already is not fed again,
        and the matcher is not touched (a mask fill may be using it).
        """
        self.output_ids.append(int(token_id))
        if self.return_logprob:
            self.output_token_logprobs.append(float(logprob) if logprob is not None else float("nan"))
            if self.top_logprobs_num > 0:
                self.output_top_logprobs.append(list(top_logprobs or []))
        if self.grammar is not None and self.finished_reason is None:
            fed, self._grammar_fed = self._grammar_fed, None
            if fed is not None and fed[0] == int(token_id):
                accepted, terminated = fed[1], fed[2]
            else:
                accepted = bool(self.grammar.accept(token_id))
                terminated = accepted and self.grammar.terminated
            if not accepted:
                self.finished_reason = FinishReason.abort(f"token {int(token_id)} violates the request's grammar")
                return
            if terminated:
                self.finished_reason = FinishReason.stop(int(token_id))
                return
        self.check_finished(tokenizer)

    @staticmethod
    def feed_grammars(reqs: Sequence["Req"], tokens: Sequence[int]) -> list[bool]:
        """Give each request's grammar the token ``append_token`` will append next, all in one call
        (the overlapped loop's chained step fills the next masks before those tokens are processed);
        element ``i`` is False when ``reqs[i]``'s grammar refused ``tokens[i]`` or ended on it."""
        grammars = [r.grammar for r in reqs]
        if all(isinstance(g, GrammarMatcher) for g in grammars):
            outcomes = GrammarMatcher.accept_many(grammars, list(tokens))
        else:
            outcomes = []
            for g, t in zip(grammars, tokens):
                accepted = bool(g.accept(int(t)))
                outcomes.append((accepted, accepted and bool(g.terminated)))
        for r, t, (accepted, terminated) in zip(reqs, tokens, outcomes):
            r._grammar_fed = (int(t), accepted, terminated)
        return [accepted and not terminated for accepted, terminated in outcomes]

    def check_finished(self, tokenizer: Any = None) -> None:
        """Set ``finished_reason`` when the newest token ends the request.

        Order: EOS (model eos ids unless ``ignore_eos``), ``stop_token_ids``,
        stop strings (the decoded tail of the output; needs ``tokenizer``
        with ``decode(ids, skip_special_tokens=...)``), then
        ``max_new_tokens`` (already clipped to the context length).
        """
        if self.finished_reason is not None or not self.output_ids:
            return
        last = self.output_ids[-1]
        if last in self.eos_token_ids or last in self.stop_token_ids:
            self.finished_reason = FinishReason.stop(last)
            return
        if self.stop_strs and tokenizer is not None:
            # a resumed stream's earlier output counts: a stop string may span the join
            tail = tokenizer.decode(
                self.generated_ids[-self._stop_tail :], skip_special_tokens=self.sampling_params.skip_special_tokens
            )
            for s in self.stop_strs:
                if s in tail:
                    self.finished_reason = FinishReason.stop(s)
                    return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = FinishReason.of_length(len(self.output_ids))

    def take_chunk(self) -> Optional[TokenChunk]:
        """The output chunk for tokens not sent yet (and the finish, once); None if nothing new."""
        new = self.output_ids[self.sent_len :]
        done = self.finished and not self.finish_sent
        if not new and not done:
            return None
        chunk = TokenChunk(
            rid=self.rid,
            token_ids=list(new),
            finished=self.finished,
            finish_reason=self.finished_reason if self.finished else None,
            prompt_tokens=len(self.origin_input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            spec_accept_length=self.spec_round_tokens / self.spec_rounds if self.spec_rounds else None,
        )
        if self.return_logprob:
            chunk.logprobs = self.output_token_logprobs[self.sent_len :]
            if self.top_logprobs_num > 0:
                chunk.top_logprobs = self.output_top_logprobs[self.sent_len :]
        self.sent_len = len(self.output_ids)
        self.finish_sent = self.finished
        return chunk

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"kv={self.kv_committed_len}/{self.kv_allocated_len}, cached={self.cache_protected_len})"
        )


class KVAllocationError(RuntimeError):
    """The allocator could not give a batch its slots even after eviction."""


@dataclass
class ScheduleBatch:
    """The requests of one forward step and their CPU-side layout.

    ``prepare_for_extend`` / ``prepare_for_decode`` allocate KV slots (evicting
    cache entries if the allocator is short) and update each request's
    ``kv_allocated_len``; ``prepare_for_extend`` also writes ``req_to_token``
    and the inputs, and ``to_forward_batch`` moves an extend's layout to
    ``device`` (decode batches are built by ``kvship.engine.scheduler.launch``).
    ``extend_input_len`` of each request must be set before ``prepare_for_extend``.
    """

    reqs: list[Req]
    forward_mode: ForwardMode
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: Optional[torch.Tensor] = None
    # requests whose logits are sampled this step (extend: those whose fill_ids are complete)
    sample_mask: list[bool] = field(default_factory=list)
    # --enable-mixed-chunk: running requests (by id) that decode one token inside this extend step
    decode_rows: frozenset[int] = frozenset()

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def sampling_reqs(self) -> list[Req]:
        return [r for r, m in zip(self.reqs, self.sample_mask) if m]

    def alloc_slots(
        self, allocator: Any, cache: "BasePrefixCache", alloc: Callable[[], Optional[torch.Tensor]]
    ) -> torch.Tensor:
        """Run ``alloc``; if the allocator is short, evict cache entries and retry once."""
        out = alloc()
        if out is None:
            need = allocator.pages_needed(self.prefix_lens, self.seq_lens) * allocator.page_size
            cache.evict(need - allocator.available_size())
            out = alloc()
        if out is None:
            raise KVAllocationError(
                f"{self.forward_mode.name}: KV pool exhausted ({allocator.available_size()} slots free)"
            )
        return out

    def prepare_for_extend(self, allocator: Any, req_to_token_pool: Any, cache: "BasePrefixCache") -> None:
        self.prefix_lens = [r.kv_committed_len for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        self.seq_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        last_locs = [r.last_loc for r in self.reqs]
        if any(e <= 0 for e in self.extend_lens):
            raise ValueError("every request of an extend batch needs at least one new token")
        loc = self.alloc_slots(
            allocator, cache, lambda: allocator.alloc_extend(self.prefix_lens, self.seq_lens, last_locs)
        )
        self.out_cache_loc = loc
        offset = 0
        self.input_ids, self.positions, self.sample_mask = [], [], []
        for r, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens):
            req_to_token_pool.write(r.req_pool_idx, p, loc[offset : offset + e])
            r.kv_allocated_len = p + e
            r.last_loc = int(loc[offset + e - 1])
            offset += e
            fill = r.fill_ids
            self.input_ids.extend(fill[p : p + e])
            self.positions.extend(range(p, p + e))
            r.is_chunked = p + e < len(fill)
            self.sample_mask.append(not r.is_chunked)

    def prepare_for_decode(self, allocator: Any, cache: "BasePrefixCache") -> list[int]:
        """Allocate one slot per request for its next position; returns the slots.

        The caller writes them into ``req_to_token`` and builds the input ids
        (the newest token of each request, possibly still on the device).
        """
        self.prefix_lens = [r.kv_committed_len for r in self.reqs]
        self.seq_lens = [p + 1 for p in self.prefix_lens]
        self.extend_lens = [1] * len(self.reqs)
        last_locs = [r.last_loc for r in self.reqs]
        loc = self.alloc_slots(allocator, cache, lambda: allocator.alloc_decode(self.seq_lens, last_locs))
        self.out_cache_loc = loc
        locs = loc.tolist()
        for r, s, l in zip(self.reqs, self.seq_lens, locs):
            r.kv_allocated_len = s
            r.last_loc = l
        self.positions = list(self.prefix_lens)
        self.sample_mask = [True] * len(self.reqs)
        return locs

    def commit(self) -> None:
        """The forward succeeded: every allocated position now has computed K/V."""
        for r in self.reqs:
            r.kv_committed_len = r.kv_allocated_len

    def to_forward_batch(
        self, device: torch.device | str, req_to_token_pool: Any, kv_pool: Any, attn_backend: Any
    ) -> ForwardBatch:
        assert self.out_cache_loc is not None, "prepare_for_extend/decode first"
        extend = self.forward_mode.is_extend()
        logits_indices = None
        if extend:  # logits only for requests that sample this step (not mid-prompt chunks)
            logits_indices, end = [], 0
            for e, m in zip(self.extend_lens, self.sample_mask):
                end += e
                if m:
                    logits_indices.append(end - 1)
        return build_forward_batch(
            self.forward_mode,
            device=device,
            input_ids=self.input_ids,
            positions=self.positions,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
            extend_lens=self.extend_lens if extend else None,
            prefix_lens=self.prefix_lens if extend else None,
            logits_indices=logits_indices,
        )

"""Selective disaggregation (``--pd-selective``): which PD requests the decode worker serves alone.

A prompt whose *tokens left to prefill* are at most ``--pd-selective-max-tokens`` skips the prefill worker:
the router sends it, without bootstrap fields, to the decode worker the decode policy chose, and that worker
prefills it itself (``kvship.decode``: a request carrying no bootstrap field is prefilled locally, as in unified
mode).  Shipping KV costs a round of bootstrap messages and a transfer; for a short prompt (or one whose prefix
decode already holds) that costs more than computing it in place.

Tokens left to prefill = the prompt's tokens less the prefix the decode worker caches.  The router has no
tokenizer: a token-id prompt counts its ids; a text prompt counts ``ceil(characters / CHARS_PER_TOKEN)``.  The
cached prefix comes from an ``ApproxRadixTree`` per decode worker of every prompt sent to it (PD or alone: its
radix cache keeps the KV of both once they finish), so it is the router's estimate, never the worker's truth.

Reasons (the metric's and the trace's): ``short`` (the whole prompt is under the limit), ``cached`` (only the
uncached part is), ``long`` (through prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvship.router.config import RouterConfig
from kvship.router.radix_tree import ApproxRadixTree
from kvship.router.wire import RoutingRequest
from kvship.router.worker import Worker

CHARS_PER_TOKEN = 4  # a text prompt's token estimate (English BPE averages about 4 characters a token)


@dataclass(frozen=True)
class Decision:
    local: bool  # the decode worker alone
    reason: str  # short | cached | long
    tokens: int  # estimated prompt tokens
    uncached: int  # estimated tokens left to prefill


class SelectiveDisagg:
    """The ``--pd-selective`` rule of the module docstring; event-loop thread only."""

    def __init__(self, config: RouterConfig):
        self.max_tokens = config.pd_selective_max_tokens
        self.max_tree_size = config.max_tree_size
        self.trees: dict[str, ApproxRadixTree] = {}

    @staticmethod
    def tokens_of(request: RoutingRequest, chars: int) -> int:
        if request.text_is_ids:
            return chars
        return -(-chars // CHARS_PER_TOKEN)

    def decide(self, decode: Worker, request: RoutingRequest) -> Decision:
        """Whether ``decode`` serves ``request`` alone; records the prompt in ``decode``'s tree either way."""
        text = request.text
        tree = self.trees.get(decode.url)
        if tree is None:
            tree = self.trees[decode.url] = ApproxRadixTree(self.max_tree_size)
        matched = tree.match(text) if text else 0
        tokens = self.tokens_of(request, len(text))
        uncached = self.tokens_of(request, len(text) - matched)
        if tokens <= self.max_tokens:
            decision = Decision(True, "short", tokens, uncached)
        elif uncached <= self.max_tokens:
            decision = Decision(True, "cached", tokens, uncached)
        else:
            decision = Decision(False, "long", tokens, uncached)
        if text:
            tree.insert(text)
        return decision

    def on_worker_removed(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)

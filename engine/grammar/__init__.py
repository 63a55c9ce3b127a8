"""Structured output: constrain generation to a JSON schema, a regex or an EBNF grammar (xgrammar).

Life cycle of a constrained request (``SamplingParams.grammar_key`` set)::

    HTTP layer: GrammarBackend.compile_async(key)   over a limit, invalid or timed out -> 400
                (limits checked first; the compile runs in a child process killed after the timeout)
    scheduler:  submit -> grammar queue (compiling in the backend's pool, other requests keep running;
                tensor-parallel ranks admit it together when rank 0's compile is broadcast)
                -> matcher ready (``Req.grammar``; with ``grammar_after``, wrapped: free until those ids, ``deferred``) -> role.admit / waiting -> extend / decode
    each step:  fill the matcher's next-token bitmask -> mask the logits -> sample
                -> ``Req.append_token`` accepts the token; the request stops when the grammar terminates

``xgrammar`` is an optional dependency (``pip install kvship[grammar]``);
without it a constrained request is refused with a clear message.
"""

from kvship.engine.grammar.backend import (
    GrammarBackend,
    GrammarError,
    GrammarLimits,
    GrammarMatcher,
    GrammarQueue,
    GrammarTimeout,
    LockstepGrammarQueue,
    grammar_available,
)
from kvship.engine.grammar.mask import apply_grammar_mask

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarLimits",
    "GrammarMatcher",
    "GrammarQueue",
    "GrammarTimeout",
    "LockstepGrammarQueue",
    "apply_grammar_mask",
    "grammar_available",
]

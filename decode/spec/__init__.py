"""Speculative decoding for decode workers (and unified workers, which use the same code).

One round for a request whose newest token ``t`` has no K/V yet (the *root*)::

    drafter.propose(req)      -> DraftTree (tokens, parents; depth d >= 1 below the root)
    target verify forward     -> one TARGET_VERIFY forward over [root] + tree, tree attention mask,
                                 positions seq_len + depth; logits for every node
    accept (verify.py)        -> the accepted path from the root, plus one token the target samples
                                 where the path ends; K/V of the root and the accepted nodes is kept,
                                 the slots of rejected nodes are freed at once

Pieces here: ``tree`` (the draft tree and its mask / positions / walk arrays),
``verify`` (greedy longest-path acceptance and the lossless rejection rule for
sampled requests), ``ngram`` (prompt-lookup drafting, no extra model),
``eagle`` / ``eagle_head`` / ``eagle_tree`` (EAGLE heads: entries, the draft
steps as a fixed-shape device loop), ``graphs`` (CUDA graphs of the verify
forward and of the EAGLE draft steps), ``worker`` (the ``Speculator``).
"""

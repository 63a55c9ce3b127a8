"""kvship.router: the gateway in front of the workers (``kvship router``).

Request path: ``app`` (HTTP surface, auth, limits) -> ``core.Router.choose``
(registry + policy + session affinity) -> ``proxy`` (attempts, retries,
stream relay) or ``pd`` (prefill/decode pair) -> workers.  Background:
``health`` checks and ``discovery`` keep the ``worker`` registry current.
See docs/router.md.  Nothing here imports torch.
"""

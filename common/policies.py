"""Names of the router's worker-selection policies.

The one list the router's flags (``--policy``), ``kvship local`` and the
operator's CRD enum accept.  ``kvship.router.policies`` registers exactly
these names (tests/test_router_policies.py checks), so adding a policy means
adding its name here and registering its class there.
"""

POLICY_NAMES = (
    "cache_aware",
    "round_robin",
    "random",
    "shortest_queue",
    "power_of_two",
    "bucket",
    "kv_events",
)
DEFAULT_POLICY = "cache_aware"

"""KV transfer between prefill and decode workers (PD disaggregation).

The contract is :mod:`kvship.engine.disagg.base`; ``create_kv_manager``
(:mod:`kvship.engine.disagg.factory`) builds a worker's manager, and the
backends (``tcp``, ``mooncake``, ``nixl``) load lazily through the registry.
"""

from kvship.engine.disagg.base import (
    AuxInfo,
    BackendUnavailableError,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    available_transfer_backends,
    get_transfer_backend,
    register_transfer_backend,
)
from kvship.engine.disagg.factory import create_kv_manager

__all__ = [
    "AuxInfo",
    "BackendUnavailableError",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "available_transfer_backends",
    "create_kv_manager",
    "get_transfer_backend",
    "register_transfer_backend",
]

"""KV transfer between prefill and decode workers (PD disaggregation).

Import the contract from :mod:`kvship.engine.disagg.base`; backends (``tcp``,
``mooncake``, ``nixl``) load lazily through its registry.
"""

from kvship.engine.disagg.base import (AuxInfo, BackendUnavailableError, KVManager, KVPoll, KVReceiver, KVSender,
                                       KVTransferConfig, KVTransferError, available_transfer_backends,
                                       create_kv_manager, get_transfer_backend, register_transfer_backend)

__all__ = ["AuxInfo", "BackendUnavailableError", "KVManager", "KVPoll", "KVReceiver", "KVSender", "KVTransferConfig",
           "KVTransferError", "available_transfer_backends", "create_kv_manager", "get_transfer_backend",
           "register_transfer_backend"]

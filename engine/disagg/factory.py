"""Builds a worker's ``KVManager``: the prefill or decode side over the chosen backend."""

from __future__ import annotations

from kvship.engine.disagg.base import KVManager, KVTransferConfig, get_transfer_backend


def create_kv_manager(role: str, kv_pool, config: KVTransferConfig) -> KVManager:
    """Build the prefill or decode manager for ``kv_pool`` with ``config.backend``.

    Raises ``BackendUnavailableError`` when the backend's package cannot load,
    ``ValueError`` for an invalid config or role, ``OSError`` when the
    bootstrap port cannot be bound.
    """
    config.validate()
    backend_cls = get_transfer_backend(config.backend)
    if role == "prefill":
        from kvship.engine.disagg.sender import PrefillKVManager

        return PrefillKVManager(kv_pool, config, backend_cls)
    if role == "decode":
        from kvship.engine.disagg.receiver import DecodeKVManager

        return DecodeKVManager(kv_pool, config, backend_cls)
    raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")

"""Builds a worker's ``KVManager``: the prefill or decode side over the chosen backend."""

from __future__ import annotations

from typing import Optional

from kvship.engine.disagg.base import KVManager, KVTransferConfig, SlotFeatures, get_transfer_backend


def create_kv_manager(
    role: str, kv_pool, config: KVTransferConfig, features: Optional[SlotFeatures] = None
) -> KVManager:
    """Build the prefill or decode manager for ``kv_pool`` with ``config.backend``.

    ``features``: a per-slot buffer registered with the K/V buffers (prefill: sent
    with the pages; decode: filled for them) when the peer has the same kind.

    Raises ``BackendUnavailableError`` when the backend's package cannot load,
    ``ValueError`` for an invalid config, role or features buffer, ``OSError`` when the
    bootstrap port cannot be bound.
    """
    config.validate()
    backend_cls = get_transfer_backend(config.backend)
    if role == "prefill":
        from kvship.engine.disagg.sender import PrefillKVManager

        return PrefillKVManager(kv_pool, config, backend_cls, features)
    if role == "decode":
        from kvship.engine.disagg.receiver import DecodeKVManager

        return DecodeKVManager(kv_pool, config, backend_cls, features)
    raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")

"""A worker's revision fingerprint: everything that must match across a prefill -> decode pair.

Two workers with the same KV layout (page size, KV dtype, layers, heads) can
still disagree on what the KV *means*: a fine-tune or a new revision of the
same architecture gives KV of the same shape that decode must not continue
from.  The fingerprint names what decides that meaning (docs/router.md,
"Revisions"):

* the weights' identity (``weights``): for every file of the checkpoint that
  holds weights (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``)
  its size and a SHA-256 of its head, its tail and ``SAMPLES`` evenly spaced
  chunks (files up to ``FULL_HASH_BYTES`` are hashed whole); every small
  description file (``*.json``, tokenizer files) is hashed whole.  A file's
  header (safetensors' JSON header, GGUF's metadata) sits in its head, and any
  fine-tune changes the bytes of nearly every chunk, so a sampled hash tells
  revisions apart while reading a few MiB of a 16 GB file.  Dummy weights
  (``--load-format dummy``) are named by their seed and the config;
* the numerics: compute dtype, KV dtype, page size, load format;
* the engine version (a new engine may lay KV out differently).

``fingerprint`` is the first ``FINGERPRINT_HEX`` hex digits of a SHA-256 over
the canonical JSON of those parts; ``Fingerprint.parts`` keeps the parts so a
mismatch can be explained.  Torch-free: the caller passes resolved dtypes.

The tensor-parallel layout is not part of it: the handshake's KV layout check
(``KVLayout.mismatch``, docs/parallel.md) decides which TP sizes can exchange
KV, and the weights are the same whatever the TP size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

FINGERPRINT_HEX = 16
SAMPLES = 16
CHUNK_BYTES = 1 << 20
FULL_HASH_BYTES = 32 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DESCRIPTION_SUFFIXES = (".json", ".model", ".tiktoken", ".txt", ".jinja")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fingerprint:
    """``hex``: the fingerprint; ``parts``: what it was computed from (for logs and mismatch messages)."""

    hex: str
    parts: dict = field(default_factory=dict, compare=False, hash=False)

    def __str__(self) -> str:
        return self.hex


def file_identity(path: str) -> str:
    """``<size>:<sha256>`` of a file: the whole file up to ``FULL_HASH_BYTES``, else its head, its tail
    and ``SAMPLES`` evenly spaced chunks of ``CHUNK_BYTES`` (the offsets depend only on the size)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                h.update(block)
        else:
            span = size - CHUNK_BYTES
            offsets = sorted({0, span} | {span * i // (SAMPLES + 1) for i in range(1, SAMPLES + 1)})
            for off in offsets:
                f.seek(off)
                h.update(off.to_bytes(8, "little"))
                h.update(f.read(CHUNK_BYTES))
    return f"{size}:{h.hexdigest()}"


def _checkpoint_files(path: str) -> list[tuple[str, bool]]:
    """(relative name, is a weight file) of every file that identifies the checkpoint at ``path``."""
    if os.path.isfile(path):
        return [(os.path.basename(path), True)]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skips .cache/ of hub downloads
        for name in sorted(files):
            if name.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(root, name), path)
            if name.endswith(WEIGHT_SUFFIXES):
                out.append((rel, True))
            elif name.endswith(DESCRIPTION_SUFFIXES):
                out.append((rel, False))
    return out


def weights_identity(path: str, load_format: str = "auto", seed: int = 0) -> dict[str, str]:
    """Relative file name -> identity of every file that says which weights ``path`` holds.

    ``load_format="dummy"`` weights come from ``seed``, not from files: only the
    description files count, plus the seed.  Raises ``FileNotFoundError`` for a missing path.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    files = _checkpoint_files(path)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    out = {}
    for rel, is_weight in files:
        if is_weight and load_format == "dummy":
            continue
        out[rel] = file_identity(os.path.join(base, rel))
    if load_format == "dummy":
        out["<dummy weights seed>"] = str(seed)
    return out


def compute_fingerprint(
    model_path: str,
    *,
    dtype: str,
    kv_dtype: str,
    page_size: int,
    load_format: str = "auto",
    seed: int = 0,
    engine_version: Optional[str] = None,
    quantization: str = "unquantized",
) -> Fingerprint:
    """The fingerprint of a worker serving ``model_path`` with these settings (reads the files; see the module doc).
    ``quantization`` is the resolved weight method (``--quantization fp8`` on an unquantized checkpoint computes
    other numbers from the same files); ``kv_dtype`` the resolved ``--kv-cache-dtype`` (``fp8_e4m3`` included)."""
    weights = weights_identity(model_path, load_format, seed)
    weights_hex = hashlib.sha256(json.dumps(weights, sort_keys=True).encode()).hexdigest()[:FINGERPRINT_HEX]
    parts: dict[str, Any] = {
        "weights": weights_hex,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "quantization": quantization,
        "page_size": int(page_size),
        "load_format": "dummy" if load_format == "dummy" else "files",
        "engine_version": engine_version if engine_version is not None else engine_version_string(),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return Fingerprint(digest[:FINGERPRINT_HEX], parts)


def engine_version_string() -> str:
    try:
        from importlib.metadata import version

        return version("kvship")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"


@lru_cache(maxsize=8)
def _cached(
    model_path: str, dtype: str, kv_dtype: str, page_size: int, load_format: str, seed: int, quantization: str
) -> Fingerprint:
    return compute_fingerprint(
        model_path,
        dtype=dtype,
        kv_dtype=kv_dtype,
        page_size=page_size,
        load_format=load_format,
        seed=seed,
        quantization=quantization,
    )


def quantization_of(model_path: str, requested: Optional[str]) -> str:
    """The weight method a worker runs: ``--quantization``, else config.json's
    ``quantization_config.quant_method``, else ``unquantized`` (the engine refuses a conflict at startup)."""
    if requested:
        return requested
    config = os.path.join(model_path, "config.json") if os.path.isdir(model_path) else None
    if config is None or not os.path.isfile(config):
        return "unquantized"
    try:
        with open(config) as f:
            qc = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return "unquantized"
    return str(qc.get("quant_method") or "unquantized")


def fingerprint_for(server_args: Any) -> Fingerprint:
    """The fingerprint of a worker started with ``server_args`` (a ``ServerArgs``); computed once per
    process for the same settings (the engine's ``/get_server_info`` and the KV transfer layer share it)."""
    if server_args.model_path is None:
        from kvship.engine.embedded import embedded_model_path

        path = embedded_model_path()
    else:
        path = os.path.abspath(server_args.model_path)
    return _cached(
        path,
        server_args.resolved_dtype,
        server_args.resolved_kv_dtype,
        server_args.page_size,
        server_args.load_format,
        server_args.seed,
        quantization_of(path, server_args.quantization),
    )


def fingerprint_mismatch(prefill: str, decode: str) -> Optional[str]:
    """None when a prefill worker of fingerprint ``prefill`` may ship KV to a decode worker of
    ``decode`` (equal, or one side does not report one: an older peer), else the reason naming both."""
    if not prefill or not decode or prefill == decode:
        return None
    return (
        f"model fingerprint mismatch: prefill {prefill} != decode {decode} (same KV layout, different "
        "weights, dtype or engine version: KV of one cannot be continued by the other)"
    )


def revision_info(server_args: Any) -> dict[str, str]:
    """``{"fingerprint", "revision"}`` a worker reports in ``/get_server_info``: the revision is
    ``--revision`` when given, else the fingerprint (docs/router.md, "Revisions")."""
    fp = fingerprint_for(server_args)
    logger.info("model fingerprint %s (%s)", fp.hex, ", ".join(f"{k}={v}" for k, v in sorted(fp.parts.items())))
    return {"fingerprint": fp.hex, "revision": server_args.revision or fp.hex}

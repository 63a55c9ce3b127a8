"""Reading a llama.cpp GGUF file with the ``gguf`` package: reader, metadata, tensors.

Knows nothing of ``ModelConfig`` or of our parameter names, so both
``kvship.engine.model_config`` (config from metadata) and
``kvship.engine.loaders.gguf_loader`` (weights) build on it.  The ``gguf``
package is imported only when a file is opened.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch


@functools.lru_cache(maxsize=2)
def _reader_cached(path: str, mtime: float) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_reader(path: str) -> Any:
    """A (memory-mapped) ``GGUFReader`` for ``path``, cached: opening one takes seconds."""
    path = os.path.abspath(path)
    return _reader_cached(path, os.path.getmtime(path))


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata as Python values (large arrays like the vocab are skipped,
    except ``tokenizer.ggml.tokens`` whose length is returned as a list of None)."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key in ("tokenizer.ggml.tokens",):
            meta[key] = [None] * len(fld.data)
            continue
        if key.startswith("tokenizer.ggml.") and len(fld.data) > 1:
            continue  # merges, token types, scores
        try:
            meta[key] = fld.contents()
        except Exception:  # pragma: no cover - exotic field types we do not need
            continue
    return meta


def dequantize_tensor(t: Any) -> torch.Tensor:
    """A GGUF ``ReaderTensor`` as a float32 torch tensor in PyTorch (row-major) shape."""
    from gguf.quants import dequantize

    arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    return torch.from_numpy(arr.reshape(shape).copy())


# rows dequantized at once when reading a block: bounds the float32 temporaries of a big matrix
DEQUANT_ROW_CHUNK = 4096


def dequantize_block(t: Any, ranges: tuple[slice, ...]) -> torch.Tensor:
    """Rows ``ranges[0]`` / columns ``ranges[1]`` of a GGUF tensor as float32, dequantizing only those rows
    (in chunks, so a column block never holds the whole matrix in float32)."""
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    if len(shape) != 2:
        return dequantize_tensor(t)[ranges]
    return _dequantize_rows(t.data, t.tensor_type, shape[1], *ranges)


def dequantize_expert_block(t: Any, expert: int, ranges: tuple[slice, ...]) -> torch.Tensor:
    """Rows / columns ``ranges`` of expert ``expert``'s matrix in a stacked ``[E, rows, cols]`` GGUF tensor
    (llama.cpp's ``ffn_*_exps``), dequantizing only that expert's rows."""
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    if len(shape) != 3 or not 0 <= expert < shape[0]:
        raise ValueError(f"GGUF tensor '{t.name}' of shape {shape} has no expert {expert}")
    return _dequantize_rows(t.data[expert], t.tensor_type, shape[2], *ranges)


def _dequantize_rows(data: Any, tensor_type: Any, n_cols: int, rows: slice, cols: slice) -> torch.Tensor:
    from gguf.quants import dequantize

    parts = []
    for r0 in range(rows.start, rows.stop, DEQUANT_ROW_CHUNK):
        r1 = min(r0 + DEQUANT_ROW_CHUNK, rows.stop)
        arr = np.asarray(dequantize(data[r0:r1], tensor_type), dtype=np.float32).reshape(r1 - r0, n_cols)
        parts.append(torch.from_numpy(arr[:, cols].copy()))
    if not parts:
        return torch.empty((0, cols.stop - cols.start), dtype=torch.float32)
    return torch.cat(parts)


def rope_freq_factors(reader: Any) -> list[float] | None:
    """llama3-style RoPE scaling stored as a ``rope_freqs.weight`` tensor (Llama 3.1+ GGUF files)."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return [float(x) for x in dequantize_tensor(t).flatten().tolist()]
    return None


def gguf_metadata_arch(reader: Any) -> str:
    fld = reader.fields.get("general.architecture")
    if fld is None:
        raise ValueError("GGUF file has no general.architecture")
    return str(fld.contents())

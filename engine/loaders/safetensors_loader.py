"""Hugging Face safetensors folders: one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (any ``*.safetensors`` in the folder when
there is no index)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

from safetensors import safe_open
from torch import nn

from kvship.engine.loaders.base import ModelLoader, fill_from_checkpoint, register_loader
from kvship.engine.loaders.lazy import CheckpointSlice, Loaded
from kvship.engine.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted({os.path.join(model_dir, v) for v in weight_map.values()})
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} lists shard(s) that are missing: {absent}")
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def _tensor_count(files: list[str]) -> int:
    n = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            n += len(list(f.keys()))
    return n


def iterate_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, Loaded]]:
    """``(name, tensor)`` for every tensor; with ``lazy``, ``CheckpointSlice``s that read only the block
    a weight loader takes (valid until the next item)."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if lazy:
                    yield name, _lazy(f, name)
                else:
                    yield name, f.get_tensor(name)


def _lazy(f, name: str) -> CheckpointSlice:
    shape = f.get_slice(name).get_shape()
    return CheckpointSlice(shape, lambda ranges: f.get_slice(name)[ranges] if ranges else f.get_tensor(name))


@register_loader("safetensors")
class SafetensorsLoader(ModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig, seed: int = 0, lazy: bool = False) -> None:
        from kvship.engine.layers.quantization import quant_method_for

        files = safetensors_files(model_config.model_path)
        # a format's own tensor names -> the parameters they fill (compressed-tensors block scales)
        rename = quant_method_for(model_config).checkpoint_name
        tensors = ((rename(name), t) for name, t in iterate_safetensors(files, lazy))
        fill_from_checkpoint(model, tensors, _tensor_count(files), "Loading safetensors")

"""Weight loaders behind one interface, keyed by ``--load-format``.

``load_model(model_config, load_format, device)`` builds the model class the
registry picks for ``model_config.architectures`` directly on ``device``
(parameters are uninitialised ``torch.empty``), then the loader fills every
parameter.  A loader must fill all of them: a checkpoint that leaves one
unset is an error, never silently random weights.

Formats: ``safetensors`` (Hugging Face folder, single or sharded), ``gguf``
(a llama.cpp file), ``dummy`` (seeded random weights at the real shapes, for
benchmarks); ``auto`` picks ``gguf`` for a ``.gguf`` path and
``safetensors`` for a folder.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from kvship.engine.model_config import ModelConfig
from kvship.engine.models.registry import get_model_class

if TYPE_CHECKING:
    from kvship.engine.distributed.communicator import Communicator
    from kvship.engine.models.stage import LayerRange

logger = logging.getLogger(__name__)


class ModelLoader(ABC):
    """Fills a freshly built model's parameters from one source."""

    @abstractmethod
    def load_weights(self, model: nn.Module, model_config: ModelConfig, seed: int = 0, lazy: bool = False) -> None:
        """Fill every parameter of ``model`` (raise ValueError on missing/mismatched tensors).

        ``lazy`` (a tensor-parallel model): hand ``CheckpointSlice``s to the
        weight loaders, so each rank reads only its block of a tensor.
        """


_REGISTRY: dict[str, Callable[[], ModelLoader]] = {}
_LAZY_MODULES = {
    "safetensors": "kvship.engine.loaders.safetensors_loader",
    "gguf": "kvship.engine.loaders.gguf_loader",
    "dummy": "kvship.engine.loaders.dummy",
}


def register_loader(name: str) -> Callable[[Callable[[], ModelLoader]], Callable[[], ModelLoader]]:
    def deco(factory: Callable[[], ModelLoader]) -> Callable[[], ModelLoader]:
        _REGISTRY[name] = factory
        return factory

    return deco


def get_loader(load_format: str) -> ModelLoader:
    if load_format not in _REGISTRY and load_format in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[load_format])
    if load_format not in _REGISTRY:
        raise ValueError(f"unknown load format '{load_format}'; known: {sorted(set(_REGISTRY) | set(_LAZY_MODULES))}")
    return _REGISTRY[load_format]()


def resolve_load_format(load_format: str, model_path: str) -> str:
    """``auto`` -> ``gguf`` / ``safetensors`` by path; explicit formats are checked against the path."""
    is_gguf = os.path.isfile(model_path) and model_path.endswith(".gguf")
    is_dir = os.path.isdir(model_path)
    if not (is_gguf or is_dir):
        raise FileNotFoundError(f"model path '{model_path}' is neither a folder nor a .gguf file")
    if load_format == "auto":
        return "gguf" if is_gguf else "safetensors"
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"--load-format gguf needs a .gguf file, got folder '{model_path}'")
    if load_format == "safetensors" and not is_dir:
        raise ValueError(f"--load-format safetensors needs a folder, got '{model_path}'")
    return load_format


def load_model(
    model_config: ModelConfig,
    load_format: str,
    device: str | torch.device,
    seed: int = 0,
    tp: "Communicator | None" = None,
    ep: tuple = (1, "all_reduce"),
    layers: "LayerRange | None" = None,
) -> nn.Module:
    """Build the registered model on ``device`` in ``model_config.dtype`` and fill its weights.

    With ``tp`` (a tensor-parallel rank) the model is made parallel
    (``build_parallel_model``: on CUDA via the meta device) with this rank's
    parameters only, which the loader fills from this rank's blocks; MoE
    experts are split too, ``ep = (ep size, dispatch[, redundant experts, two-batch overlap])``
    (``kvship.engine.parallel.ep``): a rank reads only its own share.
    With ``layers`` (a pipeline stage) the model holds only that part of the
    decoder (``kvship.engine.models.stage``) and reads only its tensors.
    """
    fmt = resolve_load_format(load_format, model_config.model_path)
    cls = get_model_class(model_config.architectures)
    t0 = time.perf_counter()
    kwargs = {} if layers is None else {"layers": layers}
    if tp is None:
        with torch.device(device):
            model = cls(model_config, **kwargs)
        # a stage reads slices: the other stages' tensors are skipped unread
        get_loader(fmt).load_weights(model, model_config, seed, lazy=layers is not None)
    else:
        from kvship.engine.parallel.layers import build_parallel_model

        model = build_parallel_model(cls, model_config, tp, device, ep=ep, layers=layers)
        get_loader(fmt).load_weights(model, model_config, seed, lazy=True)
    model.eval()
    logger.info(
        "loaded %s (%s, %s) on %s in %.1fs%s",
        model_config.architecture,
        fmt,
        str(model_config.dtype).removeprefix("torch."),
        device,
        time.perf_counter() - t0,
        "" if tp is None else f" (tensor-parallel rank {tp.rank}/{tp.size})",
    )
    return model


def fill_from_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], total: int, desc: str) -> None:
    """Feed ``weights`` to ``model.load_weights`` with a progress bar and check nothing is missing."""
    bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for item in weights:
            yield item
            bar.update(1)

    try:
        loaded = model.load_weights(counted())
    finally:
        bar.close()
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {sorted(missing)[:5]}")

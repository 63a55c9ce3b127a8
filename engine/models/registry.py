"""Model classes keyed by the ``architectures`` name of config.json.

A model module registers its classes with ``@register_model("XForCausalLM")``.
Modules are imported lazily on first lookup (``_LAZY_MODULES``), so adding a
family (e.g. MoE in a later issue) is one entry here plus its module.

Contract of a registered class ``cls``:
* ``cls(config: ModelConfig)`` builds parameters with ``torch.empty`` in
  ``config.dtype`` on the current default device (the loader sets it).
* ``model(input_ids, positions, forward_batch) -> LogitsOutput``.
* ``model.load_weights(iterable of (checkpoint_name, tensor))`` maps Hugging
  Face checkpoint names onto its parameters and returns the set of parameter
  names it filled.
* ``cls.tp_plan``: module-name suffix -> tensor-parallel style (see
  ``kvship.engine.parallel.layers``), needed for ``--tp-size`` > 1.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

from torch import nn

_REGISTRY: dict[str, type[nn.Module]] = {}
_LAZY_MODULES = {
    "LlamaForCausalLM": "kvship.engine.models.llama",
    "MistralForCausalLM": "kvship.engine.models.llama",
    "Qwen2ForCausalLM": "kvship.engine.models.llama",
    "Qwen3ForCausalLM": "kvship.engine.models.llama",
    **dict.fromkeys(("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"), "kvship.engine.models.moe"),
    **dict.fromkeys(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), "kvship.engine.models.deepseek"),
}


def register_model(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            _REGISTRY[name] = cls
        return cls

    return deco


def supported_architectures() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY_MODULES))


def get_model_class(architectures: Sequence[str]) -> type[nn.Module]:
    """The class for the first of ``architectures`` that is known, else ValueError."""
    for arch in architectures:
        if arch not in _REGISTRY and arch in _LAZY_MODULES:
            importlib.import_module(_LAZY_MODULES[arch])
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(f"unsupported model architecture(s) {list(architectures)}; supported: {supported_architectures()}")

"""``--load-format dummy``: random weights at the real shapes (benchmarks, no checkpoint needed).

Deterministic by ``seed``; generated directly on the parameters' device.
Norm weights are 1 and everything else is N(0, 0.02), so activations stay
finite in every dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kvship.engine.loaders.base import ModelLoader, register_loader
from kvship.engine.model_config import ModelConfig

DUMMY_STD = 0.02


@register_loader("dummy")
class DummyLoader(ModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig, seed: int = 0, lazy: bool = False) -> None:
        # a tensor-parallel rank draws its own shapes: the weights differ from --tp-size 1 (benchmarks only)
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                gen = gens.get(p.device)
                if gen is None:
                    gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, DUMMY_STD, generator=gen)

"""``FusedMoE``: the experts of one Mixture-of-Experts layer, stacked, behind a pluggable runner.

Parameters (checkpoint layout of each expert's ``nn.Linear`` weights, stacked
over experts):

* ``w13_weight [E, 2I, H]``: gate rows ``[0, I)``, up rows ``[I, 2I)``;
* ``w2_weight  [E, H, I]``: down.

Each carries ``weight_loader(param, loaded, shard_id)`` with ``shard_id =
(expert, "gate" | "up" | "down")``: one checkpoint tensor (``[I, H]`` or
``[H, I]``) into its expert's rows.  A model maps per-expert checkpoint names
onto these (``kvship.engine.models.moe``); ``expected_shards`` lists what a
complete checkpoint fills.

``forward(x [M, H], router_logits [M, E]) -> [M, H]``: the runner's
``select_experts`` (softmax -> top-k -> renormalise), then the runner.  The
runner is picked by name (``runner=`` or the ``KVSHIP_MOE_RUNNER`` knob, read
when the layer is built): ``auto`` is ``triton`` on CUDA where Triton
imports, else ``torch``.  Experts are not split across ranks yet (expert
parallelism is a later step).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from kvship.common.envs import ENV
from kvship.engine.layers.linear import _param
from kvship.engine.layers.moe.runner import MoERunner, get_moe_runner
from kvship.engine.loaders.lazy import Loaded, materialize

logger = logging.getLogger(__name__)

# checkpoint projection name -> (parameter, part)
EXPERT_PARTS = {"gate": "w13_weight", "up": "w13_weight", "down": "w2_weight"}


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype = torch.float32,
        runner: Optional[str] = None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.w13_weight = _param((num_experts, 2 * intermediate_size, hidden_size), dtype, self._load_expert)
        self.w2_weight = _param((num_experts, hidden_size, intermediate_size), dtype, self._load_expert)
        self.runner_name = runner or ENV.MOE_RUNNER
        self._runners: dict[str, MoERunner] = {}  # device type -> runner

    def _load_expert(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PARTS):
            raise ValueError(f"expert weights load with shard (expert, 'gate'|'up'|'down'), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {self.num_experts} experts")
        if param is not getattr(self, EXPERT_PARTS[part]):
            raise ValueError(f"'{part}' weights do not belong in this parameter")
        target = param.data[expert]
        if part == "gate":
            target = target.narrow(0, 0, self.intermediate_size)
        elif part == "up":
            target = target.narrow(0, self.intermediate_size, self.intermediate_size)
        loaded = materialize(loaded)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"expert {expert} {part}: expected {tuple(target.shape)}, checkpoint has {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)

    def expected_shards(self) -> dict[str, list[tuple[int, str]]]:
        """Parameter attribute -> every shard id a complete checkpoint fills."""
        experts = range(self.num_experts)
        return {
            "w13_weight": [(e, p) for e in experts for p in ("gate", "up")],
            "w2_weight": [(e, "down") for e in experts],
        }

    def runner_for(self, x: torch.Tensor) -> MoERunner:
        runner = self._runners.get(x.device.type)
        if runner is None:
            name = self.runner_name
            if name == "auto":
                name = "torch"
                if x.is_cuda:
                    try:
                        runner = get_moe_runner("triton")
                        name = "triton"
                    except ImportError as e:
                        logger.warning("Triton MoE kernels unavailable (%s); using the torch runner", e)
            runner = runner or get_moe_runner(name)
            self._runners[x.device.type] = runner
        return runner

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        runner = self.runner_for(x)
        weights, ids = runner.select_experts(router_logits, self.top_k, self.renormalize)
        return runner(x, self.w13_weight, self.w2_weight, weights, ids)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, runner={self.runner_name}"
        )

"""``FusedMoE``: the experts of one Mixture-of-Experts layer, stacked, behind a pluggable runner.

Parameters (checkpoint layout of each expert's ``nn.Linear`` weights, stacked
over experts):

* ``w13_weight [E, 2I, H]``: gate rows ``[0, I)``, up rows ``[I, 2I)``;
* ``w2_weight  [E, H, I]``: down.

where ``E`` is ``num_local_experts``: the layer holds experts ``[expert_start,
expert_start + num_local_experts)`` of the model's ``num_experts`` (all of them
unless expert parallelism splits them; checkpoint shards of other experts are
accepted and never read).

Each carries ``weight_loader(param, loaded, shard_id)`` with ``shard_id =
(expert, "gate" | "up" | "down")``: one checkpoint tensor (``[I, H]`` or
``[H, I]``) into its expert's rows.  A model maps per-expert checkpoint names
onto these (``kvship.engine.models.moe``); ``expected_shards`` lists what a
complete checkpoint fills.

The layer owns a quantization method (``quant_method``; unquantized unless
given): it creates and fills the stacked parameters and runs the experts
(``apply_moe``, over the runner's kernels).

``forward(x [M, H], router_logits [M, E]) -> [M, H]``: the runner's
``select_experts`` (softmax -> top-k -> renormalise; a layer built with
``routing=`` calls that instead, ``routing(logits, counts, rows_slots)`` with
``select_experts``' counting contract: DeepSeekMoE's grouped routing), then the method's
``apply_moe`` with that runner.  The
runner is picked by name (``runner=`` or the ``KVSHIP_MOE_RUNNER`` knob, read
when the layer is built): ``auto`` is ``triton`` on CUDA where Triton
imports, else ``torch``.  Expert parallelism replaces this layer by
``kvship.engine.parallel.ep.ExpertParallelMoE`` (this rank's experts only).

Expert load: every forward adds the tokens routed to each expert (``[E]``
int64, on the layer's device, no host sync, so it is captured in CUDA graphs
too) to a counter that ``expert_load()`` reads (``/metrics``; docs/parallel.md,
"Expert load").  It counts the rows of real tokens only: while a CUDA graph is
captured (``count_rows_by_slot``), the layer reads the graph's static KV-slot
buffer and leaves out the padding rows, which write slot 0 (the KV pool keeps
it for padding), so a batch of 5 replayed in the graph of 8 counts 5 tokens.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from kvship.common.envs import ENV
from kvship.engine.layers.linear import load_checked, unquantized_or
from kvship.engine.layers.moe.runner import MoERunner, get_moe_runner
from kvship.engine.layers.quantization import QuantMethod
from kvship.engine.loaders.lazy import Loaded

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
        expert_start: int = 0,
        num_local_experts: Optional[int] = None,
        quant_method: Optional[QuantMethod] = None,
        routing: Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        num_local = num_experts if num_local_experts is None else num_local_experts
        if not (0 <= expert_start and 1 <= num_local and expert_start + num_local <= num_experts):
            raise ValueError(f"experts [{expert_start}, {expert_start + num_local}) are not within {num_experts}")
        self.num_experts = num_experts  # in the model (routing, load counts, checkpoint ids)
        self.expert_start = expert_start  # this layer holds experts [expert_start, expert_start + num_local_experts)
        self.num_local_experts = num_local
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        # router logits -> (float32 weights, int32 global ids) [M, top_k]; None: the runner's softmax top-k
        # (a model's own routing, e.g. DeepSeekMoE's grouped one: kvship.engine.models.deepseek)
        self.routing = routing
        self.quant_method = unquantized_or(quant_method)
        weights = {
            "w13_weight": (num_local, 2 * intermediate_size, hidden_size),
            "w2_weight": (num_local, hidden_size, intermediate_size),
        }
        self.quant_method.create_weights(self, weights, dtype, self._load_expert)
        self.runner_name = runner or ENV.MOE_RUNNER
        self._runners: dict[str, MoERunner] = {}  # device type -> runner
        # tokens routed per (global) expert; made on the first forward, on the activations' device
        self._expert_tokens: Optional[torch.Tensor] = None
        # while a CUDA graph is captured: the graph's KV-slot buffer; rows writing slot 0 are padding
        self._rows_slots: Optional[torch.Tensor] = None

    def _load_expert(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PARTS):
            raise ValueError(f"expert weights load with shard (expert, 'gate'|'up'|'down'), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {self.num_experts} experts")
        name = self.param_name(param)
        if not name.startswith(EXPERT_PARTS[part]):  # w13_weight, or a method's w13_weight_scale_inv...
            raise ValueError(f"'{part}' weights do not belong in this parameter")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallelism): never read
        target = param.data[local]
        if part != "down":  # gate rows [0, I), up rows [I, 2I): the method's region of them (scales by blocks)
            start = 0 if part == "gate" else self.intermediate_size
            target = self.quant_method.rows(name, target, start, self.intermediate_size)
        load_checked(self, name, target, loaded, f"expert {expert} {part}")

    def param_name(self, param: nn.Parameter) -> str:
        """The attribute name of one of this layer's parameters (``w13_weight``, ``w2_weight_scale_inv``...)."""
        for name, p in self.named_parameters(recurse=False):
            if p is param:
                return name
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not one of this MoE layer's")

    def expected_shards(self) -> dict[str, list[tuple[int, str]]]:
        """Parameter attribute -> every shard id a complete checkpoint fills (every expert of the model,
        also those another rank holds: the check is that the checkpoint is complete)."""
        experts = range(self.num_experts)
        out: dict[str, list[tuple[int, str]]] = {}
        for name, _ in self.named_parameters(recurse=False):  # the weights and the method's scales
            parts = ("down",) if name.startswith("w2_") else ("gate", "up")
            out[name] = [(e, p) for e in experts for p in parts]
        return out

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

    def _counts(self, device: torch.device) -> torch.Tensor:
        """The expert-load counter (``[E]`` int64 on ``device``), made on the first forward."""
        counts = self._expert_tokens
        if counts is None or counts.device != device:
            counts = self._expert_tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return counts

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert since start (or the last ``reset_expert_load_``): int64 ``[E]`` on CPU."""
        if self._expert_tokens is None:
            return torch.zeros(self.num_experts, dtype=torch.int64)
        return self._expert_tokens.cpu()

    def reset_expert_load_(self) -> None:
        if self._expert_tokens is not None:
            with torch.inference_mode():  # made during an inference-mode forward: only writable inside one
                self._expert_tokens.zero_()

    def route(self, x: torch.Tensor, router_logits: torch.Tensor) -> tuple[MoERunner, torch.Tensor, torch.Tensor]:
        """The runner, routing weights and global expert ids for ``x``; counted in the expert load."""
        runner = self.runner_for(x)
        counts = self._counts(router_logits.device)
        if self.routing is not None:  # it counts the picks itself (in its kernel where it has one)
            weights, ids = self.routing(router_logits, counts, self._rows_slots)
            return runner, weights, ids
        return runner, *runner.select_experts(router_logits, self.top_k, self.renormalize, counts, self._rows_slots)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        runner, weights, ids = self.route(x, router_logits)
        return self.quant_method.apply_moe(self, runner, x, weights, ids)

    @property
    def reduce_comm(self) -> Optional[Any]:
        """The communicator whose all-reduce ``forward`` ends with, where ``forward_partial`` can leave it to the
        caller (``Linear.reduce_comm``); None here: one rank holds the whole layer."""
        return None

    def forward_partial(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``forward`` without its closing all-reduce (the whole output here)."""
        return self.forward(x, router_logits)

    def extra_repr(self) -> str:
        held = ""
        if self.num_local_experts != self.num_experts:
            held = f" (holds {self.expert_start}..{self.expert_start + self.num_local_experts - 1})"
        return (
            f"experts={self.num_experts}{held}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, runner={self.runner_name}"
        )


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert so far, per MoE layer (keyed by its decoder layer's index); one host read
    per layer.  Under expert parallelism every rank routes every token, so any rank's counts are the worker's."""
    out: dict[int, list[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            out[_layer_index(name)] = module.expert_load().tolist()
    return out


@contextlib.contextmanager
def count_rows_by_slot(model: nn.Module, out_cache_loc: torch.Tensor) -> Iterator[None]:
    """While CUDA graphs of ``model`` are captured: its MoE layers count, in the expert load, only the rows
    whose KV slot in ``out_cache_loc`` (the graph's static buffer, ``[max rows]``) is not 0, the padding slot.
    The graphs keep reading the buffer at every replay; eager forwards after the block count every row."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for m in layers:
        m._rows_slots = out_cache_loc
    try:
        yield
    finally:
        for m in layers:
            m._rows_slots = None


def reset_expert_load(model: nn.Module) -> None:
    """Zero every MoE layer's expert-load counter (after warm-up and CUDA-graph capture)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.reset_expert_load_()


def _layer_index(module_name: str) -> int:
    parts = module_name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    raise ValueError(f"MoE module '{module_name}' is not inside a numbered decoder layer")

"""Per-shape launch configs of the fused-MoE Triton kernels.

A config is ``{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K",
"GROUP_SIZE_M", "num_warps", "num_stages"}`` for both GEMMs, plus an
optional ``"down"`` dict overriding ``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``,
``num_warps`` and ``num_stages`` for the down GEMM (``BLOCK_SIZE_M`` is
shared: the aligned blocks are) and an optional ``"one_dot": true`` (the gate/up GEMM as one MMA over
interleaved gate and up weight rows, ``triton_moe._gate_up_kernel``).  ``"tma": true`` (top level for
gate/up, which is then one MMA over a block of gate rows and a block of up rows, or in ``"down"``) has the
GEMM fetch its weight tiles with the tensor memory accelerator on GPUs that have one (Hopper on);
``"persistent": true`` (top level for gate/up, in ``"down"`` for down) launches the GEMM with about one program
per multiprocessor, each looping over tiles (``triton_moe._gate_up_kernel``).  Tuned tables live in
``configs/`` as JSON files named by ``config_file_name`` (experts, expert
width, dtype, GPU name as ``torch.cuda.get_device_name`` reports it, spaces
as ``_``), each mapping a token count ``M`` (as a string) to a config; a
lookup takes the entry of the nearest ``M``.  An entry ``{"gemv": {...}}`` (keys of ``GEMV_CONFIG``:
column and reduction blocks and warps of the gate/up and down GEMVs) selects the alignment-free GEMV
kernels instead (``bench/moe_layer.py --gemv-sweep --write-table`` puts them where they win).  Without a
file for the shape and GPU, decode batches of at most ``GEMV_MAX_PAIRS`` pairs take the GEMV kernels with
``GEMV_CONFIG`` and larger ones ``default_config``.  A tuner (``bench/``) writes the files.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
DOWN_KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(num_experts: int, intermediate_size: int, dtype: torch.dtype, device_name: str) -> str:
    return f"E={num_experts},N={intermediate_size},dtype={dtype_name(dtype)},device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def load_table(num_experts: int, intermediate_size: int, dtype: torch.dtype, device_name: str) -> Optional[dict]:
    """``{M: config}`` from ``configs/`` for this shape and GPU, or None."""
    path = os.path.join(CONFIG_DIR, config_file_name(num_experts, intermediate_size, dtype, device_name))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    table = {int(m): _parse(cfg) for m, cfg in raw.items()}
    logger.info("fused-MoE kernel configs from %s (%d sizes)", path, len(table))
    return table


def _parse(cfg: dict) -> dict:
    if "gemv" in cfg:  # keys a table predates take their defaults (DOWN_UNROLL: the padded kernel)
        return {"gemv": {k: int(cfg["gemv"].get(k, GEMV_CONFIG[k])) for k in GEMV_KEYS}}
    out: dict = {k: int(cfg[k]) for k in KEYS}
    if "down" in cfg:
        out["down"] = {k: int(v) for k, v in cfg["down"].items() if k in DOWN_KEYS}
        for flag in ("tma", "persistent"):
            if cfg["down"].get(flag):
                out["down"][flag] = True
    for flag in ("one_dot", "tma", "persistent"):
        if cfg.get(flag):
            out[flag] = True
    return out


def default_config(m: int, num_experts: int, top_k: int) -> dict:
    """Untuned but reasonable: small M tiles for decode (few tokens per expert), larger for prefill."""
    if m * top_k <= num_experts * 2:  # about one token per active expert: weight-bandwidth bound
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    if m <= 512:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)


# At most this many (token, expert) pairs run the GEMV kernels (``{"gemv": GEMV_CONFIG}``): one program per
# pair reads its expert's weights, so two pairs of one expert read them twice, and past a few pairs the
# aligned GEMMs (which read each active expert once) win; chosen with ``bench/moe_layer.py --gemv-sweep``.
# Without a tuned table: GEMV_CONFIG (the H100's best at M = 1 for E=128, I=768, top-8) up to this many pairs.
GEMV_MAX_PAIRS = 16
# DOWN_UNROLL 1: the down GEMVs' experts unrolled into one accumulator (``_down_sum_gemv_unrolled_kernel``)
GEMV_CONFIG = dict(
    BLOCK_N=8,
    BLOCK_K=128,
    num_warps=8,
    num_stages=4,
    DOWN_BLOCK_N=8,
    DOWN_BLOCK_K=512,
    down_num_warps=8,
    DOWN_UNROLL=0,
)
GEMV_KEYS = tuple(GEMV_CONFIG)


def get_config(
    m: int, num_experts: int, intermediate_size: int, top_k: int, dtype: torch.dtype, device_name: str
) -> dict:
    """The config for ``m`` tokens: the tuned table's nearest entry (aligned GEMMs or ``{"gemv": ...}``) where
    ``m`` is at most twice the largest ``M`` it tuned, else the GEMV kernels for at most ``GEMV_MAX_PAIRS`` pairs
    and ``default_config`` above (a table tuned for decode alone, ``--m 1``, says nothing about prefill)."""
    table = load_table(num_experts, intermediate_size, dtype, device_name)
    if table and m <= 2 * max(table):
        return table[min(table, key=lambda k: abs(k - m))]
    if m * top_k <= GEMV_MAX_PAIRS:
        return {"gemv": dict(GEMV_CONFIG)}
    return default_config(m, num_experts, top_k)


def aligned_config(
    m: int, num_experts: int, intermediate_size: int, top_k: int, dtype: torch.dtype, device_name: str
) -> dict:
    """The aligned GEMMs' config for ``m`` tokens: the nearest tuned aligned entry, else ``default_config``."""
    table = load_table(num_experts, intermediate_size, dtype, device_name) or {}
    table = {k: v for k, v in table.items() if "gemv" not in v}
    if table:
        return table[min(table, key=lambda k: abs(k - m))]
    return default_config(m, num_experts, top_k)

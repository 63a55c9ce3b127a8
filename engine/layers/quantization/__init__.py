"""Quantization methods behind one seam (``base.QuantMethod``) and a registry by name.

``unquantized`` (the compute dtype: bfloat16 / float16 / float32), ``fp8`` and
``compressed-tensors`` (FP8 e4m3 checkpoints and ``--quantization fp8``,
``fp8.py``; the checkpoint writer is ``writer.py``).  docs/quantization.md.
"""

from kvship.engine.layers.quantization.base import (
    UNQUANTIZED,
    QuantMethod,
    Shard,
    get_quant_method,
    quant_method_for,
    register_quant_method,
    resolve_quantization,
    supported_quant_methods,
)

__all__ = [
    "UNQUANTIZED",
    "QuantMethod",
    "Shard",
    "get_quant_method",
    "quant_method_for",
    "register_quant_method",
    "resolve_quantization",
    "supported_quant_methods",
]

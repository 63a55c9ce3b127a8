"""Quantization methods behind one seam (``base.QuantMethod``) and a registry by name.

``unquantized`` (the compute dtype: bfloat16 / float16 / float32) is the only
method so far; FP8 formats are pending (issue 31).  docs/quantization.md.
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

"""Mixture-of-Experts layers: routing (``topk``), the stacked-experts layer
(``layer.FusedMoE``) and its runners (``runner``: ``torch`` reference,
``triton`` fused kernels in ``triton_moe``, which imports Triton)."""

"""Triton kernels over the KV pools (GPU only; imported lazily by the GPU backends).

* ``kv_indices``: builds FlashInfer-style page index lists from ``req_to_token``
  on the GPU (one program per request, no host loop).
* ``decode_attention``: split-KV decode attention (stage 1 partial softmax per
  KV split, stage 2 log-sum-exp merge), GQA heads of one KV head per program.
* ``extend_attention``: causal attention of new tokens over the cached prefix
  (read through ``req_to_token``) and over themselves (read from the packed
  new K/V).
* ``merge_state``: merges two partial attentions by their log-sum-exp.

Nothing here is imported by the CPU path: ``import triton`` only happens when a
GPU backend module is imported.  The kernels also run under Triton's
interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how they are
unit-tested without a GPU.
"""

"""Tensor parallelism: one worker spread over ``--tp-size`` rank processes.

* ``group``      the process group of one worker's ranks and its collectives
  (``TPGroup``); NCCL on CUDA, gloo on CPU, plus a gloo group for host objects.
* ``layers``     parallel layer classes and ``apply_tensor_parallel`` (a
  model's ``tp_plan`` says which module gets which style), applied after the
  model is built, gpt-fast style: model code knows nothing of parallelism.
* ``scheduling`` what keeps the replicated schedulers in lock step: rank 0's
  inbox broadcast each step and rank 0's sampled ids.
* ``launch``     starting ranks 1..N-1 from rank 0's process and watching them.

At ``--tp-size 1`` none of this is used: no process group, no collective.
See docs/parallel.md.
"""

"""Tensor and expert parallelism in the model: parallel layers and the MoE dispatch.

* ``layers``  parallel layer classes and ``apply_tensor_parallel`` (a model's
  ``tp_plan`` says which module gets which style), applied after the model is
  built, gpt-fast style: model code knows nothing of parallelism.
* ``ep``      MoE layers with experts split ``--ep-size`` ways, and their dispatch.
* ``p2p_all_reduce``  the NCCL communicator's one-shot small-tensor all-reduce.

Groups, communicators and rank processes live in ``kvship.engine.distributed``.
At ``--tp-size 1`` none of this is used.  See docs/parallel.md.
"""

"""The parallelism core: topology, process groups per axis, communicators, rank launch.

* ``topology``     the frozen ``Topology`` (nodes, node rank, TP/PP/EP sizes,
  each rank's coordinates and GPU), built first by the launcher from
  ``--nnodes/--node-rank/--dist-init-addr`` or torchrun's environment.
* ``communicator`` the ``Communicator`` interface (all_reduce, all_gather,
  reduce_scatter, all_to_all, send/recv, broadcast, host objects) and its
  NCCL and gloo backends, each declaring its CUDA-graph-capture-safe ops.
* ``groups``       ``init_distributed``: the world group and one
  communicator per axis (``ProcessGroups``), handed to the model runner,
  the scheduler's I/O (``kvship.engine.scheduler.io``), the MoE dispatch and
  the speculator when they are built.
* ``launch``       a node's rank processes, joining, the loop of a rank that
  is not the leader, the bounded rendezvous check of a node other than 0.

At one rank none of this is used: no process group, no collective.  Model
code knows none of it (``kvship.engine.parallel.layers`` swaps in parallel
layers from a model's ``tp_plan``).  See docs/parallel.md.
"""

"""The parallelism core (kvship.engine.distributed): topology, communicators' capture rules, the scheduler's I/O.

* ``Topology``: rank coordinates, per-axis groups, GPU placement, one-line errors, torchrun's environment;
* communicators declare their CUDA-graph-safe ops, and the MoE all-to-all dispatch asks them (no
  ``is_current_stream_capturing`` in the layer): inside ``graph_capture`` it all-reduces;
* the scheduler's collaborators are fixed at construction: its I/O is chosen in the constructor, replacing
  ``inbox`` / ``launcher.sampler`` / ``grammar_queue`` afterwards raises, and no product module assigns them
  on another object (the old ``make_scheduler_tensor_parallel`` did).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvship.engine.distributed.communicator import Communicator, GlooCommunicator, NcclCommunicator
from kvship.engine.distributed.topology import Topology, parse_host_port

ROOT = Path(__file__).resolve().parent.parent


# --- topology ---------------------------------------------------------------------------------
def test_topology_places_ranks_on_nodes_gpus_and_axes_in_sglang_order():
    t = Topology(tp_size=4, pp_size=2, ep_size=2, nnodes=2, node_rank=1, rank=5, dist_init_addr="10.0.0.1:5000")
    assert (t.world_size, t.ranks_per_node, t.moe_tp_size) == (8, 4, 2)
    assert list(t.node_ranks) == [4, 5, 6, 7]
    c = t.me
    assert (c.node, c.local_rank, c.tp_rank, c.pp_rank, c.ep_rank, c.moe_tp_rank) == (1, 1, 1, 1, 0, 1)
    assert t.gpu_id == 1 and Topology(tp_size=2, rank=1, base_gpu_id=4).gpu_id == 5
    assert t.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # every rank is in exactly one group of each axis
    for groups in (t.tp_groups(), t.pp_groups(), t.ep_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert t.for_rank(6).me.local_rank == 2 and t.init_host_port == ("10.0.0.1", 5000)
    assert not t.is_leader and Topology().is_leader


def test_expert_parallel_coordinates_match_the_expert_split():
    from kvship.engine.parallel.ep import expert_split

    t = Topology(tp_size=4, ep_size=2)
    for rank in range(4):
        split = expert_split(8, 16, 4, 2, rank)
        c = t.coords(rank)
        assert split.start == c.ep_rank * 4 and split.inter_start == c.moe_tp_rank * 8


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "3 ranks do not split evenly over --nnodes 2"),
        (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank 2 is out of range"),
        (dict(tp_size=2, nnodes=2, node_rank=1, rank=1), "--nnodes 2 needs --dist-init-addr"),
        (dict(tp_size=2, dist_init_addr="nohost"), "--dist-init-addr must be host:port"),
        (dict(tp_size=4, ep_size=3), "--ep-size 3 must divide --tp-size"),
        (dict(tp_size=2, nnodes=2, node_rank=1, rank=0, dist_init_addr="h:1"), "rank 0 is not on node 1"),
        (dict(tp_size=0), "--tp-size must be >= 1"),
    ],
)
def test_bad_topology_is_one_clear_line(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        Topology(**kw)
    assert "\n" not in str(e.value)


def test_host_port_parsing():
    assert parse_host_port("[::1]:29500") == ("::1", 29500)
    assert parse_host_port("node0.cluster:29500") == ("node0.cluster", 29500)
    with pytest.raises(ValueError):
        parse_host_port("node0:0")


def test_topology_from_flags_starts_each_node_at_its_first_rank():
    from kvship.engine.config import ServerArgs

    sa = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
    t = Topology.from_server_args(sa)
    assert (t.rank, list(t.node_ranks), t.torchrun) == (2, [2, 3], False)


def test_topology_from_torchrun_environment(monkeypatch):
    from kvship.engine.config import ServerArgs

    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29501"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t = Topology.from_server_args(ServerArgs(tp_size=4))
    assert (t.nnodes, t.node_rank, t.rank, t.me.local_rank, t.torchrun) == (2, 1, 3, 1, True)
    assert t.dist_init_addr == "10.1.2.3:29501"
    with pytest.raises(ValueError, match="WORLD_SIZE 4 is not the worker's --tp-size 2"):
        Topology.from_server_args(ServerArgs(tp_size=2))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="LOCAL_RANK 0 is not RANK 3 mod 2"):
        Topology.from_server_args(ServerArgs(tp_size=4))


# --- communicators: capture safety --------------------------------------------------------------
def test_backends_declare_which_ops_run_inside_cuda_graph_capture():
    assert not any(GlooCommunicator.capture_safe(op) for op in ("all_reduce", "all_gather", "broadcast"))
    assert NcclCommunicator.capture_safe("all_reduce") and NcclCommunicator.capture_safe("all_gather")
    assert not NcclCommunicator.capture_safe("all_to_all")  # split sizes come from the host
    with pytest.raises(ValueError, match="unknown communicator op"):
        NcclCommunicator.capture_safe("all_reduce_object")
    comm = NcclCommunicator(0, 2)
    assert comm.can_run("all_to_all")
    with comm.graph_capture():
        assert comm.can_run("all_reduce") and not comm.can_run("all_to_all")
    assert comm.can_run("all_to_all")


class Loopback(Communicator):
    """A one-rank communicator that records the ops it ran (no process group)."""

    backend = "loopback"

    def __init__(self):
        super().__init__(0, 1)
        self.ops: list[str] = []

    def all_reduce(self, t):
        self.ops.append("all_reduce")
        return t

    def all_gather(self, t):
        self.ops.append("all_gather")
        return t

    def all_to_all(self, out, inp, out_splits=None, in_splits=None):
        self.ops.append("all_to_all")
        return out.copy_(inp)

    def broadcast(self, t, src=0):
        self.ops.append("broadcast")
        return t

    def broadcast_object(self, obj=None, src=0):
        return obj

    def close(self):
        pass


def test_moe_all_to_all_dispatch_asks_the_communicator_and_all_reduces_while_a_graph_captures():
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.ep import ParallelFusedMoE

    comm = Loopback()
    torch.manual_seed(0)
    layer = ParallelFusedMoE(FusedMoE(8, 2, 32, 16, renormalize=True, runner="torch"), comm, 1, "all_to_all")
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.1)
        layer.w2_weight.normal_(0, 0.1)
        x, logits = torch.randn(5, 32), torch.randn(5, 8)
        eager = layer(x, logits)
        assert "all_to_all" in comm.ops and "all_reduce" not in comm.ops
        comm.ops.clear()
        with comm.graph_capture():
            captured = layer(x, logits)
        assert comm.ops == ["all_reduce"]
    torch.testing.assert_close(eager, captured, atol=1e-5, rtol=1e-5)
    src = (ROOT / "engine" / "parallel" / "ep.py").read_text()
    assert "is_current_stream_capturing" not in src


# --- scheduler collaborators fixed at construction ----------------------------------------------
FIXED_ATTRS = {"inbox", "sampler", "grammar_queue", "launcher", "io", "speculator", "runner"}


def assignments_to_other_objects(source: str) -> list[str]:
    """``x.inbox = ...`` / ``x.launcher.sampler = ...`` where the object is not ``self`` (a collaborator
    replaced from outside its owner)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in FIXED_ATTRS:
                owner = t.value
                if not (isinstance(owner, ast.Name) and owner.id == "self"):
                    bad.append(f"{ast.unparse(t)} (line {node.lineno})")
    return bad


def test_no_module_replaces_a_schedulers_collaborators_after_construction():
    # the check catches what parallelism used to do after the scheduler was built
    old = "scheduler.inbox = BroadcastInbox(tp, on_stop)\nscheduler.launcher.sampler = RankZeroSampler(s, tp)\n"
    assert len(assignments_to_other_objects(old)) == 2
    bad = []
    for folder in ("engine", "prefill", "decode", "app"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}: {b}" for b in assignments_to_other_objects(path.read_text())]
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=tiny_llama_dir, device="cpu", max_total_tokens=512))


def _scheduler(runner, io=None):
    from kvship.engine.scheduler import Scheduler
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(runner.model_path)
    return Scheduler(runner.server_args, runner, tok, lambda chunks: None, io=io)


def test_scheduler_collaborators_cannot_be_replaced_after_construction(runner):
    from kvship.engine.scheduler.inbox import Inbox

    sched = _scheduler(runner)
    for name, value in (("inbox", Inbox()), ("grammar_queue", None), ("launcher", None), ("io", None)):
        with pytest.raises(AttributeError, match="fixed at construction"):
            setattr(sched, name, value)
    with pytest.raises(AttributeError, match="fixed at construction"):
        sched.launcher.sampler = lambda logits, info: None
    sched.counters["free"] = 1  # other state stays writable


def test_scheduler_io_is_chosen_when_the_scheduler_is_built(runner):
    from kvship.engine.grammar.backend import GrammarQueue, LockstepGrammarQueue
    from kvship.engine.scheduler.inbox import Inbox
    from kvship.engine.scheduler.io import BroadcastInbox, BroadcastIO, RankZeroSampler, scheduler_io

    local = _scheduler(runner, scheduler_io(None, lambda: None))
    assert type(local.inbox) is Inbox and type(local.grammar_queue) is GrammarQueue
    assert not isinstance(local.launcher.sampler, RankZeroSampler)
    comm = Loopback()
    comm.size = 2  # a leader of two ranks; the loopback broadcasts go nowhere
    tp = _scheduler(runner, BroadcastIO(comm, lambda: None))
    assert isinstance(tp.inbox, BroadcastInbox) and isinstance(tp.grammar_queue, LockstepGrammarQueue)
    assert isinstance(tp.launcher.sampler, RankZeroSampler)
    assert isinstance(scheduler_io(comm, lambda: None), BroadcastIO)

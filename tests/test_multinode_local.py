"""``kvship local --prefill-nnodes / --decode-nnodes``: the node processes of a multi-node worker (argv only).

A worker spanning N nodes is N ``kvship serve`` children: each with ``--nnodes N``, its own ``--node-rank``
and HTTP port (node 0's is the URL the router gets), one shared ``--dist-init-addr``, and on CUDA its own
``--base-gpu-id`` (docs/parallel.md, "kvship local").  No process is started here.
"""

from __future__ import annotations

import argparse
import logging

import pytest


def _config(argv: list[str]):
    from kvship.app import local
    from kvship.engine.config import dataclass_from_namespace

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["local", *argv])
    return dataclass_from_namespace(local.LocalConfig, ns), dataclass_from_namespace(local.WorkerFlags, ns)


def _flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def _deployment(argv: list[str], tmp_path, device: str = "cpu", num_gpus: int = 0):
    from kvship.app.gpu_placement import worker_gpus
    from kvship.app.local import LocalDeployment, worker_argv

    cfg, flags = _config(argv)
    gpus = worker_gpus(cfg, flags, device, num_gpus=num_gpus)
    return LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path), gpus)


def test_a_decode_worker_over_two_nodes_is_two_children_with_one_rendezvous(tmp_path):
    dep = _deployment(["--decode", "2", "--decode-tp-size", "2", "--decode-nnodes", "2"], tmp_path)
    assert [w.name for w in dep.nodes] == ["prefill-0", "decode-0", "decode-1"]
    assert [[c.name for c in w.nodes] for w in dep.nodes] == [
        ["prefill-0"],
        ["decode-0", "decode-0-node1"],
        ["decode-1", "decode-1-node1"],
    ]
    assert [c.name for c in dep.workers] == ["prefill-0", "decode-0", "decode-1"]  # what the router knows
    prefill = dep.nodes[0].head.argv
    assert "--nnodes" not in prefill and "--dist-init-addr" not in prefill and "--node-rank" not in prefill
    for w in dep.nodes[1:]:
        for r, c in enumerate(w.nodes):
            assert _flags(c.argv, "--nnodes") == ["2"] and _flags(c.argv, "--node-rank") == [str(r)]
            assert _flags(c.argv, "--tp-size") == ["2"] and _flags(c.argv, "--mode") == ["decode"]
        addrs = {_flags(c.argv, "--dist-init-addr")[-1] for c in w.nodes}
        assert len(addrs) == 1 and next(iter(addrs)).startswith("127.0.0.1:")
        assert len({c.url for c in w.nodes}) == 2
    router = dep.router.argv
    decode_urls = router[router.index("--decode") + 1 :]
    assert decode_urls == [dep.nodes[1].head.url, dep.nodes[2].head.url]  # node 0 of each worker only
    assert {c.name for c in dep.children} == {
        "router",
        "prefill-0",
        "decode-0",
        "decode-0-node1",
        "decode-1",
        "decode-1-node1",
    }
    # a restart gives all nodes of a worker a new rendezvous, together
    w = dep.nodes[1]
    w.new_rendezvous(12345)
    assert {_flags(c.argv, "--dist-init-addr")[-1] for c in w.nodes} == {"127.0.0.1:12345"}


def test_a_prefill_worker_over_two_nodes_gives_every_node_the_same_bootstrap_port_run(tmp_path):
    dep = _deployment(["--prefill-tp-size", "4", "--prefill-nnodes", "2"], tmp_path)
    prefill = dep.nodes[0]
    ports = {_flags(c.argv, "--disaggregation-bootstrap-port")[-1] for c in prefill.nodes}
    assert len(prefill.nodes) == 2 and len(ports) == 1  # rank r (on whichever node) binds port + r
    assert _flags(dep.nodes[1].head.argv, "--nnodes") == []  # decode stays one node


def test_shared_nnodes_applies_to_both_roles_and_role_flags_override_it(tmp_path):
    dep = _deployment(["--tp-size", "2", "--nnodes", "2", "--decode-nnodes", "1"], tmp_path)
    assert [w.nnodes for w in dep.nodes] == [2, 1]
    assert _flags(dep.nodes[1].head.argv, "--nnodes")[-1] == "1"  # the role's own value comes last


def test_each_node_gets_its_own_gpus_on_cuda(tmp_path):
    from kvship.app.gpu_placement import worker_gpus

    cfg, flags = _config(["--prefill-tp-size", "2", "--decode-tp-size", "4", "--decode-nnodes", "2"])
    assert worker_gpus(cfg, flags, "cuda", num_gpus=6) == [0, 2, 4]  # prefill (2 GPUs), decode node 0, node 1
    dep = _deployment(
        ["--prefill-tp-size", "2", "--decode-tp-size", "4", "--decode-nnodes", "2", "--device", "cuda"],
        tmp_path,
        "cuda",
        6,
    )
    assert [[_flags(c.argv, "--base-gpu-id")[-1] for c in w.nodes] for w in dep.nodes] == [["0"], ["2", "4"]]
    assert dep.gpus_of == {"prefill-0": [0, 1], "decode-0": [2, 3, 4, 5]}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode-tp-size", "3", "--decode-nnodes", "2"], "decode worker's --tp-size 3 ranks do not split evenly"),
        (["--prefill-nnodes", "2"], "prefill worker's --tp-size 1 ranks do not split evenly over its 2 nodes"),
        (["--decode-nnodes", "-1"], "--prefill-nnodes and --decode-nnodes must be >= 0"),
        (["--node-rank", "1"], None),  # not a flag of kvship local: it sets every node's own
    ],
)
def test_bad_node_counts_are_refused_before_anything_starts(argv, message, capsys):
    from kvship.app import local

    if message is None:
        with pytest.raises(SystemExit):
            _config(argv)
        return
    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["local", "--device", "cpu", *argv])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert local.run(ns) == 2  # (its setup_logging replaces the root handlers: put them back after)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "invalid settings: " in err and message in err, err

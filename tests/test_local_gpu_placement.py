"""``kvship local --gpu-placement``: which GPU each worker gets on CUDA (pure functions, checked on CPU).

Prefill workers come first, then decode; each takes the next ``--tp-size`` GPUs from ``--base-gpu-id`` on and
starts again at ``--base-gpu-id`` when its group no longer fits (docs/pd.md, "kvship local").
"""

from __future__ import annotations

import argparse

import pytest


def _parse(argv: list[str]) -> argparse.Namespace:
    from kvship.app import local

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    return parser.parse_args(["local", *argv])


def _config(argv: list[str]):
    from kvship.app.local import LocalConfig, WorkerFlags
    from kvship.engine.config import dataclass_from_namespace

    ns = _parse(argv)
    return dataclass_from_namespace(LocalConfig, ns), dataclass_from_namespace(WorkerFlags, ns)


def _last_flag(argv: list[str], flag: str):
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return int(values[-1]) if values else None


@pytest.mark.parametrize(
    "tp_sizes, num_gpus, base, expected",
    [
        ([1, 1], 2, 0, [0, 1]),  # 1 prefill + 1 decode on 2 GPUs: one each
        ([1, 1, 1, 1], 2, 0, [0, 1, 0, 1]),  # 2 + 2 on 2 GPUs: wrap, two workers a GPU
        ([2, 1], 2, 0, [0, 0]),  # a TP=2 prefill takes both GPUs; decode wraps to GPU 0
        ([1, 2, 1], 4, 0, [0, 1, 3]),  # groups are consecutive
        ([1, 2, 1], 3, 0, [0, 1, 0]),  # TP=2 at GPU 1 still fits, the next one wraps
        ([1, 1, 1], 4, 2, [2, 3, 2]),  # from --base-gpu-id on, wrapping back to it
        ([1, 1], 1, 0, [0, 0]),  # one GPU: every worker on it
        ([1, 1, 1], 1, 0, [0, 0, 0]),
    ],
)
def test_spread_gives_workers_consecutive_gpus_and_wraps_when_a_group_no_longer_fits(
    tp_sizes, num_gpus, base, expected
):
    from kvship.app.gpu_placement import spread_gpus

    assert spread_gpus(tp_sizes, num_gpus, base) == expected


def test_spread_refuses_a_worker_whose_group_cannot_fit_at_all():
    from kvship.app.gpu_placement import spread_gpus

    with pytest.raises(ValueError, match="--tp-size 2 from --base-gpu-id 1 needs 3 GPUs, 2 visible"):
        spread_gpus([1, 2], 2, 1)
    with pytest.raises(ValueError, match="0 visible"):
        spread_gpus([1], 0, 0)


def test_placement_defaults_to_spread_and_only_applies_on_cuda():
    from kvship.app.gpu_placement import worker_gpus

    cfg, flags = _config(["--prefill", "2", "--decode", "2"])
    assert cfg.gpu_placement == "spread"
    assert worker_gpus(cfg, flags, "cpu", num_gpus=2) is None
    assert worker_gpus(cfg, flags, "cuda", num_gpus=2) == [0, 1, 0, 1]
    # the role TP sizes count: TP=2 prefill + TP=1 decode on 2 GPUs
    cfg, flags = _config(["--prefill-tp-size", "2"])
    assert worker_gpus(cfg, flags, "cuda", num_gpus=2) == [0, 0]
    cfg, flags = _config(["--tp-size", "2", "--decode-tp-size", "1"])
    assert worker_gpus(cfg, flags, "cuda", num_gpus=4) == [0, 2]
    # shared keeps the old behaviour: every worker from --base-gpu-id
    cfg, flags = _config(["--gpu-placement", "shared", "--base-gpu-id", "1", "--decode", "2"])
    assert worker_gpus(cfg, flags, "cuda", num_gpus=4) == [1, 1, 1]


def test_children_argv_carry_each_workers_base_gpu_id(tmp_path):
    from kvship.app.gpu_placement import worker_gpus
    from kvship.app.local import LocalDeployment, worker_argv

    cfg, flags = _config(["--prefill", "2", "--decode", "2", "--device", "cuda", "--base-gpu-id", "1"])
    gpus = worker_gpus(cfg, flags, "cuda", num_gpus=3)
    dep = LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path), gpus)
    names = [w.name for w in dep.workers]
    assert names == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    # the user's --base-gpu-id passes through; each worker's own comes after it, so it wins
    assert [_last_flag(w.argv, "--base-gpu-id") for w in dep.workers] == [1, 2, 1, 2]
    assert dep.gpus_of == {"prefill-0": [1], "prefill-1": [2], "decode-0": [1], "decode-1": [2]}
    assert all(_last_flag(w.argv, "--tp-size") is None for w in dep.workers)

    cfg, flags = _config(["--prefill-tp-size", "2", "--decode", "1"])
    dep = LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path), worker_gpus(cfg, flags, "cuda", num_gpus=4))
    assert [_last_flag(w.argv, "--base-gpu-id") for w in dep.workers] == [0, 2]
    assert dep.gpus_of == {"prefill-0": [0, 1], "decode-0": [2]}


def test_children_argv_have_no_gpu_flag_on_cpu(tmp_path):
    from kvship.app.gpu_placement import worker_gpus
    from kvship.app.local import LocalDeployment, worker_argv

    cfg, flags = _config(["--prefill", "2", "--device", "cpu"])
    dep = LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path), worker_gpus(cfg, flags, "cpu"))
    assert all("--base-gpu-id" not in w.argv for w in dep.workers)
    assert dep.gpus_of == {}


def test_a_kv_events_router_gets_workers_that_publish_their_events(tmp_path):
    from kvship.app.local import LocalDeployment, worker_argv

    for args, on in ((["--policy", "kv_events"], True), (["--policy", "cache_aware"], False), ([], False)):
        cfg, flags = _config(["--device", "cpu", *args])
        dep = LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path))
        assert all(("--enable-kv-events" in w.argv) == on for w in dep.workers), args
        assert dep.router.argv[dep.router.argv.index("--policy") + 1] == cfg.policy
    cfg, flags = _config(["--device", "cpu", "--policy", "kv_events", "--enable-kv-events"])
    dep = LocalDeployment(cfg, worker_argv(flags), "tcp", str(tmp_path))
    assert all(w.argv.count("--enable-kv-events") == 1 for w in dep.workers)

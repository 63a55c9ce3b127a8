"""DeepSeek (MLA + DeepSeekMoE) under tensor and expert parallelism on CPU: 2 gloo rank processes vs one.

One group of 2 real rank processes (``run_ranks``) runs, in turn, three
settings of two tiny random checkpoints (tests/deepseek_fixtures.py):

* ``tp2``: V3 with q LoRA, YaRN, grouped ``noaux_tc`` routing with the
  correction bias, shared experts and a dense first layer, ``--tp-size 2``
  (query heads, ``kv_b_proj``, ``o_proj``, dense/shared MLPs and every
  expert's width split; the latent cache whole on each rank);
* ``tp2_v2lite``: the V2-Lite shape (no q LoRA: ``q_proj`` split by heads);
* ``ep2`` / ``ep2_a2a``: the V3 model at ``--tp-size 2 --ep-size 2`` (half
  of the routed experts, whole, per rank; grouped routing on every rank),
  with the ``all_reduce`` and the ``all_to_all`` dispatch;
* ``tp2_dummy``: ``--load-format dummy`` of the V3 config at ``--tp-size 2
  --ep-size 2``: each rank's block of the same random model as one process's
  (logits compared; dummy logits are too flat for a token comparison).

Each setting gives prefill logits at every position and batched decode logits
(within ``ATOL`` of the single process) and the greedy tokens of the real
scheduler over a batch of prompts (equal to the single process's), after
which every KV slot is free again.  About 15-25 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KVDriver
from deepseek_fixtures import build_tiny_deepseek
from pd_fixtures import Collector, run_until_idle
from server_fixtures import rank_body, run_ranks

from kvship.engine.config import ServerArgs

ATOL = 1e-4  # float32 end to end; the ranks' all-reduces only reorder sums (measured ~1e-6)
RANK_TIMEOUT_S = 180
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77], [8, 9]]
MAX_NEW = 6
# setting -> (model, tp size, ep size, expert dispatch, load format)
SETTINGS = {
    "tp2": ("v3", 2, 1, "all_reduce", "auto"),
    "tp2_v2lite": ("v2", 2, 1, "all_reduce", "auto"),
    "ep2": ("v3", 2, 2, "all_reduce", "auto"),
    "ep2_a2a": ("v3", 2, 2, "all_to_all", "auto"),
    "tp2_dummy": ("v3", 2, 2, "all_reduce", "dummy"),
}


def _sa(path: str, tp: int = 1, ep: int = 1, dispatch: str = "all_reduce", fmt: str = "auto") -> ServerArgs:
    return ServerArgs(
        model_path=path, device="cpu", max_total_tokens=512, max_running_requests=8, tp_size=tp, ep_size=ep,
        ep_dispatch=dispatch, chunked_prefill_size=8, load_format=fmt,
    )  # fmt: skip


def _run(runner, groups=None) -> dict:
    """Logits of a prefill and a batched decode (KVDriver), then the scheduler's greedy tokens."""
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.scheduler import Scheduler
    from kvship.engine.scheduler.io import scheduler_io

    drv = KVDriver(runner)
    a, b = drv.new(), drv.new()
    try:
        prefill = drv.extend([a], [PROMPTS[0]], all_logits=True)
        drv.extend([b], [PROMPTS[1]])
        decode = [drv.decode([a, b], [3 + i, 4 + i]) for i in range(3)]
    finally:
        drv.free(a)
        drv.free(b)
    sink, stopped = Collector(), []
    io = scheduler_io(None if groups is None else groups.tp, lambda: stopped.append(True))
    sched = Scheduler(_sa(runner.model_path, runner.tp_size), runner, None, sink, io=io)
    if groups is None or groups.is_leader:
        for i, p in enumerate(PROMPTS):
            sched.submit(
                GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
            )
        run_until_idle(sched)
        if groups is not None:
            sched.inbox.close("done")
    else:
        while not stopped:
            sched.step(block_s=0.01)
    st = sched.get_stats()
    return {
        "prefill": prefill.numpy(),
        "decode": torch.stack(decode).numpy(),
        "tokens": [sink.tokens(f"r{i}") for i in range(len(PROMPTS))],
        "free": (st["free_slots"], st["total_slots"]),
        "heads": runner.model.model.layers[0].self_attn.num_heads,
        "latent_rows": tuple(runner.kv_pool.get_latent_buffer(0).shape[1:]),
        "moe_sums": _moe_sums(runner.model),
    }


def _moe_sums(model) -> tuple[bool, bool]:
    """How the first DeepSeekMoE layer adds its shared and routed experts: (as two collective-free branches,
    all-reduced once after the sum)."""
    from kvship.engine.layers.side_stream import partials_comm
    from kvship.engine.models.deepseek import DeepseekMoE

    moe = next(m for m in model.modules() if isinstance(m, DeepseekMoE))
    apart, comm = partials_comm(moe.shared_experts, moe.experts)
    return apart, comm is not None


def _rank_main(rank: int, init_method: str, paths: dict, out) -> None:
    def body(groups) -> dict:
        from kvship.engine.model_runner import ModelRunner

        torch.manual_seed(0)
        res = {}
        for name, (model, tp, ep, dispatch, fmt) in SETTINGS.items():
            res[name] = _run(ModelRunner(_sa(paths[model], tp, ep, dispatch, fmt), groups=groups), groups)
        return res

    rank_body(rank, init_method, _sa("", 2), body, out)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    return {
        "v3": build_tiny_deepseek(str(tmp_path_factory.mktemp("dstp_v3")), "v3_yarn_grouped", seed=51),
        "v2": build_tiny_deepseek(str(tmp_path_factory.mktemp("dstp_v2")), "v2_lite", seed=52),
    }


@pytest.fixture(scope="module")
def ranks(paths) -> list[dict]:
    return run_ranks(_rank_main, 2, (paths,), RANK_TIMEOUT_S)


@pytest.fixture(scope="module")
def single(paths) -> dict:
    from kvship.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    out = {(m, "auto"): _run(ModelRunner(_sa(p))) for m, p in paths.items()}
    out[("v3", "dummy")] = _run(ModelRunner(_sa(paths["v3"], fmt="dummy")))
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_deepseek_parallel_ranks_give_single_process_logits_and_tokens(setting, ranks, single):
    model, fmt = SETTINGS[setting][0], SETTINGS[setting][4]
    ref = single[(model, fmt)]
    for rank, got in enumerate(r[setting] for r in ranks):
        assert abs(got["prefill"] - ref["prefill"]).max() < ATOL, f"rank {rank}"
        assert abs(got["decode"] - ref["decode"]).max() < ATOL, f"rank {rank}"
        if fmt != "dummy":  # dummy weights give near-flat logits: greedy ties may flip (logits are compared)
            assert got["tokens"] == ref["tokens"], f"rank {rank}"
        assert all(len(t) == MAX_NEW for t in got["tokens"])
        free, total = got["free"]
        assert free == total, f"rank {rank}: {total - free} KV slots still held"


def test_each_rank_holds_half_the_query_heads_and_the_whole_latent_row(ranks, single):
    for setting in SETTINGS:
        ref = single[(SETTINGS[setting][0], SETTINGS[setting][4])]
        assert ref["heads"] == 4 and ref["latent_rows"] == (1, 40)
        for r in ranks:
            assert r[setting]["heads"] == 2
            assert r[setting]["latent_rows"] == (1, 40)  # the latent cache is replicated, not split


def test_deepseek_rotary_table_is_rebuilt_after_a_meta_device_build():
    """A CUDA tensor-parallel rank builds the model on the meta device (build_parallel_model): the YaRN table
    must come back equal after ``to_empty`` + ``rebuild_table_``."""
    from deepseek_fixtures import YARN

    from kvship.engine.models.deepseek import DeepseekRotary

    ref = DeepseekRotary(8, 64, 10000.0, YARN, interleave=True)
    with torch.device("meta"):
        rot = DeepseekRotary(8, 64, 10000.0, YARN, interleave=True)
    rot.to_empty(device="cpu")
    rot.rebuild_table_()
    assert torch.equal(rot.cos_sin_cache, ref.cos_sin_cache)


# setting -> how the shared and routed experts are summed: the all_reduce dispatch leaves both as partial sums
# (one all-reduce after adding them; docs/deepseek.md, "Two streams"); the all_to_all dispatch keeps its own
# exchanges, so its shared MLP keeps its all-reduce
MOE_SUMS = {
    "tp2": (True, True),
    "tp2_v2lite": (True, True),
    "ep2": (True, True),
    "ep2_a2a": (False, True),
    "tp2_dummy": (True, True),
}


def test_shared_and_routed_experts_are_summed_before_one_all_reduce(ranks, single):
    for (model, fmt), ref in single.items():
        assert ref["moe_sums"] == (True, False), (model, fmt)  # one process: no collective at all
    for setting, want in MOE_SUMS.items():
        for rank, r in enumerate(ranks):
            assert tuple(r[setting]["moe_sums"]) == want, (setting, rank)

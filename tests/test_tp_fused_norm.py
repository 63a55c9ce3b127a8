"""A row-parallel layer's all-reduce meets the next block's residual add and RMSNorm in one call
(docs/parallel.md, "The all-reduce").

* The kernels (``engine/parallel/push_all_reduce.py``) on CPU under the Triton interpreter, two forked ranks
  over shared memory (tests/push_kernel_ranks.py): the push all-reduce gives both ranks the same sum, within
  one rounding of the float32 sum, over three calls (both slot parities), in one program and chunked over 6 and
  24 programs with counters of their own; the fused kernel's normed rows and new residual equal the plain
  all-reduce followed by the norm kernel, bit for bit, and leave the input alone.
* The model's plumbing on a real gloo TP=2 group: a Llama decoder leaves ``o_proj``'s and ``down_proj``'s
  all-reduces to the norm that follows them (``Communicator.all_reduce_rmsnorm``), 2 x layers - 1 of them a
  forward, and the logits and greedy tokens equal those of the unfused path exactly.  MoE blocks at EP=2 (the
  ``all_reduce`` dispatch) leave theirs too; a block with a shared expert keeps its own (Qwen2-MoE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import KVDriver, build_tiny_model
from moe_fixtures import build_tiny_moe
from server_fixtures import rank_body, run_ranks

from kvship.engine.config import ServerArgs

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = [5, 17, 33, 101, 7, 250, 64, 9, 12]


def test_push_kernels_sum_alike_on_both_ranks_and_the_fused_norm_equals_all_reduce_then_norm():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "push_kernel_ranks.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    r0, r1 = report["ranks"]["0"], report["ranks"]["1"]
    # program 0: three plain, three fused, three references of the 40-row norm (7.5 KiB: one program), six chunked
    # calls and the NaN check's plain one; programs 1-5 ran in the six chunked calls, 6-23 in the three of 24
    assert report["shapes"] == [[6, 4096, 1], [24, 4096, 3]], report["shapes"]
    assert r0["epoch"] == r1["epoch"] == [16] + [6] * 5 + [3] * 18 + [0] * 8, r0["epoch"]
    for a, b, ref in zip(r0["chunked"], r1["chunked"], report["chunked_float_sums"]):
        assert a == b, "the chunked kernel left the ranks with different sums"
        got, ref = torch.tensor(a), torch.tensor(ref)
        assert ((got - ref).abs() <= torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2**-6)).all()
    for i, want in enumerate(report["float_sums"]):
        a, b = r0["rounds"][i], r1["rounds"][i]
        assert a["sum"] == b["sum"], f"round {i}: the ranks hold different sums"
        got, ref = torch.tensor(a["sum"]), torch.tensor(want)
        ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2**-6)  # one bfloat16 rounding
        assert ((got - ref).abs() <= ulp).all(), f"round {i}: {(got - ref).abs().max()}"
        assert a["fused_equal"] and b["fused_equal"], f"round {i}: fused norm differs from all-reduce + norm"
        assert a["input_kept"] and b["input_kept"]
        # the sentinel exchange: the push kernel's sum and fused norm, bit for bit, in 2- and 4-byte values
        assert a["sentinel_equal"] and b["sentinel_equal"], f"round {i}: sentinel sum differs"
        assert a["sentinel_norm_equal"] and b["sentinel_norm_equal"], f"round {i}: sentinel norm differs"
        assert a["sentinel_f32"] == b["sentinel_f32"] == want, f"round {i}: float32 sentinel sum"
        assert a["sentinel_chunked_equal"] == b["sentinel_chunked_equal"] == [True, True], f"round {i}: chunked"
        assert a["sentinel_rows_equal"] and b["sentinel_rows_equal"], f"round {i}: 40 rows with the norm inside"
    for r in (r0, r1):
        # a round: one-program sum (program 0), the 3-row norm (programs 0-2), the float32 sum (0), the 40-row norm
        # (0-19), two chunked sums (0-5, 0-23); then the NaN call (0): both parities over and over, every part freed
        epochs = [3 * 6 + 1] + [3 * 4] * 2 + [3 * 3] * 3 + [3 * 2] * 14 + [3] * 4 + [0] * 8
        assert r["sentinel"] == {"nan_ok": True, "freed": True, "sentinel_epoch": epochs}


def _fused_vs_plain(groups, path: str, ep_size: int) -> dict:
    """One rank: the same extend and greedy run with a reference ``all_reduce_rmsnorm`` on the gloo communicator
    (the all-reduce, then RMSNorm's own arithmetic; counted) and without it (the fallback: all-reduce, norm)."""
    from kvship.engine.distributed.communicator import GlooCommunicator
    from kvship.engine.model_runner import ModelRunner

    calls = []

    def reference(self, x, residual, weight, eps):
        calls.append(tuple(x.shape))
        s = self.all_reduce(x.clone()) + residual
        h = s.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(s.dtype), s

    runner = ModelRunner(
        ServerArgs(model_path=path, max_total_tokens=512, max_running_requests=4, tp_size=2, ep_size=ep_size),
        groups=groups,
    )
    drv = KVDriver(runner)
    out = {}
    for name in ("fused", "plain"):
        if name == "fused":
            GlooCommunicator.all_reduce_rmsnorm = reference
        else:
            del GlooCommunicator.all_reduce_rmsnorm  # back to the base class's: no kernel, all-reduce then norm
        calls.clear()
        req = drv.new()
        try:
            logits = drv.extend([req], [PROMPT], all_logits=True)
        finally:
            drv.free(req)
        out[name] = {"logits": logits.numpy().tolist(), "calls": len(calls), "greedy": drv.greedy(PROMPT, 6)}
    out["layers"] = runner.model_config.num_hidden_layers
    return out


def _rank(rank, init_method, path, ep_size, out):
    body = lambda g: _fused_vs_plain(g, path, ep_size)  # noqa: E731
    rank_body(rank, init_method, ServerArgs(model_path=path, tp_size=2, ep_size=ep_size), body, out)


# model -> (ep size, fused calls a forward): 3 layers each
CASES = {
    "llama": (1, 5),  # o_proj x 3, down_proj of layers 0 and 1
    "qwen3": (1, 5),
    "qwen3_moe": (2, 5),  # sparse, dense, sparse: every block's output left to the next norm
    "qwen2_moe": (2, 5),  # layer 1's shared and routed experts: partial sums added, their all-reduce left to the norm
}


def test_the_fused_norm_kernel_refuses_more_than_its_part_of_a_slot():
    """Its one program writes part 0 of a slot; a larger tensor would overwrite parts that chunked calls' other
    programs own (a peer may still be summing them), so it is refused before anything is written."""
    from kvship.engine.parallel import push_all_reduce as pa

    buf = torch.zeros(pa.buffer_bytes(1), dtype=torch.uint8)
    ar = pa.PushAllReduce([buf.data_ptr()], 0, torch.device("cpu"))
    rows = pa.SUB_BYTES // (2 * 96) + 1
    x = torch.ones(rows, 96, dtype=torch.bfloat16)
    w = torch.ones(96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm inside takes up to"):
        ar.all_reduce_rmsnorm_(x, x.clone(), w, 1e-6)
    assert not ar.fits_norm(x, x, w)
    assert int(buf.count_nonzero()) == 0


@pytest.mark.parametrize("model", list(CASES))
def test_tp2_row_parallel_all_reduces_meet_the_next_norm_and_change_nothing(tmp_path, model):
    ep_size, want_calls = CASES[model]
    if model.endswith("_moe"):
        path = build_tiny_moe(str(tmp_path / model), model, seed=11)
    else:
        path = build_tiny_model(str(tmp_path / model), model, seed=11, num_hidden_layers=3)
    ranks = run_ranks(_rank, 2, (path, ep_size), 180)
    for r in ranks:
        assert r["layers"] == 3
        assert r["fused"]["calls"] == want_calls, r["fused"]["calls"]
        assert r["plain"]["calls"] == 0
        assert r["fused"]["logits"] == r["plain"]["logits"]
        assert r["fused"]["greedy"] == r["plain"]["greedy"]
    assert ranks[0]["fused"]["greedy"] == ranks[1]["fused"]["greedy"]

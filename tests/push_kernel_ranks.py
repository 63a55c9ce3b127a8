"""Two ranks of the push all-reduce kernels on CPU under the Triton interpreter (run by
tests/test_tp_fused_norm.py as ``TRITON_INTERPRET=1 python tests/push_kernel_ranks.py``).

The ranks are forked processes: the peer buffers are shared memory mapped before the fork, so one address names
the same bytes in both, as symmetric memory's peer pointers do on GPUs (the interpreter is not thread-safe, so
threads would not do).  Each rank runs, three times over (both slot parities, the epoch counter climbing):
the plain push all-reduce, then the all-reduce-and-RMSNorm kernel on the same inputs, then the norm kernel on
the plain sum.  Prints one JSON line: each rank's sums (as floats), whether the fused outputs equal the
unfused ones bit for bit, and the epochs."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

import torch

from kvship.engine.layers.fused_ops_cuda import rmsnorm
from kvship.engine.parallel import push_all_reduce as pa

N, ROWS, HIDDEN, ROUNDS = 2, 3, 96, 3
CHUNKED = [(5, 4096 + 123), (70, 4096)]  # (rows, hidden) in bf16: above one program's 32 KiB


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)  # no OpenMP pool in the parent: a forked rank's first parallel op would deadlock on it
    bufs = [torch.empty(pa.buffer_bytes(N), dtype=torch.uint8).share_memory_() for _ in range(N)]
    for b in bufs:
        pa.init_buffer(b, N)
    ptrs = [b.data_ptr() for b in bufs]
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(ROUNDS)] for _ in range(N)]
    res = torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16)
    w = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16)

    wide = [[torch.randn(40, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(ROUNDS)] for _ in range(N)]
    wide_res = torch.randn(40, HIDDEN, generator=g).to(torch.bfloat16)
    # chunked sizes: 6 programs of one step (42 KiB), 24 programs of 3 steps, the last one partial (573 KiB)
    big = [[torch.randn(rows, cols, generator=g).to(torch.bfloat16) for rows, cols in CHUNKED] for _ in range(N)]

    def rank_main(rank: int, q) -> None:
        ar = pa.PushAllReduce(ptrs, rank, torch.device("cpu"))
        out = []
        chunked = []
        for i in range(ROUNDS):
            x = xs[rank][i]
            plain = ar.all_reduce_(x.clone())
            y, res_out = ar.all_reduce_rmsnorm_(x, res, w, 1e-6)
            want_y, want_res = rmsnorm(plain, w, 1e-6, res)
            sent = ar.all_reduce_sentinel_(x.clone())
            sy, sres = ar.all_reduce_sentinel_rmsnorm_(x, res, w, 1e-6)
            s32 = ar.all_reduce_sentinel_(x.float())  # 4-byte values
            # 40 rows: 20 programs of two rows each, against the push all-reduce then the norm kernel
            many = wide[rank][i]
            my, mres = ar.all_reduce_sentinel_rmsnorm_(many, wide_res, w, 1e-6)
            want_my, want_mres = rmsnorm(ar.all_reduce_(many.clone()), w, 1e-6, wide_res)
            out.append(
                {
                    "sum": plain.float().flatten().tolist(),
                    "fused_equal": bool(torch.equal(y, want_y) and torch.equal(res_out, want_res)),
                    "input_kept": bool(torch.equal(x, xs[rank][i])),
                    "sentinel_equal": bool(torch.equal(sent, plain)),
                    "sentinel_norm_equal": bool(torch.equal(sy, want_y) and torch.equal(sres, want_res)),
                    "sentinel_f32": s32.flatten().tolist(),
                    "sentinel_rows_equal": bool(torch.equal(my, want_my) and torch.equal(mres, want_mres)),
                }
            )
            for j, x in enumerate(big[rank]):  # between the small calls: the counters of programs > 0 advance alone
                pushed = ar.all_reduce_(x.clone())
                chunked.append(pushed.float().flatten()[::97].tolist())
                # the sentinel exchange cut the same way: the push kernel's bits
                out[-1].setdefault("sentinel_chunked_equal", []).append(
                    bool(torch.equal(ar.all_reduce_sentinel_(x.clone()), pushed))
                )
        # a value whose bits are the sentinel (a NaN) travels as another NaN: the sum is NaN there, on both ranks
        nan = xs[rank][0].clone()
        nan.view(torch.int16)[0, 0] = -1
        got_nan = ar.all_reduce_sentinel_(nan)
        nan_ok = bool(torch.isnan(got_nan[0, 0]) and torch.equal(got_nan[1:], ar.all_reduce_(xs[rank][0].clone())[1:]))
        freed = bool(bufs[rank][pa.sentinel_region(N) :].eq(0xFF).all())  # every sentinel slot free again
        q.put(
            (
                rank,
                out,
                ar.epoch.tolist(),
                chunked,
                {"nan_ok": nan_ok, "freed": freed, "sentinel_epoch": ar.sentinel_epoch.tolist()},
            )
        )

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, q)) for r in range(N)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(N):
        rank, out, epoch, chunked, sentinel = q.get(timeout=600)
        got[rank] = {"rounds": out, "epoch": epoch, "chunked": chunked, "sentinel": sentinel}
    for p in procs:
        p.join(30)
    want = [(xs[0][i].float() + xs[1][i].float()).flatten().tolist() for i in range(ROUNDS)]
    want_chunked = [(big[0][j].float() + big[1][j].float()).flatten()[::97].tolist() for j in range(len(CHUNKED))]
    shapes = [pa.launch_shape(rows * cols, 2) for rows, cols in CHUNKED]
    print(json.dumps({"ranks": got, "float_sums": want, "chunked_float_sums": want_chunked * ROUNDS, "shapes": shapes}))


if __name__ == "__main__":
    sys.exit(main())

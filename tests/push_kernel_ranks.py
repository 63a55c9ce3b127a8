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


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    bufs = [torch.zeros(pa.buffer_bytes(N), dtype=torch.uint8).share_memory_() for _ in range(N)]
    ptrs = [b.data_ptr() for b in bufs]
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(ROUNDS)] for _ in range(N)]
    res = torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16)
    w = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16)

    def rank_main(rank: int, q) -> None:
        ar = pa.PushAllReduce(ptrs, rank, torch.device("cpu"))
        out = []
        for i in range(ROUNDS):
            x = xs[rank][i]
            plain = ar.all_reduce_(x.clone())
            y, res_out = ar.all_reduce_rmsnorm_(x, res, w, 1e-6)
            want_y, want_res = rmsnorm(plain, w, 1e-6, res)
            out.append(
                {
                    "sum": plain.float().flatten().tolist(),
                    "fused_equal": bool(torch.equal(y, want_y) and torch.equal(res_out, want_res)),
                    "input_kept": bool(torch.equal(x, xs[rank][i])),
                }
            )
        q.put((rank, out, int(ar.epoch.item())))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, q)) for r in range(N)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(N):
        rank, out, epoch = q.get(timeout=300)
        got[rank] = {"rounds": out, "epoch": epoch}
    for p in procs:
        p.join(30)
    want = [(xs[0][i].float() + xs[1][i].float()).flatten().tolist() for i in range(ROUNDS)]
    print(json.dumps({"ranks": got, "float_sums": want}))


if __name__ == "__main__":
    sys.exit(main())

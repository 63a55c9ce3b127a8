"""Static SASS of our Triton decode kernel's variants, compiled for a GPU target on a machine without one.

Triton compiles a kernel for any target it ships a backend for, and its NVIDIA backend carries ``ptxas``,
``nvdisasm`` and ``cuobjdump``.  This compiles stage 1 of ``decode_attention`` (the Llama-3.1-8B attention
shape: 4 query heads per KV head, head dim 128) for ``--arch`` (default 90, Hopper) at each tile of
``--tiles``, on an FP8 pool read as e4m3 and as int32 words (``stage1_tile``'s ``words``: both tiles, the keys'
or the values' only) and on a bf16 pool (``--pools``),
and prints per variant: registers a thread, stack bytes (spills) and the count of each shared-memory, conversion
and tensor-core opcode in the SASS.  Counts are static (instructions in the code, not executed), so they say how
the compiler lowered a loop, not how fast it runs; Nsight Compute and the timing benchmarks (bench/kv_layout.py,
bench/kv_fp8.py) say that on a GPU.

The lowering depends on Triton's version: run it with the device's Triton on ``PYTHONPATH`` (its wheel, unpacked
into a folder) to see what the device compiles.

    PYTHONPATH=/tmp/triton-3.6.0 .venv/bin/python bench/decode_sass.py
    .venv/bin/python bench/decode_sass.py --tiles 128:4:3:168,64:4:3:none --json /tmp/sass.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from typing import Any, Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvship.engine.attention.triton_ops import decode_attention as da

OPCODES = ("LDS", "LDSM", "STS", "LDGSTS", "LDG", "F2FP", "PRMT", "IMAD", "HMMA", "MUFU")
POINTERS = {
    "q": "*bf16",
    "req_to_token": "*i32",
    "req_pool_indices": "*i64",
    "seq_lens": "*i32",
    "mid_out": "*fp32",
    "mid_lse": "*fp32",
}


def compile_stage1(
    pool: str, block_n: int, warps: int, stages: int, maxnreg: Optional[int], arch: int
) -> "triton.compiler.CompiledKernel":
    """Stage 1 for ``pool`` in ``("e4m3", "words", "words_k", "words_v", "bf16")`` (``words_k`` / ``words_v``: only
    the keys / values read as words), pointers and strides 16-aligned as at run time."""
    fn = da._decode_stage1
    names = fn.arg_names
    wk, wv = pool in ("words", "words_k"), pool in ("words", "words_v")
    fp8 = pool != "bf16"
    consts = dict(
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_H=16,
        BLOCK_D=128,
        BLOCK_N=block_n,
        USE_PDL=arch >= 90,
        KV_FP8=fp8,
        DOT_F16=fp8,
        WORDS_K=wk,
        WORDS_V=wv,
        PTX_CVT=wk or wv,
    )
    pool_ptr = {True: "*i32", False: "*fp8e4nv" if fp8 else "*bf16"}
    ptrs = {**POINTERS, "k_buf": pool_ptr[wk], "v_buf": pool_ptr[wv]}
    sig: dict[str, str] = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
        elif n in ("sm_scale", "v_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptrs or n.startswith("stride")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg)
    return triton.compile(src, target=GPUTarget("cuda", arch, 128 if arch >= 90 else 32), options=opts)


def sass_counts(kernel: Any) -> dict[str, Any]:
    """Registers, stack bytes and opcode counts of a compiled kernel's cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return {
        "registers": int(reg.group(1)) if reg else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "instructions": sum(ops.values()),
        **{op: ops[op] for op in OPCODES},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument(
        "--tiles",
        default="128:4:3:168,128:4:3:none,64:4:3:none",
        help="block_n:warps:stages:maxnreg, comma-separated (maxnreg 'none': the compiler's choice)",
    )
    ap.add_argument("--pools", default="e4m3,words,words_k,words_v,bf16", help="pool variants, comma-separated")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for tile in args.tiles.split(","):
        bn, w, st, mr = tile.split(":")
        for pool in args.pools.split(","):
            k = compile_stage1(pool, int(bn), int(w), int(st), None if mr == "none" else int(mr), args.arch)
            row = {
                "pool": pool,
                "block_n": int(bn),
                "warps": int(w),
                "stages": int(st),
                "maxnreg": mr,
                **sass_counts(k),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

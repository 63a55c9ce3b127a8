"""GPU decode benchmark of the model runner at a real model shape, with its baselines measured in the same run.

What one run measures (everything on the same GPU, side by side):
1. HBM bandwidth: a large device-to-device copy (bytes read + written).
2. FlashInfer's decode kernel alone at batch 64 x 2048 context (Llama-3.1-8B
   attention shape, bf16, tensor cores): achieved KV-read bandwidth; and our
   attention step (the ``flashinfer`` backend's ``forward_decode`` for one
   layer, plus its per-step plan amortised over the layers) at the same shape.
3. Decode tokens/s of our runner (dummy bf16 weights built on the GPU) at each
   batch size, input ``--input-len`` / output ``--output-len``, with CUDA
   graphs and eagerly, each step including the host work an engine does
   (slot allocation, batch tensors, greedy argmax, token copy to the host);
   ``--overlap`` also runs the graph loop with the host work of step N+1
   overlapping the GPU work of step N.
4. Hugging Face ``transformers`` ``generate`` (same shape, same GPU, greedy)
   as the naive baseline.
5. Batch-1 decode as a fraction of the HBM roofline: (weight bytes + KV bytes
   read per step) / measured copy bandwidth.

Writes ``decode_latency.json`` and ``decode_latency.md`` under ``--out`` and
prints the table.  ``--tp-size N`` (N GPUs) instead runs item 3's eager and
graph loops with the model split over N tensor-parallel ranks (rank 0 here,
ranks 1..N-1 spawned) and writes ``decode_latency_tp<N>.json`` (per-rank
roofline: each rank reads its weight shard and its KV heads).  With an MoE
``--shape`` (``qwen3-30b-a3b``), ``--ep-size E`` splits the experts E ways too
(``decode_latency_tp<N>_ep<E>.json``; docs/parallel.md, "Expert parallelism").
``python bench/decode_latency.py --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
from deepseek import V2_LITE  # bench/deepseek.py (this directory is on sys.path when a bench script runs)

logger = logging.getLogger("decode_latency")

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        torch_dtype="bfloat16",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
    # Mixture-of-Experts (issue 13): 128 experts of width 768, 8 active per token, 61 GB of bf16 weights
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
}
# DeepSeek-V2-Lite (issue 34): MLA over a latent cache, 64 routed + 2 shared experts (bench/deepseek.py's definition)
SHAPES["deepseek-v2-lite"] = V2_LITE


def step_weight_bytes(mc: Any, weight_bytes: int, elem: float = 2, tp_size: int = 1, ep_size: int = 1) -> int:
    """Weight bytes a batch-1 decode step reads (of ``weight_bytes``, one rank's): all of them, except that
    an MoE layer reads only its ``top_k`` experts.  With ``tp_size`` ranks and experts split ``ep_size``
    ways a rank holds ``E/ep`` experts of width ``I/(tp/ep)`` and reads, on average, ``top_k/ep`` of them."""
    moe = getattr(mc, "moe", None)
    if moe is None:
        return weight_bytes
    sparse = sum(moe.is_sparse_layer(i) for i in range(mc.num_hidden_layers))
    expert = 3 * mc.hidden_size * (moe.intermediate_size // (tp_size // ep_size)) * elem
    return int(weight_bytes - sparse * (moe.num_experts - moe.top_k) / ep_size * expert)


def write_model_dir(shape: str, root: str, **overrides: Any) -> str:
    cfg = dict(SHAPES[shape])
    cfg.update(overrides)
    path = os.path.join(root, shape + "".join(f"-{k}{v}" for k, v in sorted(overrides.items())))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def cuda_time(fn: Callable[[], Any], iters: int, warmup: int = 3, rounds: int = 5) -> float:
    """Seconds per call of ``fn``: CUDA events around ``iters`` back-to-back calls (the host runs
    ahead, as in a model's forward), median over ``rounds``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        per_call.append(s.elapsed_time(e) * 1e-3 / iters)
    per_call.sort()
    return per_call[len(per_call) // 2]


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = "unknown"
    for mod in ("flashinfer", "triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - report whatever is missing
            env[mod] = None
    return env


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / t


# --- attention: kernel alone vs our backend step -----------------------------------------
def attention_bench(model_dir: str, bs: int, ctx: int, page_size: int, hbm: float, layers: int) -> dict[str, Any]:
    """Per-layer decode attention at ``bs`` x ``ctx``: FlashInfer's kernel alone vs our backend's step.

    Our step is ``forward_decode`` (K/V write + kernel) plus the per-step plan
    (``init_forward_metadata``) divided by the model's ``layers``.
    """
    import flashinfer

    from kvship.engine.attention.base import AttentionLayerSpec
    from kvship.engine.config import ServerArgs
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch
    from kvship.engine.model_runner import ModelRunner

    runner = ModelRunner(
        ServerArgs(
            model_path=model_dir,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            page_size=page_size,
            max_total_tokens=bs * ctx + 64 * page_size,
            max_running_requests=bs,
            context_length=ctx + 64,
            disable_cuda_graph=True,
        )
    )
    mc = runner.model_config
    h, hk, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    kbuf, vbuf = runner.kv_pool.get_key_buffer(0), runner.kv_pool.get_value_buffer(0)
    kbuf.normal_()
    vbuf.normal_()
    # every request owns ctx-1 cached tokens on its own scattered pages, plus the new one
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    slots = runner.allocator.alloc_extend([0] * bs, [ctx] * bs, [-1] * bs).view(bs, ctx)
    dev = runner.device
    r2t = runner.req_to_token_pool.req_to_token
    r2t[torch.tensor(rows)[:, None].to(dev), torch.arange(ctx, device=dev)[None, :]] = slots.to(dev, torch.int32)
    fb = build_forward_batch(
        ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
        positions=torch.full((bs,), ctx - 1, dtype=torch.int64, device=dev),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
        seq_lens=torch.full((bs,), ctx, dtype=torch.int64, device=dev),
        seq_lens_cpu=[ctx] * bs,
        out_cache_loc=slots[:, -1].to(dev),
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )
    backend = runner.attn_backend
    spec = AttentionLayerSpec(0, h, hk, d, d**-0.5)
    q = torch.randn(bs, h * d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(bs, hk * d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(bs, hk * d, dtype=torch.bfloat16, device=dev)
    backend.init_forward_metadata(fb)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):  # host work mostly: time it on the host clock
        backend.init_forward_metadata(fb)
    torch.cuda.synchronize()
    plan_s = (time.perf_counter() - t0) / 20
    backend.init_forward_metadata(fb)
    ours_s = cuda_time(lambda: backend.forward_decode(q, k, v, spec, fb), iters=50)

    # the kernel alone: same pages, same cache, wrapper planned once outside the timing
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=h // hk >= 4, backend="fa2")
    npg = (ctx + page_size - 1) // page_size
    indptr = torch.arange(0, bs * npg + 1, npg, dtype=torch.int32)
    indices = (slots[:, ::page_size] // page_size).to(torch.int32).flatten().to(dev)
    last = torch.full((bs,), ctx - (npg - 1) * page_size, dtype=torch.int32)
    w.plan(indptr, indices, last, h, hk, d, page_size, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    cache = (kbuf.view(-1, page_size, hk, d), vbuf.view(-1, page_size, hk, d))
    qh = q.view(bs, h, d)
    alone_s = cuda_time(lambda: w.run(qh, cache), iters=50)
    ref = w.run(qh, cache).float()
    got = backend.forward_decode(q, k, v, spec, fb).view(bs, h, d).float()
    kv_bytes = bs * ctx * hk * d * 2 * kbuf.element_size()
    out = {
        "batch": bs,
        "context": ctx,
        "page_size": page_size,
        "kernel_alone_us": alone_s * 1e6,
        "kernel_kv_TBps": kv_bytes / alone_s / 1e12,
        "kernel_frac_hbm": kv_bytes / alone_s / hbm,
        "ours_layer_us": ours_s * 1e6,
        "plan_us": plan_s * 1e6,
        "ours_per_layer_incl_plan_us": (ours_s + plan_s / layers) * 1e6,
        "ours_vs_kernel": (ours_s + plan_s / layers) / alone_s,
        "max_abs_diff_vs_kernel": float((got - ref).abs().max()),
        "layers": layers,
    }
    del runner, backend, fb, ws, w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def graph_time(fn: Callable[[int], Any], calls: int, rounds: int = 7) -> float:
    """Seconds per call: ``calls`` calls (``fn(i)``) captured in one CUDA graph (launch cost as in a decode
    step's graph), median replay over ``rounds``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) * 1e-3 / calls)
    del g
    per.sort()
    return per[len(per) // 2]


def decode_kernel_choice(shape: str) -> list[dict[str, Any]]:
    """FlashInfer decode alone, tensor-core vs CUDA-core kernels, per layer inside a CUDA graph of one call per
    layer (each layer its own KV, as in a model), at small and large batches (page size 1)."""
    import flashinfer

    cfg = SHAPES[shape]
    h, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layers = cfg["num_hidden_layers"]
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    out = []
    for bs, ctx in ((1, 640), (4, 640), (8, 640), (16, 640), (32, 640), (64, 640), (64, 2048)):
        n = bs * ctx
        per_layer = (n + 1) * 2 * hk * d * 2
        nl = max(2, min(layers, (2 << 30) // per_layer))  # distinct KV per layer, up to 2 GiB
        kvs = [torch.randn(n + 1, 2, 1, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(nl)]
        indptr = torch.arange(0, n + 1, ctx, dtype=torch.int32)
        indices = torch.randperm(n, device="cuda").to(torch.int32) + 1
        last = torch.ones(bs, dtype=torch.int32)
        q = torch.randn(bs, h, d, dtype=torch.bfloat16, device="cuda")
        row: dict[str, Any] = {"batch": bs, "context": ctx, "layers_in_graph": nl}
        for tc, no_split in ((True, False), (False, False), (True, True), (False, True)):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tc,
                paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=torch.empty(n, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device="cuda"),
                backend="fa2",
            )
            w.plan(
                indptr,
                indices,
                last,
                h,
                hk,
                d,
                1,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
                disable_split_kv=no_split,
            )
            t = graph_time(lambda i, w=w: w.run(q, kvs[i % nl]), calls=nl)
            row[("tensor_cores" if tc else "cuda_cores") + ("_no_split" if no_split else "") + "_us"] = t * 1e6
        out.append(row)
        del kvs
        torch.cuda.empty_cache()
    del ws
    torch.cuda.empty_cache()
    return out


def small_m_gemm(shape: str, hbm: float) -> list[dict[str, Any]]:
    """Batch-1 projections of the shape: F.linear (what the layers call) vs torch.mv vs a pre-transposed
    weight, as achieved weight-read bandwidth (fraction of measured HBM)."""
    import torch.nn.functional as F

    cfg = SHAPES[shape]
    hid, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q = cfg["num_attention_heads"] * d
    kv = cfg["num_key_value_heads"] * d
    shapes = {
        "qkv_proj": (q + 2 * kv, hid),
        "o_proj": (hid, q),
        "gate_up_proj": (2 * inter, hid),
        "down_proj": (hid, inter),
        "lm_head": (cfg["vocab_size"], hid),
    }
    out = []
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(3)]  # rotate: no L2 reuse
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        it = iter(range(10**9))

        def pick(lst):
            return lst[next(it) % len(lst)]

        row: dict[str, Any] = {"layer": name, "n": n, "k": k}
        for label, fn in (
            ("linear", lambda: F.linear(x, pick(ws))),
            ("mv", lambda: torch.mv(pick(ws), x[0])),
            ("x@wt", lambda: x @ pick(wts)),
        ):
            t = cuda_time(fn, iters=30)
            row[label + "_us"] = t * 1e6
            row[label + "_frac_hbm"] = n * k * 2 / t / hbm
        out.append(row)
        del ws, wts
    torch.cuda.empty_cache()
    return out


# --- engine decode -----------------------------------------------------------------------
class DecodeDriver:
    """Allocates KV and builds ForwardBatches for a fixed set of requests (what a scheduler does)."""

    def __init__(self, runner: Any, bs: int):
        self.r = runner
        self.bs = bs
        self.rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
        if any(x is None for x in self.rows):
            raise RuntimeError("not enough request rows")
        self.rows_dev = torch.tensor(self.rows, dtype=torch.int64, device=runner.device)
        self.lens = [0] * bs
        self.last = [-1] * bs
        self.slots: list[torch.Tensor] = []

    def _write(self, rows: list[int], starts: list[int], counts: list[int], locs: torch.Tensor) -> torch.Tensor:
        dev = self.r.device
        rr = torch.tensor([r for r, n in zip(rows, counts) for _ in range(n)], dtype=torch.int64)
        pp = torch.tensor([s + i for s, n in zip(starts, counts) for i in range(n)], dtype=torch.int64)
        host = torch.stack([rr, pp, locs]).pin_memory()
        d = host.to(dev, non_blocking=True)
        self.r.req_to_token_pool.req_to_token[d[0], d[1]] = d[2].to(torch.int32)
        return d

    def prefill(self, prompt_len: int, gen: torch.Generator, chunk_tokens: int = 16384) -> torch.Tensor:
        from kvship.engine.forward_batch import ForwardMode, build_forward_batch

        r, dev = self.r, self.r.device
        per = max(1, chunk_tokens // prompt_len)
        last_ids = []
        for lo in range(0, self.bs, per):
            idx = list(range(lo, min(self.bs, lo + per)))
            n = len(idx)
            locs = r.allocator.alloc_extend([0] * n, [prompt_len] * n, [-1] * n)
            if locs is None:
                raise RuntimeError("KV pool too small for the prefill")
            d = self._write([self.rows[i] for i in idx], [0] * n, [prompt_len] * n, locs)
            ids = torch.randint(3, r.model_config.vocab_size, (n * prompt_len,), generator=gen).to(dev)
            for j, i in enumerate(idx):
                self.lens[i] = prompt_len
                self.last[i] = int(locs[(j + 1) * prompt_len - 1])
            self.slots.append(locs)
            ext = torch.full((n,), prompt_len, dtype=torch.int64, device=dev)
            fb = build_forward_batch(
                ForwardMode.EXTEND,
                input_ids=ids,
                positions=d[1],
                req_pool_indices=self.rows_dev[lo : lo + n],
                seq_lens=ext,
                seq_lens_cpu=[prompt_len] * n,
                out_cache_loc=d[2],
                req_to_token_pool=r.req_to_token_pool,
                kv_pool=r.kv_pool,
                attn_backend=r.attn_backend,
                extend_lens=[prompt_len] * n,
                prefix_lens=[0] * n,
                extend_tensors=(
                    ext,
                    torch.zeros(n, dtype=torch.int64, device=dev),
                    torch.arange(0, n * prompt_len, prompt_len, device=dev),
                ),
            )
            last_ids.append(r.forward(fb).next_token_logits.argmax(-1))
        return torch.cat(last_ids)

    def decode_step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step fed by ``ids`` (on the GPU); returns the greedy next ids (on the GPU)."""
        from kvship.engine.forward_batch import ForwardMode, build_forward_batch

        r = self.r
        seq = [n + 1 for n in self.lens]
        locs = r.allocator.alloc_decode(seq, self.last)
        if locs is None:
            raise RuntimeError("KV pool exhausted during decode")
        self.slots.append(locs)
        d = self._write(self.rows, self.lens, [1] * self.bs, locs)
        self.lens = seq
        self.last = locs.tolist()
        seq_dev = d[1] + 1
        fb = build_forward_batch(
            ForwardMode.DECODE,
            input_ids=ids,
            positions=d[1],
            req_pool_indices=self.rows_dev,
            seq_lens=seq_dev,
            seq_lens_cpu=seq,
            out_cache_loc=d[2],
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )
        return r.forward(fb).next_token_logits.argmax(-1)

    def free(self) -> None:
        if self.slots:  # one call: slots of one page may come from several steps
            self.r.allocator.free(torch.cat(self.slots))
        for row in self.rows:
            self.r.req_to_token_pool.free(row)
        self.slots = []


def engine_decode(runner: Any, bs: int, input_len: int, output_len: int, mode: str) -> dict[str, Any]:
    """Decode tokens/s for one batch size; ``mode`` is eager, graph or graph+overlap."""
    saved = runner.cuda_graph_runner
    if mode == "eager":
        runner.cuda_graph_runner = None
    try:
        drv = DecodeDriver(runner, bs)
        gen = torch.Generator().manual_seed(bs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = drv.prefill(input_len, gen)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        tokens: list[list[int]] = []
        t0 = time.perf_counter()
        if mode == "graph+overlap":
            # launch step N+1 (its inputs are on the GPU) before copying step N's tokens to the host
            pinned = torch.empty((output_len, bs), dtype=torch.int64, pin_memory=True)
            prev: Optional[tuple[int, torch.cuda.Event]] = None
            for step in range(output_len):
                nxt = drv.decode_step(ids)
                pinned[step].copy_(nxt, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                if prev is not None:
                    prev[1].synchronize()
                    tokens.append(pinned[prev[0]].tolist())
                prev = (step, ev)
                ids = nxt
            if prev is not None:
                prev[1].synchronize()
                tokens.append(pinned[prev[0]].tolist())
        else:
            for _ in range(output_len):
                ids = drv.decode_step(ids)
                tokens.append(ids.tolist())  # the per-step token copy an engine makes
        torch.cuda.synchronize()
        decode_s = time.perf_counter() - t0
        drv.free()
    finally:
        runner.cuda_graph_runner = saved
    return {
        "batch": bs,
        "mode": mode,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "step_ms": decode_s / output_len * 1e3,
        "decode_tok_s": bs * output_len / decode_s,
        "sample_tokens": tokens[-1][:4],
    }


def scheduler_decode(
    runner: Any,
    bs: int,
    input_len: int,
    output_len: int,
    overlap: bool,
    speculator: Any = None,
    label: str = "",
    warmup: bool = True,
) -> dict[str, Any]:
    """Decode tokens/s through the real ``Scheduler`` (batching, sampling, stop checks, output chunks),
    with its overlap loop (``kvship.engine.scheduler.overlap``) on or off.  With ``warmup`` the same batch
    first runs 8 tokens untimed.  The clock runs from the end of the last prefill step until every request
    has finished; tokens counted are those generated by decode."""
    import dataclasses

    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.scheduler import Scheduler

    sa = dataclasses.replace(
        runner.server_args,
        disable_overlap_schedule=not overlap,
        disable_radix_cache=True,
        chunked_prefill_size=16384,
        max_prefill_tokens=16384,
    )
    chunks: list = []
    sched = Scheduler(sa, runner, None, chunks.extend, speculator=speculator)
    gen = torch.Generator().manual_seed(bs)
    vocab = runner.model_config.vocab_size
    # a short run of the same batch first: first-use costs (kernel compiles, allocator growth) stay off the clock
    for i in range(bs if warmup else 0):
        ids = torch.randint(3, vocab, (input_len,), generator=gen).tolist()
        sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        sched.submit(GenerateRequest(f"w{bs}-{i}", ids, sp))
    while sched.has_work():
        sched.step()
    for i in range(bs):
        ids = torch.randint(3, vocab, (input_len,), generator=gen).tolist()
        sched.submit(
            GenerateRequest(
                f"b{bs}-{i}", ids, SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
            )
        )
    t0 = time.perf_counter()
    while sched.waiting or sched.chunked_req is not None or not sched.inbox.empty():
        sched.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    gen0 = sched.counters["generation_tokens"]
    steps0 = sched.counters["decode_steps"]
    t0 = time.perf_counter()
    while sched.has_work():
        sched.step()
    torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    st = sched.get_stats()
    if st["free_slots"] != st["total_slots"]:
        raise RuntimeError(f"scheduler bench leaked KV slots: {st}")
    n = sched.counters["generation_tokens"] - gen0
    steps = sched.counters["decode_steps"] - steps0
    out = {
        "batch": bs,
        "mode": label or ("sched+overlap" if overlap else "sched"),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "step_ms": decode_s / max(steps, 1) * 1e3,
        "decode_tok_s": n / decode_s,
        "decode_steps": steps,
        "generated": n,
    }
    if overlap:
        out["chained_steps"] = sched.overlap.launched
    return out


def is_collective_kernel(name: str) -> bool:
    """NCCL's device kernels (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``, ``ncclKernel_AllGather_...``) and the
    one-shot peer-memory all-reduce's (``...symmetric_memory::one_shot_all_reduce_kernel...``)."""
    low = name.lower()
    return "nccl" in low or "all_reduce" in low or "allreduce" in low


def kernel_profile(runner: Any, bs: int, input_len: int, steps: int = 8) -> list[dict[str, Any]]:
    """Top CUDA kernels of graph decode steps at ``bs`` (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    drv = DecodeDriver(runner, bs)
    ids = drv.prefill(input_len, torch.Generator().manual_seed(0))
    for _ in range(2):
        ids = drv.decode_step(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ids = drv.decode_step(ids)
        torch.cuda.synchronize()
    drv.free()
    rows = []
    total = 0.0
    cuda_type = torch.autograd.DeviceType.CUDA
    for ev in prof.key_averages():
        if getattr(ev, "device_type", cuda_type) != cuda_type:
            continue
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t > 0 and ev.key:
            rows.append({"kernel": ev.key[:90], "us_per_step": t / steps, "calls_per_step": ev.count / steps})
            total += t / steps
    rows.sort(key=lambda r: -r["us_per_step"])
    for r in rows:
        r["share"] = r["us_per_step"] / total if total else 0.0
    top = rows[:15]
    coll = [r for r in rows if is_collective_kernel(r["kernel"])]
    if coll:  # the tensor-parallel all-reduces / all-gathers (inside the graph too)
        us = sum(r["us_per_step"] for r in coll)
        top.append(
            {
                "kernel": "COLLECTIVES",
                "us_per_step": us,
                "calls_per_step": sum(r["calls_per_step"] for r in coll),
                "share": us / total if total else 0.0,
            }
        )
    top.append(
        {
            "kernel": "TOTAL (all kernels)",
            "us_per_step": total,
            "calls_per_step": sum(r["calls_per_step"] for r in rows),
            "share": 1.0,
        }
    )
    timeline = kernel_timeline(prof, steps)
    if timeline:
        top.append(timeline)
    return top


def graph_replay_ms(runner: Any, bs: int, input_len: int, replays: int = 64) -> float:
    """Milliseconds per decode graph replay, ``replays`` back to back with no host work between them:
    the device's own step time, the floor a scheduler loop can reach."""
    drv = DecodeDriver(runner, bs)
    ids = drv.prefill(input_len, torch.Generator().manual_seed(0))
    ids = drv.decode_step(ids)  # fills the graph's input buffers with a real step
    torch.cuda.synchronize()
    graph = runner.cuda_graph_runner.graphs[runner.cuda_graph_runner.padded_size(bs)]
    per = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / replays)
    drv.free()
    per.sort()
    return per[len(per) // 2]


# the scheduler's phases (``StepPhase`` events), labelled in the host trace of ``sched_gap_profile``
_SCHED_PHASES = ("recv", "schedule", "launch", "sample", "process", "flush", "end_step")


def _decoding_scheduler(runner: Any, bs: int, input_len: int, max_new: int, tag: str) -> Any:
    """A ``Scheduler`` (overlap on where the device has it) with ``bs`` greedy requests of ``input_len`` random
    ids admitted, prefilled and 6 decode steps in.  Its phases are timed through its event bus: subscribe to
    ``StepPhase`` (docs/observability.md, "Events"); no method is replaced."""
    import dataclasses

    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.scheduler import Scheduler

    sa = dataclasses.replace(
        runner.server_args, disable_overlap_schedule=False, disable_radix_cache=True, chunked_prefill_size=16384
    )
    sched = Scheduler(sa, runner, None, lambda chunks: None)
    gen = torch.Generator().manual_seed(bs)
    vocab = runner.model_config.vocab_size
    for i in range(bs):
        ids = torch.randint(3, vocab, (input_len,), generator=gen).tolist()
        sp = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        sched.submit(GenerateRequest(f"{tag}{bs}-{i}", ids, sp))
    while sched.waiting or sched.chunked_req is not None or not sched.inbox.empty():
        sched.step()
    for _ in range(6):
        sched.step()
    return sched


def sched_gap_profile(runner: Any, bs: int, input_len: int, steps: int = 16) -> dict[str, Any]:
    """Where the overlapped scheduler loop leaves the GPU idle at batch ``bs``: ``steps`` decode steps
    of the real ``Scheduler`` (overlap on) under the profiler, host and device.  Reports the device's idle
    time per step (gaps between its kernels and copies, merged), the largest gaps with the scheduler phase
    and the CUDA runtime calls the host was in when each began, and the host's blocking calls
    (synchronizes, allocations) in the window."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvship.common.events import StepPhase

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sched = _decoding_scheduler(runner, bs, input_len, steps + 24, "gap")
    phases: list[tuple[float, float, str]] = []  # perf_counter seconds, from the scheduler's StepPhase events
    unsubscribe = sched.events.subscribe(lambda ev: phases.append((ev.start, ev.end, ev.phase)), (StepPhase,))
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        with record_function("bench.clock_mark"):  # lines the events' clock up with the profiler's
            mark = time.perf_counter()
        for _ in range(steps):
            sched.step()
        sync()
    wall = time.perf_counter() - t0
    unsubscribe()
    while sched.has_work():
        sched.step()
    cuda_type = torch.autograd.DeviceType.CUDA
    dev, host = [], []
    mark_us = None
    for ev in prof.events():
        tr = getattr(ev, "time_range", None)
        if tr is None or not ev.key:
            continue
        if ev.key == "bench.clock_mark":
            mark_us = tr.start
            continue
        (dev if getattr(ev, "device_type", None) == cuda_type else host).append((tr.start, tr.end, ev.key))
    if mark_us is not None:  # the phases as host ranges on the profiler's clock (microseconds)
        host += [(mark_us + (a - mark) * 1e6, mark_us + (b - mark) * 1e6, "sched." + n) for a, b, n in phases]
    dev.sort()
    gaps = []
    end = dev[0][1] if dev else 0.0
    for s, e, name in dev[1:]:
        if s > end:
            gaps.append((s - end, end, s, name))
        end = max(end, e)
    span = (end - dev[0][0]) if dev else 0.0
    idle = sum(g[0] for g in gaps)

    def host_at(t: float) -> list[str]:
        """Host events in flight at ``t``: the innermost scheduler phase and any CUDA runtime call."""
        live = [(s, e, n) for s, e, n in host if s <= t <= e]
        phases = sorted((x for x in live if x[2].startswith("sched.")), key=lambda x: -x[0])[:1]
        calls = [x for x in live if x[2].startswith("cuda")]
        return [n for _, _, n in phases] + [f"{n} ({e - s:.0f} us)" for s, e, n in calls]

    big = sorted(gaps, reverse=True)[:12]
    blocking: dict[str, dict[str, float]] = {}
    for s, e, n in host:
        if (
            n.startswith(
                (
                    "cudaStreamSynchronize",
                    "cudaEventSynchronize",
                    "cudaDeviceSynchronize",
                    "cudaHostAlloc",
                    "cudaMalloc",
                    "cudaMemcpy ",
                    "cudaFree",
                    "cudaGraphLaunch",
                )
            )
            or n == "cudaMemcpy"
        ):
            d = blocking.setdefault(n, {"calls": 0, "us": 0.0})
            d["calls"] += 1
            d["us"] += e - s
    phases: dict[str, float] = {}
    for s, e, n in host:
        if n.startswith("sched."):
            phases[n] = phases.get(n, 0.0) + (e - s) / steps
    return {
        "batch": bs,
        "steps": steps,
        "step_ms_under_profiler": wall / steps * 1e3,
        "device_span_us_per_step": span / steps,
        "device_idle_us_per_step": idle / steps,
        "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
        "largest_gaps": [
            {"us": g[0], "next": g[3][:60], "host_at_start": host_at(g[1]), "host_at_end": host_at(g[2])} for g in big
        ],
        "host_calls": blocking,
        "host_phase_us_per_step": phases,
    }


def sched_step_events(runner: Any, bs: int, input_len: int, steps: int = 64) -> dict[str, Any]:
    """The overlapped scheduler's decode steps at ``bs`` timed without a profiler, through its ``StepPhase``
    events: host clocks around each phase, and (CUDA) device events this bench records on the stream when a
    step's ``schedule`` phase ends (the launch's first op) and when its ``launch`` phase ends (after the
    step's inputs, graph and sampler were enqueued).  Per step (medians): the device time of a launch (its
    inputs, graph and sampler; less the graph alone, ``graph_replay_ms``, it is the work around the graph),
    the device time from one launch's end to the next launch's first op (idle waits for the host), the period
    between launches' ends, and the host's time in each phase."""
    from kvship.common.events import StepPhase

    cuda = torch.cuda.is_available()
    host: dict[str, list[float]] = {}
    marks: list[tuple[Any, Any]] = []  # (launch entry, launch end) device events of one step
    entry: list[Any] = [None]
    on = [False]

    def on_phase(ev: StepPhase) -> None:
        if not on[0]:
            return
        host.setdefault(ev.phase, []).append(ev.end - ev.start)
        if not cuda:
            return
        if ev.phase == "schedule":
            entry[0] = torch.cuda.Event(enable_timing=True)
            entry[0].record()
        elif ev.phase == "launch" and entry[0] is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            marks.append((entry[0], done))
            entry[0] = None

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sched = _decoding_scheduler(runner, bs, input_len, steps + 24, "ev")
    unsubscribe = sched.events.subscribe(on_phase, (StepPhase,))
    sync()
    on[0] = True
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync()
    wall = time.perf_counter() - t0
    on[0] = False
    unsubscribe()
    while sched.has_work():
        sched.step()

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    n = len(marks)
    return {
        "batch": bs,
        "steps": n if cuda else steps,
        "step_ms": wall / steps * 1e3,
        "launch_device_ms": med([marks[i][0].elapsed_time(marks[i][1]) for i in range(n)]),
        "launch_end_to_next_launch_ms": med([marks[i - 1][1].elapsed_time(marks[i][0]) for i in range(1, n)]),
        "launch_period_ms": med([marks[i - 1][1].elapsed_time(marks[i][1]) for i in range(1, n)]),
        "host_phase_ms": {k: med(v) * 1e3 for k, v in host.items()},
    }


def kernel_timeline(prof: Any, steps: int) -> Optional[dict[str, Any]]:
    """The kernels of one profiled step in launch order, each with its duration and the idle gap before it
    (GPU time between the previous kernel's end and its start): where the step loses time to bubbles."""
    cuda_type = torch.autograd.DeviceType.CUDA
    ks = []
    for ev in prof.events():
        if getattr(ev, "device_type", cuda_type) != cuda_type or not ev.key:
            continue
        tr = getattr(ev, "time_range", None)
        if tr is None:
            continue
        ks.append((tr.start, tr.end, ev.key[:60]))
    if len(ks) < steps:
        return None
    ks.sort()
    per = len(ks) // steps
    mid = ks[per * (steps // 2) : per * (steps // 2 + 1)]  # one step from the middle of the run
    seq = []
    for i, (s, e, name) in enumerate(mid):
        gap = s - mid[i - 1][1] if i else 0.0
        seq.append({"kernel": name, "us": e - s, "gap_us": gap})
    busy = sum(x["us"] for x in seq)
    span = mid[-1][1] - mid[0][0]
    # per kernel name: calls, kernel time and the gaps before its launches
    by: dict[str, dict[str, float]] = {}
    for x in seq:
        d = by.setdefault(x["kernel"], {"calls": 0, "us": 0.0, "gap_us": 0.0})
        d["calls"] += 1
        d["us"] += x["us"]
        d["gap_us"] += x["gap_us"]
    return {
        "kernel": "TIMELINE (one step)",
        "us_per_step": span,
        "calls_per_step": len(seq),
        "share": 1.0,
        "busy_us": busy,
        "gap_us": span - busy,
        "by_kernel": by,
        "sequence": seq[:40],
    }


def host_profile(runner: Any, bs: int, input_len: int, steps: int = 20) -> dict[str, Any]:
    """Where the host time of eager decode steps goes: cProfile over ``steps`` eager steps at ``bs`` (the GPU
    is synchronised every step, as the runner loop does); top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    saved = runner.cuda_graph_runner
    runner.cuda_graph_runner = None
    try:
        drv = DecodeDriver(runner, bs)
        ids = drv.prefill(input_len, torch.Generator().manual_seed(0))
        for _ in range(3):
            ids = drv.decode_step(ids)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            ids = drv.decode_step(ids)
            ids.tolist()
        prof.disable()
        wall = (time.perf_counter() - t0) / steps
        drv.free()
    finally:
        runner.cuda_graph_runner = saved
    out: dict[str, Any] = {"batch": bs, "steps": steps, "step_ms_under_profiler": wall * 1e3}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
        out[key] = buf.getvalue()[-6000:]
    return out


def _gpu_clock_sampler(path: str) -> Optional[subprocess.Popen]:
    """``nvidia-smi`` sampling the SM clock and power every 20 ms into ``path`` (None where it is missing)."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=open(path, "w"),
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None


def _clock_summary(path: str) -> dict[str, Any]:
    clocks = []
    for line in open(path):
        parts = [x.strip() for x in line.split(",")]
        try:
            clocks.append(float(parts[0]))
        except (ValueError, IndexError):
            continue
    if not clocks:
        return {}
    return {"samples": len(clocks), "sm_mhz_min": min(clocks), "sm_mhz_max": max(clocks), "sm_mhz_first": clocks[0]}


def prefill_timing(runner: Any, prompt_len: int, repeats: int = 6, idle_s: float = 0.5) -> dict[str, Any]:
    """Where one prompt's prefill forward (batch 1, eager, as a prefill worker runs it) spends its time:
    the host's time to enqueue it, the GPU's time between events around it, and the wall time to the
    result, back to back (``hot``) and after ``idle_s`` of an idle GPU (``idle``: what a lone request
    meets); then the kernels of one forward (count, summed GPU time) and its host profile (cProfile)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    orig = runner.forward
    rec: dict[str, float] = {}

    def timed(fb: Any) -> Any:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        out = orig(fb)
        e1.record()
        rec["host_ms"] = (time.perf_counter() - t0) * 1e3
        rec["events"] = (e0, e1)  # type: ignore[assignment]
        return out

    def one(gen: torch.Generator) -> dict[str, float]:
        drv = DecodeDriver(runner, 1)
        try:
            t0 = time.perf_counter()
            ids = drv.prefill(prompt_len, gen)
            ids.tolist()
            wall = (time.perf_counter() - t0) * 1e3
        finally:
            drv.free()
        e0, e1 = rec["events"]  # type: ignore[misc]
        return {"wall_ms": wall, "host_ms": rec["host_ms"], "gpu_ms": e0.elapsed_time(e1)}

    def med(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}

    runner.forward = timed
    out: dict[str, Any] = {"prompt_len": prompt_len}
    try:
        gen = torch.Generator().manual_seed(prompt_len)
        for _ in range(2):
            one(gen)
        torch.cuda.synchronize()
        out["hot"] = med([one(gen) for _ in range(repeats)])
        idle = []
        for _ in range(repeats):
            time.sleep(idle_s)
            idle.append(one(gen))
        out["idle"] = med(idle)
        out["idle_all"] = idle
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one(gen)
            torch.cuda.synchronize()
        cuda_type = torch.autograd.DeviceType.CUDA
        kernels: dict[str, list[float]] = {}
        for ev in prof.events():
            if getattr(ev, "device_type", cuda_type) != cuda_type or not ev.key:
                continue
            tr = getattr(ev, "time_range", None)
            if tr is not None:
                kernels.setdefault(ev.key[:70], []).append(tr.end - tr.start)
        out["kernel_count"] = sum(len(v) for v in kernels.values())
        out["kernel_ms"] = sum(sum(v) for v in kernels.values()) / 1e3
        out["top_kernels"] = sorted(
            ({"kernel": k, "calls": len(v), "ms": sum(v) / 1e3} for k, v in kernels.items()), key=lambda r: -r["ms"]
        )[:12]
        cp = cProfile.Profile()
        cp.enable()
        one(gen)
        cp.disable()
        buf = io.StringIO()
        pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(20)
        out["host_profile"] = buf.getvalue()[-5000:]
    finally:
        runner.forward = orig
    return out


# --- quantization variants side by side ---------------------------------------------------------
# config.json quantization_config of each --variants entry (the dummy loader makes FP8 weights of that format;
# docs/quantization.md "--load-format dummy"); "bf16": none
QUANT_VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "bf16": None,
    "fp8_channel": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    "fp8_block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "fp8_static": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"},
}


def prefill_ms(runner: Any, prompt_len: int, repeats: int = 3) -> float:
    """Wall milliseconds of one batch-1 prefill forward of ``prompt_len`` tokens (best of ``repeats``)."""
    best = float("inf")
    for i in range(repeats + 1):
        drv = DecodeDriver(runner, 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        drv.prefill(prompt_len, torch.Generator().manual_seed(i))
        torch.cuda.synchronize()
        if i:  # the first one warms up
            best = min(best, time.perf_counter() - t0)
        drv.free()
    return best * 1e3


def variants_main(args: argparse.Namespace) -> int:
    """``--variants bf16,fp8_channel,fp8_block``: one dummy-weight runner per variant at ``--shape`` (with
    ``--quantization``, if given, passed to every FP8-less variant), each measured the same way: CUDA-graph
    decode tok/s at ``--batch-sizes`` (batch 1 against its roofline: weight bytes read per step (every
    weight but the embedding table) + KV bytes, at the measured copy bandwidth) and the prefill time of each
    ``--prefill-lens`` prompt (default 4096).  Writes ``decode_latency_variants.{json,md}``."""
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in QUANT_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; known: {sorted(QUANT_VARIANTS)}")
    bs_list = [int(x) for x in args.batch_sizes.split(",") if x]
    prefill_lens = [int(x) for x in (args.prefill_lens or "4096").split(",") if x]
    hbm = copy_bandwidth()
    res: dict[str, Any] = {"env": environment(), "shape": args.shape, "hbm_TBps": hbm / 1e12, "variants": []}
    tmp = tempfile.mkdtemp(prefix="kvship-bench-")
    ctx = max(args.input_len + args.output_len, max(prefill_lens)) + 8
    max_bs = max(bs_list)
    for name in names:
        qc = QUANT_VARIANTS[name]
        model_dir = write_model_dir(args.shape, os.path.join(tmp, name), **({"quantization_config": qc} if qc else {}))
        runner = ModelRunner(
            ServerArgs(
                model_path=model_dir,
                load_format="dummy",
                device="cuda",
                dtype="bfloat16",
                attention_backend=args.attention_backend,
                page_size=args.page_size,
                context_length=ctx,
                max_total_tokens=max_bs * (args.input_len + args.output_len + 8 + args.page_size) + ctx + 4096,
                max_running_requests=max_bs,
                cuda_graph_max_bs=max_bs,
                quantization=None if qc else args.quantization,
                prefill_graph_max_tokens=args.prefill_graph_max_tokens,
            )
        )
        mc = runner.model_config
        embed = mc.vocab_size * mc.hidden_size * 2
        # an FP8 expert weight is one byte an element (+ a float32 scale per 128 x 128 block, per row otherwise)
        elem = 2.0 if not qc else 1.0 + (4.0 / (128 * 128) if qc.get("weight_block_size") else 4.0 / mc.hidden_size)
        weight_read = step_weight_bytes(mc, runner.weight_bytes, elem=elem) - embed
        kv = (args.input_len + args.output_len / 2) * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4
        row: dict[str, Any] = {
            "variant": name + ("+quantization=" + args.quantization if args.quantization and not qc else ""),
            "quantization": mc.quantization,
            "weight_GB": runner.weight_bytes / 1e9,
            "weight_read_GB": weight_read / 1e9,
            "roofline_tok_s": hbm / (weight_read + kv),
            "decode": {},
            "prefill_ms": {},
        }
        for bs in bs_list:
            r = engine_decode(runner, bs, args.input_len, args.output_len, "graph")
            row["decode"][bs] = r["decode_tok_s"]
            # the device's own step (graph replays back to back): what the loop's host work hides or adds
            replay = graph_replay_ms(runner, bs, args.input_len) if runner.cuda_graph_runner is not None else None
            row.setdefault("replay_ms", {})[bs] = replay
            logger.info(
                "%s bs %d: %.1f tok/s (%.3f ms/step; graph replay alone %s ms)",
                name, bs, r["decode_tok_s"], r["step_ms"], f"{replay:.3f}" if replay is not None else "-",
            )  # fmt: skip
            if "graph+overlap" in args.modes.split(","):
                o = engine_decode(runner, bs, args.input_len, args.output_len, "graph+overlap")
                row.setdefault("decode_overlap", {})[bs] = o["decode_tok_s"]
                logger.info("%s bs %d graph+overlap: %.1f tok/s", name, bs, o["decode_tok_s"])
        for bs in [int(x) for x in args.profile_bs.split(",") if x and int(x) in bs_list]:
            if runner.cuda_graph_runner is None:
                break
            rows = kernel_profile(runner, bs, args.input_len)
            row.setdefault("profile", {})[bs] = rows
            for k in rows[:10] + [x for x in rows if x.get("kernel", "").startswith("TOTAL")]:
                if "us_per_step" in k:
                    logger.info("%s bs %d kernel %-90s %8.1f us/step x%.0f", name, bs, k["kernel"], k["us_per_step"],
                                k["calls_per_step"])  # fmt: skip
        if 1 in row["decode"]:
            row["bs1_pct_roofline"] = 100 * row["decode"][1] / row["roofline_tok_s"]
        for n in prefill_lens:
            row["prefill_ms"][n] = prefill_ms(runner, n)
            logger.info("%s prefill %d: %.2f ms", name, n, row["prefill_ms"][n])
        res["variants"].append(row)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    base = res["variants"][0]
    lines = [
        f"# {args.shape}: quantization variants ({res['env']['gpu']}; copy bandwidth {hbm / 1e12:.2f} TB/s)",
        "",
        "| variant | weights GB (read/step) | bs1 tok/s | roofline tok/s | % roofline | "
        + " | ".join(f"bs{b} tok/s" for b in bs_list if b != 1)
        + " | "
        + " | ".join(f"prefill {n} ms" for n in prefill_lens)
        + f" | bs1 x {base['variant']} |",
        "|---" * (6 + len([b for b in bs_list if b != 1]) + len(prefill_lens)) + "|",
    ]
    for v in res["variants"]:
        cells = [
            v["variant"],
            f"{v['weight_GB']:.2f} ({v['weight_read_GB']:.2f})",
            f"{v['decode'].get(1, float('nan')):.1f}",
            f"{v['roofline_tok_s']:.1f}",
            f"{v.get('bs1_pct_roofline', float('nan')):.0f}%",
        ]
        cells += [f"{v['decode'][b]:.0f} ({v['decode'][b] / base['decode'][b]:.2f}x)" for b in bs_list if b != 1]
        cells += [f"{v['prefill_ms'][n]:.1f} ({v['prefill_ms'][n] / base['prefill_ms'][n]:.2f}x)" for n in prefill_lens]
        cells.append(f"{v['decode'].get(1, 0) / base['decode'].get(1, 1):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for v in res["variants"]:  # the device's step alone, and the loop with the host work overlapped
        extra = [f"bs{b} replay {ms:.3f} ms" for b, ms in v.get("replay_ms", {}).items() if ms is not None]
        extra += [
            f"bs{b} overlap {t:.0f} tok/s ({t / base['decode_overlap'][b]:.2f}x)"
            for b, t in v.get("decode_overlap", {}).items() if b in base.get("decode_overlap", {})
        ]  # fmt: skip
        if extra:
            lines.append(f"* {v['variant']}: " + "; ".join(extra))
    md = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_latency_variants.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "decode_latency_variants.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


# --- transformers baseline -----------------------------------------------------------------
def hf_generate(
    shape: str,
    bs_list: list[int],
    input_len: int,
    output_len: int,
    out: list[dict[str, Any]],
    on_result: Callable[[], None],
) -> None:
    """Append one result per batch size to ``out`` (calling ``on_result`` after each)."""
    import transformers

    cfg = dict(SHAPES[shape])
    cls_name = cfg.pop("architectures")[0]
    cfg.pop("model_type")
    cfg.pop("torch_dtype")
    conf_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3ForCausalLM": transformers.Qwen3Config}[cls_name]
    config = conf_cls(**cfg)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = getattr(transformers, cls_name)(config)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(torch.bfloat16).eval()
    for bs in bs_list:
        gen = torch.Generator().manual_seed(bs)
        ids = torch.randint(3, config.vocab_size, (bs, input_len), generator=gen).cuda()
        mask = torch.ones_like(ids)
        kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids[:, :16], max_new_tokens=2, min_new_tokens=2, **kw)  # warm up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
            torch.cuda.synchronize()
            total_s = time.perf_counter() - t0
        assert res.shape[1] == input_len + output_len
        decode_s = max(total_s - prefill_s, 1e-9)
        out.append(
            {
                "batch": bs,
                "prefill_s": prefill_s,
                "total_s": total_s,
                "decode_tok_s": bs * (output_len - 1) / decode_s,
                "end_to_end_tok_s": bs * output_len / total_s,
            }
        )
        logger.info("transformers bs %d: %.1f decode tok/s", bs, out[-1]["decode_tok_s"])
        on_result()
    del model
    gc.collect()
    torch.cuda.empty_cache()


# --- report --------------------------------------------------------------------------------
def markdown(res: dict[str, Any]) -> str:
    env, a = res["env"], res.get("attention", [])
    lines = [
        f"GPU: {env['gpu']} (driver {env['driver']}), torch {env['torch']} (CUDA {env['cuda']}), "
        f"flashinfer {env['flashinfer']}, triton {env['triton']}, transformers {env['transformers']}.",
        f"Model shape: {res['shape']} ({res['weight_gb']:.2f} GB bf16 dummy weights), input {res['input_len']} / "
        f"output {res['output_len']}, attention backend {res['backend']}, page size {res['page_size']}.",
        f"Measured device copy bandwidth: {res['hbm_TBps']:.2f} TB/s (read + write counted).",
        "",
    ]
    hf = {r["batch"]: r for r in res.get("hf", [])}
    eng: dict[tuple[int, str], dict[str, Any]] = {(r["batch"], r["mode"]): r for r in res.get("engine", [])}
    order = ("graph", "graph+overlap", "sched", "sched+overlap", "sched+overlap+kmajor", "sched+kmajor", "eager")
    modes = [m for m in order if any(k[1] == m for k in eng)]
    modes += sorted({k[1] for k in eng} - set(modes))
    ratios: dict[str, float] = {}  # default mode over its variant (same batch, same run)
    for m in [m for m in modes if "+" in m and m.rsplit("+", 1)[0] in modes]:
        base = m.rsplit("+", 1)[0]
        for bs in sorted({k[0] for k in eng}):
            if (bs, m) in eng and (bs, base) in eng:
                ratios[f"{bs}:{base} / {m}"] = eng[(bs, base)]["decode_tok_s"] / eng[(bs, m)]["decode_tok_s"]
    head = (
        "| batch | "
        + " | ".join(f"ours {m} tok/s" for m in modes)
        + " | transformers tok/s | graph / eager | "
        + " | ".join(f"{m} / transformers" for m in modes if m != "eager")
        + " |"
    )
    lines += [head, "|" + "---|" * (len(modes) + 3 + len([m for m in modes if m != "eager"]))]
    for bs in sorted({k[0] for k in eng}):
        cells = [f"{eng[(bs, m)]['decode_tok_s']:.1f}" if (bs, m) in eng else "-" for m in modes]
        g, e, h = eng.get((bs, "graph")), eng.get((bs, "eager")), hf.get(bs)
        hf_cell = f"{h['decode_tok_s']:.1f}" if h else "-"
        ratio_ge = f"{g['decode_tok_s'] / e['decode_tok_s']:.2f}x" if g and e else "-"
        vs_hf = [
            f"{eng[(bs, m)]['decode_tok_s'] / h['decode_tok_s']:.1f}x" if (bs, m) in eng and h else "-"
            for m in modes
            if m != "eager"
        ]
        lines.append(f"| {bs} | " + " | ".join(cells) + f" | {hf_cell} | {ratio_ge} | " + " | ".join(vs_hf) + " |")
    if ratios:
        lines += [
            "",
            "Side by side in this run (same batch, tok/s ratio): "
            + "; ".join(f"batch {k.split(':', 1)[0]} {k.split(':', 1)[1]} = {v:.3f}x" for k, v in ratios.items()),
        ]
    if "roofline" in res:
        rf = res["roofline"]
        lines += [
            "",
            f"Batch-1 roofline: {rf['bytes_per_step_GB']:.2f} GB per step (weights {rf.get('weight_read_GB', rf['weight_GB']):.2f} + "
            f"KV {rf['kv_GB']:.3f}) / {res['hbm_TBps']:.2f} TB/s = {rf['roofline_tok_s']:.1f} tok/s; "
            f"ours (best CUDA-graph mode, {rf.get('best_mode', '?')}) {rf['ours_tok_s']:.1f} tok/s = {rf['fraction']:.1%} of the roofline.",
        ]
    for x in a:
        lines += [
            f"FlashInfer decode kernel alone, batch {x['batch']} x {x['context']} ctx, page {x['page_size']}: "
            f"{x['kernel_alone_us']:.1f} us, KV read {x['kernel_kv_TBps']:.2f} TB/s = {x['kernel_frac_hbm']:.1%} "
            f"of measured HBM; our attention step {x['ours_layer_us']:.1f} us + plan {x['plan_us']:.1f} us per "
            f"step (/{x['layers']} layers) = {x['ours_vs_kernel']:.2f}x the kernel alone."
        ]
    for x in res.get("small_m_gemm", []):
        lines.append(
            f"Batch-1 {x['layer']} [{x['n']}x{x['k']}]: F.linear {x['linear_us']:.1f} us "
            f"({x['linear_frac_hbm']:.0%} of HBM), torch.mv {x['mv_us']:.1f} us ({x['mv_frac_hbm']:.0%}), "
            f"x @ W^T-contiguous {x['x@wt_us']:.1f} us ({x['x@wt_frac_hbm']:.0%})."
        )
    for x in res.get("decode_kernels", []):
        lines.append(
            f"FlashInfer decode alone (per layer, in a CUDA graph), batch {x['batch']} x {x['context']} ctx, "
            f"page 1: tensor cores {x['tensor_cores_us']:.1f} us, CUDA cores {x['cuda_cores_us']:.1f} us; "
            f"without KV split: tensor cores {x.get('tensor_cores_no_split_us', float('nan')):.1f} us, "
            f"CUDA cores {x.get('cuda_cores_no_split_us', float('nan')):.1f} us."
        )
    return "\n".join(lines) + "\n"


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """``NAME:ENV=VAL[,ENV=VAL]:MODE[;MODE...]`` -> (name, env, modes), e.g. ``cublas:A=1:sched+overlap``."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0]:
        raise SystemExit(f"--variant {spec!r}: expected NAME:ENV=VAL[,ENV=VAL]:MODES")
    env: dict[str, str] = {}
    for kv in parts[1].split(","):
        if "=" not in kv:
            raise SystemExit(f"--variant {spec!r}: {kv!r} is not ENV=VAL")
        k, v = kv.split("=", 1)
        env[k] = v
    modes = [m for m in parts[2].split(";") if m]
    return parts[0], env, modes


def tp_bench(rank: int, args: argparse.Namespace, init_method: str) -> Optional[dict[str, Any]]:
    """``--tp-size N``: rank ``rank``'s part of the decode loops (every rank runs the same steps, so the
    all-reduces pair up); rank 0 returns the results.  Only the runner's eager / graph modes run."""
    from kvship.engine.config import ServerArgs
    from kvship.engine.distributed.launch import join
    from kvship.engine.distributed.topology import Topology
    from kvship.engine.model_runner import ModelRunner

    bs_list = [int(x) for x in args.batch_sizes.split(",") if x]
    modes = [m for m in args.modes.split(",") if m and not m.startswith("sched")]
    ctx = args.input_len + args.output_len + 8
    runner_args = ServerArgs(
        model_path=write_model_dir(args.shape, tempfile.mkdtemp(prefix=f"kvship-bench-tp{rank}-")),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        context_length=ctx,
        max_total_tokens=max(bs_list) * (ctx + args.page_size) + 4096,
        max_running_requests=max(bs_list),
        cuda_graph_max_bs=max(bs_list),
        disable_cuda_graph=not any(m.startswith("graph") for m in modes),
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        ep_dispatch=args.ep_dispatch,
        base_gpu_id=args.base_gpu_id,
    )
    # tp_size 1 without --force-tp-group: the plain single-GPU runner (tp_main's same-run baseline)
    topology = Topology(tp_size=args.tp_size, ep_size=args.ep_size, rank=rank, base_gpu_id=args.base_gpu_id)
    groups = join(runner_args, topology, init_method) if args.tp_size > 1 or args.force_tp_group else None
    runner = ModelRunner(runner_args, groups=groups)
    res: dict[str, Any] = {
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "ep_dispatch": args.ep_dispatch,
        "weight_gb_per_rank": runner.weight_bytes / 1e9,
        "engine": [],
    }
    for bs in bs_list:
        for mode in modes:
            r = engine_decode(runner, bs, args.input_len, args.output_len, mode)
            res["engine"].append(r)
            if rank == 0:
                logger.info(
                    "tp %d bs %d %s: %.1f tok/s (%.2f ms/step)", args.tp_size, bs, mode, r["decode_tok_s"], r["step_ms"]
                )
    if runner.cuda_graph_runner is not None:  # every rank profiles the same steps, so the collectives pair up
        for bs in [int(x) for x in args.profile_bs.split(",") if x and int(x) in bs_list]:
            rows = kernel_profile(runner, bs, args.input_len)
            res.setdefault("profile", {})[str(bs)] = rows
            coll = [r for r in rows if r["kernel"] == "COLLECTIVES"]
            total = next(r["us_per_step"] for r in rows if r["kernel"] == "TOTAL (all kernels)")
            res.setdefault("collectives", {})[str(bs)] = {
                "us_per_step": coll[0]["us_per_step"] if coll else 0.0,
                "calls_per_step": coll[0]["calls_per_step"] if coll else 0,
                "kernels_us_per_step": total,
            }
    mc = runner.model_config
    graphed = [r for r in res["engine"] if r["batch"] == 1 and r["mode"] != "eager"]
    if graphed:  # per rank: its weight shard and its KV heads, against one GPU's copy bandwidth
        avg_ctx = args.input_len + args.output_len / 2
        kv = avg_ctx * mc.num_hidden_layers * runner.num_kv_heads * mc.head_dim * 2 * 2
        step_bytes = step_weight_bytes(mc, runner.weight_bytes, tp_size=args.tp_size, ep_size=args.ep_size) + kv
        best = max(r["decode_tok_s"] for r in graphed)
        res["roofline_per_rank"] = {"bytes_per_step_GB": step_bytes / 1e9, "ours_tok_s": best}
    return res if rank == 0 else None


def _tp_rank_main(rank: int, argv: Optional[list[str]], init_method: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    tp_bench(rank, parse_args(argv), init_method)


def _baseline_main(argv: Optional[list[str]], out: Any) -> None:
    """The same loops on one GPU with the plain runner (no group): ``tp_main``'s baseline, in its own process so
    its memory is gone before the ranks load."""
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    args.tp_size, args.ep_size, args.force_tp_group = 1, 1, False
    try:
        out.put(tp_bench(0, args, ""))
    except BaseException as e:  # noqa: BLE001 - the TP run goes on without its baseline, and says why
        logger.exception("the one-GPU baseline failed")
        out.put({"error": repr(e)})
        raise


def side_by_side(base: dict[str, Any], res: dict[str, Any]) -> str:
    """Markdown: every (batch, mode) of the TP run beside the one-GPU baseline of the same run, with the ratio
    and the collectives' GPU time per step from the kernel profile (NCCL and the peer-memory all-reduce)."""
    n, ep = res["tp_size"], res.get("ep_size", 1)
    label = f"TP={n}" + (f" EP={ep}" if ep > 1 else "")
    lines = [
        f"| batch | mode | 1 GPU tok/s | {label} tok/s | {label} / 1 GPU | {label} ms/step | collectives us/step (share) |",
        "|---|---|---|---|---|---|---|",
    ]
    one = {(r["batch"], r["mode"]): r for r in base.get("engine", [])}
    for r in res.get("engine", []):
        b = one.get((r["batch"], r["mode"]))
        coll = (res.get("collectives") or {}).get(str(r["batch"])) if r["mode"] != "eager" else None
        cs = f"{coll['us_per_step']:.0f} ({coll['us_per_step'] / coll['kernels_us_per_step']:.0%})" if coll else "-"
        lines.append(
            f"| {r['batch']} | {r['mode']} | {b['decode_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}x | {r['step_ms']:.3f} | {cs} |"
            if b
            else f"| {r['batch']} | {r['mode']} | - | {r['decode_tok_s']:.1f} | - | {r['step_ms']:.3f} | {cs} |"
        )
    return "\n".join(lines)


def tp_main(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    """``--tp-size N`` > 1: ranks 1..N-1 spawned here, rank 0 in this process; writes ``decode_latency_tp<N>.json``.
    Unless ``--no-baseline``, the same loops run first on one GPU (plain runner) and the table puts them side by
    side."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    base: dict[str, Any] = {}
    if args.baseline and args.tp_size > 1:
        q = ctx.Queue()
        p = ctx.Process(target=_baseline_main, args=(argv, q))
        p.start()
        base = q.get(timeout=3600) or {}
        p.join(120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_tp_rank_main, args=(r, argv, init_method)) for r in range(1, args.tp_size)]
    for p in procs:
        p.start()
    try:
        res = tp_bench(0, args, init_method) or {}
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    hbm = copy_bandwidth()
    res.update(
        env=environment(), shape=args.shape, input_len=args.input_len, output_len=args.output_len, hbm_TBps=hbm / 1e12
    )
    if base:
        res["baseline_1gpu"] = base
    roof = res.get("roofline_per_rank")
    if roof:
        roof["roofline_tok_s"] = hbm / (roof["bytes_per_step_GB"] * 1e9)
        roof["fraction"] = roof["ours_tok_s"] / roof["roofline_tok_s"]
    os.makedirs(args.out, exist_ok=True)
    ep = f"_ep{args.ep_size}" if args.ep_size > 1 else ""
    with open(os.path.join(args.out, f"decode_latency_tp{args.tp_size}{ep}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    for r in res.get("engine", []):
        print(
            f"tp {args.tp_size} bs {r['batch']:4d} {r['mode']:14s} {r['decode_tok_s']:10.1f} tok/s {r['step_ms']:8.3f} ms/step"
        )
    if roof:
        print(f"bs 1 per-rank roofline fraction: {roof['fraction']:.1%}")
    if base:
        md = side_by_side(base, res)
        print(md)
        with open(os.path.join(args.out, f"decode_latency_tp{args.tp_size}{ep}.md"), "w") as f:
            f.write(f"{args.shape}, dummy bf16 weights, {res['env'].get('gpu', '')}\n\n{md}\n")
    return 0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """The parser's namespace with the shape-dependent defaults filled in (every process of a run: the TP
    ranks and the one-GPU baseline re-parse ``argv``)."""
    args = build_parser().parse_args(argv)
    mla = "kv_lora_rank" in SHAPES[args.shape]
    if args.attention_backend is None:
        args.attention_backend = "triton" if mla else "flashinfer"
    elif mla and args.attention_backend == "flashinfer":
        raise SystemExit(f"{args.shape} is an MLA shape: its attention runs with --attention-backend triton")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.device == "cpu":
        return cpu_main(args)
    if not torch.cuda.is_available():
        print("decode_latency needs a CUDA GPU (--device cpu: the scheduler-phase timings alone)", file=sys.stderr)
        return 2
    if args.variants:
        return variants_main(args)
    if args.tp_size > 1 or args.force_tp_group:
        return tp_main(args, argv)
    return single_gpu_main(args)


# ``--device cpu``: a small model of ``--shape``'s architecture (dummy float32 weights)
_CPU_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
)


def cpu_main(args: argparse.Namespace) -> int:
    """``--device cpu``: the scheduler-phase timings (``sched_gap_profile`` under the host profiler and
    ``sched_step_events``, both through the scheduler's ``StepPhase`` events) of a small model on the CPU, at
    each of ``--gap-profile-bs`` (default: ``--batch-sizes``).  Device figures need the GPU."""
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    bs_list = [int(x) for x in (args.gap_profile_bs or args.batch_sizes).split(",") if x]
    ctx = args.input_len + 64 + 8
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or write_model_dir(args.shape, tmp, **_CPU_SHAPE)
        runner = ModelRunner(
            ServerArgs(
                model_path=model_path,
                load_format="auto" if args.model_path else "dummy",
                device="cpu",
                dtype="float32",
                page_size=args.page_size,
                context_length=max(ctx, 256),
                max_total_tokens=max(bs_list) * (ctx + args.page_size) + 1024,
                max_running_requests=max(bs_list),
            )
        )
        res: dict[str, Any] = {"device": "cpu", "model": args.model_path or f"{args.shape} at {_CPU_SHAPE}"}
        res["cpu"] = platform.processor() or platform.machine()
        res["step_events"], res["gap_profile"] = [], []
        for bs in bs_list:
            ev = sched_step_events(runner, bs, args.input_len, steps=16)
            gp = sched_gap_profile(runner, bs, args.input_len, steps=8)
            res["step_events"].append(ev)
            res["gap_profile"].append(gp)
            print(
                f"bs {bs}: {ev['step_ms']:.3f} ms/step; host phases ms "
                f"{json.dumps({k: round(v, 3) for k, v in ev['host_phase_ms'].items()})}; under the profiler "
                f"{gp['step_ms_under_profiler']:.3f} ms/step, phases us/step "
                f"{json.dumps({k: round(v, 1) for k, v in gp['host_phase_us_per_step'].items()})}"
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_latency_cpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: only the scheduler-phase timings, of a small model (--model-path to pick one)",
    )
    ap.add_argument("--model-path", default=None, help="--device cpu: an HF folder instead of a small --shape")
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (one GPU each, from --base-gpu-id): runs only the runner's eager/graph "
        "decode loops and writes decode_latency_tp<N>.json",
    )
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument(
        "--force-tp-group",
        action="store_true",
        help="at --tp-size 1: run the tensor-parallel code path anyway (a world-size-1 NCCL group: parallel "
        "layers, NCCL all-reduce in the CUDA graphs) to compare with the plain path on one GPU",
    )
    ap.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="with --tp-size N and an MoE --shape (qwen3-30b-a3b): experts split this many ways "
        "(writes decode_latency_tp<N>_ep<E>.json)",
    )
    ap.add_argument("--ep-dispatch", default="all_reduce", choices=("all_reduce", "static", "all_to_all"))
    ap.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tp-size N > 1: run the same loops on one GPU first and print both side by side",
    )
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument(
        "--attention-backend",
        default=None,
        choices=("flashinfer", "triton"),
        help="default: flashinfer; triton for an MLA shape (deepseek-*), which has no FlashInfer path",
    )
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument(
        "--modes",
        default="graph,eager",
        help="comma list of graph, eager, graph+overlap (runner loop), sched, sched+overlap "
        "(the real Scheduler with CUDA graphs, overlap scheduling off / on)",
    )
    ap.add_argument(
        "--kmajor-modes",
        default="",
        help="modes to run again on a runner with K-major Linear weights (KVSHIP_K_MAJOR_WEIGHTS=1)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:ENV=VAL[,ENV=VAL]:MODES",
        help="run MODES (;-separated list, e.g. sched+overlap;graph) again on a runner built with these "
        "environment variables set; rows get the suffix +NAME (repeatable).  Example: "
        "cublas:KVSHIP_DISABLE_SKINNY_GEMM=1:sched+overlap",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of " + ",".join(QUANT_VARIANTS) + ": one dummy-weight runner each (bf16, FP8 formats), "
        "side by side: graph decode tok/s at --batch-sizes (and graph+overlap where --modes names it; the graph "
        "replay alone; the kernels of --profile-bs), batch 1 vs its roofline, prefill of --prefill-lens "
        "(default 4096); writes decode_latency_variants.{json,md}",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        help="--quantization of the runner (e.g. fp8: the dummy bf16 weights quantized per channel at load); "
        "with --variants it applies to the variants without an FP8 config",
    )
    ap.add_argument("--hf-batch-sizes", default=None, help="transformers baseline batches (default: --batch-sizes)")
    ap.add_argument("--hf-output-len", type=int, default=None, help="default: --output-len")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument(
        "--decode-kernels-only",
        action="store_true",
        help="of the attention measurements, run only FlashInfer's decode kernel variants",
    )
    ap.add_argument("--profile-bs", default="1,64", help="batch sizes to profile (empty: none)")
    ap.add_argument("--host-profile-bs", default="", help="batch sizes whose eager steps run under cProfile")
    ap.add_argument(
        "--sched-repeats",
        type=int,
        default=1,
        help="timed runs of each sched mode; the row is their median (all kept as runs_tok_s)",
    )
    ap.add_argument(
        "--gap-profile-bs",
        default="",
        help="batch sizes whose overlapped scheduler steps run under the host+device profiler (where the GPU "
        "idles between steps), with the pure graph-replay step time beside them",
    )
    ap.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=2048,
        help="the runner's --prefill-graph-max-tokens (prefill timings run with and without the graphs)",
    )
    ap.add_argument(
        "--prefill-lens",
        default="",
        help="prompt lengths whose batch-1 prefill forward is timed (host enqueue, GPU, wall; hot and after an "
        "idle GPU) and profiled, before the decode modes",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap


def single_gpu_main(args: argparse.Namespace) -> int:
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    bs_list = [int(x) for x in args.batch_sizes.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    res: dict[str, Any] = {
        "env": environment(),
        "shape": args.shape,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "backend": args.attention_backend,
        "page_size": args.page_size,
    }
    os.makedirs(args.out, exist_ok=True)

    def save() -> None:
        with open(os.path.join(args.out, "decode_latency.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    res["hbm_TBps"] = copy_bandwidth() / 1e12
    logger.info("device copy bandwidth %.2f TB/s", res["hbm_TBps"])
    tmp = tempfile.mkdtemp(prefix="kvship-bench-")
    if args.decode_kernels_only and args.attention_backend == "flashinfer":
        res["decode_kernels"] = decode_kernel_choice(args.shape)
        for x in res["decode_kernels"]:
            logger.info("decode kernels: %s", x)
        save()
    elif not args.skip_attention and args.attention_backend == "flashinfer":
        one_layer = write_model_dir(args.shape, tmp, num_hidden_layers=1)
        res["attention"] = []
        for ps in (16, 1):
            try:
                res["attention"].append(
                    attention_bench(
                        one_layer, 64, 2048, ps, res["hbm_TBps"] * 1e12, SHAPES[args.shape]["num_hidden_layers"]
                    )
                )
                logger.info("attention: %s", res["attention"][-1])
            except Exception as e:  # noqa: BLE001 - keep the rest of the run
                logger.exception("attention bench (page %d) failed", ps)
                res.setdefault("errors", []).append(f"attention ps{ps}: {e!r}")
        try:
            res["small_m_gemm"] = small_m_gemm(args.shape, res["hbm_TBps"] * 1e12)
            logger.info("batch-1 projections: %s", res["small_m_gemm"])
        except Exception as e:  # noqa: BLE001
            logger.exception("small-M GEMM comparison failed")
            res.setdefault("errors", []).append(f"small-M GEMM: {e!r}")
        try:
            res["decode_kernels"] = decode_kernel_choice(args.shape)
            logger.info("decode kernels: %s", res["decode_kernels"])
        except Exception as e:  # noqa: BLE001
            logger.exception("decode kernel comparison failed")
            res.setdefault("errors", []).append(f"decode kernels: {e!r}")
        save()

    model_dir = write_model_dir(args.shape, tmp)
    max_bs = max(bs_list)
    ctx = args.input_len + args.output_len + 8
    runner_args = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        context_length=ctx,
        max_total_tokens=max_bs * (ctx + args.page_size) + 4096,
        max_running_requests=max_bs,
        cuda_graph_max_bs=max_bs,
        disable_cuda_graph=not any(m.startswith(("graph", "sched")) for m in modes) and not args.prefill_lens,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        quantization=args.quantization,
    )
    runner = ModelRunner(runner_args)
    res["weight_gb"] = runner.weight_bytes / 1e9
    res["engine"] = []

    def run_modes(runner: Any, run_list: list[str], suffix: str = "") -> None:
        for bs in bs_list:
            for mode in run_list:
                if mode.startswith("sched"):
                    # the median of --sched-repeats timed runs (each after its own warm-up); every run is kept
                    runs = [
                        scheduler_decode(runner, bs, args.input_len, args.output_len, overlap=mode == "sched+overlap")
                        for _ in range(max(1, args.sched_repeats))
                    ]
                    r = dict(sorted(runs, key=lambda x: x["decode_tok_s"])[len(runs) // 2])
                    if len(runs) > 1:
                        r["runs_tok_s"] = [round(x["decode_tok_s"], 1) for x in runs]
                else:
                    r = engine_decode(runner, bs, args.input_len, args.output_len, mode)
                r["mode"] += suffix
                logger.info(
                    "ours bs %d %s: %.1f tok/s (%.2f ms/step)%s",
                    bs,
                    r["mode"],
                    r["decode_tok_s"],
                    r["step_ms"],
                    f", median of {r['runs_tok_s']}" if "runs_tok_s" in r else "",
                )
                res["engine"].append(r)
                save()

    profile_bs = [int(x) for x in args.profile_bs.split(",") if x]

    def profile_runner(runner: Any, suffix: str) -> None:
        if not profile_bs or runner.cuda_graph_runner is None:
            return
        prof = res.setdefault("profile", {})
        for bs in profile_bs:
            try:
                prof[f"{bs}{suffix}"] = kernel_profile(runner, bs, args.input_len)
            except Exception as e:  # noqa: BLE001
                res.setdefault("errors", []).append(f"profile bs{bs}{suffix}: {e!r}")
        save()

    prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x]
    if prefill_lens:
        clock_log = os.path.join(tempfile.mkdtemp(), "clocks.csv")
        sampler = _gpu_clock_sampler(clock_log)
        res["prefill"] = []
        pg = getattr(runner, "prefill_graph_runner", None)
        variants = ["graphs", "eager"] if pg is not None else ["eager"]
        for n, variant in [(n, v) for n in prefill_lens for v in variants]:
            try:
                runner.prefill_graph_runner = pg if variant == "graphs" else None
                res["prefill"].append(dict(prefill_timing(runner, n), variant=variant))
                p = res["prefill"][-1]
                print(
                    f"prefill {n} {variant}: hot wall {p['hot']['wall_ms']:.2f} ms (host enqueue {p['hot']['host_ms']:.2f}, "
                    f"GPU {p['hot']['gpu_ms']:.2f}); after idle wall {p['idle']['wall_ms']:.2f} ms (host "
                    f"{p['idle']['host_ms']:.2f}, GPU {p['idle']['gpu_ms']:.2f}); {p['kernel_count']} kernels, "
                    f"{p['kernel_ms']:.2f} ms busy"
                )
                for k in p["top_kernels"][:8]:
                    print(f"    x{k['calls']:<4d} {k['ms']:8.3f} ms  {k['kernel']}")
                print(p["host_profile"][:2500])
            except Exception as e:  # noqa: BLE001
                logger.exception("prefill timing %d failed", n)
                res.setdefault("errors", []).append(f"prefill {n}: {e!r}")
            finally:
                runner.prefill_graph_runner = pg
        if sampler is not None:
            sampler.terminate()
            sampler.wait()
            res["prefill_clocks"] = _clock_summary(clock_log)
            print("SM clocks during the prefill timings:", res["prefill_clocks"])
        save()
    run_modes(runner, modes)
    profile_runner(runner, "")
    for bs in [int(x) for x in args.gap_profile_bs.split(",") if x]:
        try:
            gp = sched_gap_profile(runner, bs, args.input_len)
            gp["graph_replay_ms"] = graph_replay_ms(runner, bs, args.input_len)
            gp["step_events"] = ev = sched_step_events(runner, bs, args.input_len)
            print(
                f"step events bs {bs}: {ev['step_ms']:.3f} ms/step; launch on the device {ev['launch_device_ms']:.3f} "
                f"ms (graph alone {gp['graph_replay_ms']:.3f} ms), launch end -> next launch "
                f"{ev['launch_end_to_next_launch_ms']:.3f} ms, launch period {ev['launch_period_ms']:.3f} ms; host "
                f"phases {json.dumps({k: round(v, 3) for k, v in ev['host_phase_ms'].items()})}"
            )
            res.setdefault("gap_profile", []).append(gp)
            print(
                f"gap profile bs {bs}: graph replay alone {gp['graph_replay_ms']:.3f} ms/step; scheduler under the "
                f"profiler {gp['step_ms_under_profiler']:.3f} ms/step, device span {gp['device_span_us_per_step']:.0f} "
                f"us/step, idle {gp['device_idle_us_per_step']:.0f} us/step ({gp['gaps_over_20us']} gaps > 20 us)"
            )
            for g in gp["largest_gaps"]:
                print(f"    gap {g['us']:7.1f} us before {g['next']}: host {g['host_at_start']} -> {g['host_at_end']}")
            print("    host calls:", json.dumps(gp["host_calls"]))
            print(
                "    host phases us/step:",
                json.dumps({k: round(v, 1) for k, v in gp["host_phase_us_per_step"].items()}),
            )
        except Exception as e:  # noqa: BLE001
            logger.exception("gap profile bs %d failed", bs)
            res.setdefault("errors", []).append(f"gap profile bs{bs}: {e!r}")
        save()
    for bs in [int(x) for x in args.host_profile_bs.split(",") if x]:
        try:
            hp = host_profile(runner, bs, args.input_len)
            res.setdefault("host_profile", []).append(hp)
            print(f"host profile, eager decode bs {bs}: {hp['step_ms_under_profiler']:.2f} ms/step under cProfile")
            print(hp["tottime"][:3500])
        except Exception as e:  # noqa: BLE001
            res.setdefault("errors", []).append(f"host profile bs{bs}: {e!r}")
        save()
    variants = [("kmajor", {"KVSHIP_K_MAJOR_WEIGHTS": "1"}, [m for m in args.kmajor_modes.split(",") if m])]
    variants += [parse_variant(v) for v in args.variant]
    mc, weight_bytes = runner.model_config, runner.weight_bytes
    for name, env_set, vmodes in variants:
        if not vmodes:
            continue
        # a fresh runner built (and its graphs captured) with the variant's environment
        del runner
        gc.collect()
        torch.cuda.empty_cache()
        saved = {k: os.environ.get(k) for k in env_set}
        os.environ.update(env_set)
        try:
            runner = ModelRunner(runner_args)
            run_modes(runner, vmodes, "+" + name)
            profile_runner(runner, "+" + name)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    graphed = [r for r in res["engine"] if r["batch"] == 1 and r["mode"] != "eager"]
    if graphed:
        avg_ctx = args.input_len + args.output_len / 2
        kv = avg_ctx * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2 * 2
        step_bytes = step_weight_bytes(mc, weight_bytes) + kv
        roof = res["hbm_TBps"] * 1e12 / step_bytes
        best_row = max(graphed, key=lambda r: r["decode_tok_s"])
        best = best_row["decode_tok_s"]
        res["roofline"] = {
            "weight_GB": weight_bytes / 1e9,
            "weight_read_GB": step_weight_bytes(mc, weight_bytes) / 1e9,
            "kv_GB": kv / 1e9,
            "best_mode": best_row["mode"],
            "bytes_per_step_GB": step_bytes / 1e9,
            "roofline_tok_s": roof,
            "ours_tok_s": best,
            "fraction": best / roof,
        }
    save()
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        hf_bs = [int(x) for x in (args.hf_batch_sizes or args.batch_sizes).split(",") if x]
        res["hf"] = []
        try:
            hf_generate(args.shape, hf_bs, args.input_len, args.hf_output_len or args.output_len, res["hf"], save)
        except Exception as e:  # noqa: BLE001
            logger.exception("transformers baseline failed")
            res.setdefault("errors", []).append(f"hf: {e!r}")
    save()
    md = markdown(res)
    with open(os.path.join(args.out, "decode_latency.md"), "w") as f:
        f.write(md)
    print(md)
    for bs, rows in (res.get("profile") or {}).items():
        print(f"top kernels, graph decode bs {bs} (runner loop, GPU time per step):")
        tl = rows[-1] if rows and "by_kernel" in rows[-1] else None
        plain = [r for r in rows if "by_kernel" not in r]
        for r in plain[:12] + plain[-1:]:
            print(f"  {r['share']:6.1%} {r['us_per_step']:9.1f} us/step  x{r['calls_per_step']:.0f}  {r['kernel']}")
        if tl:
            print(
                f"  one step: span {tl['us_per_step']:.1f} us, kernels busy {tl['busy_us']:.1f} us, "
                f"idle gaps {tl['gap_us']:.1f} us over {tl['calls_per_step']} kernels"
            )
            for name, d in sorted(tl["by_kernel"].items(), key=lambda kv: -kv[1]["us"] - kv[1]["gap_us"])[:12]:
                print(f"    x{d['calls']:<4d} busy {d['us']:8.1f} us  gaps before {d['gap_us']:7.1f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

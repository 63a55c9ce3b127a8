"""DeepSeek (MLA) benchmark at the DeepSeek-V2-Lite shape, dummy weights, with its baselines measured in the same run.

What one run measures (docs/deepseek.md, "Benchmark"), on one device:

1. copy bandwidth: a large device-to-device copy (bytes read + written);
2. KV tokens per GB: the latent pool (``MLAKVPool``: one row of
   ``kv_lora_rank + qk_rope_head_dim`` per token and layer) against the K/V
   pool of a GQA model of the same hidden size and layer count
   (``--gqa-kv-heads`` x ``--gqa-head-dim``; default half the heads x
   ``hidden / heads``: 8 x 128 at V2-Lite's shape, Qwen3-1.7B's attention), both from the pools' own byte counts (pools of ``--pool-mib`` are
   built and their slots counted);
3. the MLA decode attention alone (the backend's ``forward_decode`` on one
   layer: ``triton`` on CUDA, ``torch_native`` on CPU) at batch ``--kernel-bs`` x
   ``--kernel-ctx`` (default 32 x 8192), as a fraction of the copy bandwidth
   (latent bytes read / time);
4. batch-1 decode over HTTP: ``kvship serve --load-format dummy`` in a child
   process, ``/generate`` with ``--output-len`` new tokens and with one, the
   difference per token against the roofline ``(active weight bytes + latent KV
   bytes at the mean context) / copy bandwidth``; active weights are every
   weight a batch-1 step reads (attention, dense layers, the router, ``top_k``
   routed and the shared experts of each MoE layer, one embedding row, the LM
   head);
5. one MLA layer's extend of ``T`` new tokens (``--extend-new``) over a
   cached prefix of ``--extend-prefix`` positions (default 8192), one request:
   the whole attention block (projections included) with the batch forced
   absorbed and forced decompressed (``ForwardBatch.mla_absorbed_extend``),
   next to the path ``auto`` picks and the cost rule's FLOP ratio
   (``mla_extend_flops``; docs/deepseek.md, "Absorbed or decompressed
   extend"), so a GPU run shows where the measured crossover lies.  On CUDA
   (``triton``), or on a CPU with ``--reduced`` (``torch_native``, a
   self-check); skipped on a CPU otherwise.

``--reduced`` shrinks the shape (3 layers, hidden 256, 8 experts...), the
kernel batch and the context so that the whole run finishes on a CPU in about a
minute; its numbers check the script end to end and mean nothing about a GPU.
Writes ``deepseek.json`` and ``deepseek.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

# decode_latency's CUDA timers (kernel_time, copy_bandwidth) when run from anywhere
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

V2_LITE: dict[str, Any] = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    max_position_embeddings=163840,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=100000,
    eos_token_id=100001,
    torch_dtype="bfloat16",
)
REDUCED = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    bos_token_id=1,
    eos_token_id=2,
)


def write_model_dir(root: str, reduced: bool) -> str:
    """config.json of the shape plus a word-level tokenizer of its vocabulary (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = dict(V2_LITE, **(REDUCED if reduced else {}))
    path = os.path.join(root, "deepseek-v2-lite" + ("-reduced" if reduced else ""))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    vocab = {f"<{i}>": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token="<2>").save_pretrained(path)
    return path


# --- arithmetic ---------------------------------------------------------------------------------------------
def active_weight_bytes(cfg: dict, elem: int = 2) -> int:
    """Weight bytes one batch-1 decode step reads (module docstring, item 4)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_lora = cfg.get("q_lora_rank")
    q = heads * (dn + dr) * (h if not q_lora else q_lora) + (q_lora * h if q_lora else 0)
    attn = q + (r + dr) * h + heads * (dn + dv) * r + h * heads * dv
    dense_mlp = 3 * h * cfg["intermediate_size"]
    moe_i = cfg["moe_intermediate_size"]
    moe = cfg["n_routed_experts"] * h + (cfg["num_experts_per_tok"] + cfg["n_shared_experts"]) * 3 * h * moe_i
    layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    total = layers * attn + dense * dense_mlp + (layers - dense) * moe + h + cfg["vocab_size"] * h
    return total * elem


def latent_bytes_per_token(cfg: dict, elem: int = 2) -> int:
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem


def kv_tokens_per_gb(cfg: dict, gqa_kv_heads: int, gqa_head_dim: int, pool_mib: int) -> dict[str, Any]:
    """Tokens per GB (1e9 bytes) of the latent pool and of a GQA model's K/V pool, from pools actually built."""
    from kvship.engine.mem.mla_pool import MLAKVPool
    from kvship.engine.mem.pools import KVPool

    layers, dt = cfg["num_hidden_layers"], torch.bfloat16
    budget = pool_mib << 20
    mla_bpt = MLAKVPool.bytes_per_token(layers, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], dt)
    gqa_bpt = 2 * layers * gqa_kv_heads * gqa_head_dim * 2
    mla = MLAKVPool(budget // mla_bpt, 1, dt, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], layers, "cpu")
    gqa = KVPool(budget // gqa_bpt, 1, dt, gqa_kv_heads, gqa_head_dim, layers, "cpu")

    def held(pool) -> int:  # bytes of every buffer the pool holds, less its one padding page
        return sum(b.numel() * b.element_size() for b in pool.buffers()) * pool.num_slots // (pool.num_slots + 1)

    out = {
        "mla_bytes_per_token": mla_bpt,
        "gqa_bytes_per_token": gqa_bpt,
        "gqa": f"{layers} layers x {gqa_kv_heads} KV heads x {gqa_head_dim} (K and V)",
        "mla_tokens_per_gb": mla.num_slots * 1e9 / held(mla),
        "gqa_tokens_per_gb": gqa.num_slots * 1e9 / held(gqa),
    }
    out["ratio"] = out["mla_tokens_per_gb"] / out["gqa_tokens_per_gb"]
    return out


# --- measurements -------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def kernel_time(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Seconds per call of a kernel launch: on CUDA ``calls`` launches captured in one CUDA graph (as in a decode
    step; a host-timed single launch would add the launch and the synchronisation, tens of microseconds, to a
    kernel of ~100), elsewhere ``timed``."""
    if device.type != "cuda":
        return timed(fn, device, iters)
    from decode_latency import graph_time

    return graph_time(lambda i: fn(), calls=max(iters, 10))


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second of a device copy (read + written): CUDA-event timed on a GPU (a graph's copy node may run
    on a copy engine, slower than the kernel an eager copy launches)."""
    if device.type == "cuda":
        from decode_latency import copy_bandwidth as cuda_copy_bandwidth

        return cuda_copy_bandwidth(mib / 1024)
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, 5)


def mla_decode_kernel(
    cfg: dict, device: torch.device, bs: int, ctx: int, bw: float, sweep: bool = False
) -> dict[str, Any]:
    """One layer's MLA decode attention over ``bs`` requests of ``ctx`` latent rows (module docstring, item 3)."""
    from kvship.engine.attention.base import AttentionContext
    from kvship.engine.attention.mla import MLALayerSpec
    from kvship.engine.attention.mla_registry import create_mla_attention_backend
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch
    from kvship.engine.mem.mla_pool import MLAKVPool
    from kvship.engine.mem.pools import ReqToTokenPool

    r, dr, heads = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool = MLAKVPool(bs * ctx, 1, dt, r, dr, 1, device)
    pool.get_latent_buffer(0).normal_()
    r2t = ReqToTokenPool(bs, ctx + 1, device)
    for i in range(bs):
        r2t.write(i, 0, torch.arange(1 + i * ctx, 1 + (i + 1) * ctx, device=device))
    name = "triton" if device.type == "cuda" else "torch_native"
    actx = AttentionContext(
        device=device, dtype=dt, kv_dtype=dt, num_heads=heads, num_kv_heads=1, head_dim=r + dr, page_size=1,
        req_to_token_pool=r2t, max_running_requests=bs, cuda_graph_bs=(),
    )  # fmt: skip
    backend = create_mla_attention_backend(name, actx)
    spec = MLALayerSpec(0, heads, r, cfg["qk_nope_head_dim"], dr, cfg["v_head_dim"], scaling=0.1)
    last = torch.tensor([(i + 1) * ctx for i in range(bs)], device=device)
    fb = build_forward_batch(
        ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
        positions=torch.full((bs,), ctx - 1, dtype=torch.int64, device=device),
        out_cache_loc=last,
        req_pool_indices=torch.arange(bs, device=device),
        seq_lens=torch.full((bs,), ctx, dtype=torch.int64, device=device),
        seq_lens_cpu=[ctx] * bs,
        req_to_token_pool=r2t,
        kv_pool=pool,
        attn_backend=backend,
        device=device,
    )
    backend.init_forward_metadata(fb)
    q = torch.randn(bs, heads, r + dr, dtype=dt, device=device)
    k = pool.get_latent_buffer(0)[last, 0]
    sec = kernel_time(lambda: backend.forward_decode(q, k, None, spec, fb, save_kv_cache=False), device, 5)
    read = bs * ctx * (r + dr) * pool.get_latent_buffer(0).element_size()
    out = {
        "backend": name,
        "bs": bs,
        "ctx": ctx,
        "splits": getattr(fb.attn_metadata, "num_splits", None),
        "ms": sec * 1e3,
        "GB/s": read / sec / 1e9,
        "of_copy_bw": read / sec / bw,
    }
    if device.type == "cuda" and sweep:
        out["sweep"] = mla_decode_sweep(q, pool, r2t, fb, r, spec.scaling, read, bw)
        best = out["sweep"][0]
        print(f"MLA decode sweep best: {best}", flush=True)
    return out


def mla_decode_sweep(q, pool, r2t, fb, r: int, scale: float, read: int, bw: float) -> list[dict[str, Any]]:
    """``mla_decode`` launch configs at this batch (tiles over the context, warps, pipeline stages, splits),
    fastest first: where the backend's defaults stand (docs/deepseek.md)."""
    import triton

    from kvship.engine.attention import mla_triton as mt

    latent = pool.get_latent_buffer(0)
    rows = []
    few = q.shape[0] * triton.cdiv(q.shape[1], mt.DECODE_BLOCK_H) < 8  # few programs a split: try more splits
    for splits in (4, 8, 16, 32, 64) if few else (4, 8, 16):
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                    try:
                        sec = kernel_time(
                            lambda kw=kw: mt.mla_decode(
                                q, latent, r2t.req_to_token, fb.req_pool_indices, fb.seq_lens, r, scale, **kw
                            ),
                            q.device,
                            5,
                        )
                    except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                        print(f"  {kw}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
                        continue
                    rows.append({**kw, "ms": sec * 1e3, "of_copy_bw": read / sec / bw})
    return sorted(rows, key=lambda row: row["ms"])


def mla_extend_paths(cfg: dict, device: torch.device, prefix: int, new_lens: list[int]) -> dict[str, Any]:
    """One MLA layer's extend over a cached prefix, both paths (module docstring, item 5)."""
    from kvship.engine.attention.base import AttentionContext
    from kvship.engine.attention.mla_registry import create_mla_attention_backend
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch
    from kvship.engine.layers.rmsnorm import RMSNorm
    from kvship.engine.mem.mla_pool import MLAKVPool
    from kvship.engine.mem.pools import ReqToTokenPool
    from kvship.engine.model_config import ModelConfig
    from kvship.engine.models.deepseek import DeepseekRotary, MLAAttention, extend_takes_absorbed, mla_extend_flops

    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = prefix + max(new_lens)
    mc = ModelConfig.from_hf_dict(cfg, dtype=dt, context_length=ctx + 1)
    mla = mc.mla
    assert mla is not None
    r, dr = mla.kv_lora_rank, mla.qk_rope_head_dim
    with torch.device(device), torch.no_grad():
        rotary = DeepseekRotary(dr, ctx + 1, mc.rope_theta, mc.rope_scaling, mla.rope_interleave)
        attn = MLAAttention(mc, 0, rotary)
        norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dt)
        for prm in attn.parameters():
            prm.normal_(0.0, 0.02)
        norm.weight.fill_(1.0)
    pool = MLAKVPool(ctx, 1, dt, r, dr, 1, device)
    pool.get_latent_buffer(0).normal_()
    r2t = ReqToTokenPool(1, ctx + 1, device)
    r2t.write(0, 0, torch.arange(1, ctx + 1, device=device))
    name = "triton" if device.type == "cuda" else "torch_native"
    actx = AttentionContext(
        device=device, dtype=dt, kv_dtype=dt, num_heads=attn.num_heads, num_kv_heads=1, head_dim=r + dr,
        page_size=1, req_to_token_pool=r2t, max_running_requests=1, cuda_graph_bs=(),
    )  # fmt: skip
    backend = create_mla_attention_backend(name, actx)
    rows = []
    for t in new_lens:
        seq = prefix + t
        ms = {}
        for path in ("absorbed", "decompressed"):
            fb = build_forward_batch(
                ForwardMode.EXTEND,
                input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                positions=torch.arange(prefix, seq, device=device),
                out_cache_loc=torch.arange(prefix + 1, seq + 1, device=device),
                req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
                seq_lens=torch.tensor([seq], device=device),
                seq_lens_cpu=[seq],
                req_to_token_pool=r2t,
                kv_pool=pool,
                attn_backend=backend,
                device=device,
                extend_lens=[t],
                prefix_lens=[prefix],
                mla_absorbed_extend=path == "absorbed",
            )
            backend.init_forward_metadata(fb)
            hidden = torch.randn(t, mc.hidden_size, dtype=dt, device=device)
            with torch.inference_mode():
                sec = timed(lambda: attn(fb.positions, hidden, None, norm, fb), device, 5)
            ms[path] = sec * 1e3
        dec, ab = mla_extend_flops(attn.spec, [t], [seq])
        rows.append(
            {
                "new": t,
                "absorbed_ms": ms["absorbed"],
                "decompressed_ms": ms["decompressed"],
                "auto": "absorbed" if extend_takes_absorbed("auto", attn.spec, [t], [seq]) else "decompressed",
                "flops_decompressed_over_absorbed": dec / ab,
            }
        )
    return {"backend": name, "prefix": prefix, "rows": rows}


def http_batch1_decode(model_dir: str, device: str, input_len: int, output_len: int, bw: float, cfg: dict) -> dict:
    """Per-token decode time over HTTP: ``/generate`` of ``output_len`` tokens minus one of 1 token."""
    import httpx

    port = _free_port()
    cmd = [
        sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", model_dir, "--load-format", "dummy",
        "--dtype", "bfloat16" if device == "cuda" else "float32", "--device", device, "--host", "127.0.0.1",
        "--port", str(port), "--context-length", str(input_len + output_len + 64), "--max-running-requests", "4",
        "--max-total-tokens", str(4 * (input_len + output_len + 64)),
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="deepseek-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvship serve exited with {proc.returncode}; log: {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvship serve not healthy after 900 s; log: {log.name}")
            time.sleep(1)
        ids = [3 + (i * 7919) % (cfg["vocab_size"] - 3) for i in range(input_len)]

        def generate(n: int) -> float:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
            t0 = time.perf_counter()
            r = httpx.post(url + "/generate", json=body, timeout=600)
            r.raise_for_status()
            return time.perf_counter() - t0

        generate(4)  # warm-up
        one = sorted(generate(1) for _ in range(3))[1]
        many = sorted(generate(output_len) for _ in range(3))[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    per_token = (many - one) / (output_len - 1)
    elem = 2 if device == "cuda" else 4
    step_bytes = active_weight_bytes(cfg, elem) + latent_bytes_per_token(cfg, elem) * (input_len + output_len // 2)
    roofline = step_bytes / bw
    return {
        "input_len": input_len,
        "output_len": output_len,
        "ms_per_token": per_token * 1e3,
        "step_bytes": step_bytes,
        "roofline_ms": roofline * 1e3,
        "of_roofline": roofline / per_token,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reduced", action="store_true", help="a small shape and sizes: the run checks itself on a CPU")
    p.add_argument("--kernel-bs", type=int, default=None, help="decode kernel batch (default 32; 4 reduced)")
    p.add_argument("--kernel-ctx", type=int, default=None, help="decode kernel context (default 8192; 512 reduced)")
    p.add_argument("--input-len", type=int, default=None, help="HTTP prompt length (default 1024; 64 reduced)")
    p.add_argument("--output-len", type=int, default=None, help="HTTP new tokens (default 128; 16 reduced)")
    p.add_argument("--gqa-kv-heads", type=int, default=None, help="default: half the shape's attention heads")
    p.add_argument("--gqa-head-dim", type=int, default=None, help="default: hidden size / attention heads")
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--extend-prefix", type=int, default=None, help="extend paths: cached prefix (8192; 256 reduced)")
    p.add_argument(
        "--extend-new",
        default=None,
        help="extend paths: new tokens, comma-separated (default 4,16,64,128,192,256,512; 4,64 reduced)",
    )
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--skip-extend", action="store_true")
    p.add_argument("--sweep", action="store_true", help="CUDA: also time mla_decode launch configs at the kernel batch")
    a = p.parse_args(argv)
    red = a.reduced
    device = torch.device(a.device)
    cfg = dict(V2_LITE, **(REDUCED if red else {}))
    root = tempfile.mkdtemp(prefix="deepseek-bench-")
    model_dir = write_model_dir(root, red)
    bw = copy_bandwidth(device, 64 if red else 2048)
    res: dict[str, Any] = {"device": str(device), "reduced": red, "copy_GB/s": bw / 1e9}
    heads = cfg["num_attention_heads"]
    gqa = (a.gqa_kv_heads or heads // 2, a.gqa_head_dim or cfg["hidden_size"] // heads)
    res["kv_tokens_per_gb"] = kv_tokens_per_gb(cfg, *gqa, 16 if red else a.pool_mib)
    res["mla_decode_kernel"] = mla_decode_kernel(
        cfg, device, a.kernel_bs or (4 if red else 32), a.kernel_ctx or (512 if red else 8192), bw, a.sweep
    )
    if not a.skip_extend and (device.type == "cuda" or red):
        new = a.extend_new or ("4,64" if red else "4,16,64,128,192,256,512")
        res["mla_extend_paths"] = mla_extend_paths(
            cfg, device, a.extend_prefix or (256 if red else 8192), [int(x) for x in new.split(",")]
        )
    if not a.skip_http:
        res["http_batch1"] = http_batch1_decode(
            model_dir, a.device, a.input_len or (64 if red else 1024), a.output_len or (16 if red else 128), bw, cfg
        )
    res["active_weight_bytes"] = active_weight_bytes(cfg)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "deepseek.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = _markdown(res)
    with open(os.path.join(a.out, "deepseek.md"), "w") as f:
        f.write(md)
    print(md)
    return res


def _markdown(res: dict) -> str:
    kv, k = res["kv_tokens_per_gb"], res["mla_decode_kernel"]
    lines = [
        f"DeepSeek-V2-Lite shape{' (REDUCED: a CPU self-check)' if res['reduced'] else ''} on {res['device']}",
        "",
        "| measure | value |",
        "|---|---|",
        f"| copy bandwidth | {res['copy_GB/s']:.1f} GB/s |",
        f"| KV tokens / GB: latent pool | {kv['mla_tokens_per_gb']:,.0f} ({kv['mla_bytes_per_token']} B/token) |",
        f"| KV tokens / GB: GQA ({kv['gqa']}) | {kv['gqa_tokens_per_gb']:,.0f} ({kv['gqa_bytes_per_token']} B/token) |",
        f"| latent / GQA tokens per GB | {kv['ratio']:.2f}x |",
        f"| MLA decode ({k['backend']}) {k['bs']} x {k['ctx']} | {k['ms']:.3f} ms, {k['GB/s']:.1f} GB/s, "
        f"{100 * k['of_copy_bw']:.0f}% of copy bandwidth |",
    ]
    e = res.get("mla_extend_paths")
    for row in e["rows"] if e else []:
        lines.append(
            f"| MLA extend ({e['backend']}) {row['new']} new over {e['prefix']} | absorbed {row['absorbed_ms']:.3f} ms, "
            f"decompressed {row['decompressed_ms']:.3f} ms; auto picks {row['auto']} (FLOPs decompressed / absorbed "
            f"{row['flops_decompressed_over_absorbed']:.2f}) |"
        )
    h = res.get("http_batch1")
    if h:
        lines.append(
            f"| batch-1 decode over HTTP ({h['input_len']} + {h['output_len']}) | {h['ms_per_token']:.2f} ms/token, "
            f"roofline {h['roofline_ms']:.2f} ms: {100 * h['of_roofline']:.0f}% of roofline |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Tensor parallelism on CPU (gloo, real rank processes) against ``--tp-size 1`` and ``transformers``.

The rank-level tests start one gloo group per tp size; every rank builds a
``ModelRunner`` holding its shard of each tiny model in turn and runs the
same steps (prefill with logits at every position, greedy decoding, a
batched decode); rank 0 sends what it computed back.  Head counts cover an
even split, KV heads replicated (``tp > num_key_value_heads``) and a
vocabulary that does not divide by tp.  The server tests run ``kvship serve
--tp-size 2`` and talk HTTP.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import re
import signal
import time
import traceback

import pytest
import torch
from conftest import KVDriver, build_tiny_model
from server_fixtures import run_ranks, start_server

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.communicator import GlooCommunicator
from kvship.engine.distributed.groups import solo_groups
from kvship.engine.distributed.topology import Topology
from kvship.engine.model_runner import ModelRunner
from kvship.engine.parallel.layers import check_tp_divisible, head_split, vocab_shard

ATOL = 1e-4
RANK_TIMEOUT_S = 120
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 8

# name -> (arch, overrides): the tp sizes each model runs at are in TP_MODELS
MODEL_SPECS = {
    "llama": ("llama", dict(seed=1)),  # 4 heads / 2 KV heads
    "llama_tied_vocab385": ("llama", dict(seed=2, tie_word_embeddings=True, vocab_size=385)),
    "qwen2": ("qwen2", dict(seed=3)),
    "qwen3": ("qwen3", dict(seed=4)),
    "qwen3_6h_3kv": (
        "qwen3",
        dict(seed=5, num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192),
    ),
    "llama_6h_1kv": (
        "llama",
        dict(seed=6, num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=96),
    ),
    "qwen2_6h_6kv": (
        "qwen2",
        dict(seed=7, num_attention_heads=6, num_key_value_heads=6, hidden_size=96, intermediate_size=96),
    ),
}
WORLD = 3
TP_MODELS = {
    2: ["llama", "llama_tied_vocab385", "qwen2", "qwen3", "llama_6h_1kv"],
    3: ["qwen3_6h_3kv", "llama_6h_1kv", "qwen2_6h_6kv"],
}


@pytest.fixture(scope="module")
def tp_model_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, (arch, kw) in MODEL_SPECS.items():
        kw = dict(kw)
        out[name] = build_tiny_model(str(tmp_path_factory.mktemp(f"tp_{name}")), arch, seed=kw.pop("seed"), **kw)
    return out


def _server_args(path: str, tp_size: int = 1) -> ServerArgs:
    return ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=8, tp_size=tp_size)


def _run_steps(runner) -> dict:
    """Prefill logits at every position, greedy tokens and a batched decode: the same calls on every rank."""
    drv = KVDriver(runner)
    req = drv.new()
    try:
        prefill = drv.extend([req], [PROMPTS[0]], all_logits=True)
    finally:
        drv.free(req)
    greedy = [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]
    a, b = drv.new(), drv.new()
    try:
        drv.extend([a, b], PROMPTS)
        decode = drv.decode([a, b], [3, 4])
    finally:
        drv.free(a)
        drv.free(b)
    free = (runner.allocator.available_size(), runner.allocator.total_slots)
    return {"prefill": prefill, "greedy": greedy, "decode": decode, "free": free, "kv_heads": runner.num_kv_heads}


def _rank_main(rank: int, init_method: str, paths: dict, out: "mp.Queue") -> None:
    """One of 3 ranks: tp 2 runs on ranks 0-1 (a subgroup), then tp 3 on all three."""
    import torch.distributed as dist

    from kvship.engine.distributed.launch import join

    torch.set_num_threads(1)
    try:
        world = join(_server_args("", WORLD), Topology(tp_size=WORLD, rank=rank), init_method)
        pair = dist.new_group([0, 1])
        results: dict[int, dict] = {}
        for size, names in TP_MODELS.items():
            if rank < size:
                pg = (
                    world
                    if size == WORLD
                    else solo_groups(Topology(size, rank=rank), GlooCommunicator(rank, size, pair))
                )
                results[size] = {n: _run_steps(ModelRunner(_server_args(paths[n], size), groups=pg)) for n in names}
        if rank == 0:  # numpy: torch tensors would travel as shared memory tied to this exiting process
            for by_name in results.values():
                for r in by_name.values():
                    r["prefill"], r["decode"] = r["prefill"].numpy(), r["decode"].numpy()
            out.put(("ok", results))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)  # skip the process group's teardown at exit (it waits for the other ranks)


@pytest.fixture(scope="module")
def tp_results(tp_model_dirs) -> dict[int, dict]:
    """{tp size: {model name: rank 0's results}} from one group of 3 rank processes."""
    return run_ranks(_rank_main, WORLD, (tp_model_dirs,), RANK_TIMEOUT_S)


@pytest.fixture(scope="module")
def tp1_results(tp_model_dirs) -> dict[str, dict]:
    torch.set_num_threads(1)
    return {name: _run_steps(ModelRunner(_server_args(path))) for name, path in tp_model_dirs.items()}


CASES = [(size, name) for size, names in TP_MODELS.items() for name in names]


@pytest.mark.parametrize("size,name", CASES, ids=[f"tp{s}-{n}" for s, n in CASES])
def test_tensor_parallel_ranks_match_tp1_tokens_and_transformers_logits(
    size, name, tp_results, tp1_results, tp_model_dirs
):
    ours, ref = dict(tp_results[size][name]), tp1_results[name]
    ours["prefill"], ours["decode"] = torch.from_numpy(ours["prefill"]), torch.from_numpy(ours["decode"])
    assert ours["greedy"] == ref["greedy"]
    assert (ours["prefill"] - ref["prefill"]).abs().max().item() < ATOL
    assert (ours["decode"] - ref["decode"]).abs().max().item() < ATOL
    assert ours["free"] == ref["free"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tp_model_dirs[name], dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPTS[0]])).logits[0].float()
    assert ours["prefill"].shape == hf_logits.shape
    assert (ours["prefill"] - hf_logits).abs().max().item() < ATOL


def test_kv_heads_are_split_or_replicated_per_rank(tp_results):
    assert tp_results[2]["llama"]["kv_heads"] == 1  # 2 KV heads over 2 ranks
    assert tp_results[2]["llama_6h_1kv"]["kv_heads"] == 1  # 1 KV head replicated on both
    assert tp_results[3]["qwen3_6h_3kv"]["kv_heads"] == 1
    assert tp_results[3]["llama_6h_1kv"]["kv_heads"] == 1


# --- the split itself (no processes) ----------------------------------------------------
def test_head_split_gives_each_rank_its_query_heads_and_their_kv_head():
    assert head_split(8, 4, 2, 1) == head_split(8, 4, 2, 1)
    s = head_split(8, 4, 2, 1)
    assert (s.num_heads, s.num_kv_heads, s.q_head_start, s.kv_head_start) == (4, 2, 4, 2)
    # 8 query heads in groups of 4 over 2 KV heads; tp 4: ranks 0,1 share KV head 0, ranks 2,3 KV head 1
    assert [head_split(8, 2, 4, r).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert [head_split(8, 2, 4, r).num_kv_heads for r in range(4)] == [1, 1, 1, 1]
    # SmolLM2-135M: 9 query / 3 KV heads at tp 3
    assert [(head_split(9, 3, 3, r).q_head_start, head_split(9, 3, 3, r).kv_head_start) for r in range(3)] == [
        (0, 0),
        (3, 1),
        (6, 2),
    ]


@pytest.mark.parametrize(
    "heads,kv,tp,match",
    [
        (4, 2, 3, "does not divide the model's 4 attention heads"),
        (12, 4, 6, "not a multiple of it"),
        (12, 6, 4, "does not divide the model's 6 KV heads"),
    ],
)
def test_heads_that_do_not_split_are_a_clear_error(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        head_split(heads, kv, tp, 0)


def test_mlp_width_that_does_not_split_is_a_clear_error():
    class Cfg:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 130

    with pytest.raises(ValueError, match="intermediate_size 130"):
        check_tp_divisible(Cfg, 4)


def test_serve_refuses_a_tp_size_the_model_cannot_split_before_starting_ranks(tiny_llama_dir):
    from kvship.app.serve import check_tensor_parallel

    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_tensor_parallel(ServerArgs(model_path=tiny_llama_dir, tp_size=3))
    check_tensor_parallel(ServerArgs(model_path=tiny_llama_dir, tp_size=4))  # 4 heads, 2 KV heads replicated
    for mode in ("prefill", "decode"):  # PD workers split too (tests/test_pd_tp.py)
        check_tensor_parallel(ServerArgs(model_path=tiny_llama_dir, tp_size=2, mode=mode))


def test_vocabulary_is_padded_to_a_multiple_of_tp():
    assert [vocab_shard(385, 2, r) for r in range(2)] == [(0, 193, 193), (193, 193, 192)]
    assert [vocab_shard(10, 4, r)[2] for r in range(4)] == [3, 3, 3, 1]


def test_tp1_builds_no_process_group_and_plain_layers(tiny_llama_dir):
    import torch.distributed as dist

    from kvship.engine.layers.linear import Linear, StackedLinear

    runner = ModelRunner(_server_args(tiny_llama_dir))
    assert runner.tp is None and runner.tp_size == 1
    assert not dist.is_initialized()
    layer = runner.model.model.layers[0]
    assert type(layer.self_attn.o_proj) is Linear and type(layer.mlp.gate_up_proj) is StackedLinear


def test_shard_loaders_read_only_their_block(tp_model_dirs):
    """A rank's parameters come from ``CheckpointSlice`` blocks: nothing reads the full qkv or vocab."""
    from kvship.engine.loaders import lazy

    reads: list[tuple] = []
    real_load = lazy.CheckpointSlice.load

    def spy(self):
        reads.append(tuple(self.shape))
        return real_load(self)

    lazy.CheckpointSlice.load = spy
    try:
        from kvship.engine.loaders.base import load_model
        from kvship.engine.model_config import ModelConfig

        mc = ModelConfig.from_pretrained(tp_model_dirs["qwen3_6h_3kv"], dtype=torch.float32)
        load_model(mc, "auto", "cpu", tp=GlooCommunicator(rank=2, size=3))
    finally:
        lazy.CheckpointSlice.load = real_load
    assert (16 * 2, 96) in reads  # q_proj: 2 of 6 heads
    assert (16, 96) in reads  # k_proj / v_proj: 1 of 3 KV heads
    assert (128, 96) in reads  # embed_tokens: 384 / 3 rows
    assert (96, 64) in reads  # down_proj: 64 of 192 input columns
    assert all(s[0] != 384 for s in reads) and (16 * 6, 96) not in reads


def test_cuda_style_build_on_meta_gives_the_same_rank_as_building_in_place(tp_model_dirs):
    """On CUDA a rank's model is built on the meta device then moved (no full-size weight ever allocated):
    same parameters after loading, same RoPE table, as the CPU build."""
    from kvship.engine.loaders.base import get_loader
    from kvship.engine.model_config import ModelConfig
    from kvship.engine.models.registry import get_model_class
    from kvship.engine.parallel.layers import build_parallel_model

    mc = ModelConfig.from_pretrained(tp_model_dirs["qwen2"], dtype=torch.float32)
    tp = GlooCommunicator(rank=1, size=2)
    built = []
    for on_meta in (False, True):
        model = build_parallel_model(get_model_class(mc.architectures), mc, tp, "cpu", on_meta=on_meta)
        get_loader("safetensors").load_weights(model, mc, lazy=True)
        built.append(model)
    plain, meta = (dict(m.named_parameters()) for m in built)
    assert plain.keys() == meta.keys()
    assert all(torch.equal(plain[k], meta[k]) and meta[k].device.type == "cpu" for k in plain)
    assert torch.equal(built[0].model.rotary_emb.cos_sin_cache, built[1].model.rotary_emb.cos_sin_cache)


def test_gguf_shard_of_smollm2_at_tp3_is_the_block_of_the_full_weights(smollm2_path):
    """Rank 1 of 3 dequantizes only its rows / columns of the quantized GGUF (q/k rows un-permuted per
    head); they equal the same block of the whole tensors (checked on layer 0)."""
    from kvship.engine.loaders.base import load_model
    from kvship.engine.loaders.gguf_file import dequantize_tensor, gguf_reader
    from kvship.engine.loaders.gguf_loader import hf_name, unpermute_qk
    from kvship.engine.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(smollm2_path, dtype=torch.float32)
    assert (mc.num_attention_heads, mc.num_key_value_heads) == (9, 3)
    full = {}
    for t in gguf_reader(smollm2_path).tensors:
        name = hf_name(t.name)
        if name and name.startswith("model.layers.0."):
            w = dequantize_tensor(t)
            if ".q_proj." in name or ".k_proj." in name:  # llama.cpp's per-head row order, undone
                w = unpermute_qk(w, w.shape[0] // mc.head_dim)
            full[name] = w
    rank, block = 1, lambda n: slice(n // 3, 2 * n // 3)
    shard = dict(load_model(mc, "auto", "cpu", tp=GlooCommunicator(rank, 3)).named_parameters())
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    want_qkv = torch.cat([full[f"{attn}{p}_proj.weight"][block(n)] for p, n in (("q", 576), ("k", 192), ("v", 192))])
    assert torch.equal(shard[attn + "qkv_proj.weight"], want_qkv)
    want_gate_up = torch.cat([full[f"{mlp}{p}_proj.weight"][block(1536)] for p in ("gate", "up")])
    assert torch.equal(shard[mlp + "gate_up_proj.weight"], want_gate_up)
    assert torch.equal(shard[attn + "o_proj.weight"], full[attn + "o_proj.weight"][:, block(576)])
    assert torch.equal(shard[mlp + "down_proj.weight"], full[mlp + "down_proj.weight"][:, block(1536)])
    assert shard["model.embed_tokens.weight"].shape == (49152 // 3, 576)
    assert torch.equal(shard["model.layers.0.input_layernorm.weight"], full["model.layers.0.input_layernorm.weight"])


# --- kvship serve --tp-size 2 --------------------------------------------------------------
def test_serve_tp2_matches_tp1_over_http_and_exits_non_zero_when_a_rank_dies(tp_model_dirs, tp1_results):
    """/generate and the OpenAI API through a 2-rank worker give --tp-size 1's greedy tokens;
    /get_server_info reports tp_size; SIGKILL on rank 1 makes the worker exit non-zero, no hang."""
    import psutil
    from openai import OpenAI

    name = "qwen3"
    path = tp_model_dirs[name]
    args = ["--model-path", path, "--max-total-tokens", "1024", "--tp-size", "2"]
    with start_server(args, keep_log=True) as srv:
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = srv.post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == tp1_results[name]["greedy"]

        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        kw = dict(model=path, max_tokens=8, temperature=0)
        text = client.completions.create(prompt="The capital of France is", **kw).choices[0].text
        r = srv.post(
            "/generate",
            json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        )
        assert text == r.json()["text"]
        stream = client.completions.create(prompt="The capital of France is", stream=True, **kw)
        assert "".join(c.choices[0].text for c in stream) == text
        chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
        assert chat.choices[0].finish_reason in ("stop", "length")
        if importlib.util.find_spec("xgrammar") is not None:  # structured output: every rank masks alike
            ipv4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
            sp = {"max_new_tokens": 40, "temperature": 0, "regex": ipv4}
            r = srv.post("/generate", json={"text": ["an address:", "another:"], "sampling_params": sp})
            assert r.status_code == 200 and all(re.fullmatch(ipv4, o["text"]) for o in r.json()), r.text

        info = srv.get("/get_server_info").json()
        assert info["tp_size"] == 2 and info["server_args"]["tp_size"] == 2

        ranks = [c for c in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 1
        os.kill(ranks[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 45
        while srv.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srv.alive(), "the worker is still up after its rank died"
        assert srv.proc.returncode == 1
        assert "tensor-parallel rank 1" in srv.log_tail(200)


# --- embedded SmolLM2 at --tp-size 3 (9 query / 3 KV heads) ------------------------------------
def test_embedded_smollm2_at_tp3_generates_what_tp1_does_over_generate_and_openai(smollm2_path):
    """The GGUF shards (one KV head per rank) give TP=1's greedy tokens through /generate, the
    completions API and the chat API (TP=1 reference: the unified scheduler in this process)."""
    from openai import OpenAI
    from pd_fixtures import unified_greedy

    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    prompts = ["The capital of France is", "Three primary colors are"]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = [tok.encode(p) for p in prompts] + [tok.encode_chat(chat)]
    want = unified_greedy(smollm2_path, ids, 12)
    with start_server(["--max-total-tokens", "4096", "--tp-size", "3"], timeout=300) as srv:
        assert srv.get("/get_server_info").json()["tp_size"] == 3
        sp = {"max_new_tokens": 12, "temperature": 0}
        r = srv.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == want
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = srv.get("/get_model_info").json()["served_model_name"]
        for prompt, expected in zip(prompts, want):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == tok.decode(expected)
        out = client.chat.completions.create(model=model, messages=chat, max_tokens=12, temperature=0)
        assert out.choices[0].message.content == tok.decode(want[2])


# --- a rank killed mid-generation, behind the real router --------------------------------------
def test_a_rank_killed_mid_generation_takes_its_worker_down_and_the_router_serves_the_streams_elsewhere(
    tp_model_dirs,
):
    """Worker A (TP=2) and worker B (TP=1) behind `kvship router`; rank 1 of A is SIGKILLed while A
    streams: A's /health stops answering 200 and A exits 1 within the collective timeout, and every
    stream still ends with the undisturbed greedy text (the router resumes A's streams on B)."""
    import concurrent.futures
    import contextlib
    import json
    import threading

    import httpx
    import psutil
    from router_fixtures import router_process

    path = tp_model_dirs["qwen3"]
    base = ["--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096"]
    base += ["--max-running-requests", "4", "--dist-timeout", "20"]
    managers = [start_server(base + ["--tp-size", "2"], keep_log=True), start_server(base)]
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]  # the two start-ups overlap
        for m, f in zip(managers, futures):
            if f.exception() is None:
                stack.push(m.__exit__)
        a, b = (f.result() for f in futures)
        rank1 = [c for c in psutil.Process(a.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(rank1) == 1
        bodies = [
            {"input_ids": PROMPTS[i % 2] + [i + 3], "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
            for i in range(8)
        ]
        for body in bodies:
            body["sampling_params"]["ignore_eos"] = True
        # the undisturbed answers, from B directly
        want = [httpx.post(b.url + "/generate", json=body, timeout=60).json()["text"] for body in bodies]
        args = ["--worker-urls", a.url, b.url, "--policy", "round_robin", "--health-check-interval", "1"]
        with router_process(args + ["--max-resumes", "2", "--debug-headers"]) as (url, _):
            killed = threading.Event()

            def stream(body: dict) -> dict:
                last: dict = {}
                with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=120) as r:
                    assert r.status_code == 200, r.read()
                    from_a = r.headers.get("x-kvship-worker") == a.url
                    n = 0
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        last = json.loads(line[6:])
                        n += 1
                        if from_a and n >= 3 and not killed.is_set():
                            killed.set()
                            os.kill(rank1[0].pid, signal.SIGKILL)
                return last

            results = list(pool.map(stream, bodies))
            assert killed.is_set(), "no stream of worker A got going before the others finished"
            meta = [r.get("meta_info", {}) for r in results]
            bad = [
                (m.get("finish_reason"), m.get("kvship_resumes"))
                for r, m, w in zip(results, meta, want)
                if r.get("text") != w
            ]
            assert not bad, bad
            assert any(r["meta_info"].get("kvship_resumes", 0) for r in results)
        deadline = time.monotonic() + 45  # --dist-timeout 20, plus the shutdown
        while time.monotonic() < deadline:
            try:
                if httpx.get(a.url + "/health", timeout=2).status_code != 200:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("worker A still answers /health 200 after its rank died")
        assert a.proc.wait(45) == 1
        assert "tensor-parallel rank 1" in a.log_tail(200)


def test_p2p_all_reduce_is_only_for_cuda_groups_of_several_ranks():
    """The one-shot peer-memory all-reduce (engine/parallel/p2p_all_reduce.py) is never set up on CPU, at one
    rank or without KVSHIP_TP_ALLREDUCE=p2p, and asks no peer anything then (``agree`` is a collective)."""
    from kvship.engine.parallel.p2p_all_reduce import P2PAllReduce

    def no_collective(ok: int) -> int:
        raise AssertionError("agree() must not run")

    assert P2PAllReduce.create(None, torch.device("cpu"), 2, agree=no_collective) is None
    assert P2PAllReduce.create(None, torch.device("cuda", 0), 1, agree=no_collective) is None
    assert P2PAllReduce.create(None, torch.device("cuda", 0), 2, agree=no_collective, mode="nccl") is None


def test_p2p_all_reduce_is_the_default_and_its_knob_refuses_other_values(monkeypatch):
    """Measured better than NCCL on two H200s (docs/parallel.md, "The all-reduce"), the peer-memory all-reduce is
    the TP groups' default; KVSHIP_TP_ALLREDUCE=nccl turns it off, and a value that is neither is refused with the
    variable's name (not silently NCCL).  Its size table picks one-shot below two-shot below NCCL."""
    from kvship.common.envs import ENV
    from kvship.engine.parallel.p2p_all_reduce import THRESHOLDS

    monkeypatch.delenv("KVSHIP_TP_ALLREDUCE", raising=False)
    assert ENV.TP_ALLREDUCE == "p2p"
    monkeypatch.setenv("KVSHIP_TP_ALLREDUCE", " NCCL ")
    assert ENV.TP_ALLREDUCE == "nccl"
    monkeypatch.setenv("KVSHIP_TP_ALLREDUCE", "custom")
    with pytest.raises(ValueError, match="KVSHIP_TP_ALLREDUCE='custom': expected one of p2p, nccl"):
        ENV.TP_ALLREDUCE
    for one_shot_max, two_shot_max in THRESHOLDS.values():
        assert 0 < one_shot_max <= two_shot_max


def test_the_push_kernel_takes_small_tensors_by_default_and_its_knob_is_checked(monkeypatch):
    """The push all-reduce (``engine/parallel/push_all_reduce.py``) measured faster than the one-shot kernel up to
    1 MiB on two H200s: that is its default limit; 0 turns it off, a negative size is refused; it never takes more
    than 1 MiB, one program up to 16 KiB and up to 32 chunks above; its buffer holds the flags of every (program,
    rank) and two parities of a slot per rank."""
    from kvship.common.envs import ENV
    from kvship.engine.parallel.push_all_reduce import (
        FLAG_BYTES,
        MAX_BYTES,
        MAX_PROGRAMS,
        PushAllReduce,
        buffer_bytes,
        launch_shape,
    )

    monkeypatch.delenv("KVSHIP_TP_ALLREDUCE_PUSH_MAX", raising=False)
    assert ENV.TP_ALLREDUCE_PUSH_MAX == 1 << 20
    monkeypatch.setenv("KVSHIP_TP_ALLREDUCE_PUSH_MAX", "0")
    assert ENV.TP_ALLREDUCE_PUSH_MAX == 0
    monkeypatch.setenv("KVSHIP_TP_ALLREDUCE_PUSH_MAX", "-1")
    with pytest.raises(ValueError, match="KVSHIP_TP_ALLREDUCE_PUSH_MAX='-1'"):
        ENV.TP_ALLREDUCE_PUSH_MAX
    # flags, two parities of a 1 MiB slot per rank, then two parities of a 1 MiB sentinel slot per rank
    assert MAX_BYTES == 1 << 20 and FLAG_BYTES >= MAX_PROGRAMS * 8 * 8
    assert buffer_bytes(2) == FLAG_BYTES + 4 * MAX_BYTES + 4 * MAX_BYTES
    assert PushAllReduce.fits(torch.empty(512 << 10, dtype=torch.bfloat16))
    assert not PushAllReduce.fits(torch.empty((256 << 10) + 1, dtype=torch.float32))
    assert launch_shape(4096, 2) == (1, 4096, 1)  # batch 1 of hidden 4096: one program
    assert launch_shape(8192, 2) == (1, 8192, 1)  # 16 KiB: still one
    assert launch_shape(16384, 2) == (4, 4096, 1)  # 32 KiB: four chunks
    assert launch_shape(64 * 4096, 2) == (32, 4096, 2)  # batch 64: 32 programs of two 8 KiB steps
    with pytest.raises(ValueError, match="takes up to 1048576 bytes"):
        launch_shape((MAX_BYTES // 2) + 4096, 2)
    programs, block, steps = launch_shape(5000 * 7, 2)
    assert programs * block * steps >= 35000 > (programs - 1) * block * steps and programs <= MAX_PROGRAMS


def test_a_tp_group_spanning_nodes_keeps_nccl_and_unmeasured_sizes_get_smaller_one_shot_limits():
    """Peer GPU memory maps only within a host: a TP group over two nodes takes NCCL without trying (no
    rendezvous that could hang), one inside a node keeps the asked mode.  Group sizes the bench has not measured
    get the 2-rank row with one-shot's limit divided by the peers it reads."""
    from kvship.engine.distributed.groups import tp_all_reduce_mode
    from kvship.engine.parallel.p2p_all_reduce import THRESHOLDS, thresholds_for

    addr = "10.0.0.5:29500"
    spans = Topology(tp_size=8, nnodes=2, node_rank=1, rank=5, dist_init_addr=addr)  # 0-3 node 0, 4-7 node 1
    assert tp_all_reduce_mode(spans, "p2p") == "nccl"
    inside = Topology(tp_size=4, pp_size=2, nnodes=2, node_rank=1, rank=5, dist_init_addr=addr)  # TP group 4-7
    assert tp_all_reduce_mode(inside, "p2p") == "p2p"
    assert tp_all_reduce_mode(inside, "nccl") == "nccl"
    one_node = Topology(tp_size=2, rank=1)
    assert tp_all_reduce_mode(one_node, "p2p") == "p2p"
    assert thresholds_for(2) == THRESHOLDS[2]
    one2, two2 = THRESHOLDS[2]
    assert thresholds_for(4) == (one2 // 3, two2)
    assert thresholds_for(8)[0] == one2 // 7 and thresholds_for(8)[0] < thresholds_for(4)[0]

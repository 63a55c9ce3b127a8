"""``--load-format dummy`` is the same model at every tensor- and expert-parallel size.

* Shards, no processes: rank ``r``'s parameters from the dummy loader equal,
  bit for bit, rank ``r``'s parameters loaded by the safetensors path from the
  dummy checkpoint written out whole (``dummy_checkpoint``), and at
  ``--tp-size 1`` both loads are the same model.  Covered: an even head split,
  KV heads replicated (tp 4 > 2 KV heads), a vocabulary padded to the tp size
  with tied embeddings, q/k/v biases, q/k norms, and Qwen3-MoE / Qwen2-MoE
  (shared expert) / Mixtral experts split by width (``--ep-size 1``), by
  expert (``--ep-size`` = tp) and both (tp 4, ep 2).
* Ranks, 2 gloo processes: ``ModelRunner``s on dummy weights at
  ``--tp-size 2`` (Llama; Llama with its one KV head replicated; Qwen3-MoE at
  ``--ep-size 2``) give ``--tp-size 1``'s greedy tokens and its logits within
  ``ATOL`` (float32).
* Two ``--tp-size 1`` loads are bit-identical; another seed gives other weights.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import traceback

import pytest
import torch
from conftest import build_tiny_model
from moe_fixtures import build_tiny_moe
from server_fixtures import run_ranks
from test_moe_ep import _run_steps

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.communicator import GlooCommunicator
from kvship.engine.distributed.topology import Topology
from kvship.engine.loaders import dummy
from kvship.engine.loaders.base import load_model
from kvship.engine.loaders.dummy import dummy_checkpoint
from kvship.engine.model_config import ModelConfig
from kvship.engine.model_runner import ModelRunner

ATOL = 1e-4
RANK_TIMEOUT_S = 180

# name -> builder of a tiny model folder (only its config.json matters to the dummy loader)
MODELS = {
    "llama": lambda d: build_tiny_model(d, "llama", seed=1),  # 4 heads / 2 KV heads
    "llama_tied_vocab385": lambda d: build_tiny_model(d, "llama", seed=2, tie_word_embeddings=True, vocab_size=385),
    "qwen2": lambda d: build_tiny_model(d, "qwen2", seed=3),
    "qwen3": lambda d: build_tiny_model(d, "qwen3", seed=4),
    "llama_6h_1kv": lambda d: build_tiny_model(
        d, "llama", seed=6, num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=96
    ),
    "qwen3_moe": lambda d: build_tiny_moe(d, "qwen3_moe", seed=40),
    "qwen2_moe": lambda d: build_tiny_moe(d, "qwen2_moe", seed=41),
    "mixtral": lambda d: build_tiny_moe(d, "mixtral", seed=42),
}
# (model, tp size, ep size) whose every rank is compared with the whole model's blocks
SHARD_CASES = [
    ("llama", 2, 1),
    ("llama", 4, 1),  # 2 KV heads replicated on 2 ranks each
    ("llama_tied_vocab385", 2, 1),
    ("qwen2", 2, 1),
    ("qwen3", 2, 1),
    ("qwen3_moe", 2, 1),
    ("qwen3_moe", 2, 2),
    ("qwen3_moe", 4, 2),
    ("qwen2_moe", 2, 2),
    ("mixtral", 2, 1),
    ("mixtral", 2, 2),
]
# (model, ep size) run at --tp-size 2 by 2 rank processes
RANK_CASES = [("llama", 1), ("llama_6h_1kv", 1), ("qwen3_moe", 2)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: build(str(tmp_path_factory.mktemp(f"dummy_{name}"))) for name, build in MODELS.items()}


def _dummy_as_safetensors(model_dir: str, out_dir: str, device: str = "cpu") -> str:
    """``model_dir``'s config with the dummy checkpoint (float32, drawn on ``device``) written whole as
    ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
    mc = ModelConfig.from_pretrained(model_dir, dtype=torch.float32)
    tensors = {name: whole.load().cpu().contiguous() for name, whole in dummy_checkpoint(mc, device=device)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("name,tp,ep", SHARD_CASES, ids=[f"{n}-tp{t}-ep{e}" for n, t, e in SHARD_CASES])
def test_every_dummy_rank_holds_its_block_of_the_tp1_dummy_model(name, tp, ep, model_dirs, tmp_path, monkeypatch):
    """The safetensors path takes each rank's block of the whole checkpoint (tests/test_tensor_parallel.py,
    tests/test_moe_ep.py): the dummy loader must hand every rank the same block of the same tensors.  Blocks
    of 1000 elements (15 rows of 64) are drawn per seed, so shard bounds cut through them as at real shapes."""
    monkeypatch.setattr(dummy, "BLOCK_ELEMENTS", 1000)
    mc = ModelConfig.from_pretrained(model_dirs[name], dtype=torch.float32)
    whole = ModelConfig.from_pretrained(_dummy_as_safetensors(model_dirs[name], str(tmp_path / "whole")))
    dummy1, file1 = (_params(load_model(c, fmt, "cpu")) for c, fmt in ((mc, "dummy"), (whole, "safetensors")))
    assert dummy1.keys() == file1.keys() and all(torch.equal(dummy1[k], file1[k]) for k in dummy1)
    for rank in range(tp):
        group = GlooCommunicator(rank=rank, size=tp)
        mine = _params(load_model(mc, "dummy", "cpu", tp=group, ep=(ep, "all_reduce")))
        from_file = _params(load_model(whole, "safetensors", "cpu", tp=group, ep=(ep, "all_reduce")))
        assert mine.keys() == from_file.keys()
        differ = [k for k in mine if not torch.equal(mine[k], from_file[k])]
        assert not differ, f"rank {rank}/{tp}: {differ[:5]}"
        if tp > 1:  # really a shard
            assert mine["model.layers.0.self_attn.qkv_proj.weight"].shape[0] < mc.q_size + 2 * mc.kv_size


def test_a_rank_draws_only_the_row_blocks_of_its_slices(model_dirs, monkeypatch):
    """Rank 1 of --tp-size 2 --ep-size 2 draws no block of experts 0-3 and, of the vocabulary, only the
    blocks of its rows 192..383 (16 rows per block)."""
    monkeypatch.setattr(dummy, "BLOCK_ELEMENTS", 16 * 64)
    drawn: list[tuple[str, int]] = []
    real = dummy.SyntheticTensor._block

    def spy(self, i):
        drawn.append((self.name, i))
        return real(self, i)

    monkeypatch.setattr(dummy.SyntheticTensor, "_block", spy)
    mc = ModelConfig.from_pretrained(model_dirs["qwen3_moe"], dtype=torch.float32)
    load_model(mc, "dummy", "cpu", tp=GlooCommunicator(rank=1, size=2), ep=(2, "all_reduce"))
    experts = {int(n.split(".")[5]) for n, _ in drawn if ".experts." in n}
    assert experts == {4, 5, 6, 7}
    assert sorted(i for n, i in drawn if n == "model.embed_tokens.weight") == list(range(12, 24))
    assert len(drawn) == len(set(drawn))  # each block drawn once


def test_two_tp1_dummy_loads_are_bit_identical_and_another_seed_differs(model_dirs):
    mc = ModelConfig.from_pretrained(model_dirs["qwen3_moe"], dtype=torch.float32)
    a, b, other = (_params(load_model(mc, "dummy", "cpu", seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    std = a["model.layers.0.self_attn.qkv_proj.weight"].std().item()
    assert 0.018 < std < 0.022  # DUMMY_STD


# --- rank processes ---------------------------------------------------------------------------
def _server_args(path: str, tp_size: int = 1, ep_size: int = 1) -> ServerArgs:
    return ServerArgs(
        model_path=path,
        load_format="dummy",
        max_total_tokens=1024,
        max_running_requests=8,
        tp_size=tp_size,
        ep_size=ep_size,
    )


def _rank_main(rank: int, init_method: str, paths: dict, out: "mp.Queue") -> None:
    from kvship.engine.distributed.launch import join

    torch.set_num_threads(1)
    try:
        groups = join(_server_args("", 2), Topology(tp_size=2, rank=rank), init_method)
        results = {}
        for name, ep in RANK_CASES:
            results[name] = _run_steps(ModelRunner(_server_args(paths[name], 2, ep), groups=groups))
        if rank == 0:
            out.put(("ok", results))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)  # skip the process group's teardown at exit (it waits for the other rank)


@pytest.fixture(scope="module")
def tp2_results(model_dirs) -> dict:
    return run_ranks(_rank_main, 2, (model_dirs,), RANK_TIMEOUT_S)


@pytest.mark.parametrize("name,ep", RANK_CASES, ids=[f"{n}-ep{e}" for n, e in RANK_CASES])
def test_dummy_model_at_tp2_gives_tp1_tokens_and_logits(name, ep, model_dirs, tp2_results):
    torch.set_num_threads(1)
    ref = _run_steps(ModelRunner(_server_args(model_dirs[name])))
    ours = tp2_results[name]
    assert ours["greedy"] == ref["greedy"]
    for key in ("prefill", "decode"):
        assert abs(ours[key] - ref[key]).max() < ATOL, key
    assert ours["load"] == ref["load"]  # MoE: the same routing, expert for expert

"""The host KV tier on a 2-rank tensor-parallel worker (gloo, CPU; docs/cache.md, "Tiers"): each rank keeps
its own shard of every page on its host pool, and a prefix loaded back from host gives the greedy tokens of
a cold request at ``--tp-size 1``."""

from __future__ import annotations

import pytest
import torch
from server_fixtures import start_server

PAGE = 4


def _cold_tp1(model_dir: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of ``prompt`` on a fresh single-rank scheduler (no host tier, nothing cached)."""
    from tests.test_hicache import _drain, _gen, _sched

    sched, _, out = _sched(model_dir, page_size=PAGE, max_total_tokens=1024)
    sched.submit(_gen("cold", prompt, n))
    _drain(sched)
    return out.tokens("cold")


@pytest.mark.timeout(300)
def test_tp2_worker_loads_a_prefix_back_from_each_ranks_host_shard_and_matches_tp1(tiny_llama_dir):
    g = torch.Generator().manual_seed(21)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    first, others, tail = rand(100), [rand(120) for _ in range(4)], rand(10)
    args = ["--model-path", tiny_llama_dir, "--tp-size", "2", "--page-size", str(PAGE)]
    args += ["--max-total-tokens", "256", "--hicache-ratio", "4", "--max-running-requests", "2"]
    greedy = lambda n: {"max_new_tokens": n, "temperature": 0}  # noqa: E731
    with start_server(args) as srv:
        r = srv.post("/generate", json={"input_ids": first, "sampling_params": greedy(8)})
        assert r.status_code == 200, r.text
        turn2 = first + r.json()["output_ids"] + tail
        for ids in others:  # other sessions push the first one's pages out of both ranks' device pools
            assert srv.post("/generate", json={"input_ids": ids, "sampling_params": greedy(8)}).status_code == 200
        before = srv.get("/get_server_info").json()
        assert before["host_cached_slots"] >= 96, before
        r = srv.post("/generate", json={"input_ids": turn2, "sampling_params": greedy(12)})
        assert r.status_code == 200, r.text
        got = r.json()
        after = srv.get("/get_server_info").json()
        assert got["meta_info"]["cached_tokens"] >= 96
        assert after["host_hit_tokens"] - before["host_hit_tokens"] >= 96
    assert got["output_ids"] == _cold_tp1(tiny_llama_dir, turn2, 12)

"""PD of a DeepSeek (MLA) model: prefill ships the latent KV pool's pages to decode (docs/deepseek.md, "PD").

PrefillScheduler + DecodeScheduler in one process over the real transfer layer (tcp, mooncake over tcp,
nixl over UCX; a backend whose package is missing is skipped with its reason), on a tiny random DeepSeek-V3
checkpoint (q LoRA, YaRN, grouped routing, a dense first layer):

* greedy tokens equal the unified scheduler's on every backend, both with layer-wise sends (decode registered
  first) and with whole-request sends checked by the KV checksum; every KV slot comes back on both sides;
* the layout names the MLA dims: a DeepSeek prefill refuses a per-head (Llama) decode, naming both caches,
  and the wire format round-trips the MLA fields and refuses an inconsistent MLA layout.
"""

from __future__ import annotations

import pytest
from deepseek_fixtures import build_tiny_deepseek
from pd_fixtures import InProcessPD, _server_args, make_prompts, unified_greedy

from kvship.engine.disagg.base import BackendUnavailableError, get_transfer_backend
from kvship.engine.disagg.wire import KVLayout, WireError

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 8
KW = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=2048, disable_radix_cache=True)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory) -> str:
    return build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_pd")), "v3_yarn_grouped", seed=41)


@pytest.fixture(scope="module")
def ds_runners(ds_dir):
    """(prefill, decode) ModelRunners shared by the backends (no radix cache: their pools end empty)."""
    from kvship.engine.model_runner import ModelRunner

    return ModelRunner(_server_args(ds_dir, mode="prefill", **KW)), ModelRunner(
        _server_args(ds_dir, mode="decode", **KW)
    )


def _need(backend: str) -> None:
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"{backend}: {e}")


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_deepseek_pd_greedy_output_equals_unified_for_each_backend(ds_dir, ds_runners, backend):
    _need(backend)
    prompts = make_prompts(5, seed=17, lo=1, hi=40)  # within one chunk of 16 and over several
    expected = unified_greedy(ds_dir, prompts, MAX_NEW, **KW)
    threads = dict(transfer_threads=len(prompts) + 1)  # a thread per room: every room may go layer-wise
    with InProcessPD(ds_dir, backend=backend, runners=ds_runners, prefill_kv=threads, **KW) as pd:
        rids = pd.run_registered_first(prompts, MAX_NEW)
        for rid, want in zip(rids, expected):
            assert pd.finish(rid, "prefill") == {"type": "length", "length": 0}
            assert pd.tokens(rid) == want, rid
        stats = pd.prefill.get_stats()
        assert stats["kv_transfers_ok"] == len(prompts) and stats["kv_transfers_failed"] == 0
        assert stats["kv_transfers_layerwise"] == len(prompts)
        pd.wait_idle()
        # the latent rows are the only KV: a page of one layer is page_size rows of kv_lora_rank + rope values
        lay = pd.decode.kv_manager.layout
        assert (lay.kv_lora_rank, lay.qk_rope_head_dim, lay.num_buffers) == (32, 8, 3)
        assert lay.page_bytes == 4 * 40 * 4


def test_deepseek_pd_whole_request_send_with_checksum_equals_unified(ds_dir, ds_runners):
    prompts = make_prompts(3, seed=18, lo=5, hi=30)
    expected = unified_greedy(ds_dir, prompts, MAX_NEW, **KW)
    with InProcessPD(ds_dir, runners=ds_runners, decode_kv=dict(checksum=True), **KW) as pd:
        rids = [f"c{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, MAX_NEW)
        pd.wait(rids)
        assert [pd.tokens(r) for r in rids] == expected
        assert pd.prefill.get_stats()["kv_transfers_layerwise"] == 0  # a checksum sends the whole request
        pd.wait_idle()


def test_deepseek_prefill_refuses_a_per_head_decode_naming_both_caches(ds_dir, tiny_llama_dir):
    with InProcessPD(ds_dir, decode_args=dict(model_path=tiny_llama_dir), **KW) as pd:
        pd.submit("m", [5, 6, 7, 8, 9], to="decode")
        pd.wait(["m"], timeout=20)
        msg = pd.finish("m")["message"]
        assert "MLA latent rows (kv_lora_rank 32 + qk_rope_head_dim 8)" in msg and "per-head K/V" in msg, msg
        pd.wait_idle()


def test_mla_layout_round_trips_and_mismatches_name_the_mla_dims():
    mla = KVLayout(
        page_size=4, kv_dtype="bfloat16", num_layers=61, num_kv_heads=1, head_dim=576, total_kv_heads=1,
        kv_lora_rank=512, qk_rope_head_dim=64,
    )  # fmt: skip
    assert KVLayout.from_dict(mla.__dict__) == mla
    assert mla.num_buffers == 61 and mla.num_regions == 62 and mla.kv_planes == 1
    assert mla.mismatch(mla) is None
    # a TP=2 decode rank holds the whole latent row (replicated), and may take it from a TP=1 prefill
    assert mla.mismatch(KVLayout(**{**mla.__dict__, "tp_size": 2, "tp_rank": 1})) is None
    other = KVLayout(**{**mla.__dict__, "kv_lora_rank": 448, "qk_rope_head_dim": 128})
    assert mla.mismatch(other) == (
        "KV cache MLA latent rows (kv_lora_rank 512 + qk_rope_head_dim 64) != "
        "MLA latent rows (kv_lora_rank 448 + qk_rope_head_dim 128)"
    )
    gqa = KVLayout(page_size=4, kv_dtype="bfloat16", num_layers=61, num_kv_heads=1, head_dim=576)
    assert "!= per-head K/V" in mla.mismatch(gqa) and gqa.num_buffers == 122
    with pytest.raises(WireError, match="one KV head of kv_lora_rank"):
        KVLayout.from_dict({**mla.__dict__, "head_dim": 512})

"""The model fingerprint (kvship.engine.fingerprint): what it tells apart, and decode refusing a prefill
worker of another fingerprint with the same KV layout (two tiny random llamas of one shape)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time

import httpx
import pytest
import server_fixtures
from pd_fixtures import KV_SECRET, room_token

from kvship.engine import fingerprint as F
from kvship.engine.disagg.wire import Hello, KVLayout, Welcome, decode_body, encode_frame

LAYOUT = KVLayout(page_size=1, kv_dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)


def _fp(path: str, **kw) -> F.Fingerprint:
    args = dict(dtype="float32", kv_dtype="float32", page_size=1)
    args.update(kw)
    return F.compute_fingerprint(path, **args)


def test_same_shape_other_weights_give_another_fingerprint(tiny_llama_dir, tiny_llama_b_dir, tmp_path):
    a, b = _fp(tiny_llama_dir), _fp(tiny_llama_b_dir)
    assert a.hex != b.hex and a.parts["weights"] != b.parts["weights"]
    assert len(a.hex) == F.FINGERPRINT_HEX and int(a.hex, 16) >= 0
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "copy")  # where the files live does not matter
    assert _fp(str(copy)).hex == a.hex


def test_numerics_and_engine_version_change_the_fingerprint(tiny_llama_dir):
    base = _fp(tiny_llama_dir, engine_version="1")
    for change in (
        dict(dtype="bfloat16"),
        dict(kv_dtype="bfloat16"),
        dict(page_size=16),
        dict(engine_version="2"),
        dict(load_format="dummy"),
    ):
        assert _fp(tiny_llama_dir, **{"engine_version": "1", **change}).hex != base.hex, change
    assert _fp(tiny_llama_dir, engine_version="1").hex == base.hex
    # dummy weights are named by their seed
    assert _fp(tiny_llama_dir, load_format="dummy", seed=1).hex != _fp(tiny_llama_dir, load_format="dummy", seed=2).hex


def test_large_files_are_identified_by_size_and_sampled_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "FULL_HASH_BYTES", 4096)
    monkeypatch.setattr(F, "CHUNK_BYTES", 256)
    data = bytearray(os.urandom(64 * 1024))
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    ident = F.file_identity(str(path))
    assert ident.startswith(f"{len(data)}:")
    # a byte inside a sampled chunk (the head, the tail, a middle sample) changes the identity
    span = len(data) - 256
    for off in (0, len(data) - 1, span * 3 // (F.SAMPLES + 1) + 10):
        changed = bytearray(data)
        changed[off] ^= 0xFF
        path.write_bytes(changed)
        assert F.file_identity(str(path)) != ident, off
    path.write_bytes(data + b"\0")  # so does the size
    assert F.file_identity(str(path)) != ident
    path.write_bytes(data)
    assert F.file_identity(str(path)) == ident


def test_hidden_files_and_readmes_do_not_count(tiny_llama_dir, tmp_path):
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    before = _fp(str(copy)).hex
    (copy / "README.md").write_text("notes")
    os.makedirs(copy / ".cache" / "huggingface")
    (copy / ".cache" / "huggingface" / "x.json").write_text("{}")
    assert _fp(str(copy)).hex == before
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("2048", "4096"))
    assert _fp(str(copy)).hex != before


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _fp(str(tmp_path / "nope"))


def test_hello_and_welcome_carry_the_fingerprint_and_older_frames_still_decode():
    hello = Hello(peer_id="d", backend="tcp", layout=LAYOUT, region_bytes=[1], fingerprint="ab" * 8)
    welcome = Welcome(prefill_id="p", backend="tcp", layout=LAYOUT, fingerprint="cd" * 8)
    assert decode_body(encode_frame(hello)[4:]).fingerprint == "ab" * 8
    assert decode_body(encode_frame(welcome)[4:]).fingerprint == "cd" * 8
    old = Welcome(prefill_id="p", backend="tcp", layout=LAYOUT)
    assert decode_body(encode_frame(old)[4:]).fingerprint == ""


def test_mismatch_rule_names_both_sides():
    assert F.fingerprint_mismatch("a1", "a1") is None
    assert F.fingerprint_mismatch("", "a1") is None  # a peer that reports none (older engine) is not refused
    msg = F.fingerprint_mismatch("a1", "b2")
    assert msg is not None and "prefill a1" in msg and "decode b2" in msg and "fingerprint mismatch" in msg


# --- real workers: prefill of one model, decode of another of the same shape ---------------------------


def _worker(model: str, mode: str, extra: list[str]) -> contextlib.AbstractContextManager:
    args = ["--model-path", model, "--mode", mode, "--max-total-tokens", "2048", "--max-running-requests", "8"]
    # both workers share one KV transfer secret (docs/pd.md, "KV plane authentication")
    return server_fixtures.start_server(args + extra, env={"KVSHIP_KV_TRANSFER_SECRET": KV_SECRET.decode()})


def _free(url: str) -> dict:
    info = httpx.get(url + "/get_server_info", timeout=10).json()
    return {k: info.get(k) for k in ("free_slots", "total_slots", "active_requests")}


def _wait_free(urls: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = {u: _free(u) for u in urls}
        if all(s["free_slots"] == s["total_slots"] and not s["active_requests"] for s in states.values()):
            return
        assert time.monotonic() < deadline, f"KV or requests still held: {states}"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_decode_refuses_a_prefill_of_another_fingerprint_with_a_503_naming_both(tiny_llama_dir, tiny_llama_b_dir):
    boot = server_fixtures.free_port()
    with contextlib.ExitStack() as stack:
        p, d = server_fixtures.enter_together(
            stack,
            [
                _worker(tiny_llama_dir, "prefill", ["--disaggregation-bootstrap-port", str(boot)]),
                _worker(tiny_llama_b_dir, "decode", ["--revision", "rollout-7"]),
            ],
        )
        pi, di = p.get("/get_server_info").json(), d.get("/get_server_info").json()
        assert pi["fingerprint"] != di["fingerprint"]
        assert pi["revision"] == pi["fingerprint"]  # no --revision: the fingerprint is the revision
        assert di["revision"] == "rollout-7" and len(di["fingerprint"]) == 16  # --revision only renames it
        body = {
            "input_ids": list(range(3, 40)),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": 4242,
            "bootstrap_token": room_token(4242),
        }

        async def pair() -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as c:
                p_task = asyncio.create_task(c.post(p.url + "/generate", json=body))
                try:
                    return await c.post(d.url + "/generate", json=body)
                finally:  # what the router does when decode fails first: close the prefill call
                    p_task.cancel()
                    with contextlib.suppress(BaseException):
                        await p_task

        r = asyncio.run(pair())
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "fingerprint mismatch" in message
        assert pi["fingerprint"] in message and di["fingerprint"] in message
        _wait_free([p.url, d.url])

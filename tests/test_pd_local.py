"""``kvship local``: flags, start-up, serving a chat completion, clean SIGINT shutdown, fail-fast."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
from pd_fixtures import ROOT, free_port, pid_alive, start_local, stop_local, unified_greedy

pytestmark = pytest.mark.timeout(400)


def _parse(argv: list[str]) -> argparse.Namespace:
    from kvship.app import local

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    return parser.parse_args(["local", *argv])


def test_worker_flags_pass_through_and_local_flags_stay_local():
    from kvship.app.local import LocalConfig, WorkerFlags, worker_argv
    from kvship.engine.config import dataclass_from_namespace

    ns = _parse(
        [
            "--port",
            "9000",
            "--prefill",
            "2",
            "--page-size",
            "16",
            "--disable-radix-cache",
            "--cuda-graph-bs",
            "1",
            "2",
            "--model-path",
            "/m",
            "--kv-transfer-checksum",
        ]
    )
    cfg = dataclass_from_namespace(LocalConfig, ns)
    assert (cfg.port, cfg.prefill, cfg.decode, cfg.transfer_backend) == (9000, 2, 1, "auto")
    argv = worker_argv(dataclass_from_namespace(WorkerFlags, ns))
    assert argv == [
        "--model-path",
        "/m",
        "--page-size",
        "16",
        "--disable-radix-cache",
        "--cuda-graph-bs",
        "1",
        "2",
        "--kv-transfer-checksum",
    ]
    assert "--port" not in argv and "--mode" not in argv


def test_transfer_backend_auto_is_tcp_on_cpu_and_explicit_choices_are_checked():
    from kvship.app.local import resolve_transfer_backend
    from kvship.engine.disagg import available_transfer_backends

    assert resolve_transfer_backend("auto", "cpu") == "tcp"
    assert resolve_transfer_backend("tcp", "cpu") == "tcp"
    usable = available_transfer_backends()
    assert resolve_transfer_backend("auto", "cuda") == ("nixl" if "nixl" in usable else "tcp")
    for name in usable:
        assert resolve_transfer_backend(name, "cpu") == name


def test_kvship_local_refuses_bad_settings_before_starting_anything():
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "local", "--prefill", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--prefill and --decode must be >= 1" in out.stderr


def _children_with_arg(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read() and pid_alive(int(name)):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def test_kvship_local_fails_fast_with_the_log_of_a_worker_that_cannot_start(tmp_path):
    missing = str(tmp_path / "no-such-model")
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvship.app.cli",
            "local",
            "--model-path",
            missing,
            "--port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - t0 < 150
    assert "exited with status" in out.stderr and "while starting" in out.stderr
    assert "cannot start the server" in out.stderr  # the child's own log tail explains why
    assert not _children_with_arg(missing), "kvship local left children running"


def test_kvship_local_default_serves_a_chat_completion_and_stops_cleanly_on_sigint(smollm2_path):
    import openai

    with start_local(["--device", "cpu"]) as cluster:  # defaults: 1 prefill + 1 decode, embedded SmolLM2, tcp
        assert len(cluster.workers("prefill")) == 1 and len(cluster.workers("decode")) == 1
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=12,
        )
        assert "Paris" in chat.choices[0].message.content
        _structured_output_and_logprobs_through_pd(client, model)
        # the same deployment through /generate: greedy tokens equal the unified scheduler's
        from kvship.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(smollm2_path)
        prompts = [
            tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in ("Name three colors.", "Count from one to five.", "What is 2 + 2?")
        ]
        expected = unified_greedy(smollm2_path, prompts, 16)
        for ids, want in zip(prompts, expected):
            r = cluster.generate(ids, max_new=16)
            assert r.status_code == 200 and r.json()["output_ids"] == want, r.text
        cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))
        worker_pids = [cluster.pid(u) for u in cluster.workers("prefill") + cluster.workers("decode")]
        # this run's KV transfer secret reached both workers through their environment, never argv (docs/pd.md)
        kv_secrets = set()
        for pid in worker_pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert env[b"KVSHIP_KV_TRANSFER_SECRET"] not in f.read()
            kv_secrets.add(env[b"KVSHIP_KV_TRANSFER_SECRET"])
        assert len(kv_secrets) == 1 and len(next(iter(kv_secrets))) == 64
        children = [int(p) for p in open(f"/proc/{cluster.proc.pid}/task/{cluster.proc.pid}/children").read().split()]
        assert set(worker_pids) <= set(children) and len(children) == 3  # + the router
        assert "serving on " + cluster.url in cluster.log("local")
        code = stop_local(cluster.proc)
        assert code == 0, cluster.log("local")
        assert "SIGINT received" in cluster.log("local")
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in children), "children outlived kvship local"


def _structured_output_and_logprobs_through_pd(client, model: str) -> None:
    """response_format json_schema gives valid JSON, and completions logprobs (first token included) come back."""
    import json

    import jsonschema

    name = {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}
    schema = {
        "type": "object",
        "properties": {"city": name, "country": name},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
    )
    answer = json.loads(chat.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris", answer
    comp = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[tok] == value  # greedy: the chosen token is the best alternative

"""Revision-aware routing (kvship.router.revisions; docs/router.md, "Revisions").

Unit tests on the router's choice, discovery reading the ``kvship.io/revision``
pod label (Kubernetes emulator + worker doubles), and a rollout under load
with real ``kvship serve`` PD workers of two tiny models of one shape: no
request ever gets a prefill and a decode worker of different revisions, and
none fails while the new revision comes up and the old one is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx
import kube_emulator
import pytest
import server_fixtures
from conftest import TINY_COMMON
from router_fixtures import running_router, start_double

from kvship.router.circuit import CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.core import NoWorker, Router
from kvship.router.wire import RoutingRequest, WorkerInfo
from kvship.router.worker import Worker

pytestmark = pytest.mark.timeout(300)


def _worker(router: Router, name: str, role: str, revision, model: str = "m", label=None) -> Worker:
    w = Worker(url=f"http://{name}:30000", role=role, breaker=CircuitBreaker(5, 30), label_revision=label)
    w.info = WorkerInfo(models=(model,), mode=role, bootstrap_port=8998 if role == "prefill" else None)
    w.info.revision = revision
    w.healthy = True
    router.registry._workers[w.url] = w
    router.registry.revisions.sync(router.registry.all())
    return w


def _req(model=None) -> RoutingRequest:
    return RoutingRequest(route="/generate", body={}, raw=b"", text="x", model=model, stream=False, session_id=None)


def _pairs(router: Router, n: int = 40) -> set[tuple[str, str]]:
    out = set()
    for _ in range(n):
        sel = router.choose(_req(), set())
        out.add((sel.prefill.url, sel.decode.url))
    return out


def test_pd_pairs_stay_within_the_newest_revision_that_has_both_roles_ready():
    router = Router(RouterConfig(pd=True, policy="random"))
    p1, d1 = _worker(router, "p1", "prefill", "r1"), _worker(router, "d1", "decode", "r1")
    assert _pairs(router) == {(p1.url, d1.url)}
    p2 = _worker(router, "p2", "prefill", "r2")  # the new revision has no decode worker yet: r1 serves
    assert _pairs(router) == {(p1.url, d1.url)}
    assert router.serving_revision() == "r1"
    d2 = _worker(router, "d2", "decode", "r2")
    assert _pairs(router) == {(p2.url, d2.url)}  # newest ready revision takes every new request
    assert router.in_rotation(p2) and router.in_rotation(d2)
    assert not router.in_rotation(p1) and not router.in_rotation(d1)  # draining
    d2.healthy = False  # r2 loses its decode worker: r1 serves again (never p2 with d1)
    assert _pairs(router) == {(p1.url, d1.url)}
    d1.healthy = False  # no decode worker at all
    with pytest.raises(NoWorker, match="no healthy decode worker"):
        router.choose(_req(), set())
    d2.healthy, p2.healthy = True, False  # a prefill of r1 and a decode of r2 only: no pair, and it says why
    with pytest.raises(NoWorker, match="never mixes revisions"):
        router.choose(_req(), set())
    p2.healthy = True
    assert _pairs(router) == {(p2.url, d2.url)}


def test_retries_stay_in_the_revision_even_when_its_workers_failed_this_request():
    router = Router(RouterConfig(pd=True, policy="round_robin"))
    _worker(router, "p1", "prefill", "r1"), _worker(router, "d1", "decode", "r1")
    p2, d2 = _worker(router, "p2", "prefill", "r2"), _worker(router, "d2", "decode", "r2")
    sel = router.choose(_req(), {p2.url, d2.url})  # both excluded: stay on r2 rather than mix or move
    assert (sel.prefill, sel.decode) == (p2, d2)


def test_revisions_are_per_model_and_a_revision_that_comes_back_counts_as_new():
    router = Router(RouterConfig(policy="round_robin"))
    a1 = _worker(router, "a1", "unified", "ra1", model="A")
    b1 = _worker(router, "b1", "unified", "rb1", model="B")
    # model B's newer revision does not take model A's requests
    assert router.choose(_req("A"), set()).worker is a1 and router.choose(_req("B"), set()).worker is b1
    a2 = _worker(router, "a2", "unified", "ra2", model="A")
    assert {router.choose(_req("A"), set()).worker.url for _ in range(6)} == {a2.url}
    router.registry.remove(a1.url)
    router.registry.remove(a2.url)
    a1b = _worker(router, "a1b", "unified", "ra1", model="A")  # rollback: ra1 is back, it is the newest now
    a2b = _worker(router, "a2b", "unified", "ra2", model="A")
    assert router.serving_revision("A") == "ra2"  # added after a1b: newer
    router.registry.remove(a2b.url)
    assert router.serving_revision("A") == "ra1" and router.choose(_req("A"), set()).worker is a1b


def test_the_pod_label_wins_over_what_the_worker_reports():
    router = Router(RouterConfig(pd=True))
    w = _worker(router, "p", "prefill", "fingerprint-x", label="op-rev-1")
    assert w.revision == "op-rev-1"
    assert WorkerInfo.parse({}, {"fingerprint": "f1"}, None).revision == "f1"
    assert WorkerInfo.parse({}, {"fingerprint": "f1", "revision": "r9"}, None).revision == "r9"
    assert WorkerInfo.parse({}, {}, None).revision is None  # an older worker: revision None


def test_workers_report_has_the_contract_fields():
    router = Router(RouterConfig(pd=True, policy="random"))
    _worker(router, "p1", "prefill", "r1"), _worker(router, "d1", "decode", "r1")
    _worker(router, "p2", "prefill", "r2")
    report = router.workers_report()
    assert report["pd"] is True
    by_url = {w["url"]: w for w in report["workers"]}
    assert by_url["http://p1:30000"]["state"] == "serving" and by_url["http://p1:30000"]["in_rotation"] is True
    assert by_url["http://p2:30000"]["state"] == "draining" and by_url["http://p2:30000"]["in_rotation"] is False
    for w in report["workers"]:
        assert {"url", "role", "revision", "state", "in_rotation", "pod", "healthy", "in_flight"} <= set(w)
    revs = {r["revision"]: r for r in report["revisions"]}
    assert revs["r1"]["serving"] is True and revs["r1"]["prefill_ready"] == 1 and revs["r1"]["decode_ready"] == 1
    assert revs["r2"]["serving"] is False and revs["r2"]["prefill_ready"] == 1 and revs["r2"]["decode_ready"] == 0
    assert [r["revision"] for r in report["revisions"]] == ["r1", "r2"]  # oldest first


# --- discovery reads the revision label (Kubernetes emulator, worker doubles) -----------------------------


def _pod(name: str, role: str, revision: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"app": "kvship", "role": role, "kvship.io/revision": revision},
            "annotations": {"kvship.io/port": str(port)},
        },
        "spec": {"containers": [{"name": "worker", "image": "kvship/worker"}]},
    }


def _ready(kube, name: str) -> None:
    status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
    kube.patch_status("v1", "pods", "default", name, status)


async def _until(predicate, timeout: float = 15.0) -> None:
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_discovery_reads_the_revision_label_and_moves_traffic_when_the_new_pair_is_ready():
    with (
        kube_emulator.EmulatorThread() as k,
        start_double(name="p-old", mode="prefill", bootstrap_port=8998) as p_old,
        start_double(name="d-old", mode="decode") as d_old,
        start_double(name="p-new", mode="prefill", bootstrap_port=8999) as p_new,
        start_double(name="d-new", mode="decode") as d_new,
    ):
        for name, role, rev, dbl in (
            ("prefill-old", "prefill", "aaaa", p_old),
            ("decode-old", "decode", "aaaa", d_old),
        ):
            k.create("v1", "pods", "default", _pod(name, role, rev, dbl.port))
            _ready(k, name)
        config = RouterConfig(
            debug_headers=True,
            pd=True,
            service_discovery=True,
            prefill_selector=["app=kvship", "role=prefill"],
            decode_selector=["app=kvship", "role=decode"],
            namespace="default",
            kubeconfig=k.kubeconfig,
            health_check_interval=0.5,
        )
        async with running_router(config) as (url, _), httpx.AsyncClient(timeout=10) as c:

            async def report() -> dict:
                return (await c.get(url + "/workers")).json()

            async def ready() -> bool:
                return (await c.get(url + "/readiness")).status_code == 200

            await _until(ready)
            rep = await report()
            ws = {w["url"]: w for w in rep["workers"]}
            assert ws[p_old.url]["revision"] == "aaaa" and ws[p_old.url]["pod"] == "prefill-old"
            assert ws[p_old.url]["in_rotation"] and ws[d_old.url]["in_rotation"]
            k.create("v1", "pods", "default", _pod("prefill-new", "prefill", "bbbb", p_new.port))
            _ready(k, "prefill-new")

            async def listed_new_prefill() -> bool:
                return any(w["url"] == p_new.url and w["healthy"] for w in (await report())["workers"])

            await _until(listed_new_prefill)
            r = await c.post(url + "/generate", json={"text": "x"})  # bbbb has no decode: aaaa still serves
            assert (r.headers["x-kvship-prefill"], r.headers["x-kvship-decode"]) == (p_old.url, d_old.url)
            k.create("v1", "pods", "default", _pod("decode-new", "decode", "bbbb", d_new.port))
            _ready(k, "decode-new")

            async def new_serves() -> bool:
                revs = {r["revision"]: r for r in (await report())["revisions"]}
                return revs.get("bbbb", {}).get("serving") is True

            await _until(new_serves)
            for _ in range(5):
                r = await c.post(url + "/generate", json={"text": "x"})
                assert (r.headers["x-kvship-prefill"], r.headers["x-kvship-decode"]) == (p_new.url, d_new.url)
            ws = {w["url"]: w for w in (await report())["workers"]}
            assert ws[p_old.url]["state"] == "draining" and not ws[p_old.url]["in_rotation"]
            assert ws[d_new.url]["state"] == "serving" and ws[d_new.url]["pod"] == "decode-new"


# --- a rollout under load with real PD workers of two models -------------------------------------------


def _pd_worker(model: str, mode: str) -> contextlib.AbstractContextManager:
    args = ["--model-path", model, "--mode", mode, "--served-model-name", "tiny"]
    args += ["--max-total-tokens", "4096", "--max-running-requests", "8"]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(server_fixtures.free_port())]
    # the KV plane is authenticated (docs/security.md): every worker of the test shares one secret
    return server_fixtures.start_server(args, env={"KVSHIP_KV_TRANSFER_SECRET": "rollout-test-kv-secret-0123456789"})


@pytest.mark.slow
async def test_rollout_under_load_never_mixes_revisions_and_fails_no_request(tiny_llama_dir, tiny_llama_b_dir):
    with contextlib.ExitStack() as stack:
        pa, da, pb, db = server_fixtures.enter_together(
            stack,
            [
                _pd_worker(tiny_llama_dir, "prefill"),
                _pd_worker(tiny_llama_dir, "decode"),
                _pd_worker(tiny_llama_b_dir, "prefill"),
                _pd_worker(tiny_llama_b_dir, "decode"),
            ],
        )
        rev = {w.url: w.get("/get_server_info").json()["revision"] for w in (pa, da, pb, db)}
        assert rev[pa.url] == rev[da.url] != rev[pb.url] == rev[db.url]
        config = RouterConfig(
            debug_headers=True,
            pd=True,
            prefill=[pa.url],
            decode=[da.url],
            health_check_interval=0.5,
            slo_scrape_interval=0.3,
            admin_api_key="rollout-admin",  # the rollout below adds and removes workers through the admin API
        )
        admin = {"authorization": "Bearer rollout-admin"}
        async with running_router(config) as (url, app), httpx.AsyncClient(timeout=120, headers=admin) as c:
            results: list[tuple[int, str, str, str, int]] = []  # status, prefill, decode, error text, prompt len
            stop = asyncio.Event()

            async def one(i: int) -> None:
                rng = random.Random(i)
                n = 0
                while not stop.is_set():
                    n += 1
                    ids = [rng.randrange(3, 380) for _ in range(rng.randrange(4, 40))]
                    if n % 2:
                        body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "stream": True}
                        async with c.stream("POST", url + "/v1/completions", json=body) as r:
                            text = (await r.aread()).decode()
                            err = text if r.status_code != 200 or '"error"' in text else ""
                    else:
                        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
                        r = await c.post(url + "/generate", json=body)
                        err = r.text if r.status_code != 200 else ""
                    results.append(
                        (
                            r.status_code,
                            r.headers.get("x-kvship-prefill", ""),
                            r.headers.get("x-kvship-decode", ""),
                            err,
                            len(ids),
                        )
                    )

            async def served_by(prefill_url: str, at_least: int) -> None:
                start = len(results)
                await _until(lambda: _count(results[start:], prefill_url, at_least), timeout=120)

            async def _count(rs, prefill_url, k) -> bool:
                return sum(1 for r in rs if r[1] == prefill_url) >= k

            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            try:
                await served_by(pa.url, 6)
                assert (await c.post(url + "/workers", json={"url": pb.url, "role": "prefill"})).status_code == 200
                await served_by(pa.url, 6)  # the new revision lacks a decode worker: the old one still serves
                assert (await c.post(url + "/workers", json={"url": db.url, "role": "decode"})).status_code == 200
                await served_by(pb.url, 6)  # traffic moved to the new revision

                async def old_drained() -> bool:
                    ws = {w["url"]: w for w in (await c.get(url + "/workers")).json()["workers"]}
                    return all(ws[u]["in_flight"] == 0 and not ws[u]["in_rotation"] for u in (pa.url, da.url))

                await _until(old_drained, timeout=60)
                marker = len(results)
                for old in (pa, da):
                    assert (await c.delete(url + "/workers", params={"url": old.url})).status_code == 200
                await asyncio.to_thread(pa.stop)
                await asyncio.to_thread(da.stop)
                await served_by(pb.url, 6)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            slo = (await c.get(url + "/slo")).json()
        errors = [r for r in results if r[0] != 200 or r[3]]
        assert not errors, errors[:3]
        mixed = [r for r in results if rev[r[1]] != rev[r[2]]]
        assert not mixed, mixed[:3]
        assert all(r[1] == pb.url for r in results[marker:])
        # decode workers report the KV bytes they received; the router turns that into a rate
        assert slo["kv_transfer_gbps"] is not None and slo["kv_transfer_gbps"] > 0
        # float32 KV (CPU), page size 1: every prompt token brings K and V of every layer
        per_token = (
            TINY_COMMON["num_key_value_heads"] * TINY_COMMON["head_dim"] * 4 * 2 * TINY_COMMON["num_hidden_layers"]
        )
        expected = per_token * sum(r[4] for r in results if r[2] == db.url)
        assert db.get("/get_server_info").json()["kv_transfer_bytes"] == expected > 0
        assert slo["requests"] > 0 and slo["ttft_p50_ms"] is not None


def test_a_resumed_stream_stays_on_its_revision_while_that_one_is_ready():
    router = Router(RouterConfig(pd=True, policy="random"))
    p1, d1 = _worker(router, "p1", "prefill", "r1"), _worker(router, "d1", "decode", "r1")
    p2, d2 = _worker(router, "p2", "prefill", "r2"), _worker(router, "d2", "decode", "r2")
    assert router.serving_revision() == "r2"
    sel = router.choose(_req(), set(), prefer_revision="r1")  # the broken stream began on r1
    assert (sel.prefill, sel.decode) == (p1, d1)
    d1.healthy = False  # r1 is not ready any more: the continuation goes to the serving revision
    sel = router.choose(_req(), set(), prefer_revision="r1")
    assert (sel.prefill, sel.decode) == (p2, d2)


def _k8s_pod(conditions: dict, gates: tuple = ()):
    from kubernetes.client import (
        V1Container,
        V1ObjectMeta,
        V1Pod,
        V1PodCondition,
        V1PodReadinessGate,
        V1PodSpec,
        V1PodStatus,
    )

    return V1Pod(
        metadata=V1ObjectMeta(name="p", namespace="default", annotations={}),
        spec=V1PodSpec(
            containers=[V1Container(name="worker")],
            readiness_gates=[V1PodReadinessGate(condition_type=g) for g in gates] or None,
        ),
        status=V1PodStatus(
            pod_ip="10.0.0.1", conditions=[V1PodCondition(type=t, status=s) for t, s in conditions.items()]
        ),
    )


def test_discovery_takes_pods_held_back_only_by_the_in_rotation_gate():
    from kvship.router.discovery import IN_ROTATION_GATE, pod_worker_url

    ready = {"ContainersReady": "True", "Ready": "True"}
    gated = {"ContainersReady": "True", "Ready": "False"}
    assert pod_worker_url(_k8s_pod(ready), 30000) == "http://10.0.0.1:30000"
    # the operator turns the gate True only once this router lists the pod: waiting for Ready would never end
    assert pod_worker_url(_k8s_pod(gated, (IN_ROTATION_GATE,)), 30000) == "http://10.0.0.1:30000"
    assert pod_worker_url(_k8s_pod(gated), 30000) is None  # no gate: Ready is what counts
    assert pod_worker_url(_k8s_pod({"ContainersReady": "False", "Ready": "False"}, (IN_ROTATION_GATE,)), 30000) is None
    other = {**gated, "example.com/warm": "False"}  # another gate that is not True still holds the pod back
    assert pod_worker_url(_k8s_pod(other, (IN_ROTATION_GATE, "example.com/warm")), 30000) is None
    other["example.com/warm"] = "True"
    assert pod_worker_url(_k8s_pod(other, (IN_ROTATION_GATE, "example.com/warm")), 30000) is not None

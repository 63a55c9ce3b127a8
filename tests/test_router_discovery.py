"""Kubernetes discovery against a Kubernetes-API-compatible server on loopback (tests/kube_emulator.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import kube_emulator
import pytest
from router_fixtures import running_router, start_double

from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)


def make_pod(name: str, labels: dict, port: int | None = None) -> dict:
    meta = {"name": name, "namespace": "default", "labels": labels}
    if port is not None:
        meta["annotations"] = {"kvship.io/port": str(port)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "worker", "image": "kvship/worker"}]},
    }


def set_ready(kube, name: str, ready: bool, ip: str | None = "127.0.0.1") -> None:
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    kube.patch_status("v1", "pods", "default", name, status)


async def listed(client: httpx.AsyncClient, url: str) -> dict[str, dict]:
    return {w["url"]: w for w in (await client.get(url + "/workers")).json()["workers"]}


async def eventually(predicate, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


@contextlib.contextmanager
def kube():
    with kube_emulator.EmulatorThread() as k:
        yield k


async def test_discovery_adds_ready_pods_and_drops_unready_or_deleted_ones():
    with kube() as k, start_double(name="a") as a, start_double(name="b") as b, start_double(name="c") as c:
        labels = {"app": "kvship", "role": "worker"}
        k.create("v1", "pods", "default", make_pod("pod-a", labels, a.port))
        set_ready(k, "pod-a", True)
        k.create("v1", "pods", "default", make_pod("pod-b", labels, b.port))  # not Ready yet
        set_ready(k, "pod-b", False)
        k.create("v1", "pods", "default", make_pod("other", {"app": "else"}, c.port))
        set_ready(k, "other", True)
        config = RouterConfig(
            debug_headers=True,
            service_discovery=True,
            selector=["app=kvship", "role=worker"],
            namespace="default",
            kubeconfig=k.kubeconfig,
            health_check_interval=0.5,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:

                async def only_a() -> bool:
                    ws = await listed(client, url)
                    return set(ws) == {a.url} and ws[a.url]["healthy"]

                await eventually(only_a)
                assert (await listed(client, url))[a.url]["source"] == "discovery"
                r = await client.post(url + "/generate", json={"text": "x"})
                assert r.status_code == 200 and r.headers["x-kvship-worker"] == a.url

                set_ready(k, "pod-b", True)  # b becomes Ready: added

                async def both() -> bool:
                    ws = await listed(client, url)
                    return set(ws) == {a.url, b.url} and all(w["healthy"] for w in ws.values())

                await eventually(both)

                set_ready(k, "pod-a", False)  # a not Ready: dropped

                async def only_b() -> bool:
                    return set(await listed(client, url)) == {b.url}

                await eventually(only_b)

                k.delete("v1", "pods", "default", "pod-b")  # b deleted: dropped

                async def none() -> bool:
                    return not await listed(client, url)

                await eventually(none)
                r = await client.post(url + "/generate", json={"text": "x"})
                assert r.status_code == 503

                k.create("v1", "pods", "default", make_pod("pod-c", labels, c.port))  # a new pod
                set_ready(k, "pod-c", True)

                async def only_c() -> bool:
                    return set(await listed(client, url)) == {c.url}

                await eventually(only_c)


async def test_discovery_uses_the_default_port_without_annotation_and_ignores_pods_without_ip():
    with kube() as k, start_double(name="a") as a:
        labels = {"app": "kvship"}
        k.create("v1", "pods", "default", make_pod("no-annotation", labels))
        set_ready(k, "no-annotation", True, ip="127.0.0.1")
        k.create("v1", "pods", "default", make_pod("no-ip", labels, a.port))
        set_ready(k, "no-ip", True, ip=None)
        config = RouterConfig(
            debug_headers=True,
            service_discovery=True,
            selector=["app=kvship"],
            namespace="default",
            kubeconfig=k.kubeconfig,
            service_discovery_port=a.port,
            health_check_interval=0.5,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:

                async def found() -> bool:
                    return set(await listed(client, url)) == {a.url}

                await eventually(found)
                await asyncio.sleep(0.3)
                assert set(await listed(client, url)) == {a.url}  # the pod without IP stayed out


async def test_pd_discovery_sorts_pods_into_prefill_and_decode_by_selector():
    with (
        kube() as k,
        start_double(name="p", mode="prefill", bootstrap_port=8998) as p,
        start_double(name="d", mode="decode") as d,
    ):
        k.create("v1", "pods", "default", make_pod("prefill-0", {"app": "kvship", "role": "prefill"}, p.port))
        set_ready(k, "prefill-0", True)
        k.create("v1", "pods", "default", make_pod("decode-0", {"app": "kvship", "role": "decode"}, d.port))
        set_ready(k, "decode-0", True)
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
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=10) as client:

                async def ready() -> bool:
                    return (await client.get(url + "/readiness")).status_code == 200

                await eventually(ready)
                ws = await listed(client, url)
                assert ws[p.url]["role"] == "prefill" and ws[p.url]["bootstrap_port"] == 8998
                assert ws[d.url]["role"] == "decode"
                r = await client.post(url + "/generate", json={"text": "x"})
                assert r.status_code == 200
                assert r.headers["x-kvship-prefill"] == p.url and r.headers["x-kvship-decode"] == d.url

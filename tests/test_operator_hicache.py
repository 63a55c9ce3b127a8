"""The operator's shared KV tier (``spec.hicache``; docs/operator.md, "Shared KV tier") and its KV-events wiring.

* builders: ``storage: mooncake`` makes the master's Deployment, Service and NetworkPolicy (valid against the
  Kubernetes schema, hardened, one pod, recreated) and gives every worker the store flags with the Service's
  address; a ``mooncakeMaster`` of the user's makes none of them; ``storage: file`` mounts the claim; unified
  workers sharing a Mooncake store reach each other; a ``kv_events`` router turns on its roles' KV events;
* the spec: the CRD's rules and the operator-owned store flags are refused with the field to use;
* a real run: the master container's argv (``kvship mooncake-master ...``) starts the package's real
  ``mooncake_master``, and a store built from a worker's argv, as the worker parses it, writes and reads pages
  through it at the address the worker advertises.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import kubernetes_validate
import pytest
from test_operator_builders import IMAGES, PD, by_kind, config, container, server_parser

from kvship.operator.builders import build_children
from kvship.operator.builders.store import MASTER_ROLE
from kvship.operator.spec import SpecError, parse_service

UNIFIED = {"model": {"uri": "builtin:smollm2"}, "decode": {"replicas": 2}}
MOONCAKE = {"storage": "mooncake"}


def children(spec: dict) -> list[dict]:
    out = build_children(config(spec), IMAGES)
    for obj in out:
        kubernetes_validate.validate(obj, "1.35.0", strict=True)
    return out


def errors(spec: dict, **kw) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_service({"metadata": {"name": "svc", "namespace": "ml"}, "spec": spec}, **kw)
    return e.value.errors


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def test_mooncake_storage_runs_one_hardened_master_and_points_every_worker_at_its_service():
    objs = children(dict(PD, hicache=MOONCAKE))
    deps, svcs, policies = by_kind(objs, "Deployment"), by_kind(objs, "Service"), by_kind(objs, "NetworkPolicy")
    master = deps["svc-mooncake-master"]
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"] == {"type": "Recreate"}
    c = container(master)
    assert c["image"] == IMAGES.worker
    assert c["args"] == ["mooncake-master", "--host", "0.0.0.0", "--port", "50051"]
    assert c["ports"] == [{"name": "rpc", "containerPort": 50051, "protocol": "TCP"}]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] and c["readinessProbe"]["tcpSocket"] == {"port": "rpc"}
    pod = master["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"]
    svc = svcs["svc-mooncake-master"]
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["selector"]["kvship.io/role"] == MASTER_ROLE
    # the master before the workers in apply order: they connect to it as they start
    names = [o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"]
    assert names.index("svc-mooncake-master") < min(i for i, n in enumerate(names) if n.startswith("svc-prefill"))
    for role in ("prefill", "decode"):
        args = container(deps[f"svc-{role}"])["args"]
        assert flag(args, "--hicache-storage") == "mooncake"
        assert flag(args, "--hicache-storage-master") == "svc-mooncake-master.ml.svc:50051"
        assert flag(args, "--hicache-storage-metadata") == "P2PHANDSHAKE"
        server_parser().parse_args(args[1:])  # the worker takes them
    # only this service's workers reach the master's (unauthenticated) RPC port
    ingress = policies["svc-mooncake-master"]["spec"]["ingress"]
    assert ingress[0]["ports"] == [{"protocol": "TCP", "port": 50051}]
    roles = ingress[0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert sorted(roles) == ["decode", "prefill"] and len(ingress) == 1


def test_storage_off_or_an_external_master_makes_no_master():
    for hicache in ({}, {"storage": "none"}, {"storage": "mooncake", "mooncakeMaster": "store.infra:7000"}):
        objs = children(dict(PD, hicache=hicache))
        assert not [o for o in objs if MASTER_ROLE in o["metadata"]["name"]], hicache
    args = container(by_kind(children(dict(PD, hicache={})), "Deployment")["svc-decode"])["args"]
    assert not [a for a in args if a.startswith("--hicache")]
    objs = children(dict(PD, hicache={"storage": "mooncake", "mooncakeMaster": "store.infra:7000"}))
    args = container(by_kind(objs, "Deployment")["svc-prefill"])["args"]
    assert flag(args, "--hicache-storage-master") == "store.infra:7000"


def test_master_settings_are_passed_through():
    m = {
        "image": "reg/mooncake:2",
        "port": 6000,
        "resources": {"limits": {"memory": "4Gi"}},
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "x", "operator": "Exists"}],
    }
    objs = children(dict(UNIFIED, hicache={"storage": "mooncake", "master": m}))
    deps = by_kind(objs, "Deployment")
    c = container(deps["svc-mooncake-master"])
    assert c["image"] == "reg/mooncake:2" and c["args"][-2:] == ["--port", "6000"]
    assert c["resources"]["limits"] == {"memory": "4Gi"} and "memory" not in c["resources"].get("requests", {})
    pod = deps["svc-mooncake-master"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == m["tolerations"]
    assert by_kind(objs, "Service")["svc-mooncake-master"]["spec"]["ports"][0]["port"] == 6000
    assert flag(container(deps["svc-worker"])["args"], "--hicache-storage-master") == "svc-mooncake-master.ml.svc:6000"


def test_unified_workers_sharing_a_mooncake_store_reach_each_other():
    def worker_ingress(spec: dict) -> list[dict]:
        return by_kind(children(spec), "NetworkPolicy")["svc-worker"]["spec"]["ingress"]

    plain = worker_ingress(UNIFIED)
    assert all("ports" in rule for rule in plain)  # the HTTP port only
    shared = worker_ingress(dict(UNIFIED, hicache=MOONCAKE))
    every_port = [rule for rule in shared if "ports" not in rule]
    assert len(every_port) == 1
    assert every_port[0]["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["unified"]


def test_file_storage_mounts_the_claim_in_every_worker():
    objs = children(dict(PD, hicache={"storage": "file", "volumeClaim": "kv-pages"}))
    for role in ("prefill", "decode"):
        dep = by_kind(objs, "Deployment")[f"svc-{role}"]
        c = container(dep)
        assert flag(c["args"], "--hicache-storage") == "file"
        assert flag(c["args"], "--hicache-storage-path") == "/kv-store"
        assert {"name": "kv-store", "mountPath": "/kv-store"} in c["volumeMounts"]
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert {"name": "kv-store", "persistentVolumeClaim": {"claimName": "kv-pages"}} in volumes
    assert not [o for o in objs if MASTER_ROLE in o["metadata"]["name"]]


@pytest.mark.parametrize(
    "router, on",
    [
        ({"policy": "kv_events"}, {"prefill", "decode"}),
        ({"prefillPolicy": "kv_events"}, {"prefill"}),
        ({"policy": "kv_events", "decodePolicy": "round_robin"}, {"prefill"}),
        ({"decodePolicy": "kv_events"}, {"decode"}),
        ({}, set()),
    ],
)
def test_a_kv_events_router_turns_on_the_events_of_the_roles_it_routes(router, on):
    deps = by_kind(children(dict(PD, router=router)), "Deployment")
    got = {role for role in ("prefill", "decode") if "--enable-kv-events" in container(deps[f"svc-{role}"])["args"]}
    assert got == on
    unified = by_kind(children(dict(UNIFIED, router={"policy": "kv_events"})), "Deployment")["svc-worker"]
    assert "--enable-kv-events" in container(unified)["args"]


def test_the_spec_refuses_what_the_tier_cannot_run_with_the_field_to_change():
    assert errors(dict(UNIFIED, hicache={"storage": "file"})) == [
        "spec.hicache.volumeClaim: required with storage file (a ReadWriteMany claim)"
    ]
    assert errors(dict(UNIFIED, hicache={"storage": "mooncake", "volumeClaim": "x"})) == [
        "spec.hicache.volumeClaim: used by storage file only (storage is mooncake)"
    ]
    assert errors(dict(UNIFIED, hicache={"mooncakeMaster": "m:1"})) == [
        "spec.hicache.mooncakeMaster: used by storage mooncake only (storage is none)"
    ]
    assert errors(dict(UNIFIED, hicache={"storage": "mooncake", "mooncakeMaster": "m:70000"})) == [
        "spec.hicache.mooncakeMaster: 'm:70000' has no port in 1-65535"
    ]
    assert errors(dict(UNIFIED, hicache={"storage": "mooncake", "mooncakeMaster": "no-port"}))[0].startswith(
        "spec.hicache.mooncakeMaster: must be HOST:PORT"
    )
    assert errors(dict(UNIFIED, hicache={"storage": "s3"}))[0].startswith("spec.hicache.storage:")
    # the store's flags belong to spec.hicache: extraArgs may not set them, in any spelling
    for args, field in (
        (["--hicache-storage", "file"], "hicache.storage"),
        (["--hicache-storage-path=/x"], "hicache.volumeClaim (storage file)"),
        (["--hicache-storage-master", "m:1"], "hicache.mooncakeMaster (storage mooncake)"),
        (["--hicache-storage-metadata", "http://m:8080/metadata"], "hicache.storage"),
    ):
        errs = errors(dict(UNIFIED, engine={"extraArgs": args}))
        assert len(errs) == 1 and errs[0].startswith(
            f"spec.engine.extraArgs[0]: {args[0].split('=')[0]} is set by the operator; use spec.{field}"
        ), errs
    # the tier's size and bandwidth stay worker flags
    parse_service(
        {"metadata": {"name": "svc"}, "spec": dict(UNIFIED, engine={"extraArgs": ["--hicache-storage-size-gb", "8"]})}
    )
    # a kv_events router reads the events a --no-enable-kv-events would turn off
    assert errors(
        dict(
            PD, router={"prefillPolicy": "kv_events"}, prefill=dict(PD["prefill"], extraArgs=["--no-enable-kv-events"])
        )
    ) == [
        "spec.prefill.extraArgs: --no-enable-kv-events, but the router routes the prefill workers by policy "
        "kv_events, which reads their KV events"
    ]
    parse_service(
        {
            "metadata": {"name": "svc"},
            "spec": dict(PD, prefill=dict(PD["prefill"], extraArgs=["--no-enable-kv-events"])),
        }
    )
    assert errors(dict(UNIFIED, router={"policy": "kv_events"}, decode={"extraArgs": ["--no-enable-kv-events"]})) == [
        "spec.decode.extraArgs: --no-enable-kv-events, but the router routes the unified workers by policy "
        "kv_events, which reads their KV events"
    ]
    # the master's image is held to the operator's allowed prefixes like the others
    spec = dict(
        UNIFIED, engine={"image": "reg.io/w:1"}, hicache={"storage": "mooncake", "master": {"image": "evil.io/m:1"}}
    )
    assert errors(spec, allowed_image_prefixes=("reg.io/",)) == [
        "spec.hicache.master.image: 'evil.io/m:1' is not allowed by this operator (images must start with one of: "
        "reg.io/)"
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_master_pods_argv_runs_the_real_master_and_a_workers_store_flags_reach_it(monkeypatch):
    pytest.importorskip("mooncake.store", reason="the mooncake package has no distributed store here")
    from kvship.app.mooncake_master import mooncake_master_binary

    try:
        mooncake_master_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    from kvship.engine.config import ServerArgs
    from kvship.engine.mem.hicache_store import make_page_store

    port = _free_port()
    objs = children(dict(UNIFIED, hicache={"storage": "mooncake", "master": {"port": port}}))
    deps = by_kind(objs, "Deployment")
    argv = container(deps["svc-mooncake-master"])["args"]
    # the pod's argv after the image's `kvship` entrypoint; here bound on loopback, not the pod's every address
    argv = [("127.0.0.1" if a == "0.0.0.0" else a) for a in argv] + ["--metrics-port", str(_free_port())]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvship.app.cli", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None, f"the master exited with {proc.returncode}"
                assert time.monotonic() < deadline, "the master never listened"
                time.sleep(0.1)
        worker_argv = container(deps["svc-worker"])["args"][1:]  # after `serve`
        master = flag(worker_argv, "--hicache-storage-master")
        assert master == f"svc-mooncake-master.ml.svc:{port}"
        # in the cluster that name is the Service's; here the master's host is this machine
        worker_argv[worker_argv.index(master)] = f"localhost:{port}"
        args = ServerArgs.from_cli_args(server_parser().parse_args(worker_argv))
        # the pod IP the operator gives the worker (KVSHIP_ADVERTISE_HOST): what the other workers read it at
        monkeypatch.setenv("KVSHIP_ADVERTISE_HOST", "127.0.0.1")
        store = make_page_store(args)  # connects in the background: a worker never waits for its store
        assert store.wait_connected(60), "the store never connected to the master"
        try:
            store.put("page-1", b"\x01" * 4096)
            assert store.exists(["page-1", "page-2"]) == [True, False]
            assert store.get("page-1") == b"\x01" * 4096
        finally:
            store.close()
    finally:
        proc.terminate()
        assert proc.wait(10) is not None


def test_a_pod_without_the_master_binary_exits_with_the_reason(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path), PYTHONPATH=str(tmp_path))
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")  # a mooncake package without the binary
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "mooncake-master", "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "no mooncake_master is installed here" in out.stderr, out.stderr

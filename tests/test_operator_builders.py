"""Layer 2: the pure builders emit valid, hardened Kubernetes objects whose argv the workers and router accept."""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvship.engine.config import ServerArgs, add_dataclass_arguments
from kvship.operator.builders import Images, build_children
from kvship.operator.builders.workers import EP_FLAG, PP_FLAG, SPEC_FLAGS, TP_FLAG
from kvship.operator.spec import SpecError, parse_service
from kvship.router.config import RouterConfig

ROOT = Path(__file__).resolve().parent.parent
IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
EXAMPLES = sorted(glob.glob(str(ROOT / "examples" / "*.yaml")))
GPU = "nvidia.com/gpu"
# Speculative-decoding worker flags: the builders emit them only when the spec asks for speculation.
SPEC_WORKER_FLAGS = {*SPEC_FLAGS.values()}


def config(spec: dict, name: str = "svc"):
    return parse_service({"metadata": {"name": name, "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": spec})


def example(path: str):
    body = yaml.safe_load(Path(path).read_text())
    body["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    return parse_service(body)


def by_kind(children: list[dict], kind: str) -> dict[str, dict]:
    """Children of ``kind`` by name; PD worker Deployments by ``<name>-<role>`` (without their revision suffix)."""
    return {_unrevisioned(c["metadata"]): c for c in children if c["kind"] == kind}


def _unrevisioned(meta: dict) -> str:
    rev = (meta.get("labels") or {}).get("kvship.io/revision")
    name = meta["name"]
    return name[: -len(rev) - 1] if rev and name.endswith("-" + rev) else name


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_arguments(p, RouterConfig)
    return p


PD = {
    "model": {"uri": "hf://org/model"},
    "prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "kvTransfer": {"backend": "mooncake", "rdmaDevices": ["mlx5_0", "mlx5_1"], "bootstrapPort": 9000},
}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_every_child_of_every_example_passes_the_kubernetes_schema(path):
    for obj in build_children(example(path), IMAGES):
        kubernetes_validate.validate(obj, "1.35.0", strict=True)


def test_unified_children_and_names():
    children = build_children(config({"model": {"uri": "builtin:smollm2"}}), IMAGES)
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in children)
    assert kinds == [
        ("ConfigMap", "svc-config"),
        ("Deployment", "svc-router"),
        ("Deployment", "svc-worker"),
        ("NetworkPolicy", "svc-router"),
        ("NetworkPolicy", "svc-worker"),
        ("Role", "svc-router"),
        ("RoleBinding", "svc-router"),
        ("Service", "svc-router"),
        ("Service", "svc-worker"),
        ("ServiceAccount", "svc-router"),
    ]


def test_pd_children_add_prefill_and_decode_roles():
    names = {(c["kind"], _unrevisioned(c["metadata"])) for c in build_children(config(PD), IMAGES)}
    assert {
        ("Deployment", "svc-prefill"),
        ("Deployment", "svc-decode"),
        ("Service", "svc-prefill"),
        ("PodDisruptionBudget", "svc-prefill"),
        ("PodDisruptionBudget", "svc-decode"),
    } <= names
    assert ("Deployment", "svc-worker") not in names


def test_every_child_is_owned_labelled_and_namespaced():
    for obj in build_children(config(PD), IMAGES):
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvship.io/v1alpha1",
                "kind": "InferenceService",
                "name": "svc",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/instance"] == "svc"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvship-operator"
        assert meta["labels"]["app.kubernetes.io/name"] == "kvship"


def test_builders_are_deterministic():
    assert build_children(config(PD), IMAGES) == build_children(config(PD), IMAGES)


def test_unified_worker_and_router_arguments():
    deps = by_kind(build_children(config({"model": {"uri": "builtin:smollm2"}}), IMAGES), "Deployment")
    w = container(deps["svc-worker"])
    assert w["args"][:8] == [
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--mode",
        "unified",
        "--served-model-name",
    ]
    assert "--model-path" not in w["args"] and not any(a.startswith("--disaggregation") for a in w["args"])
    ns = router_parser().parse_args(container(deps["svc-router"])["args"][1:])
    cfg = RouterConfig(**{k: v for k, v in vars(ns).items()})
    assert cfg.service_discovery and not cfg.pd and cfg.namespace == "ml"
    assert cfg.selector_labels == deps["svc-worker"]["spec"]["selector"]["matchLabels"]
    assert cfg.service_discovery_port == 30000


def test_pd_arguments_and_router_selectors_match_the_pods():
    cfg = config(dict(PD, router={"prefillPolicy": "round_robin", "decodePolicy": "shortest_queue"}))
    deps = by_kind(build_children(cfg, IMAGES), "Deployment")
    p, d = container(deps["svc-prefill"])["args"], container(deps["svc-decode"])["args"]
    assert p[p.index("--mode") + 1] == "prefill" and d[d.index("--mode") + 1] == "decode"
    for args in (p, d):
        assert args[args.index("--disaggregation-transfer-backend") + 1] == "mooncake"
        assert args[args.index("--disaggregation-ib-device") + 1] == "mlx5_0,mlx5_1"
        assert args[args.index("--model-path") + 1] == "/cache/models/org/model/main"
    assert p[p.index("--disaggregation-bootstrap-port") + 1] == "9000"
    assert "--disaggregation-bootstrap-port" not in d
    ns = router_parser().parse_args(container(deps["svc-router"])["args"][1:])
    rc = RouterConfig(**vars(ns))
    assert rc.pd and rc.resolved_prefill_policy == "round_robin" and rc.resolved_decode_policy == "shortest_queue"
    for role, labels in (("prefill", rc.prefill_selector_labels), ("decode", rc.decode_selector_labels)):
        pod_labels = deps[f"svc-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert labels.items() <= pod_labels.items() and labels["kvship.io/role"] == role
    ports = {pt["name"]: pt["containerPort"] for pt in container(deps["svc-prefill"])["ports"]}
    assert ports == {"http": 30000, "bootstrap": 9000}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_worker_arguments_parse_with_the_worker_cli(path):
    cfg = example(path)
    for dep in by_kind(build_children(cfg, IMAGES), "Deployment").values():
        args = container(dep)["args"]
        if args[0] != "serve":
            continue
        ns, unknown = server_parser().parse_known_args(args[1:])
        flags = {a for a in unknown if a.startswith("--")}
        assert not flags, f"flags kvship serve does not know: {flags}"
        ServerArgs.from_cli_args(ns).validate()
        assert ns.served_model_name == cfg.served_name


def test_speculative_worker_flags_appear_only_when_speculation_is_asked_for():
    for args in (container(d)["args"] for d in by_kind(build_children(config(PD), IMAGES), "Deployment").values()):
        assert not SPEC_WORKER_FLAGS & set(args)
    spec = {
        "model": {"uri": "hf://a/b"},
        "decode": {
            "tensorParallelSize": 2,
            "expertParallelSize": 2,
            "resources": {"limits": {"nvidia.com/gpu": 2}},
            "speculative": {"algorithm": "eagle", "draftModel": "hf://a/d"},
        },
    }
    worker = container(by_kind(build_children(config(spec), IMAGES), "Deployment")["svc-worker"])
    args = worker["args"]
    assert args[args.index(TP_FLAG) + 1] == "2" and args[args.index(EP_FLAG) + 1] == "2"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2  # one GPU per tensor-parallel rank
    ns, _ = server_parser().parse_known_args(args[1:])
    assert ns.tp_size == 2  # kvship serve takes --tp-size (docs/parallel.md)
    assert args[args.index(SPEC_FLAGS["algorithm"]) + 1] == "eagle"
    assert args[args.index(SPEC_FLAGS["draft"]) + 1] == "/cache/models/a/d/main"
    assert ns.speculative_algorithm == "eagle" and ns.speculative_draft_model_path == "/cache/models/a/d/main"


def test_pipeline_parallel_size_becomes_pp_size_on_its_role_only():
    spec = {
        "model": {"uri": "hf://a/b"},
        "prefill": {
            "replicas": 1,
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "resources": {"limits": {GPU: 4}},
        },
        "decode": {"tensorParallelSize": 2, "resources": {"limits": {GPU: 2}}},
    }
    deployments = by_kind(build_children(config(spec), IMAGES), "Deployment")
    prefill, decode = (container(deployments[f"svc-{role}"]) for role in ("prefill", "decode"))
    assert prefill["args"][prefill["args"].index(PP_FLAG) + 1] == "2" and PP_FLAG not in decode["args"]
    assert prefill["resources"]["limits"][GPU] == 4  # tp x pp ranks, one GPU each
    for c, (mode, tp, pp) in ((prefill, ("prefill", 2, 2)), (decode, ("decode", 2, 1))):
        ns, unknown = server_parser().parse_known_args(c["args"][1:])
        assert not [a for a in unknown if a.startswith("--")]
        ServerArgs.from_cli_args(ns).validate()  # the engine takes --pp-size 2 on a prefill worker
        assert (ns.mode, ns.tp_size, ns.pp_size) == (mode, tp, pp)
    # a unified pipeline-parallel worker, its stages split as extraArgs says
    unified = {
        "model": {"uri": "hf://a/b"},
        "decode": {
            "pipelineParallelSize": 2,
            "resources": {"limits": {GPU: 2}},
            "extraArgs": ["--pp-layer-partition", "1,3"],
            "speculative": {"algorithm": "ngram"},
        },
    }
    args = container(by_kind(build_children(config(unified), IMAGES), "Deployment")["svc-worker"])["args"]
    ns, _ = server_parser().parse_known_args(args[1:])
    ServerArgs.from_cli_args(ns).validate()
    assert (ns.mode, ns.pp_size, ns.pp_layer_partition, ns.speculative_algorithm) == ("unified", 2, "1,3", "ngram")


# speculative settings each worker takes at pipelineParallelSize 1 (draft drafts a chain: steps == draft tokens)
SPECULATIVE = {
    "ngram": {"algorithm": "ngram"},
    "eagle": {"algorithm": "eagle", "draftModel": "hf://a/d"},
    "eagle3": {"algorithm": "eagle3", "draftModel": "hf://a/d"},
    "draft": {"algorithm": "draft", "draftModel": "hf://a/d", "numSteps": 4, "numDraftTokens": 4},
}


def _role_args(children: list[dict], mode: str) -> list[list[str]]:
    """The argv (after ``serve``) of every worker Deployment started with ``--mode mode``."""
    out = []
    for dep in by_kind(children, "Deployment").values():
        args = container(dep)["args"]
        if args[0] == "serve" and args[args.index("--mode") + 1] == mode:
            out.append(args[1:])
    return out


def _engine_accepts(argv: list[str]) -> bool:
    ns, unknown = server_parser().parse_known_args(argv)
    assert not [a for a in unknown if a.startswith("--")], unknown
    try:
        ServerArgs.from_cli_args(ns).validate()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("algorithm", [None, *SPECULATIVE])
@pytest.mark.parametrize("role", ["unified", "prefill", "decode"])
def test_the_operator_refuses_the_pipeline_parallel_workers_the_engine_refuses(role, algorithm):
    """pipelineParallelSize 2 on ``role`` is accepted by the operator exactly when the engine accepts the workers
    it would start: the argv of the same spec at pipelineParallelSize 1 (which the engine accepts), plus
    --pp-size 2."""
    block = "prefill" if role == "prefill" else "decode"
    spec: dict = {
        "model": {"uri": "hf://a/b"},
        "prefill": {"replicas": 0 if role == "unified" else 1, "resources": {"limits": {GPU: 1}}},
        "decode": {"resources": {"limits": {GPU: 1}}, **({"speculative": SPECULATIVE[algorithm]} if algorithm else {})},
    }
    plain = _role_args(build_children(config(spec), IMAGES), role)
    assert plain and all(_engine_accepts(argv) for argv in plain)
    engine_ok = all(_engine_accepts(argv + [PP_FLAG, "2"]) for argv in plain)
    spec[block] = {**spec[block], "pipelineParallelSize": 2, "resources": {"limits": {GPU: 2}}}
    try:
        cfg = config(spec)
    except SpecError as e:
        assert not engine_ok, e.errors
        assert [m.split(":", 1)[0] for m in e.errors] == [f"spec.{block}.pipelineParallelSize"]
        return
    assert engine_ok, f"the operator accepts pipelineParallelSize 2 on {role} with {algorithm}; the engine does not"
    (argv,) = _role_args(build_children(cfg, IMAGES), role)
    assert argv[argv.index(PP_FLAG) + 1] == "2" and _engine_accepts(argv)


@pytest.mark.parametrize(
    "algorithm,draft", [("eagle", "hf://a/d"), ("eagle3", "hf://a/d3"), ("ngram", None), ("draft", "hf://a/small")]
)
def test_pd_prefill_pods_get_the_speculative_flags_only_for_eagle(algorithm, draft):
    """An EAGLE prefill worker computes the prompt's features for decode's drafter (docs/speculative.md, PD);
    ngram and draft need nothing from prefill, whose worker refuses their flags."""
    sp = {"algorithm": algorithm, **({"draftModel": draft} if draft else {})}
    spec = {**PD, "decode": {**PD["decode"], "speculative": sp}}
    deployments = by_kind(build_children(config(spec), IMAGES), "Deployment")
    prefill, decode = (container(deployments[f"svc-{role}"])["args"] for role in ("prefill", "decode"))
    assert decode[decode.index(SPEC_FLAGS["algorithm"]) + 1] == algorithm
    if algorithm in ("eagle", "eagle3"):
        assert prefill[prefill.index(SPEC_FLAGS["algorithm"]) + 1] == algorithm
        assert prefill[prefill.index(SPEC_FLAGS["draft"]) + 1] == decode[decode.index(SPEC_FLAGS["draft"]) + 1]
        ns, _ = server_parser().parse_known_args(prefill[1:])
        ServerArgs.from_cli_args(ns).validate()
        assert ns.mode == "prefill" and ns.speculative_algorithm == algorithm
    else:
        assert not SPEC_WORKER_FLAGS & set(prefill)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_router_arguments_parse_with_the_router_cli(path):
    cfg = example(path)
    args = container(by_kind(build_children(cfg, IMAGES), "Deployment")[f"{cfg.name}-router"])["args"]
    assert args[0] == "router"
    RouterConfig(**vars(router_parser().parse_args(args[1:]))).validate()


def test_values_from_the_resource_stay_single_arguments_without_a_shell():
    spec = {
        "model": {"uri": "builtin:smollm2", "servedName": "x; rm -rf / $(id)"},
        "engine": {"extraArgs": ["--page-size", "16"]},
    }
    for obj in build_children(config(spec), IMAGES):
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c.get("command") in (None, ["hf"])
            assert all(isinstance(a, str) for a in c["args"])
            assert "sh" not in c["args"] and "-c" not in c["args"]
    w = container(by_kind(build_children(config(spec), IMAGES), "Deployment")["svc-worker"])["args"]
    assert w[w.index("--served-model-name") + 1] == "x; rm -rf / $(id)" and w[-2:] == ["--page-size", "16"]


def test_pods_run_non_root_read_only_with_probes_and_resources_passed_through():
    resources = {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}, "requests": {"cpu": "8"}}
    spec = dict(PD, decode={"replicas": 1, "resources": resources})
    for dep in by_kind(build_children(config(spec), IMAGES), "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            # everything dropped; RDMA workers (mooncake with rdmaDevices here) add only IPC_LOCK to pin memory
            rdma_worker = c["name"] == "worker" and _unrevisioned(dep["metadata"]) in ("svc-prefill", "svc-decode")
            assert sc["capabilities"] == ({"drop": ["ALL"], "add": ["IPC_LOCK"]} if rdma_worker else {"drop": ["ALL"]})
        c = pod["containers"][0]
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts
        if c["name"] == "worker":
            assert {"/cache", "/dev/shm"} <= mounts and pod["automountServiceAccountToken"] is False
            assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    decode = container(by_kind(build_children(config(spec), IMAGES), "Deployment")["svc-decode"])
    # passed through, plus the model cache's ephemeral storage (hf:// download into an emptyDir)
    assert decode["resources"] == {
        "limits": {"nvidia.com/gpu": 1, "memory": "64Gi"},
        "requests": {"cpu": "8", "ephemeral-storage": "100Gi"},
    }


def test_gpu_roles_roll_without_surge_and_cpu_roles_surge():
    deps = by_kind(build_children(config(dict(PD, decode={"replicas": 1})), IMAGES), "Deployment")
    assert deps["svc-prefill"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deps["svc-decode"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_autoscaled_roles_leave_replicas_to_their_hpa():
    spec = dict(
        PD,
        decode={
            "autoscaling": {"minReplicas": 2, "maxReplicas": 8, "metric": "kvship:num_running_reqs", "target": "32"}
        },
        router={"autoscaling": {"maxReplicas": 3, "target": 70}},
    )
    children = build_children(config(spec), IMAGES)
    deps, hpas = by_kind(children, "Deployment"), by_kind(children, "HorizontalPodAutoscaler")
    assert "replicas" not in deps["svc-decode"]["spec"] and deps["svc-prefill"]["spec"]["replicas"] == 2
    dec = hpas["svc-decode"]["spec"]
    target = deps["svc-decode"]["metadata"]["name"]
    assert target.startswith("svc-decode-"), "the HPA scales the current revision's Deployment"
    assert dec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": target}
    assert (dec["minReplicas"], dec["maxReplicas"]) == (2, 8)
    assert dec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "kvship:num_running_reqs"},
                "target": {"type": "AverageValue", "averageValue": "32"},
            },
        }
    ]
    assert hpas["svc-router"]["spec"]["metrics"][0]["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 70},
    }
    assert set(by_kind(children, "PodDisruptionBudget")) == {"svc-prefill", "svc-decode", "svc-router"}


def test_single_pod_roles_get_no_disruption_budget():
    assert not by_kind(build_children(config({"model": {"uri": "builtin:smollm2"}}), IMAGES), "PodDisruptionBudget")


def test_hf_models_download_in_an_init_container_with_the_token_only_there():
    spec = {
        "model": {
            "uri": "hf://meta-llama/Llama-3.1-8B-Instruct@abc123",
            "hfTokenSecretRef": {"name": "hf", "key": "token"},
            "cacheVolumeClaim": "cache-pvc",
        }
    }
    pod = by_kind(build_children(config(spec), IMAGES), "Deployment")["svc-worker"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    target = "/cache/models/meta-llama/Llama-3.1-8B-Instruct/abc123"
    assert init["command"] == ["hf"]
    assert init["args"] == [
        "download",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--local-dir",
        target,
        "--revision",
        "abc123",
    ]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    worker = pod["containers"][0]
    assert "HF_TOKEN" not in {e["name"] for e in worker["env"]}
    assert worker["args"][worker["args"].index("--model-path") + 1] == target
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "cache-pvc"}} in pod["volumes"]


def test_pvc_models_mount_read_only():
    pod = by_kind(build_children(config({"model": {"uri": "pvc://weights/llama/8b"}}), IMAGES), "Deployment")[
        "svc-worker"
    ]["spec"]["template"]["spec"]
    assert {"name": "weights-0", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    worker = pod["containers"][0]
    assert {"name": "weights-0", "mountPath": "/weights/weights", "readOnly": True} in worker["volumeMounts"]
    assert worker["args"][worker["args"].index("--model-path") + 1] == "/weights/weights/llama/8b"
    assert "initContainers" not in pod


def test_client_key_secret_reaches_the_router_only_and_workers_require_the_worker_key():
    spec = {"model": {"uri": "builtin:smollm2"}, "router": {"apiKeySecretRef": {"name": "k", "key": "api-key"}}}
    client_key = {"name": "KVSHIP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "api-key"}}}
    worker_key = {"name": "KVSHIP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "svc-worker-key", "key": "key"}}}
    deps = by_kind(build_children(config(spec), IMAGES), "Deployment")
    router, worker = container(deps["svc-router"]), container(deps["svc-worker"])
    assert client_key in router["env"] and client_key not in worker["env"]
    assert worker_key in worker["env"]
    for c in (router, worker):
        assert "--api-key" not in c["args"]


def test_router_rbac_only_reads_pods():
    children = build_children(config({"model": {"uri": "builtin:smollm2"}}), IMAGES)
    role = by_kind(children, "Role")["svc-router"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = by_kind(children, "RoleBinding")["svc-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "ml"}]
    pod = by_kind(children, "Deployment")["svc-router"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "svc-router"


def test_router_service_type_port_and_config_map_record():
    spec = {
        "model": {"uri": "builtin:smollm2"},
        "router": {"service": {"type": "LoadBalancer", "port": 80, "annotations": {"lb": "internal"}}},
    }
    children = build_children(config(spec), IMAGES)
    svc = by_kind(children, "Service")["svc-router"]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"lb": "internal"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert by_kind(children, "Service")["svc-worker"]["spec"]["clusterIP"] == "None"
    cm = by_kind(children, "ConfigMap")["svc-config"]["data"]
    argv = json.loads(cm["args.json"])
    assert argv["unified"] == container(by_kind(children, "Deployment")["svc-worker"])["args"]
    assert cm["mode"] == "unified"


def test_images_default_to_the_operators_and_spec_overrides_them():
    deps = by_kind(build_children(config({"model": {"uri": "builtin:smollm2"}}), IMAGES), "Deployment")
    assert container(deps["svc-worker"])["image"] == "reg/worker:1"
    assert container(deps["svc-router"])["image"] == "reg/router:1"
    spec = {
        "model": {"uri": "builtin:smollm2"},
        "engine": {"image": "mine/w:2", "imagePullPolicy": "Always"},
        "router": {"image": "mine/r:2"},
    }
    deps = by_kind(build_children(config(spec), IMAGES), "Deployment")
    assert (container(deps["svc-worker"])["image"], container(deps["svc-worker"])["imagePullPolicy"]) == (
        "mine/w:2",
        "Always",
    )
    assert container(deps["svc-router"])["image"] == "mine/r:2"


def test_quantization_and_kv_cache_dtype_reach_the_workers_with_per_role_overrides():
    """engine.quantization / engine.kvCacheDtype go to every worker; a role's own value wins (docs/operator.md)."""
    unified = config(
        {"model": {"uri": "builtin:smollm2"}, "engine": {"quantization": "fp8", "kvCacheDtype": "fp8_e4m3"}}
    )
    w = container(by_kind(build_children(unified, IMAGES), "Deployment")["svc-worker"])["args"]
    ns = server_parser().parse_args(w[1:])
    assert (ns.quantization, ns.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    pd = config(dict(PD, decode=dict(PD["decode"], kvCacheDtype="fp8_e4m3", quantization="fp8"),
                     prefill=dict(PD["prefill"], kvCacheDtype="fp8_e4m3", quantization="fp8")))  # fmt: skip
    deps = by_kind(build_children(pd, IMAGES), "Deployment")
    for role in ("prefill", "decode"):
        ns = server_parser().parse_args(container(deps[f"svc-{role}"])["args"][1:])
        assert (ns.quantization, ns.kv_cache_dtype) == ("fp8", "fp8_e4m3"), role
    plain = container(by_kind(build_children(config(PD), IMAGES), "Deployment")["svc-decode"])["args"]
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain


def test_tracing_passes_the_otlp_endpoint_and_sample_ratio_to_every_pod():
    traced = config(dict(PD, tracing={"otlpEndpoint": "http://otel-collector.obs:4318", "sampleRatio": 0.25}))
    deps = by_kind(build_children(traced, IMAGES), "Deployment")
    assert {"svc-prefill", "svc-decode", "svc-router"} <= deps.keys()
    for name, dep in deps.items():
        args = container(dep)["args"]
        if args[0] == "serve":
            ns = server_parser().parse_known_args(args[1:])[0]
        else:
            ns = router_parser().parse_args(args[1:])
        assert ns.otlp_traces_endpoint == "http://otel-collector.obs:4318", name
        assert ns.otlp_traces_sample_ratio == 0.25, name
    untraced = by_kind(build_children(config(PD), IMAGES), "Deployment")
    assert not any("--otlp-traces-endpoint" in container(dep)["args"] for dep in untraced.values())
    with pytest.raises(Exception, match="sampleRatio|otlpEndpoint"):
        config(dict(PD, tracing={"otlpEndpoint": "http://c:4318", "sampleRatio": 2}))
    for url in ("grpc://c:4317", "grpcs://c:4317"):  # OTLP/gRPC, plaintext and TLS
        assert config(dict(PD, tracing={"otlpEndpoint": url})).spec.tracing.otlp_endpoint == url
    with pytest.raises(Exception, match="otlpEndpoint"):
        config(dict(PD, tracing={"otlpEndpoint": "collector:4317"}))


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "draft", "ngram"])
@pytest.mark.parametrize("pd", [False, True], ids=["unified", "pd"])
def test_speculative_defaults_give_workers_the_engine_accepts(algorithm, pd):
    """Only the algorithm (and a draft model) set, every other speculative field at its CRD default: each
    worker's argv passes the engine's own validation (draft once got numSteps 3 beside numDraftTokens 4)."""
    sp = {"algorithm": algorithm, **({"draftModel": "hf://a/d"} if algorithm != "ngram" else {})}
    spec: dict = {
        "model": {"uri": "hf://a/b"},
        "prefill": {"replicas": 1 if pd else 0, "resources": {"limits": {GPU: 1}}},
        "decode": {"resources": {"limits": {GPU: 1}}, "speculative": sp},
    }
    children = build_children(config(spec), IMAGES)
    argvs = [a for mode in ("unified", "prefill", "decode") for a in _role_args(children, mode)]
    assert argvs and all(_engine_accepts(argv) for argv in argvs)


@pytest.mark.parametrize(
    "where,pd,extra",
    [
        ("engine", False, {}),
        ("decode", False, {}),
        ("engine", True, {}),
        ("decode", False, {"speculative": {"algorithm": "ngram"}}),
        ("decode", False, {"pipelineParallelSize": 2, "resources": {"limits": {GPU: 2}}}),
        ("decode", False, {"extraArgs": ["--enable-mixed-chunk", "--no-enable-mixed-chunk"]}),
    ],
)
def test_mixed_chunks_are_accepted_exactly_where_the_engine_runs_them(where, pd, extra):
    spec: dict = {
        "model": {"uri": "hf://a/b"},
        "prefill": {"replicas": 1 if pd else 0, "resources": {"limits": {GPU: 1}}},
        "decode": {"resources": {"limits": {GPU: 1}}},
    }
    spec["decode"].update(extra)
    if where == "engine":
        spec["engine"] = {"extraArgs": ["--enable-mixed-chunk"]}
    elif "extraArgs" not in extra:
        spec["decode"]["extraArgs"] = ["--enable-mixed-chunk"]
    plain = {**spec, "engine": {}, "decode": {k: v for k, v in spec["decode"].items() if k != "extraArgs"}}
    argvs = [
        a for mode in ("unified", "prefill", "decode") for a in _role_args(build_children(config(plain), IMAGES), mode)
    ]
    flags = list(spec.get("engine", {}).get("extraArgs", [])) + list(spec["decode"].get("extraArgs", []))
    engine_ok = all(_engine_accepts(a + flags) for a in argvs)
    try:
        config(spec)
    except SpecError as e:
        assert not engine_ok, e.errors
        assert all("--enable-mixed-chunk works on a unified worker" in m for m in e.errors), e.errors
        return
    assert engine_ok, "the operator accepts --enable-mixed-chunk where the engine refuses it"

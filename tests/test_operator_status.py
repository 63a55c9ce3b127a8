"""Status is computed from what exists: phase, conditions, per-role counts, URL."""

from __future__ import annotations

from kvship.operator.spec import parse_service
from kvship.operator.status import compute_status

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def service(spec: dict, status: dict | None = None, generation: int = 2) -> dict:
    body = {"metadata": {"name": "svc", "namespace": "ml", "uid": "u", "generation": generation}, "spec": spec}
    if status is not None:
        body["status"] = status
    return body


def deployment(
    name: str,
    replicas: int,
    ready: int,
    updated: int | None = None,
    observed: int = 1,
    generation: int = 1,
    progressing: str | None = None,
) -> dict:
    status = {
        "observedGeneration": observed,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": replicas if updated is None else updated,
    }
    if progressing:
        status["conditions"] = [
            {
                "type": "Progressing",
                "status": "False" if progressing == "ProgressDeadlineExceeded" else "True",
                "reason": progressing,
            }
        ]
    return {"metadata": {"name": name, "generation": generation}, "spec": {"replicas": replicas}, "status": status}


UNIFIED = {"model": {"uri": "builtin:smollm2"}}
PD = {"model": {"uri": "hf://a/b"}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def children(*deps: dict, service_obj: dict | None = None) -> dict:
    out = {("Deployment", d["metadata"]["name"]): d for d in deps}
    if service_obj:
        out[("Service", "svc-router")] = service_obj
    return out


def test_invalid_spec_fails_with_valid_false_and_the_reasons():
    body = service({"model": {"uri": "nope"}})
    st = compute_status(body, None, ["spec.model.uri: bad"], [], {}, now=T0)
    c = conditions(st)
    assert st["phase"] == "Failed"
    assert (c["Valid"]["status"], c["Valid"]["reason"], c["Valid"]["message"]) == (
        "False",
        "InvalidSpec",
        "spec.model.uri: bad",
    )
    assert c["Ready"]["status"] == "False" and c["DecodeReady"]["status"] == "Unknown"
    assert st["observedGeneration"] == 2 and st["decode"]["ready"] == "0/0"


def test_no_deployments_yet_is_pending():
    body = service(UNIFIED)
    st = compute_status(body, parse_service(body), [], [], {}, now=T0)
    assert st["phase"] == "Pending" and conditions(st)["DecodeReady"]["reason"] == "DeploymentMissing"


def test_new_deployments_without_ready_pods_are_progressing():
    body = service(UNIFIED)
    kids = children(
        {"metadata": {"name": "svc-worker", "generation": 1}, "spec": {"replicas": 1}},
        {"metadata": {"name": "svc-router", "generation": 1}, "spec": {"replicas": 1}},
    )
    st = compute_status(body, parse_service(body), [], [], kids, now=T0)
    assert st["phase"] == "Progressing" and st["decode"]["ready"] == "0/1" and st["mode"] == "unified"


def test_all_roles_ready_is_ready_with_url_and_unified_prefill_condition():
    body = service(UNIFIED)
    st = compute_status(
        body,
        parse_service(body),
        [],
        [],
        children(deployment("svc-worker", 1, 1), deployment("svc-router", 1, 1)),
        now=T0,
    )
    c = conditions(st)
    assert st["phase"] == "Ready" and c["Ready"]["status"] == "True"
    assert st["url"] == "http://svc-router.ml.svc:8000" and c["Ready"]["message"].endswith(st["url"])
    assert (c["PrefillReady"]["status"], c["PrefillReady"]["reason"]) == ("True", "Unified")
    assert st["prefill"] == {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0, "ready": "0/0"}
    assert [x["type"] for x in st["conditions"]] == ["Valid", "Ready", "PrefillReady", "DecodeReady", "RouterReady"]


def test_pd_counts_each_role():
    body = service(PD)
    st = compute_status(
        body,
        parse_service(body),
        [],
        [],
        children(deployment("svc-prefill", 1, 1), deployment("svc-decode", 2, 1), deployment("svc-router", 1, 1)),
        now=T0,
    )
    assert st["prefill"]["ready"] == "1/1" and st["decode"] == {
        "replicas": 2,
        "readyReplicas": 1,
        "updatedReplicas": 2,
        "ready": "1/2",
    }
    assert st["phase"] == "Progressing" and conditions(st)["DecodeReady"]["status"] == "False"


def test_a_finished_rollout_short_of_pods_is_degraded():
    body = service(PD)
    st = compute_status(
        body,
        parse_service(body),
        [],
        [],
        children(
            deployment("svc-prefill", 1, 1),
            deployment("svc-decode", 2, 1, progressing="NewReplicaSetAvailable"),
            deployment("svc-router", 1, 1),
        ),
        now=T0,
    )
    assert st["phase"] == "Degraded" and conditions(st)["DecodeReady"]["reason"] == "ReplicasNotReady"
    stuck = compute_status(
        body,
        parse_service(body),
        [],
        [],
        children(
            deployment("svc-prefill", 1, 1),
            deployment("svc-decode", 2, 0, progressing="ProgressDeadlineExceeded"),
            deployment("svc-router", 1, 1),
        ),
        now=T0,
    )
    assert stuck["phase"] == "Degraded"
    assert conditions(stuck)["DecodeReady"]["reason"] == "ProgressDeadlineExceeded"


def test_a_stale_observed_generation_is_still_rolling_out():
    body = service(UNIFIED)
    st = compute_status(
        body,
        parse_service(body),
        [],
        [],
        children(deployment("svc-worker", 1, 1, observed=1, generation=2), deployment("svc-router", 1, 1)),
        now=T0,
    )
    assert st["phase"] == "Progressing"


def test_apply_errors_fail_the_service():
    body = service(UNIFIED)
    st = compute_status(body, parse_service(body), [], ["Deployment svc-worker: 403 Forbidden: no"], {}, now=T0)
    assert st["phase"] == "Failed" and conditions(st)["Ready"]["reason"] == "ApplyFailed"


def test_transition_times_move_only_when_a_condition_flips():
    body = service(UNIFIED)
    cfg = parse_service(body)
    first = compute_status(body, cfg, [], [], {}, now=T0)
    body["status"] = first
    same = compute_status(body, cfg, [], [], {}, now=T1)
    assert same == first
    ready = compute_status(
        body, cfg, [], [], children(deployment("svc-worker", 1, 1), deployment("svc-router", 1, 1)), now=T1
    )
    c = conditions(ready)
    assert c["Ready"]["lastTransitionTime"] == T1 and c["Valid"]["lastTransitionTime"] == T0


def test_load_balancer_ingress_becomes_the_url():
    spec = dict(UNIFIED, router={"service": {"type": "LoadBalancer", "port": 80}})
    body = service(spec)
    svc = {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}}
    st = compute_status(body, parse_service(body), [], [], children(service_obj=svc), now=T0)
    assert st["url"] == "http://203.0.113.7:80"


def test_the_store_master_is_reported_apart_from_ready():
    spec = dict(UNIFIED, hicache={"storage": "mooncake"})
    body = service(spec)
    workers = (deployment("svc-worker", 1, 1), deployment("svc-router", 1, 1))
    st = compute_status(body, parse_service(body), [], [], children(*workers), now=T0)
    assert st["phase"] == "Ready"  # the workers serve without their store: not part of Ready
    assert st["storeMaster"] == {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0, "ready": "0/0"}
    st = compute_status(
        body, parse_service(body), [], [], children(*workers, deployment("svc-mooncake-master", 1, 1)), now=T0
    )
    assert st["storeMaster"]["ready"] == "1/1" and st["phase"] == "Ready"
    plain = service(UNIFIED)
    assert "storeMaster" not in compute_status(plain, parse_service(plain), [], [], children(*workers), now=T0)

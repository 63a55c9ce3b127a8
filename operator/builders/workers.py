"""Worker children: one Deployment and one headless Service per worker role.

Unified mode (``prefill.replicas == 0``): role ``unified``, Deployment
``<name>-worker``, ``kvship serve --mode unified``.  PD mode: roles
``prefill`` and ``decode`` (``--mode prefill|decode`` plus the KV transfer
flags; with EAGLE speculation both roles get the speculative flags, the
others only decode).  The container's argv is built flag by flag from typed fields; no
value from the custom resource ever passes through a shell.
"""

from __future__ import annotations

from typing import Any

from kvship.operator.builders import common
from kvship.operator.builders.common import (
    WORKER_PORT,
    Images,
    child_name,
    container_security_context,
    http_probe,
    metadata,
    role_labels,
    role_selector,
)
from kvship.operator.builders.credentials import KV_SECRET_FILE, kv_secret_mount, kv_secret_volume, worker_key_env
from kvship.operator.builders.groups import grouped
from kvship.operator.builders.model import CACHE_DIR, cache_on_node, cache_size, cache_volume, plan_models
from kvship.operator.builders.store import storage_args, storage_volume
from kvship.operator.spec import (
    EAGLE_ALGORITHMS,
    GPU,
    ServiceConfig,
    role_kv_cache_dtype,
    role_quantization,
    routes_by_kv_events,
)
from kvship.operator.types import WorkerRole

# `kvship serve` flags not yet in every engine build; emitted only when the feature is asked for.
TP_FLAG, EP_FLAG, PP_FLAG = "--tp-size", "--ep-size", "--pp-size"
SPEC_FLAGS = {
    "algorithm": "--speculative-algorithm",
    "draft": "--speculative-draft-model-path",
    "steps": "--speculative-num-steps",
    "topk": "--speculative-eagle-topk",
    "tokens": "--speculative-num-draft-tokens",
}


# Requested where the spec names no cpu / memory, so a worker is never BestEffort.
DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
GPU_SHM, CPU_SHM = "16Gi", "1Gi"
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"


def role_spec(cfg: ServiceConfig, role: str) -> WorkerRole:
    return cfg.spec.prefill if role == "prefill" else cfg.spec.decode


def worker_args(cfg: ServiceConfig, role: str, model_path: str | None, draft_path: str | None) -> list[str]:
    """The worker container's argv after the ``kvship`` entrypoint."""
    spec, r = cfg.spec, role_spec(cfg, role)
    args = [
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        str(WORKER_PORT),
        "--mode",
        role,
        "--served-model-name",
        cfg.served_name,
    ]
    if model_path:
        args += ["--model-path", model_path]
    if spec.model.dtype != "auto":
        args += ["--dtype", spec.model.dtype]
    if spec.model.context_length is not None:
        args += ["--context-length", str(spec.model.context_length)]
    eng = spec.engine
    if eng.attention_backend != "auto":
        args += ["--attention-backend", eng.attention_backend]
    spec_role = "prefill" if role == "prefill" else "decode"  # unified workers take the decode block
    kv_dtype, quantization = role_kv_cache_dtype(spec, spec_role), role_quantization(spec, spec_role)
    if kv_dtype != "auto":
        args += ["--kv-cache-dtype", kv_dtype]
    if quantization is not None:
        args += ["--quantization", quantization]
    if eng.mem_fraction_static is not None:
        args += ["--mem-fraction-static", repr(float(eng.mem_fraction_static))]
    if eng.cuda_graph_max_batch_size is not None:
        args += ["--cuda-graph-max-bs", str(eng.cuda_graph_max_batch_size)]
    if r.tensor_parallel_size > 1:
        args += [TP_FLAG, str(r.tensor_parallel_size)]
    if r.pipeline_parallel_size > 1:  # a worker then runs tp x pp ranks (docs/parallel.md, "Pipeline parallelism")
        args += [PP_FLAG, str(r.pipeline_parallel_size)]
    if r.expert_parallel_size > 1:
        args += [EP_FLAG, str(r.expert_parallel_size)]
    if role in ("prefill", "decode"):
        kv = spec.kv_transfer
        args += ["--disaggregation-transfer-backend", kv.backend]
        if role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(kv.bootstrap_port)]
        if kv.backend == "mooncake" and kv.rdma_devices:
            args += ["--disaggregation-ib-device", ",".join(kv.rdma_devices)]
        # the per-service KV-plane secret, mounted from <name>-kv-transfer (builders/credentials.py)
        args += ["--kv-transfer-secret-file", KV_SECRET_FILE]
    sp = spec.decode.speculative
    # a prefill worker takes the EAGLE flags too: it computes the prompt's features for decode's drafter
    # (docs/speculative.md, "PD"); ngram and draft need nothing from it (and it refuses them)
    if sp is not None and (role in ("decode", "unified") or sp.algorithm in EAGLE_ALGORITHMS):
        args += [SPEC_FLAGS["algorithm"], sp.algorithm]
        if draft_path:
            args += [SPEC_FLAGS["draft"], draft_path]
        # ngram looks its drafts up (the worker refuses --speculative-num-steps with it); draft drafts a chain of
        # numDraftTokens tokens (its steps are that many: the worker refuses a numSteps that differs)
        if sp.algorithm in EAGLE_ALGORITHMS:
            args += [SPEC_FLAGS["steps"], str(sp.num_steps)]
        args += [SPEC_FLAGS["topk"], str(sp.topk), SPEC_FLAGS["tokens"], str(sp.num_draft_tokens)]
    args += common.tracing_args(spec)
    if routes_by_kv_events(spec, role):  # the router's index is fed by these workers' events
        args.append("--enable-kv-events")
    args += storage_args(cfg)
    return args + list(eng.extra_args) + list(r.extra_args)


def _env(cfg: ServiceConfig, r: WorkerRole) -> list[dict[str, Any]]:
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "FLASHINFER_WORKSPACE_BASE", "value": CACHE_DIR},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # What the worker advertises to KV-transfer peers (it binds 0.0.0.0; the host name may not resolve).
        {"name": "KVSHIP_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    kv = cfg.spec.kv_transfer
    if not cfg.unified and kv.backend == "nixl" and kv.rdma_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": ",".join(kv.rdma_devices)})
    # The key this worker requires: the service's worker key (the router's and the operator's), never the client key.
    env.append(worker_key_env(cfg))
    return env + [dict(e) for e in r.env]


def ships_kv(cfg: ServiceConfig, role: str) -> bool:
    return role in ("prefill", "decode") and not cfg.unified


def ipc_lock(cfg: ServiceConfig, role: str) -> bool:
    """IPC_LOCK lets the RDMA stack pin KV memory (default: on with RDMA devices)."""
    kv = cfg.spec.kv_transfer
    if not ships_kv(cfg, role):
        return False
    return kv.ipc_lock if kv.ipc_lock is not None else bool(kv.rdma_devices)


def worker_resources(cfg: ServiceConfig, role: str) -> dict[str, Any]:
    """The spec's resources plus: default cpu/memory requests, the cache's ephemeral storage, the RDMA device."""
    r = role_spec(cfg, role)
    defaults = dict(DEFAULT_REQUESTS)
    if cache_on_node(cfg):
        defaults["ephemeral-storage"] = cache_size(cfg)
    res = common.with_default_requests(r.resources, defaults)
    rdma = cfg.spec.kv_transfer.rdma_resource
    if rdma and ships_kv(cfg, role) and rdma not in (res.get("limits") or {}):
        res.setdefault("limits", {})[rdma] = "1"  # extended resource: the request follows the limit
    return res


def shm_size(cfg: ServiceConfig, role: str) -> str:
    if cfg.spec.engine.shm_size:
        return cfg.spec.engine.shm_size
    return GPU_SHM if GPU in (role_spec(cfg, role).resources.get("limits") or {}) else CPU_SHM


def worker_deployment(
    cfg: ServiceConfig, role: str, images: Images, revision: str, credentials: str | None = None
) -> dict[str, Any]:
    """The role's Deployment; ``credentials`` (a digest of the Secrets' values) goes into the pod template, so
    a rotated Secret rolls the pods that read it at start (docs/operator.md, "Credentials")."""
    r = role_spec(cfg, role)
    eng = cfg.spec.engine
    image = eng.image or images.worker
    pull = eng.image_pull_policy or images.pull_policy
    plan = plan_models(cfg, image, pull)
    ports = [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "containerPort": cfg.spec.kv_transfer.bootstrap_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": pull,
        "args": worker_args(cfg, role, plan.model_path, plan.draft_path),
        "ports": ports,
        "env": _env(cfg, r),
        "securityContext": container_security_context(("IPC_LOCK",) if ipc_lock(cfg, role) else ()),
        "resources": worker_resources(cfg, role),
        "startupProbe": http_probe(
            "/health", "http", period=10, timeout=5, failures=common.startup_failures(eng.startup_timeout_seconds)
        ),
        "readinessProbe": http_probe("/health", "http", period=5, timeout=3, failures=3),
        "livenessProbe": http_probe("/health", "http", period=15, timeout=5, failures=4),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
        + plan.mounts,
    }
    volumes = [
        {"name": "tmp", "emptyDir": {}},
        cache_volume(cfg),
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(cfg, role)}},
    ] + plan.volumes
    if ships_kv(cfg, role):
        container["volumeMounts"].append(kv_secret_mount())
        volumes.append(kv_secret_volume(cfg))
    store_volumes, store_mounts = storage_volume(cfg)
    container["volumeMounts"] += store_mounts
    volumes += store_volumes
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": common.pod_security_context(),
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if plan.init_containers:
        pod["initContainers"] = plan.init_containers
    # Ready only once the router dispatches to the pod (the operator sets the condition from GET /workers).
    pod["readinessGates"] = [{"conditionType": common.IN_ROTATION_GATE}]
    common.scheduling(pod, r.node_selector, r.tolerations, r.affinity, eng.image_pull_secrets)
    uses_gpu = GPU in (r.resources.get("limits") or {})
    # GPU roles never surge (a spare GPU rarely exists); CPU roles surge for zero-downtime rollouts.
    strategy = {
        "type": "RollingUpdate",
        "rollingUpdate": ({"maxSurge": 0, "maxUnavailable": 1} if uses_gpu else {"maxSurge": 1, "maxUnavailable": 0}),
    }
    annotations = {common.PORT_ANNOTATION: str(WORKER_PORT)}
    if ships_kv(cfg, role) and cfg.spec.kv_transfer.networks:
        annotations[NETWORKS_ANNOTATION] = ",".join(cfg.spec.kv_transfer.networks)
    annotations.update(r.pod_annotations)
    if credentials:
        annotations[common.CREDENTIALS_ANNOTATION] = credentials
    replicas = None if r.autoscaling is not None else r.replicas
    return common.deployment(
        cfg,
        role,
        pod,
        replicas=replicas,
        pod_annotations=annotations,
        strategy=strategy,
        progress_deadline=eng.startup_timeout_seconds + 600,
        revision=revision,
    )


def worker_service(cfg: ServiceConfig, role: str) -> dict[str, Any]:
    """Headless Service: stable DNS for each worker pod (metrics scraping, debugging)."""
    ports = [{"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"}]
    if role == "prefill":
        port = cfg.spec.kv_transfer.bootstrap_port
        ports.append({"name": "bootstrap", "port": port, "targetPort": "bootstrap", "protocol": "TCP"})
    spec: dict[str, Any] = {"clusterIP": "None", "selector": role_selector(cfg, role), "ports": ports}
    if grouped(cfg, role):
        # worker groups find their leader by its DNS name before any of them is ready (builders/groups.py)
        spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, child_name(cfg, role), role_labels(cfg, role)),
        "spec": spec,
    }

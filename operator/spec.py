"""Layer 1: parse and validate an InferenceService into a :class:`ServiceConfig`.

``parse_service(body)`` takes the custom resource as the API returns it and
either returns a ``ServiceConfig`` (the typed spec plus everything derived
from it: mode, served name, where the weights come from) or raises
:class:`SpecError` listing *every* problem with its field path, e.g.
``spec.decode.tensorParallelSize: 2 does not match resources.limits
nvidia.com/gpu=1``.  Nothing here does I/O.

The schema checks (types, enums, bounds) come from the API types; the
cross-field rules below are the ones a structural schema cannot express (some
are also CEL rules in the CRD, so a cluster refuses them at admission; the
operator checks them again for clusters or clients that skip that).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from kvship.common import metrics_names
from kvship.operator.extra_args import router_args_errors, worker_args_errors
from kvship.operator.typed import ParseErrors, parse
from kvship.operator.types import Autoscaling, InferenceServiceSpec, WorkerRole

# Credentials the operator gives pods from Secrets (KVSHIP_API_KEY, KVSHIP_WORKER_API_KEY, KVSHIP_ADMIN_API_KEY,
# KVSHIP_KV_TRANSFER_SECRET, ...): a role's env may not replace them (docs/operator.md, "Credentials").
OWNED_ENV = re.compile(r"^KVSHIP_\w*(API_KEYS?|SECRET)\w*$")
# Longest child-name suffix is "-prefill": names must leave room for it inside a 63-character DNS label.
MAX_NAME_LENGTH = 63 - len("-prefill")
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU = "nvidia.com/gpu"
BUILTIN_SERVED_NAME = "SmolLM2-135M-Instruct"
# Speculative algorithms whose flags the prefill workers of a PD service take too (builders/workers.py).
EAGLE_ALGORITHMS = ("eagle", "eagle3")
# What a worker with pipelineParallelSize > 1 may run (engine/config.py refuses the others at start).
PP_SPEC_ALGORITHMS = ("ngram",)


class SpecError(ValueError):
    """The InferenceService is invalid; ``errors`` holds one ``"field.path: problem"`` per problem."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


@dataclass(frozen=True)
class ModelSource:
    """Where a worker finds weights: ``kind`` hf | pvc | builtin | path."""

    kind: str
    repo: Optional[str] = None  # hf: OWNER/NAME
    revision: Optional[str] = None  # hf: branch, tag or commit
    claim: Optional[str] = None  # pvc: claim name
    sub_path: str = ""  # pvc: path inside the claim
    path: Optional[str] = None  # path: absolute path in the image

    @classmethod
    def from_uri(cls, uri: str) -> "ModelSource":
        if uri == "builtin:smollm2":
            return cls(kind="builtin")
        if uri.startswith("hf://"):
            repo, _, rev = uri[len("hf://") :].partition("@")
            return cls(kind="hf", repo=repo, revision=rev or None)
        if uri.startswith("pvc://"):
            claim, _, sub = uri[len("pvc://") :].partition("/")
            return cls(kind="pvc", claim=claim, sub_path=sub.strip("/"))
        return cls(kind="path", path=uri)

    @property
    def default_served_name(self) -> str:
        if self.kind == "builtin":
            return BUILTIN_SERVED_NAME
        if self.kind == "hf":
            return (self.repo or "").rsplit("/", 1)[-1]
        if self.kind == "pvc":
            return (self.sub_path.rstrip("/").rsplit("/", 1)[-1] if self.sub_path else self.claim) or "model"
        return (self.path or "").rstrip("/").rsplit("/", 1)[-1] or "model"


@dataclass(frozen=True)
class ServiceConfig:
    """A valid InferenceService: the typed spec and what follows from it."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceServiceSpec
    model: ModelSource
    draft_model: Optional[ModelSource]

    @property
    def unified(self) -> bool:
        """prefill.replicas == 0: decode workers run whole requests (no KV transfer)."""
        return self.spec.prefill.replicas == 0

    @property
    def mode(self) -> str:
        return "unified" if self.unified else "pd"

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.model.default_served_name


def parse_service(body: dict, allowed_image_prefixes: tuple[str, ...] = ()) -> ServiceConfig:
    """The custom resource (metadata + spec) -> :class:`ServiceConfig`, or :class:`SpecError`.

    ``allowed_image_prefixes`` (the operator's ``--allowed-image-prefixes``; empty = any image): an image the
    spec names (``engine.image``, ``router.image``) must start with one of them.
    """
    meta = body.get("metadata") or {}
    errors: list[str] = []
    name = meta.get("name") or ""
    if not NAME_RE.match(name) or len(name) > MAX_NAME_LENGTH:
        errors.append(
            f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
            "(children are named NAME-prefill, NAME-decode, ...)"
        )
    try:
        spec: Optional[InferenceServiceSpec] = parse(InferenceServiceSpec, body.get("spec"), "spec")
    except ParseErrors as e:
        errors.extend(e.errors)
        spec = None
    if spec is not None:
        errors.extend(cross_field_errors(spec))
        grouped = spec.decode.nodes_per_replica > 1 or (
            spec.prefill.replicas > 0 and spec.prefill.nodes_per_replica > 1
        )
        if grouped and len(name) > MAX_GROUP_NAME_LENGTH:
            errors.append(
                f"metadata.name: {name!r} is longer than {MAX_GROUP_NAME_LENGTH} characters, the most that leaves "
                "room for the pod names of multi-node worker groups (nodesPerReplica > 1)"
            )
        errors.extend(image_errors(spec, allowed_image_prefixes))
    if errors:
        raise SpecError(errors)
    assert spec is not None
    draft = spec.decode.speculative.draft_model if spec.decode.speculative else None
    return ServiceConfig(
        name=name,
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "",
        generation=int(meta.get("generation") or 0),
        spec=spec,
        model=ModelSource.from_uri(spec.model.uri),
        draft_model=ModelSource.from_uri(draft) if draft else None,
    )


def cross_field_errors(spec: InferenceServiceSpec) -> list[str]:
    """Rules spanning several fields; each message names the field(s) to change."""
    errors: list[str] = []
    unified = spec.prefill.replicas == 0
    roles = (("decode", spec.decode),) if unified else (("prefill", spec.prefill), ("decode", spec.decode))
    for role, r in roles:
        errors.extend(_role_errors(role, r, slo_mode(spec)))
        errors.extend(_pipeline_errors(spec, role, r))
        errors.extend(_mixed_chunk_errors(spec, role, r, unified))
    if not unified:
        errors.extend(_pd_numerics_errors(spec))
    if unified and spec.prefill.autoscaling is not None:
        errors.append("spec.prefill.autoscaling: needs prefill.replicas > 0 (0 means unified mode: no prefill role)")
    for role, r in (("prefill", spec.prefill), ("decode", spec.decode)):
        errors.extend(worker_args_errors(f"spec.{role}.extraArgs", r.extra_args))
    errors.extend(worker_args_errors("spec.engine.extraArgs", spec.engine.extra_args))
    errors.extend(router_args_errors("spec.router.extraArgs", spec.router.extra_args))
    for path, env in (
        ("spec.prefill.env", spec.prefill.env),
        ("spec.decode.env", spec.decode.env),
        ("spec.router.env", spec.router.env),
    ):
        errors.extend(
            f"{path}[{i}]: {e['name']} is a credential the operator sets from the service's Secrets"
            for i, e in enumerate(env)
            if isinstance(e.get("name"), str) and OWNED_ENV.match(e["name"])
        )
    if spec.router.autoscaling is not None:
        errors.extend(_autoscaling_errors("spec.router.autoscaling", spec.router.autoscaling))
    errors.extend(planner_errors(spec))
    sp = spec.decode.speculative
    if sp is not None:
        if sp.algorithm in ("eagle", "draft") and not sp.draft_model:
            errors.append(f"spec.decode.speculative.draftModel: required for algorithm {sp.algorithm}")
        if sp.algorithm == "ngram" and sp.draft_model:
            errors.append("spec.decode.speculative.draftModel: not used by algorithm ngram; remove it")
        if sp.algorithm == "eagle" and sp.topk > 1 and sp.num_draft_tokens < sp.topk:
            errors.append("spec.decode.speculative.numDraftTokens: must be >= topk when topk > 1")
        if sp.algorithm == "draft" and sp.topk != 1:
            errors.append(f"spec.decode.speculative.topk: algorithm draft drafts a chain: must be 1, got {sp.topk}")
    kv = spec.kv_transfer
    if kv.rdma_devices and kv.backend == "tcp":
        errors.append("spec.kvTransfer.rdmaDevices: needs backend mooncake or nixl (backend is tcp)")
    if kv.rdma_resource and kv.backend == "tcp":
        errors.append("spec.kvTransfer.rdmaResource: needs backend mooncake or nixl (backend is tcp)")
    if kv.ipc_lock and kv.backend == "tcp":
        errors.append("spec.kvTransfer.ipcLock: only RDMA (mooncake or nixl) pins memory; remove it with tcp")
    errors.extend(hicache_errors(spec))
    svc = spec.router.service
    if svc.node_port is not None and svc.type == "ClusterIP":
        errors.append("spec.router.service.nodePort: needs type NodePort or LoadBalancer (type is ClusterIP)")
    if spec.model.cache_volume_claim and spec.model.uri.startswith("pvc://"):
        if spec.model.uri[len("pvc://") :].split("/", 1)[0] == spec.model.cache_volume_claim:
            errors.append("spec.model.cacheVolumeClaim: must differ from the claim in model.uri")
    return errors


def hicache_errors(spec: InferenceServiceSpec) -> list[str]:
    """The shared KV tier's fields (the CRD's rules, also checked here, where no API server evaluates them), and
    a ``--no-enable-kv-events`` that would blind a ``kv_events`` router."""
    hc, errors = spec.hicache, []
    if hc.storage == "file" and not hc.volume_claim:
        errors.append("spec.hicache.volumeClaim: required with storage file (a ReadWriteMany claim)")
    if hc.volume_claim and hc.storage != "file":
        errors.append(f"spec.hicache.volumeClaim: used by storage file only (storage is {hc.storage})")
    if hc.mooncake_master:
        if hc.storage != "mooncake":
            errors.append(f"spec.hicache.mooncakeMaster: used by storage mooncake only (storage is {hc.storage})")
        elif not 1 <= int(hc.mooncake_master.rsplit(":", 1)[1]) <= 65535:
            errors.append(f"spec.hicache.mooncakeMaster: {hc.mooncake_master!r} has no port in 1-65535")
    unified = spec.prefill.replicas == 0
    # (role, the spec block its workers take): unified workers are described by the decode block
    for role, block in (("unified", "decode"),) if unified else (("prefill", "prefill"), ("decode", "decode")):
        if not routes_by_kv_events(spec, role):
            continue
        for where, args in (
            ("spec.engine.extraArgs", spec.engine.extra_args),
            (f"spec.{block}.extraArgs", getattr(spec, block).extra_args),
        ):
            if "--no-enable-kv-events" in args:
                errors.append(
                    f"{where}: --no-enable-kv-events, but the router routes the {role} workers by policy kv_events, "
                    "which reads their KV events"
                )
    return errors


def routes_by_kv_events(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether the router chooses ``role``'s workers (prefill, decode or unified) by policy ``kv_events``: the
    operator then turns the workers' KV events on (``--enable-kv-events``; docs/cache.md, "Routing on KV
    events")."""
    rt = spec.router
    policy = {"prefill": rt.prefill_policy, "decode": rt.decode_policy}.get(role) or rt.policy
    return policy == "kv_events"


def slo_mode(spec: InferenceServiceSpec) -> bool:
    """``spec.autoscaling.mode`` is slo: the planner (kvship.operator.planner), not HPAs, scales worker roles."""
    return spec.autoscaling is not None and spec.autoscaling.mode == "slo"


def planner_errors(spec: InferenceServiceSpec) -> list[str]:
    """slo mode needs the targets that drive each scaled role and at least one scaled role."""
    if not slo_mode(spec):
        return []
    slo = spec.slo
    ttft = slo is not None and slo.ttft_p90_ms is not None
    itl = slo is not None and slo.itl_p50_ms is not None
    errors = []
    if spec.prefill.replicas == 0:
        if spec.decode.autoscaling is None:
            errors.append("spec.decode.autoscaling: slo mode needs minReplicas/maxReplicas on the unified workers")
        elif not (ttft or itl):
            errors.append("spec.slo: slo mode needs ttftP90Ms or itlP50Ms")
        return errors
    if spec.prefill.autoscaling is None and spec.decode.autoscaling is None:
        errors.append(
            "spec.autoscaling.mode: slo scales the roles with autoscaling (minReplicas/maxReplicas); "
            "neither spec.prefill.autoscaling nor spec.decode.autoscaling is set"
        )
    if spec.prefill.autoscaling is not None and not ttft:
        errors.append("spec.slo.ttftP90Ms: slo mode scales prefill from TTFT and needs this target")
    if spec.decode.autoscaling is not None and not itl:
        errors.append("spec.slo.itlP50Ms: slo mode scales decode from ITL and needs this target")
    return errors


def role_kv_cache_dtype(spec: InferenceServiceSpec, role: str) -> str:
    """The ``--kv-cache-dtype`` of a role's workers: its own override, else ``engine.kvCacheDtype``."""
    own = getattr(spec, role).kv_cache_dtype
    return own if own is not None else spec.engine.kv_cache_dtype


def role_quantization(spec: InferenceServiceSpec, role: str) -> Optional[str]:
    """The ``--quantization`` of a role's workers (None: the checkpoint's): its override, else the engine's."""
    own = getattr(spec, role).quantization
    return own if own is not None else spec.engine.quantization


def _pd_numerics_errors(spec: InferenceServiceSpec) -> list[str]:
    """Prefill and decode must store KV alike and run the same weights (decode refuses the prefill otherwise)."""
    errors = []
    p, d = role_kv_cache_dtype(spec, "prefill"), role_kv_cache_dtype(spec, "decode")
    if p != d:
        errors.append(
            f"spec.prefill.kvCacheDtype / spec.decode.kvCacheDtype: prefill {p} != decode {d} (decode refuses KV "
            "of another dtype)"
        )
    pq, dq = role_quantization(spec, "prefill"), role_quantization(spec, "decode")
    if pq != dq:
        errors.append(
            f"spec.prefill.quantization / spec.decode.quantization: prefill {pq or 'default'} != decode "
            f"{dq or 'default'} (decode refuses a prefill of another model fingerprint)"
        )
    return errors


def image_errors(spec: InferenceServiceSpec, allowed_prefixes: tuple[str, ...]) -> list[str]:
    """Images named by the spec that start with none of ``allowed_prefixes`` (no check when it is empty).

    A spec's images run with the pods' service accounts, Secrets and network position, so an operator may
    restrict them to its registries (docs/operator.md, "What an InferenceService author can do").
    """
    if not allowed_prefixes:
        return []
    errors = []
    for path, image in (
        ("spec.engine.image", spec.engine.image),
        ("spec.router.image", spec.router.image),
        ("spec.hicache.master.image", spec.hicache.master.image),
    ):
        if image and not image.startswith(tuple(allowed_prefixes)):
            errors.append(
                f"{path}: {image!r} is not allowed by this operator (images must start with one of: "
                f"{', '.join(allowed_prefixes)})"
            )
    return errors


def _role_errors(role: str, r: WorkerRole, slo: bool = False) -> list[str]:
    errors = []
    base = f"spec.{role}"
    if r.tensor_parallel_size % r.expert_parallel_size:
        errors.append(
            f"{base}.expertParallelSize: {r.expert_parallel_size} must divide tensorParallelSize "
            f"{r.tensor_parallel_size}"
        )
    gpus = _gpu_count(r.resources)
    nodes = r.nodes_per_replica
    world = worker_gpus(r)
    per_pod = world // nodes  # a worker's GPUs are split evenly over its pods
    if nodes > 1:
        errors.extend(_group_errors(base, r, slo))
    pp = r.pipeline_parallel_size
    if world % nodes == 0 and gpus is not None and gpus != per_pod:
        split = f", {per_pod} on each of its {nodes} pods)" if nodes > 1 else ")"
        if pp == 1:
            errors.append(
                f"{base}.tensorParallelSize: {r.tensor_parallel_size} does not match resources "
                f"{GPU}={gpus} (one worker uses tensorParallelSize GPUs" + split
            )
        else:
            errors.append(
                f"{base}.pipelineParallelSize: tensorParallelSize {r.tensor_parallel_size} x pipelineParallelSize "
                f"{pp} = {world} GPUs does not match resources {GPU}={gpus} (one worker uses tensorParallelSize x "
                "pipelineParallelSize GPUs" + split
            )
    elif world % nodes == 0 and gpus is None and per_pod > 1:
        errors.append(f"{base}.resources: {_sizes(r)} needs limits {GPU}: {per_pod}")
    for part in ("limits", "requests"):
        if GPU in (r.resources.get(part) or {}) and part == "requests" and GPU not in (r.resources.get("limits") or {}):
            errors.append(f"{base}.resources.limits: {GPU} must be set in limits (extended resources)")
    if r.autoscaling is not None:
        errors.extend(_autoscaling_errors(f"{base}.autoscaling", r.autoscaling))
    return errors


# Longest group pod name: NAME-prefill-<12-hex revision>-g<replica>-<rank> (StatefulSet fallback), a DNS label.
MAX_GROUP_NAME_LENGTH = 63 - len("-prefill-") - 12 - len("-g999-99")


def _group_errors(base: str, r: WorkerRole, slo: bool) -> list[str]:
    """nodesPerReplica > 1 (docs/operator.md, "Multi-node worker groups")."""
    errors = []
    n = r.nodes_per_replica
    if worker_gpus(r) % n:
        sizes = _sizes(r) + (f" = {worker_gpus(r)}" if r.pipeline_parallel_size > 1 else "")
        errors.append(
            f"{base}.nodesPerReplica: {n} must divide {sizes} (each pod of a group runs the same number of ranks)"
        )
    if r.autoscaling is not None and not slo:
        errors.append(
            f"{base}.autoscaling: with nodesPerReplica > 1 only the SLO planner scales groups "
            "(spec.autoscaling.mode: slo); an HPA would cut a group. Set the mode or remove it"
        )
    return errors


def worker_gpus(r: WorkerRole) -> int:
    """GPUs (ranks) of one worker of role ``r``: tensorParallelSize x pipelineParallelSize (docs/parallel.md)."""
    return r.tensor_parallel_size * r.pipeline_parallel_size


def _sizes(r: WorkerRole) -> str:
    """``tensorParallelSize 8``, or ``tensorParallelSize 8 x pipelineParallelSize 2`` with pipeline stages."""
    tp = f"tensorParallelSize {r.tensor_parallel_size}"
    return tp if r.pipeline_parallel_size == 1 else f"{tp} x pipelineParallelSize {r.pipeline_parallel_size}"


def _pipeline_errors(spec: InferenceServiceSpec, role: str, r: WorkerRole) -> list[str]:
    """pipelineParallelSize: the combinations the engine refuses at start (engine/config.py), refused here first
    so the service gets a Valid=False condition instead of crash-looping pods."""
    pp = r.pipeline_parallel_size
    base = f"spec.{role}.pipelineParallelSize"
    errors = []
    sp = spec.decode.speculative
    # unified and decode workers run decode.speculative; a PD prefill takes its flags for eagle and eagle3 only
    speculates = sp is not None and (role == "decode" or sp.algorithm in EAGLE_ALGORITHMS)
    if pp > 1 and role == "decode" and spec.prefill.replicas > 0:
        errors.append(
            f"{base}: {pp} runs on unified or prefill workers only: a pipeline-parallel decode worker is not built "
            'yet (a PP prefill feeds a TP decode; docs/parallel.md, "PD with pipeline parallelism"); set it to 1'
        )
    elif pp > 1 and speculates and sp is not None and sp.algorithm not in PP_SPEC_ALGORITHMS:
        errors.append(
            f"{base}: {pp} runs speculative algorithm ngram only (draft, eagle and eagle3 over pipeline stages are "
            f'not built yet; docs/speculative.md, "Pipeline parallelism"), got spec.decode.speculative.algorithm '
            f"{sp.algorithm}"
        )
    # --pp-layer-partition (extraArgs) names one layer count per stage; the role's own list wins over the engine's
    for path, args in ((f"spec.{role}.extraArgs", r.extra_args), ("spec.engine.extraArgs", spec.engine.extra_args)):
        partition = _last_value(list(args), "--pp-layer-partition")
        if partition is not None:
            if not _partition_fits(partition, pp):
                errors.append(
                    f"{path}: --pp-layer-partition {partition} must give {pp} positive layer counts, one per "
                    f"pipeline stage of the {role} workers (spec.{role}.pipelineParallelSize {pp})"
                )
            break
    return errors


def _mixed_chunk_errors(spec: InferenceServiceSpec, role: str, r: WorkerRole, unified: bool) -> list[str]:
    """``--enable-mixed-chunk`` in extraArgs (the role's after the engine's: the last switch wins, as in the
    argv) runs on a unified worker without speculative decoding or pipeline stages only (engine/config.py)."""
    on, path = False, ""
    for where, args in (("spec.engine.extraArgs", spec.engine.extra_args), (f"spec.{role}.extraArgs", r.extra_args)):
        for arg in args:
            if arg in ("--enable-mixed-chunk", "--no-enable-mixed-chunk"):
                on, path = arg == "--enable-mixed-chunk", where
    if not on:
        return []
    other = [
        name
        for name, bad in (
            (f"the {role} role of a PD service", not unified),
            ("spec.decode.speculative", spec.decode.speculative is not None),
            (f"spec.{role}.pipelineParallelSize {r.pipeline_parallel_size}", r.pipeline_parallel_size > 1),
        )
        if bad
    ]
    if not other:
        return []
    return [
        f"{path}: --enable-mixed-chunk works on a unified worker without speculative decoding or pipeline "
        f"stages; the {role} workers have {', '.join(other)}"
    ]


def _last_value(args: list[str], flag: str) -> Optional[str]:
    """The value of the last ``flag`` in ``args`` (``--flag v`` or ``--flag=v``; argparse keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _partition_fits(partition: str, pp: int) -> bool:
    try:
        counts = [int(x) for x in partition.split(",")]
    except ValueError:
        return False
    return len(counts) == pp and min(counts) >= 1


def _gpu_count(resources: dict) -> Optional[int]:
    value = (resources.get("limits") or {}).get(GPU)
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        return -1


def _autoscaling_errors(path: str, a: Autoscaling) -> list[str]:
    errors = []
    if a.min_replicas > a.max_replicas:
        errors.append(f"{path}.minReplicas: {a.min_replicas} exceeds maxReplicas {a.max_replicas}")
    if a.metric in ("cpu", "memory"):
        if isinstance(a.target, str) and not a.target.isdigit() or (isinstance(a.target, int) and a.target < 1):
            errors.append(f"{path}.target: must be a whole percentage >= 1 for metric {a.metric} (got {a.target!r})")
    elif a.metric.startswith("kvship") and a.metric not in metrics_names.GAUGES:
        # An HPA on a series no worker exports never acts; other names may come from other exporters.
        errors.append(
            f"{path}.metric: {a.metric} is not a gauge kvship workers export (one of {', '.join(metrics_names.GAUGES)})"
        )
    return errors

"""The InferenceService API (``kvship.io/v1alpha1``) as Python types.

These dataclasses are the one source of truth: the CRD's OpenAPI schema is
generated from them (:mod:`kvship.operator.crd`, checked against ``crds/``
by tests/test_crd.py) and :func:`kvship.operator.spec.parse_spec` parses a
custom resource's ``spec`` into them.  A field's ``description`` is what
``kubectl explain inferenceservice.spec...`` prints, so write it for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from kvship.common import metrics_names
from kvship.common.policies import DEFAULT_POLICY, POLICY_NAMES
from kvship.operator.typed import QUANTITY_PATTERN, api_field

GROUP = "kvship.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("kvsvc",)
API_VERSION = f"{GROUP}/{VERSION}"

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype (fp8_e4m3: the FP8 KV cache, docs/quantization.md)
KV_CACHE_DTYPES = DTYPES + ("fp8_e4m3",)
# --quantization: the weight methods the worker registers (tests/test_kv_fp8.py keeps this equal to the engine's)
QUANTIZATIONS = ("compressed-tensors", "fp8", "unquantized")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
TRANSFER_BACKENDS = ("tcp", "mooncake", "nixl")
# --hicache-storage: the shared KV tier (docs/cache.md)
HICACHE_STORAGES = ("none", "file", "mooncake")
# where a storage: file volume is mounted in every worker (--hicache-storage-path)
KV_STORE_MOUNT = "/kv-store"
SPEC_ALGORITHMS = ("eagle", "eagle3", "ngram", "draft")
AUTOSCALING_MODES = ("hpa", "slo")
PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Failed")
CONDITION_TYPES = ("Ready", "Valid", "PrefillReady", "DecodeReady", "RouterReady", "RouterSynced", "SLOMet")

# hf://owner/name[@revision] | pvc://claim[/path] | builtin:smollm2 | /absolute/path
MODEL_URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?|builtin:smollm2|/[^\s]*)$"
)
URI_HINT = "must be hf://OWNER/NAME[@REVISION], pvc://CLAIM[/PATH], builtin:smollm2 or an absolute path"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the InferenceService's namespace."""

    name: str = api_field(
        "Name of the Secret.", required=True, pattern=DNS_LABEL[:-1] + r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    )
    key: str = api_field("Key inside the Secret whose value is used.", required=True)


@dataclass(frozen=True)
class ModelSpec:
    """Which model the workers serve and how it is loaded."""

    uri: str = api_field(
        "Where the weights come from: hf://OWNER/NAME[@REVISION] (downloaded by an init container into the "
        "model cache), pvc://CLAIM[/PATH] (a PersistentVolumeClaim mounted read-only), an absolute path inside "
        "the image, or builtin:smollm2 (the SmolLM2-135M-Instruct GGUF shipped in the image; runs on CPU).",
        required=True,
        pattern=MODEL_URI_PATTERN,
        hint=URI_HINT,
    )
    served_name: Optional[str] = api_field(
        "Model name clients send in requests and /v1/models reports (default: the last part of the URI)."
    )
    dtype: str = api_field("Compute dtype; auto picks bfloat16 on GPUs and float32 on CPUs.", "auto", enum=DTYPES)
    context_length: Optional[int] = api_field("Longest context in tokens (default: the model's own).", minimum=1)
    hf_token_secret_ref: Optional[SecretKeyRef] = api_field(
        "Secret holding a Hugging Face token, for gated models such as Llama (exported as HF_TOKEN to the "
        "download init container only)."
    )
    cache_volume_claim: Optional[str] = api_field(
        "Existing PersistentVolumeClaim (ReadWriteMany) used as the Hugging Face cache by every worker pod, "
        "so weights are downloaded once; default: an emptyDir per pod.",
        pattern=DNS_LABEL,
    )
    cache_size: Optional[str] = api_field(
        "Size limit of the per-pod model cache emptyDir (when cacheVolumeClaim is not set), also requested as "
        "ephemeral storage so pods land on nodes with room and are not evicted mid-download; "
        "default 100Gi for hf:// models, 10Gi otherwise.",
        pattern=QUANTITY_PATTERN,
    )


@dataclass(frozen=True)
class EngineSpec:
    """Worker engine settings shared by prefill and decode workers."""

    image: Optional[str] = api_field("Worker image (default: the operator's --worker-image).")
    image_pull_policy: Optional[str] = api_field(
        "Image pull policy of every pod.", enum=("Always", "IfNotPresent", "Never")
    )
    image_pull_secrets: list[str] = api_field("Names of Secrets used to pull the images.", [])
    attention_backend: str = api_field(
        "Attention kernels: flashinfer or triton on GPUs, torch_native anywhere; auto picks the best installed.",
        "auto",
        enum=ATTENTION_BACKENDS,
    )
    kv_cache_dtype: str = api_field(
        "KV cache dtype (auto = the compute dtype; fp8_e4m3 = FP8 KV with the checkpoint's per-layer k/v scales, "
        "about twice the tokens per GPU).",
        "auto",
        enum=KV_CACHE_DTYPES,
    )
    quantization: Optional[str] = api_field(
        "Weight quantization method (--quantization; default: the checkpoint's quantization_config, else "
        "unquantized). fp8 on an unquantized checkpoint quantizes its weights per channel at load.",
        enum=QUANTIZATIONS,
    )
    mem_fraction_static: Optional[float] = api_field(
        "Fraction of GPU memory for weights and KV cache (worker default 0.85).",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )
    cuda_graph_max_batch_size: Optional[int] = api_field(
        "Largest decode batch captured in a CUDA graph (worker default 160).", minimum=1
    )
    shm_size: Optional[str] = api_field(
        "Size limit of /dev/shm, a memory-backed emptyDir (what it holds counts against the memory limit); "
        "default 16Gi for GPU workers, 1Gi otherwise.",
        pattern=QUANTITY_PATTERN,
    )
    startup_timeout_seconds: int = api_field(
        "How long a worker may take to load the model before its startup probe fails and it is restarted.",
        1800,
        minimum=30,
    )
    extra_args: list[str] = api_field(
        'More `kvship serve` flags, one argument per item (no shell), e.g. ["--page-size", "16"]. '
        "Flags are spelled in full; unknown flags and flags the operator owns (--host, --port, --mode, "
        "--model-path, keys and secrets, the KV-transfer settings, ...) are refused.",
        [],
    )


@dataclass(frozen=True)
class Autoscaling:
    """A HorizontalPodAutoscaler for this role (or the SLO planner's bounds); the role's replicas are then left
    to it."""

    __cel__ = (("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas"),)

    max_replicas: int = api_field("Most replicas.", required=True, minimum=1)
    min_replicas: int = api_field("Fewest replicas.", 1, minimum=1)
    metric: str = api_field(
        "cpu or memory (target = average utilization in percent), or the name of a per-pod metric served by a "
        f"metrics adapter, e.g. {metrics_names.AUTOSCALING_EXAMPLE} (target = average value); a kvship:* name "
        f"must be one the workers export ({', '.join(metrics_names.GAUGES)}).",
        "cpu",
        pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:.-]*$",
    )
    target: Union[int, str] = api_field(
        "Target value of the metric (percent for cpu/memory, else a quantity).", 80, kube="int-or-string"
    )


@dataclass(frozen=True)
class PlannerProfile:
    """Per-replica capacity measured offline (e.g. with bench/), where the SLO planner starts before it has
    learnt its own from the live figures."""

    prefill_requests_per_second: Optional[float] = api_field(
        "Requests per second one prefill (or unified) replica serves within the TTFT target.",
        minimum=0,
        exclusive_minimum=True,
    )
    decode_concurrency: Optional[float] = api_field(
        "Concurrent requests one decode (or unified) replica runs within the ITL target.",
        minimum=0,
        exclusive_minimum=True,
    )


@dataclass(frozen=True)
class ServiceAutoscaling:
    """How the worker roles are scaled: per-role HorizontalPodAutoscalers (hpa) or the SLO planner (slo)."""

    mode: str = api_field(
        "hpa: each role with `autoscaling` gets a HorizontalPodAutoscaler on its metric. slo: the operator's "
        "planner sets prefill replicas from TTFT and decode replicas from ITL against spec.slo, within each "
        "role's autoscaling.minReplicas..maxReplicas (their metric and target are then unused).",
        "hpa",
        enum=AUTOSCALING_MODES,
    )
    utilization: float = api_field(
        "slo: fraction of a replica's learnt capacity the planner plans for (headroom below the target); a "
        "figure above this fraction of its target also blocks scale-down.",
        0.8,
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
    )
    scale_up_stabilization_seconds: int = api_field(
        "slo: a scale-up goes no higher than the lowest replica count wanted over this many seconds.", 0, minimum=0
    )
    scale_down_stabilization_seconds: int = api_field(
        "slo: a scale-down goes no lower than the highest replica count wanted over this many seconds.",
        300,
        minimum=0,
    )
    cooldown_seconds: int = api_field(
        "slo: seconds after a role's last change before it changes again (its new replicas need that long to "
        "show in the router's figures).",
        60,
        minimum=0,
    )
    max_scale_up_step: int = api_field("slo: most replicas one decision adds to a role.", 2, minimum=1)
    max_scale_down_step: int = api_field("slo: most replicas one decision removes from a role.", 1, minimum=1)
    profile: Optional[PlannerProfile] = api_field(
        "slo: starting per-replica capacities (e.g. from a bench/ run); learnt from live figures otherwise."
    )


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding on decode (and unified) workers."""

    __cel__ = (
        (
            "self.algorithm == 'ngram' || has(self.draftModel)",
            "draftModel is required for the eagle, eagle3 and draft algorithms",
        ),
    )

    algorithm: str = api_field(
        "eagle (EAGLE draft head), eagle3 (EAGLE-3 head over auxiliary hidden states), ngram (prompt lookup, "
        "no draft model) or draft (a small draft model).",
        required=True,
        enum=SPEC_ALGORITHMS,
    )
    draft_model: Optional[str] = api_field(
        "Draft weights, in the same URI forms as model.uri.", pattern=MODEL_URI_PATTERN, hint=URI_HINT
    )
    num_steps: int = api_field(
        "Draft steps per verification (eagle, eagle3; draft drafts numDraftTokens steps, ngram looks its drafts "
        "up: neither takes it).",
        3,
        minimum=1,
        maximum=16,
    )
    topk: int = api_field(
        "Branching factor of the draft tree (eagle, eagle3; draft and ngram draft a chain: 1).", 1, minimum=1, maximum=8
    )
    num_draft_tokens: int = api_field(
        "Draft tokens verified per step (draft: the length of its chain).", 4, minimum=1, maximum=64
    )


@dataclass(frozen=True)
class WorkerRole:
    """Common fields of the prefill and decode roles."""

    __cel__ = (
        ("self.tensorParallelSize % self.expertParallelSize == 0", "expertParallelSize must divide tensorParallelSize"),
        (
            "(self.tensorParallelSize * self.pipelineParallelSize) % self.nodesPerReplica == 0",
            "nodesPerReplica must divide tensorParallelSize x pipelineParallelSize",
        ),
    )

    replicas: int = api_field("Worker pods of this role (ignored when autoscaling is set).", 1, minimum=0)
    resources: dict[str, Any] = api_field(
        "Container resources of each worker pod, e.g. limits: {nvidia.com/gpu: 8, memory: 200Gi}. The GPU count "
        "must equal tensorParallelSize x pipelineParallelSize (divided by nodesPerReplica) when set.",
        {},
        kube="resources",
    )
    tensor_parallel_size: int = api_field(
        "GPUs each pipeline stage of one worker shards the model over (tensor parallelism); a worker uses "
        "tensorParallelSize x pipelineParallelSize GPUs.",
        1,
        minimum=1,
    )
    pipeline_parallel_size: int = api_field(
        "Pipeline stages one worker splits the model's layers into (pipeline parallelism, --pp-size), each "
        "tensorParallelSize GPUs wide: a worker uses tensorParallelSize x pipelineParallelSize GPUs. Not for the "
        "decode role of a PD service (a pipeline-parallel decode worker is not built yet: a PP prefill feeds a TP "
        "decode); above 1 the role's workers run no speculative algorithm but ngram (decode.speculative reaches "
        "unified workers, and PD prefill workers under eagle and eagle3).",
        1,
        minimum=1,
    )
    expert_parallel_size: int = api_field(
        "Ranks the MoE experts are split over (expert parallelism); must divide tensorParallelSize.", 1, minimum=1
    )
    node_selector: dict[str, str] = api_field("Node labels the pods must run on.", {})
    tolerations: list[dict[str, Any]] = api_field(
        "Taints the pods tolerate (e.g. nvidia.com/gpu).", [], kube="tolerations"
    )
    affinity: dict[str, Any] = api_field("Pod affinity and anti-affinity, as in a Pod spec.", {}, kube="affinity")
    env: list[dict[str, Any]] = api_field("Extra environment variables of the worker container.", [], kube="env")
    pod_annotations: dict[str, str] = api_field(
        "Annotations of the worker pods, e.g. k8s.v1.cni.cncf.io/networks for an RDMA network.", {}
    )
    extra_args: list[str] = api_field("More `kvship serve` flags for this role only, one argument per item.", [])
    nodes_per_replica: int = api_field(
        "Pods (nodes) one worker spans. Above 1 each replica is a group of this many pods started together as a "
        "LeaderWorkerSet when the cluster serves leaderworkerset.x-k8s.io/v1, else as a StatefulSet per "
        "replica; the worker's GPUs (tensorParallelSize x pipelineParallelSize, which this must divide) are split "
        "evenly over them, the group is ready only when all its pods are, and a lost pod restarts the whole group "
        '(docs/operator.md, "Multi-node worker groups").',
        1,
        minimum=1,
        maximum=64,
    )
    autoscaling: Optional[Autoscaling] = api_field(
        "Scale this role with a HorizontalPodAutoscaler, or with spec.autoscaling.mode slo with the SLO "
        "planner between minReplicas and maxReplicas."
    )
    kv_cache_dtype: Optional[str] = api_field(
        "This role's KV cache dtype (default: engine.kvCacheDtype). In PD mode prefill and decode must agree: a "
        "decode worker refuses KV of another dtype.",
        enum=KV_CACHE_DTYPES,
    )
    quantization: Optional[str] = api_field(
        "This role's weight quantization method (default: engine.quantization). In PD mode prefill and decode "
        "must agree: decode refuses a prefill of another model fingerprint.",
        enum=QUANTIZATIONS,
    )


@dataclass(frozen=True)
class PrefillSpec(WorkerRole):
    """Prefill workers: run prompts and ship their KV cache to decode workers. replicas 0 = unified mode."""

    replicas: int = api_field(
        "Prefill worker pods; 0 means unified mode: the decode workers run whole requests "
        "(--mode unified) and no KV is transferred.",
        0,
        minimum=0,
    )


@dataclass(frozen=True)
class DecodeSpec(WorkerRole):
    """Decode workers (or the unified workers when prefill.replicas is 0)."""

    replicas: int = api_field("Decode (or unified) worker pods (ignored when autoscaling is set).", 1, minimum=1)
    speculative: Optional[Speculative] = api_field("Speculative decoding; off when absent.")


@dataclass(frozen=True)
class KvTransfer:
    """How prefill workers ship KV caches to decode workers (PD mode only)."""

    __cel__ = (
        ("self.backend != 'tcp' || size(self.rdmaDevices) == 0", "rdmaDevices needs the mooncake or nixl backend"),
    )

    backend: str = api_field(
        "mooncake (RDMA through Mooncake's TransferEngine), nixl (NIXL over UCX) or tcp "
        "(plain sockets, no RDMA needed).",
        "tcp",
        enum=TRANSFER_BACKENDS,
    )
    rdma_devices: list[str] = api_field(
        "RDMA devices to use, e.g. [mlx5_0, mlx5_1] (mooncake: --disaggregation-ib-device; nixl: UCX_NET_DEVICES).", []
    )
    bootstrap_port: int = api_field("Port of the prefill workers' bootstrap endpoint.", 8998, minimum=1, maximum=65535)
    rdma_resource: Optional[str] = api_field(
        "Extended resource of the RDMA device plugin that each prefill and decode pod requests one of, "
        "e.g. rdma/hca (k8s-rdma-shared-dev-plugin) or nvidia.com/hostdev.",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    )
    networks: list[str] = api_field(
        "Multus network attachments ([NAMESPACE/]NAME of NetworkAttachmentDefinitions) of the prefill and decode "
        "pods, set as their k8s.v1.cni.cncf.io/networks annotation: the RDMA network the KV travels over.",
        [],
    )
    ipc_lock: Optional[bool] = api_field(
        "Add the IPC_LOCK capability to prefill and decode workers, so the RDMA stack can pin (register) KV "
        "memory; default: true when rdmaDevices is set."
    )


@dataclass(frozen=True)
class MooncakeMasterSpec:
    """The Mooncake Store master pod the operator runs for hicache.storage mooncake (docs/operator.md,
    "Shared KV tier")."""

    image: Optional[str] = api_field(
        "Image whose mooncake package ships mooncake_master, run as `kvship mooncake-master` (default: the worker "
        "image; its CUDA variant has the package)."
    )
    port: int = api_field(
        "The master's RPC port (the workers' --hicache-storage-master).", 50051, minimum=1, maximum=65535
    )
    resources: dict[str, Any] = api_field("Container resources of the master.", {}, kube="resources")
    node_selector: dict[str, str] = api_field("Node labels the master pod must run on.", {})
    tolerations: list[dict[str, Any]] = api_field("Taints the master pod tolerates.", [], kube="tolerations")


@dataclass(frozen=True)
class HiCacheSpec:
    """The workers' shared KV tier (docs/cache.md, "Shared tier"): prefix pages a worker evicts are written to a
    store every worker of the service reads, so a prefix computed on one worker is a cache hit on the others.
    The host-memory tier is a worker flag (--hicache-size-gb in extraArgs)."""

    __cel__ = (
        ("self.storage == 'file' || !has(self.volumeClaim)", "volumeClaim is used by storage file only"),
        ("self.storage != 'file' || has(self.volumeClaim)", "storage file needs volumeClaim"),
        ("self.storage == 'mooncake' || !has(self.mooncakeMaster)", "mooncakeMaster is used by storage mooncake only"),
    )

    storage: str = api_field(
        "none; file (a shared volume: volumeClaim); mooncake (Mooncake Store: each worker lends it memory, a "
        "mooncake_master pod the operator runs keeps the index, or the one mooncakeMaster names).",
        "none",
        enum=HICACHE_STORAGES,
    )
    volume_claim: Optional[str] = api_field(
        f"storage file: an existing ReadWriteMany PersistentVolumeClaim every worker mounts at {KV_STORE_MOUNT}.",
        pattern=DNS_LABEL,
    )
    mooncake_master: Optional[str] = api_field(
        "storage mooncake: HOST:PORT of a mooncake_master you run; absent, the operator runs one (master).",
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$",
        hint="must be HOST:PORT",
    )
    master: MooncakeMasterSpec = api_field(
        "storage mooncake without mooncakeMaster: the master pod the operator runs.", MooncakeMasterSpec
    )


@dataclass(frozen=True)
class RouterServiceSpec:
    """The Service in front of the router: what clients call."""

    type: str = api_field("Service type.", "ClusterIP", enum=("ClusterIP", "NodePort", "LoadBalancer"))
    port: int = api_field("Service port clients connect to.", 8000, minimum=1, maximum=65535)
    node_port: Optional[int] = api_field(
        "Fixed node port (type NodePort or LoadBalancer).", minimum=30000, maximum=32767
    )
    annotations: dict[str, str] = api_field("Annotations of the Service (e.g. for a cloud load balancer).", {})


@dataclass(frozen=True)
class RouterSpec:
    """The router: the one OpenAI-compatible endpoint; it discovers the worker pods itself."""

    replicas: int = api_field("Router pods (ignored when autoscaling is set).", 1, minimum=1)
    image: Optional[str] = api_field("Router image (default: the operator's --router-image).")
    resources: dict[str, Any] = api_field("Container resources of the router.", {}, kube="resources")
    node_selector: dict[str, str] = api_field("Node labels the router pods must run on.", {})
    tolerations: list[dict[str, Any]] = api_field("Taints the router pods tolerate.", [], kube="tolerations")
    affinity: dict[str, Any] = api_field("Pod affinity of the router pods.", {}, kube="affinity")
    env: list[dict[str, Any]] = api_field("Extra environment variables of the router container.", [], kube="env")
    autoscaling: Optional[Autoscaling] = api_field("Scale the router with a HorizontalPodAutoscaler.")
    policy: str = api_field(
        "How a worker is chosen: cache_aware (prefix-cache affinity with load balancing), "
        "round_robin, random, shortest_queue, power_of_two, bucket (prompt-length buckets) or kv_events (a "
        "global prefix index from the workers' KV events; the operator adds --enable-kv-events to those workers).",
        DEFAULT_POLICY,
        enum=POLICY_NAMES,
    )
    prefill_policy: Optional[str] = api_field(
        "PD: policy choosing the prefill worker (default: policy).", enum=POLICY_NAMES
    )
    decode_policy: Optional[str] = api_field(
        "PD: policy choosing the decode worker (default: policy).", enum=POLICY_NAMES
    )
    cache_threshold: float = api_field(
        "cache_aware: smallest prefix-match ratio that routes to the matching worker.", 0.5, minimum=0, maximum=1
    )
    balance_abs_threshold: int = api_field(
        "cache_aware: balance load when the busiest worker has this many more requests than the idlest ...",
        32,
        minimum=0,
    )
    balance_rel_threshold: float = api_field("cache_aware: ... and this many times as many.", 1.5, minimum=1)
    api_key_secret_ref: Optional[SecretKeyRef] = api_field(
        "Secret holding the API key clients must send to the router as 'Authorization: Bearer KEY' (given to "
        "the router only; workers require the operator-made worker key instead); no client authentication when "
        "absent."
    )
    service: RouterServiceSpec = api_field("The router's Service.", RouterServiceSpec)
    extra_args: list[str] = api_field(
        "More `kvship router` flags, one argument per item (no shell), spelled in full; unknown flags and "
        "flags the operator owns (keys, discovery, selectors, allow-lists, policies) are refused.",
        [],
    )


@dataclass(frozen=True)
class NetworkPolicySpec:
    """NetworkPolicies the operator makes for the service's pods (docs/operator.md, "Network policies")."""

    enabled: bool = api_field(
        "Create NetworkPolicies: KV bootstrap and transfer ports open only between this service's prefill and "
        "decode pods, the workers' HTTP port only to this service's router and the operator, the router's port "
        "to anyone. Turn off on clusters without a NetworkPolicy controller or to manage policies yourself.",
        True,
    )
    worker_http_from: list[dict[str, Any]] = api_field(
        "More peers (NetworkPolicyPeer objects: podSelector, namespaceSelector, ipBlock) allowed to reach the "
        "workers' HTTP port, e.g. a metrics scraper: [{namespaceSelector: {matchLabels: "
        "{kubernetes.io/metadata.name: monitoring}}}].",
        [],
        kube="network-peers",
    )


@dataclass(frozen=True)
class SloTargets:
    """Service-level targets; the SLOMet condition says whether the router's last-minute figures meet them."""

    ttft_p90_ms: Optional[float] = api_field(
        "Most acceptable 90th-percentile time to first token, in milliseconds.", minimum=0, exclusive_minimum=True
    )
    itl_p50_ms: Optional[float] = api_field(
        "Most acceptable median inter-token latency, in milliseconds.", minimum=0, exclusive_minimum=True
    )


@dataclass(frozen=True)
class Tracing:
    """OpenTelemetry traces of every pod (router and workers), exported over OTLP (docs/observability.md)."""

    otlp_endpoint: str = api_field(
        "OTLP collector every pod exports its spans to: http(s)://host:4318 (OTLP/HTTP) or grpc(s)://host:4317 "
        "(OTLP/gRPC, plaintext or TLS); passed as --otlp-traces-endpoint.",
        required=True,
        pattern=r"^(http|https|grpc|grpcs)://\S+$",
    )
    sample_ratio: float = api_field(
        "Fraction of new traces kept (--otlp-traces-sample-ratio).", 1.0, minimum=0, maximum=1
    )


@dataclass(frozen=True)
class InferenceServiceSpec:
    """Desired state of an InferenceService: one model served by prefill, decode and router pods."""

    model: ModelSpec = api_field("The model to serve.", required=True)
    engine: EngineSpec = api_field("Engine settings shared by all workers.", EngineSpec)
    prefill: PrefillSpec = api_field(
        "Prefill workers; replicas 0 (the default) runs unified workers instead.", PrefillSpec
    )
    decode: DecodeSpec = api_field("Decode workers (unified workers when prefill.replicas is 0).", DecodeSpec)
    router: RouterSpec = api_field("The router in front of the workers.", RouterSpec)
    kv_transfer: KvTransfer = api_field("KV cache transfer between prefill and decode workers.", KvTransfer)
    hicache: HiCacheSpec = api_field(
        "The workers' shared KV tier (off by default); with mooncake the operator runs its master.", HiCacheSpec
    )
    slo: Optional[SloTargets] = api_field(
        "Targets for the live latency figures (status.slo); sets the SLOMet condition."
    )
    autoscaling: Optional[ServiceAutoscaling] = api_field(
        "How worker roles with `autoscaling` are scaled (default: mode hpa, a HorizontalPodAutoscaler each)."
    )
    network_policy: NetworkPolicySpec = api_field(
        "NetworkPolicies of the service's pods (on by default).", NetworkPolicySpec
    )
    tracing: Optional[Tracing] = api_field("OpenTelemetry tracing of the router and every worker (off if unset).")


# ------------------------------------------------------------------- status
@dataclass(frozen=True)
class Condition:
    """One aspect of the service's state, as in every Kubernetes object."""

    type: str = api_field(
        "Ready, Valid, PrefillReady, DecodeReady, RouterReady, RouterSynced (every worker pod of the current "
        "revision is in the router's rotation) or SLOMet (spec.slo targets met).",
        required=True,
    )
    status: str = api_field("True, False or Unknown.", required=True, enum=("True", "False", "Unknown"))
    reason: str = api_field("One CamelCase word saying why.", required=True)
    last_transition_time: str = api_field("When status last changed (RFC 3339).", required=True)
    message: str = api_field("Details for people.", "")
    observed_generation: Optional[int] = api_field("metadata.generation this condition was computed from.")


@dataclass(frozen=True)
class RoleStatus:
    """Replica counts of one role, read from its Deployment."""

    replicas: int = api_field("Desired pods.", 0)
    ready_replicas: int = api_field("Pods passing their readiness probe.", 0)
    updated_replicas: int = api_field("Pods running the current spec.", 0)
    ready: str = api_field(
        "readyReplicas/replicas, as printed by kubectl get (groups ready/desired when nodesPerReplica > 1).", "0/0"
    )
    nodes_per_replica: Optional[int] = api_field("Pods per replica (set when the role runs worker groups).")


@dataclass(frozen=True)
class RevisionStatus:
    """One revision's worker set: its Deployments' counts and whether the router serves it."""

    revision: str = api_field("The 12-hex revision (the pods' kvship.io/revision label).", required=True)
    current: bool = api_field("Whether this is the revision of the current spec.", False)
    serving: Optional[bool] = api_field("Whether the router sends new requests to it (absent: router not reached).")
    prefill: str = api_field("readyReplicas/replicas of its prefill Deployment (0/0 in unified mode).", "0/0")
    decode: str = api_field("readyReplicas/replicas of its decode (or unified) Deployment.", "0/0")
    in_flight: Optional[int] = api_field("Requests its workers are running, as the router counts them.")


@dataclass(frozen=True)
class SloStatus:
    """Live latency and throughput over the router's last window (GET /slo); absent figures had no sample."""

    window: str = api_field("Length of the window the figures cover, e.g. 60s.", "60s")
    requests: int = api_field("Requests finished in the window.", 0)
    ttft_p50_ms: Optional[float] = api_field("Median time to first token, ms.")
    ttft_p90_ms: Optional[float] = api_field("90th-percentile time to first token, ms.")
    itl_p50_ms: Optional[float] = api_field("Median inter-token latency, ms.")
    requests_per_second: Optional[float] = api_field("Finished requests per second.")
    output_tokens_per_second: Optional[float] = api_field("Generated tokens per second.")
    kv_transfer_g_bps: Optional[float] = api_field("KV cache transfer rate reported by decode workers, GB/s.")
    observed_at: Optional[str] = api_field("When the operator read the figures (RFC 3339).")


@dataclass(frozen=True)
class InferenceServiceStatus:
    """Observed state of an InferenceService, written by the operator."""

    phase: str = api_field("Pending, Progressing, Ready, Degraded or Failed.", "Pending", enum=PHASES)
    mode: Optional[str] = api_field("unified or pd.", enum=("unified", "pd"))
    conditions: list[Condition] = api_field(
        "Ready, Valid, PrefillReady, DecodeReady, RouterReady, RouterSynced and (with spec.slo) SLOMet.", []
    )
    prefill: RoleStatus = api_field("Prefill workers (0/0 in unified mode).", RoleStatus)
    decode: RoleStatus = api_field("Decode (or unified) workers.", RoleStatus)
    router: RoleStatus = api_field("Router pods.", RoleStatus)
    store_master: Optional[RoleStatus] = api_field(
        "The Mooncake master the operator runs for spec.hicache.storage mooncake (absent otherwise). It is not "
        "part of Ready: without it the workers serve and recompute what the store would have held."
    )
    url: Optional[str] = api_field("Base URL of the router's OpenAI-compatible API.")
    revision: Optional[str] = api_field("Revision of the current spec (hash of what must match across P and D).")
    revisions: list[RevisionStatus] = api_field(
        "Every revision with live workers: during a rollout the new set and the draining old one.", []
    )
    slo: Optional[SloStatus] = api_field("Live figures from the router, refreshed every resync.")
    observed_generation: Optional[int] = api_field("metadata.generation the status reflects.")

"""Where workers find their weights: volumes, mounts and download init containers.

* ``hf://OWNER/NAME[@REV]`` — an init container (the worker image, command
  ``hf download``) fetches the snapshot into the model cache volume
  (``/cache``: an emptyDir, or ``model.cacheVolumeClaim``), and the worker
  gets ``--model-path /cache/models/OWNER/NAME/REV``.
* ``pvc://CLAIM[/PATH]`` — the claim is mounted read-only at
  ``/weights/CLAIM``; the worker gets ``/weights/CLAIM/PATH``.
* an absolute path — used as is (baked into the image or mounted by the user).
* ``builtin:smollm2`` — no ``--model-path``: the embedded model.

The same applies to a speculative draft model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvship.operator.builders.common import container_security_context, secret_env
from kvship.operator.spec import ModelSource, ServiceConfig

CACHE_DIR = "/cache"
WEIGHTS_DIR = "/weights"


@dataclass
class ModelPlan:
    """Volumes, mounts and init containers a worker pod needs, and the resolved paths."""

    model_path: Optional[str] = None
    draft_path: Optional[str] = None
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


# Init containers only download: small fixed resources (they never count beyond the worker's own).
FETCH_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}


def cache_size(cfg: ServiceConfig) -> str:
    """Size limit (and ephemeral-storage request) of the per-pod cache emptyDir."""
    if cfg.spec.model.cache_size:
        return cfg.spec.model.cache_size
    downloads = cfg.model.kind == "hf" or (cfg.draft_model is not None and cfg.draft_model.kind == "hf")
    return "100Gi" if downloads else "10Gi"


def cache_on_node(cfg: ServiceConfig) -> bool:
    """Whether the cache is node-local ephemeral storage (an emptyDir), not a claim."""
    return not cfg.spec.model.cache_volume_claim


def cache_volume(cfg: ServiceConfig) -> dict[str, Any]:
    claim = cfg.spec.model.cache_volume_claim
    if claim:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": claim}}
    return {"name": "cache", "emptyDir": {"sizeLimit": cache_size(cfg)}}


def plan_models(cfg: ServiceConfig, image: str, pull_policy: str) -> ModelPlan:
    plan = ModelPlan()
    claims: dict[str, str] = {}
    plan.model_path = _resolve(cfg, cfg.model, "model", plan, claims, image, pull_policy)
    if cfg.draft_model is not None:
        plan.draft_path = _resolve(cfg, cfg.draft_model, "draft-model", plan, claims, image, pull_policy)
    return plan


def _resolve(
    cfg: ServiceConfig,
    src: ModelSource,
    what: str,
    plan: ModelPlan,
    claims: dict[str, str],
    image: str,
    pull_policy: str,
) -> Optional[str]:
    if src.kind == "builtin":
        return None
    if src.kind == "path":
        return src.path
    if src.kind == "pvc":
        assert src.claim is not None
        if src.claim not in claims:
            vol = f"weights-{len(claims)}"
            claims[src.claim] = vol
            plan.volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True}})
            plan.mounts.append({"name": vol, "mountPath": f"{WEIGHTS_DIR}/{src.claim}", "readOnly": True})
        base = f"{WEIGHTS_DIR}/{src.claim}"
        return f"{base}/{src.sub_path}" if src.sub_path else base
    # hf
    assert src.repo is not None
    target = f"{CACHE_DIR}/models/{src.repo}/{src.revision or 'main'}"
    args = ["download", src.repo, "--local-dir", target]
    if src.revision:
        args += ["--revision", src.revision]
    env = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if cfg.spec.model.hf_token_secret_ref is not None:
        env.append(secret_env("HF_TOKEN", cfg.spec.model.hf_token_secret_ref))
    plan.init_containers.append(
        {
            "name": f"fetch-{what}",
            "image": image,
            "imagePullPolicy": pull_policy,
            "command": ["hf"],
            "args": args,
            "env": env,
            "securityContext": container_security_context(),
            "resources": {k: dict(v) for k, v in FETCH_RESOURCES.items()},
            "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        }
    )
    return target

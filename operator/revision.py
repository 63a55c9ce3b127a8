"""The revision of an InferenceService's workers: a hash of the spec fields that decide what KV means.

A prefill worker may only ship KV to a decode worker that computes with the
same weights and lays KV out the same way (docs/operator.md, "Revisions and
lockstep rollouts").  The revision is what the operator knows of that from
the spec alone:

* the weights: ``model.uri`` (an ``hf://`` URI carries its ``@REVISION``) and
  the worker image (it decides the engine version, and for an absolute path or
  ``builtin:`` model also the weights themselves);
* the numerics: ``model.dtype``, ``engine.kvCacheDtype``, ``engine.attentionBackend``;
* the layout: each role's ``tensorParallelSize`` and ``expertParallelSize``, its ``pipelineParallelSize`` above 1
  (each rank's KV pool then holds only its stage's layers), and ``nodesPerReplica`` above 1 (a worker group is
  another workload kind, so it rolls out as a new set beside the old one);
* the flags among ``engine.extraArgs`` and the roles' ``extraArgs`` that change
  weights or KV (:data:`REVISION_FLAGS`, e.g. ``--page-size``), with their values.

Prefill and decode of one spec get the same revision (both roles' fields go
into one hash).  Everything else (replicas, resources, scheduling, other
flags) leaves the revision alone, and a change to it patches the Deployments
in place.  Workers compute their own, finer fingerprint (weights' file hashes,
docs/router.md); the revision is what the operator can know before any pod runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvship.operator.spec import ServiceConfig

REVISION_LABEL = "kvship.io/revision"
REVISION_HEX = 12
# `kvship serve` flags that change the weights loaded or the KV layout (the others are scheduling knobs).
REVISION_FLAGS = (
    "--page-size",
    "--load-format",
    "--seed",
    "--tokenizer-path",
    "--trust-remote-code",
    "--pp-layer-partition",  # which layers (and so which KV) each pipeline stage's ranks hold
)


def revision_flags(args: list[str]) -> list[str]:
    """The :data:`REVISION_FLAGS` in ``args`` with their values, in order (``--flag v`` and ``--flag=v``)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in REVISION_FLAGS:
            if "=" in args[i]:
                out.append(args[i])
            else:
                value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
                out.append(f"{flag}={value}" if value else flag)
                i += 1 if value else 0
        i += 1
    return out


def revision_parts(cfg: ServiceConfig, worker_image: str) -> dict[str, Any]:
    """What the revision hashes (also printed in the ConfigMap, so people can see why it changed)."""
    spec = cfg.spec
    roles = ("decode",) if cfg.unified else ("prefill", "decode")
    return {
        "model": spec.model.uri,
        "image": spec.engine.image or worker_image,
        "dtype": spec.model.dtype,
        "kvCacheDtype": spec.engine.kv_cache_dtype,
        "attentionBackend": spec.engine.attention_backend,
        **_set_only(quantization=spec.engine.quantization),
        "flags": revision_flags(list(spec.engine.extra_args)),
        "roles": {
            role: {
                "tp": getattr(spec, role).tensor_parallel_size,
                "ep": getattr(spec, role).expert_parallel_size,
                # set above 1 only, like nodes: services without pipeline stages keep their revisions
                **(
                    {"pp": getattr(spec, role).pipeline_parallel_size}
                    if getattr(spec, role).pipeline_parallel_size > 1
                    else {}
                ),
                "flags": revision_flags(list(getattr(spec, role).extra_args)),
                # set only (an unset override leaves the revisions of existing services as they were)
                **_set_only(
                    kvCacheDtype=getattr(spec, role).kv_cache_dtype, quantization=getattr(spec, role).quantization
                ),
                # groups run as other workload kinds: a change of nodesPerReplica is a new worker set beside the old
                **(
                    {"nodes": getattr(spec, role).nodes_per_replica}
                    if getattr(spec, role).nodes_per_replica > 1
                    else {}
                ),
            }
            for role in roles
        },
    }


def _set_only(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def compute_revision(cfg: ServiceConfig, worker_image: str) -> str:
    """The first :data:`REVISION_HEX` hex digits of SHA-256 over the canonical JSON of :func:`revision_parts`."""
    blob = json.dumps(revision_parts(cfg, worker_image), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:REVISION_HEX]

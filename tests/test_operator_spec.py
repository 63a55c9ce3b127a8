"""Layer 1: an InferenceService parses into a ServiceConfig, or every problem is named with its field."""

from __future__ import annotations

import pytest

from kvship.operator.spec import ModelSource, SpecError, parse_service


def body(spec: dict, name: str = "svc") -> dict:
    return {"metadata": {"name": name, "namespace": "ml", "uid": "uid-1", "generation": 3}, "spec": spec}


def errors_of(spec: dict, name: str = "svc") -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_service(body(spec, name))
    return e.value.errors


GPU1 = {"limits": {"nvidia.com/gpu": 1}}


def test_minimal_spec_is_unified_with_defaults():
    cfg = parse_service(body({"model": {"uri": "builtin:smollm2"}}))
    assert cfg.unified and cfg.mode == "unified"
    assert cfg.served_name == "SmolLM2-135M-Instruct"
    assert cfg.spec.decode.replicas == 1 and cfg.spec.router.policy == "cache_aware"
    assert (cfg.name, cfg.namespace, cfg.uid, cfg.generation) == ("svc", "ml", "uid-1", 3)


def test_prefill_replicas_switch_to_pd_mode():
    cfg = parse_service(body({"model": {"uri": "hf://org/model"}, "prefill": {"replicas": 2}}))
    assert not cfg.unified and cfg.mode == "pd"


def test_every_schema_problem_is_reported_with_its_path():
    errs = errors_of(
        {
            "model": {"uri": "ftp://x"},
            "decode": {"replicas": 0, "bogus": 1},
            "router": {"policy": "fastest"},
            "engine": {"memFractionStatic": 1.5},
        }
    )
    text = "\n".join(errs)
    assert "spec.model.uri: must be hf://OWNER/NAME[@REVISION]" in text
    assert "spec.decode.bogus: unknown field" in text
    assert "spec.decode.replicas: must be >= 1 (got 0)" in text
    assert "spec.router.policy: must be one of cache_aware" in text
    assert "spec.engine.memFractionStatic: must be < 1" in text


def test_missing_model_is_required():
    assert errors_of({}) == ["spec.model: required"]


def test_gpu_count_must_match_tensor_parallel_size():
    errs = errors_of({"model": {"uri": "hf://a/b"}, "decode": {"tensorParallelSize": 2, "resources": GPU1}})
    assert errs == [
        "spec.decode.tensorParallelSize: 2 does not match resources nvidia.com/gpu=1 "
        "(one worker uses tensorParallelSize GPUs)"
    ]
    errs = errors_of({"model": {"uri": "hf://a/b"}, "decode": {"tensorParallelSize": 4}})
    assert "needs limits nvidia.com/gpu: 4" in errs[0]


def test_expert_parallel_size_must_divide_tensor_parallel_size():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "prefill": {"replicas": 1},
            "decode": {
                "tensorParallelSize": 4,
                "expertParallelSize": 3,
                "resources": {"limits": {"nvidia.com/gpu": 4}},
            },
        }
    )
    assert errs == ["spec.decode.expertParallelSize: 3 must divide tensorParallelSize 4"]


def test_prefill_rules_only_apply_in_pd_mode():
    # prefill.replicas 0: its (unused) tensorParallelSize is not checked against GPUs
    parse_service(body({"model": {"uri": "hf://a/b"}, "prefill": {"replicas": 0, "tensorParallelSize": 2}}))
    errs = errors_of({"model": {"uri": "hf://a/b"}, "prefill": {"replicas": 0, "autoscaling": {"maxReplicas": 3}}})
    assert errs == ["spec.prefill.autoscaling: needs prefill.replicas > 0 (0 means unified mode: no prefill role)"]


def test_speculative_algorithms_need_the_right_draft_model():
    eagle = errors_of({"model": {"uri": "hf://a/b"}, "decode": {"speculative": {"algorithm": "eagle"}}})
    assert eagle == ["spec.decode.speculative.draftModel: required for algorithm eagle"]
    ngram = errors_of(
        {"model": {"uri": "hf://a/b"}, "decode": {"speculative": {"algorithm": "ngram", "draftModel": "hf://x/y"}}}
    )
    assert ngram == ["spec.decode.speculative.draftModel: not used by algorithm ngram; remove it"]


def test_rdma_devices_need_an_rdma_backend():
    errs = errors_of({"model": {"uri": "hf://a/b"}, "kvTransfer": {"rdmaDevices": ["mlx5_0"]}})
    assert errs == ["spec.kvTransfer.rdmaDevices: needs backend mooncake or nixl (backend is tcp)"]


def test_extra_args_may_not_override_operator_flags():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "engine": {"extraArgs": ["--page-size", "16", "--port=1"]},
            "router": {"extraArgs": ["--selector", "a=b"]},
        }
    )
    assert errs == [
        "spec.engine.extraArgs[2]: --port is set by the operator from the spec; use the matching field",
        "spec.router.extraArgs[0]: --selector is set by the operator from the spec; use the matching field",
    ]


def test_autoscaling_bounds_and_targets():
    errs = errors_of(
        {"model": {"uri": "hf://a/b"}, "decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2, "target": "80%"}}}
    )
    assert "spec.decode.autoscaling.minReplicas: 5 exceeds maxReplicas 2" in errs
    assert "spec.decode.autoscaling.target: must be a whole percentage >= 1 for metric cpu (got '80%')" in errs
    parse_service(
        body(
            {
                "model": {"uri": "hf://a/b"},
                "decode": {"autoscaling": {"maxReplicas": 4, "metric": "kvship:num_queue_reqs", "target": "500m"}},
            }
        )
    )


def test_names_must_leave_room_for_child_suffixes():
    assert "metadata.name" in errors_of({"model": {"uri": "builtin:smollm2"}}, name="x" * 60)[0]
    assert "metadata.name" in errors_of({"model": {"uri": "builtin:smollm2"}}, name="Bad_Name")[0]


def test_node_port_needs_a_node_port_service():
    errs = errors_of({"model": {"uri": "builtin:smollm2"}, "router": {"service": {"nodePort": 30080}}})
    assert errs == ["spec.router.service.nodePort: needs type NodePort or LoadBalancer (type is ClusterIP)"]


def test_wrong_types_are_named_not_crashed_on():
    errs = errors_of(
        {
            "model": "builtin:smollm2",
            "decode": {"replicas": "2", "env": "X=1", "resources": {"limits": {"memory": "lots"}}},
        }
    )
    assert "spec.model: must be an object (got string)" in errs
    assert "spec.decode.replicas: must be an integer (got '2')" in errs
    assert "spec.decode.env: must be an array (got string)" in errs
    assert "spec.decode.resources.limits.memory: 'lots' is not a Kubernetes quantity" in errs


@pytest.mark.parametrize(
    "uri,kind,served",
    [
        ("hf://meta-llama/Llama-3.1-8B-Instruct@v1.0", "hf", "Llama-3.1-8B-Instruct"),
        ("pvc://weights/llama/8b", "pvc", "8b"),
        ("pvc://weights", "pvc", "weights"),
        ("/models/qwen3", "path", "qwen3"),
        ("builtin:smollm2", "builtin", "SmolLM2-135M-Instruct"),
    ],
)
def test_model_uris_resolve_to_sources(uri, kind, served):
    src = ModelSource.from_uri(uri)
    assert src.kind == kind and src.default_served_name == served
    if kind == "hf":
        assert (src.repo, src.revision) == ("meta-llama/Llama-3.1-8B-Instruct", "v1.0")
    if uri == "pvc://weights/llama/8b":
        assert (src.claim, src.sub_path) == ("weights", "llama/8b")

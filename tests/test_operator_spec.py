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


def gpus(n: int) -> dict:
    return {"limits": {"nvidia.com/gpu": n}}


def test_pipeline_parallel_workers_use_tp_times_pp_gpus():
    unified = parse_service(
        body(
            {
                "model": {"uri": "hf://a/b"},
                "decode": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "resources": gpus(4)},
            }
        )
    )
    assert unified.spec.decode.pipeline_parallel_size == 2 and unified.spec.prefill.pipeline_parallel_size == 1
    # a PD prefill of 8 x 2 ranks over two pods: 8 GPUs each; decode stays tensor-parallel
    pd = parse_service(
        body(
            {
                "model": {"uri": "hf://a/b"},
                "prefill": {
                    "replicas": 1,
                    "tensorParallelSize": 8,
                    "pipelineParallelSize": 2,
                    "nodesPerReplica": 2,
                    "resources": gpus(8),
                },
                "decode": {"tensorParallelSize": 8, "resources": gpus(8)},
            }
        )
    )
    assert pd.spec.prefill.pipeline_parallel_size == 2 and pd.spec.prefill.nodes_per_replica == 2
    # one stage per pod on CPU: 1 x 2 ranks over 2 pods is one rank each, no GPU limit needed
    parse_service(body({"model": {"uri": "hf://a/b"}, "decode": {"pipelineParallelSize": 2, "nodesPerReplica": 2}}))


def test_gpu_limit_must_equal_tp_times_pp_over_nodes():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "decode": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "resources": gpus(2)},
        }
    )
    assert errs == [
        "spec.decode.pipelineParallelSize: tensorParallelSize 2 x pipelineParallelSize 2 = 4 GPUs does not match "
        "resources nvidia.com/gpu=2 (one worker uses tensorParallelSize x pipelineParallelSize GPUs)"
    ]
    grouped = {"replicas": 1, "tensorParallelSize": 8, "pipelineParallelSize": 2, "nodesPerReplica": 2}
    errs = errors_of({"model": {"uri": "hf://a/b"}, "prefill": {**grouped, "resources": gpus(4)}})
    assert errs == [
        "spec.prefill.pipelineParallelSize: tensorParallelSize 8 x pipelineParallelSize 2 = 16 GPUs does not match "
        "resources nvidia.com/gpu=4 (one worker uses tensorParallelSize x pipelineParallelSize GPUs, 8 on each of "
        "its 2 pods)"
    ]
    errs = errors_of({"model": {"uri": "hf://a/b"}, "prefill": grouped})
    assert errs == [
        "spec.prefill.resources: tensorParallelSize 8 x pipelineParallelSize 2 needs limits nvidia.com/gpu: 8"
    ]
    errs = errors_of({"model": {"uri": "hf://a/b"}, "decode": {"pipelineParallelSize": 2}})
    assert errs == [
        "spec.decode.resources: tensorParallelSize 1 x pipelineParallelSize 2 needs limits nvidia.com/gpu: 2"
    ]


def test_nodes_per_replica_must_divide_tp_times_pp():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "decode": {"tensorParallelSize": 2, "pipelineParallelSize": 3, "nodesPerReplica": 4, "resources": gpus(1)},
        }
    )
    assert errs == [
        "spec.decode.nodesPerReplica: 4 must divide tensorParallelSize 2 x pipelineParallelSize 3 = 6 (each pod of a "
        "group runs the same number of ranks)"
    ]
    # tensorParallelSize alone need not be a multiple of the pods: 2 x 3 = 6 ranks over 3 pods
    parse_service(
        body(
            {
                "model": {"uri": "hf://a/b"},
                "decode": {
                    "tensorParallelSize": 2,
                    "pipelineParallelSize": 3,
                    "nodesPerReplica": 3,
                    "resources": gpus(2),
                },
            }
        )
    )


def test_pipeline_parallel_decode_of_a_pd_service_is_refused():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "prefill": {"replicas": 1, "pipelineParallelSize": 2, "resources": gpus(2)},
            "decode": {"pipelineParallelSize": 2, "resources": gpus(2)},
        }
    )
    assert errs == [
        "spec.decode.pipelineParallelSize: 2 runs on unified or prefill workers only: a pipeline-parallel decode "
        'worker is not built yet (a PP prefill feeds a TP decode; docs/parallel.md, "PD with pipeline '
        'parallelism"); set it to 1'
    ]


@pytest.mark.parametrize(
    "prefill, algorithm, refused",
    [
        (0, "ngram", False),  # unified workers run decode.speculative
        (0, "eagle", True),
        (0, "eagle3", True),
        (0, "draft", True),
        (1, "ngram", False),  # a PD prefill takes the EAGLE flags only
        (1, "draft", False),
        (1, "eagle", True),
        (1, "eagle3", True),
    ],
)
def test_pipeline_stages_run_ngram_speculation_only(prefill, algorithm, refused):
    sp = {"algorithm": algorithm, **({} if algorithm == "ngram" else {"draftModel": "hf://a/d"})}
    role = "prefill" if prefill else "decode"
    spec = {"model": {"uri": "hf://a/b"}, "decode": {"speculative": sp}}
    spec[role] = {**spec.get(role, {}), "pipelineParallelSize": 2, "resources": gpus(2)}
    if prefill:
        spec["prefill"]["replicas"] = 1
    if not refused:
        assert getattr(parse_service(body(spec)).spec, role).pipeline_parallel_size == 2
        return
    assert errors_of(spec) == [
        f"spec.{role}.pipelineParallelSize: 2 runs speculative algorithm ngram only (draft, eagle and eagle3 over "
        'pipeline stages are not built yet; docs/speculative.md, "Pipeline parallelism"), got '
        f"spec.decode.speculative.algorithm {algorithm}"
    ]


def test_pipeline_errors_are_collected_with_the_others():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "prefill": {"replicas": 1, "pipelineParallelSize": 2, "nodesPerReplica": 4, "resources": gpus(1)},
            "decode": {"pipelineParallelSize": 2, "resources": gpus(2), "extraArgs": ["--pp-size", "4"]},
            "kvTransfer": {"rdmaDevices": ["mlx5_0"]},
        }
    )
    assert [e.split(":", 1)[0] for e in errs] == [
        "spec.prefill.nodesPerReplica",
        "spec.decode.pipelineParallelSize",
        "spec.decode.extraArgs[0]",
        "spec.kvTransfer.rdmaDevices",
    ]
    assert "spec.decode.extraArgs[0]: --pp-size is set by the operator; use spec.<role>.pipelineParallelSize" in errs


def test_pp_layer_partition_must_name_one_count_per_stage():
    spec = {"model": {"uri": "hf://a/b"}, "decode": {"pipelineParallelSize": 2, "resources": gpus(2)}}
    parse_service(body({**spec, "engine": {"extraArgs": ["--pp-layer-partition", "1,3"]}}))
    errs = errors_of({**spec, "engine": {"extraArgs": ["--pp-layer-partition=1,2,1"]}})
    assert errs == [
        "spec.engine.extraArgs: --pp-layer-partition 1,2,1 must give 2 positive layer counts, one per pipeline "
        "stage of the decode workers (spec.decode.pipelineParallelSize 2)"
    ]
    # the role's own flag comes after the engine's (argparse keeps the last)
    decode = {**spec["decode"], "extraArgs": ["--pp-layer-partition", "2,2"]}
    parse_service(body({**spec, "decode": decode, "engine": {"extraArgs": ["--pp-layer-partition", "4"]}}))


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
        "spec.engine.extraArgs[2]: --port is set by the operator; it cannot be changed",
        "spec.router.extraArgs[0]: --selector is set by the operator; it cannot be changed",
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--hos", "127.0.0.1"],  # an abbreviation argparse would otherwise expand to --host
        ["--api-k", ""],  # ... to --api-key, switching worker authentication off
        ["--kv-transfer-secret", "/tmp/x"],  # ... to --kv-transfer-secret-file
        ["--kv-transfer-in"],  # ... to --kv-transfer-insecure
        ["--no-such-flag", "1"],
        ["--page-size"],  # a flag without its value
        ["stray"],  # no positionals
        ["--", "--host", "x"],
    ],
)
def test_worker_extra_args_that_argparse_would_not_take_exactly_are_refused(args):
    errs = errors_of({"model": {"uri": "hf://a/b"}, "prefill": {"replicas": 1}, "decode": {"extraArgs": args}})
    assert len(errs) == 1 and errs[0].startswith("spec.decode.extraArgs: "), errs
    assert "spelled in full" in errs[0]


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--host=0.0.0.0"], "--host"),
        (["--api-key", ""], "--api-key"),
        (["--api-key="], "--api-key"),
        (["--kv-transfer-secret-file", "/tmp/mine"], "--kv-transfer-secret-file"),
        (["--kv-transfer-insecure"], "--kv-transfer-insecure"),
        (["--no-kv-transfer-insecure"], "--no-kv-transfer-insecure"),
        (["--disaggregation-bootstrap-port=1"], "--disaggregation-bootstrap-port"),
        (["--mode", "unified"], "--mode"),
    ],
)
def test_worker_extra_args_setting_an_owned_setting_are_refused_in_every_spelling(args, flag):
    errs = errors_of({"model": {"uri": "hf://a/b"}, "engine": {"extraArgs": ["--seed", "3", *args]}})
    assert errs == [f"spec.engine.extraArgs[2]: {flag} is set by the operator; " + errs[0].split("; ", 1)[1]]


def test_owned_settings_point_to_the_field_to_use():
    errs = errors_of({"model": {"uri": "hf://a/b"}, "engine": {"extraArgs": ["--dtype=float16"]}})
    assert errs == ["spec.engine.extraArgs[0]: --dtype is set by the operator; use spec.model.dtype"]


@pytest.mark.parametrize(
    "args",
    [
        ["--admin-api-key", "x"],
        ["--worker-api-key=x"],
        ["--api-key", "x"],
        ["--worker-allow-cidrs", "0.0.0.0/0"],
        ["--worker-allow-hosts", "*"],
        ["--no-service-discovery"],
        ["--namespace", "other"],
        ["--selec", "a=b"],
        ["--kubeconfig", "/x"],
    ],
)
def test_router_extra_args_cannot_touch_keys_allow_lists_or_discovery(args):
    errs = errors_of({"model": {"uri": "hf://a/b"}, "router": {"extraArgs": args}})
    assert len(errs) == 1 and errs[0].startswith("spec.router.extraArgs"), errs


def test_ordinary_extra_args_pass_in_every_spelling():
    cfg = parse_service(
        body(
            {
                "model": {"uri": "hf://a/b"},
                "prefill": {"replicas": 1},
                "engine": {"extraArgs": ["--page-size=16", "--disable-radix-cache", "--cuda-graph-bs", "1", "2"]},
                "decode": {"extraArgs": ["--no-disable-overlap-schedule", "--max-running-requests", "8"]},
                "router": {"extraArgs": ["--slo-window", "20", "--max-retries=2"]},
            }
        )
    )
    assert cfg.spec.engine.extra_args[0] == "--page-size=16"


def test_worker_flag_table_is_the_engines_flag_set():
    """The operator parses extraArgs against a copy of `kvship serve`'s flags (it cannot import the engine);
    after adding a ServerArgs field run `python -m kvship.operator.worker_flags --write`."""
    from kvship.operator.worker_flags import WORKER_FLAGS, engine_flag_table

    assert WORKER_FLAGS == engine_flag_table()


def test_every_owned_setting_is_a_real_flag_of_its_process():
    """A renamed flag would silently leave the policy: each owned destination must exist in the parser."""
    from kvship.operator.extra_args import ROUTER_OWNED, WORKER_OWNED, router_flag_table
    from kvship.operator.worker_flags import WORKER_FLAGS

    assert WORKER_OWNED <= {dest for _, dest, _ in WORKER_FLAGS}
    assert ROUTER_OWNED <= {dest for _, dest, _ in router_flag_table()}


def test_credential_env_cannot_be_replaced_by_a_role_env():
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "decode": {"env": [{"name": "KVSHIP_API_KEY", "value": ""}, {"name": "LOG", "value": "1"}]},
            "router": {"env": [{"name": "KVSHIP_WORKER_API_KEY", "value": "x"}]},
        }
    )
    assert errs == [
        "spec.decode.env[0]: KVSHIP_API_KEY is a credential the operator sets from the service's Secrets",
        "spec.router.env[0]: KVSHIP_WORKER_API_KEY is a credential the operator sets from the service's Secrets",
    ]


def test_images_outside_the_allowed_prefixes_are_refused():
    spec = {"model": {"uri": "hf://a/b"}, "engine": {"image": "evil.io/x:1"}, "router": {"image": "reg.io/kvship/r:1"}}
    with pytest.raises(SpecError) as e:
        parse_service(body(spec), allowed_image_prefixes=("reg.io/kvship/", "ghcr.io/kvship/"))
    assert e.value.errors == [
        "spec.engine.image: 'evil.io/x:1' is not allowed by this operator (images must start with one of: "
        "reg.io/kvship/, ghcr.io/kvship/)"
    ]
    parse_service(body(spec))  # no prefixes: any image
    # without engine.image the worker image is the operator's own --worker-image
    parse_service(body(dict(spec, engine={})), allowed_image_prefixes=("reg.io/kvship/",))


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


def test_quantization_and_kv_cache_dtype_fields_are_checked():
    errs = errors_of({"model": {"uri": "hf://a/b"}, "engine": {"quantization": "awq", "kvCacheDtype": "fp8_e5m2"}})
    assert any(e.startswith("spec.engine.quantization: must be one of") for e in errs), errs
    assert any(e.startswith("spec.engine.kvCacheDtype: must be one of") for e in errs), errs
    ok = parse_service(body({"model": {"uri": "hf://a/b"}, "engine": {"kvCacheDtype": "fp8_e4m3"}}))
    assert ok.spec.engine.kv_cache_dtype == "fp8_e4m3" and ok.spec.decode.kv_cache_dtype is None


def test_pd_roles_must_agree_on_kv_cache_dtype_and_quantization():
    """Decode refuses KV of another dtype and a prefill of another fingerprint: the spec says so up front."""
    errs = errors_of(
        {
            "model": {"uri": "hf://a/b"},
            "engine": {"kvCacheDtype": "fp8_e4m3"},
            "prefill": {"replicas": 1, "kvCacheDtype": "bfloat16"},
            "decode": {"quantization": "fp8"},
        }
    )
    assert "spec.prefill.kvCacheDtype / spec.decode.kvCacheDtype: prefill bfloat16 != decode fp8_e4m3" in errs[0]
    assert "prefill default != decode fp8" in errs[1]
    # unified mode has one role: its override alone counts
    cfg = parse_service(body({"model": {"uri": "hf://a/b"}, "decode": {"kvCacheDtype": "fp8_e4m3"}}))
    assert cfg.unified and cfg.spec.decode.kv_cache_dtype == "fp8_e4m3"


def test_operator_quantization_and_kv_dtype_enums_are_the_engines():
    import dataclasses

    from kvship.engine.config import ServerArgs
    from kvship.engine.layers.quantization import base
    from kvship.operator.types import KV_CACHE_DTYPES, QUANTIZATIONS

    # the engine's built-in methods (other tests register test-only methods in the same process)
    assert sorted(QUANTIZATIONS) == sorted(base._LAZY_MODULES)
    choices = next(f for f in dataclasses.fields(ServerArgs) if f.name == "kv_cache_dtype").metadata["choices"]
    assert set(KV_CACHE_DTYPES) == set(choices)

"""The InferenceService CRD: generated from the Python types, structural, documented, and what examples use."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_emulator_api import schema_defaults_prune

from kvship.operator.crd import CRD_FILE, crd_manifest, crd_paths, render_crd_yaml
from kvship.operator.spec import parse_service
from kvship.operator.typed import parse
from kvship.operator.types import InferenceServiceSpec

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.35.0"


def _schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_files_match_the_generator():
    text = render_crd_yaml()
    for path in crd_paths(str(ROOT)):
        assert Path(path).read_text() == text, f"{path} is stale: run python -m kvship.operator.crd --write"
    assert (ROOT / "crds" / CRD_FILE).exists()


def test_print_crd_cli_prints_the_same_yaml_without_importing_torch():
    code = (
        "import sys; from kvship.app.cli import main; rc = main(['operator', '--print-crd']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout == render_crd_yaml()


def test_crd_is_a_valid_custom_resource_definition():
    kubernetes_validate.validate(crd_manifest(), K8S_VERSION, strict=True)


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_every_field_has_a_description_for_kubectl_explain():
    missing = []
    for section in ("spec", "status"):
        root = _schema()["properties"][section]
        for path, node in _walk(root, section):
            parent_is_map = path.endswith("{}") or path.endswith("[]")
            if not parent_is_map and not node.get("description"):
                missing.append(path)
    assert not missing, f"fields without a description: {missing}"


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "$ref" not in node, path
        has_type = (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert has_type, f"{path} has no type"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"


def test_defaults_are_valid_values_of_their_fields():
    for path, node in _walk(_schema()):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])


def test_schema_defaulting_agrees_with_python_defaults():
    minimal = {"model": {"uri": "builtin:smollm2"}}
    defaulted = schema_defaults_prune({"spec": minimal}, _schema())["spec"]
    assert parse(InferenceServiceSpec, defaulted) == parse(InferenceServiceSpec, minimal)
    assert defaulted["decode"]["replicas"] == 1 and defaulted["prefill"]["replicas"] == 0


def test_printer_columns_show_model_roles_phase_slo_url_and_age():
    cols = crd_manifest()["spec"]["versions"][0]["additionalPrinterColumns"]
    shown = [c["name"] for c in cols if not c.get("priority")]
    assert shown == ["Model", "Prefill", "Decode", "Router", "Phase", "TTFT-P50", "ITL-P50", "RPS", "URL", "Age"]
    status = _schema()["properties"]["status"]["properties"]
    for col in cols:
        parts = col["jsonPath"].strip(".").split(".")
        if parts[0] == "status":
            node = status[parts[1]]
            for p in parts[2:]:
                node = node["properties"][p]
            assert node["type"] == col["type"], col


def test_status_subresource_short_name_and_conditions_list_map():
    spec = crd_manifest()["spec"]
    assert spec["names"]["shortNames"] == ["kvsvc"] and spec["versions"][0]["subresources"] == {"status": {}}
    cond = _schema()["properties"]["status"]["properties"]["conditions"]
    assert cond["x-kubernetes-list-type"] == "map" and cond["x-kubernetes-list-map-keys"] == ["type"]
    assert set(cond["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}


def test_cross_field_rules_are_cel_validations():
    rules = [v["rule"] for _, node in _walk(_schema()) for v in node.get("x-kubernetes-validations", [])]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    assert any("draftModel" in r for r in rules)
    assert any("rdmaDevices" in r for r in rules)
    assert any("expertParallelSize" in r for r in rules)
    assert "(self.tensorParallelSize * self.pipelineParallelSize) % self.nodesPerReplica == 0" in rules


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "examples" / "*.yaml"))), ids=lambda p: Path(p).name)
def test_examples_pass_the_crd_schema_and_the_operator_validation(path):
    body = yaml.safe_load(Path(path).read_text())
    assert body["apiVersion"] == "kvship.io/v1alpha1" and body["kind"] == "InferenceService"
    defaulted = schema_defaults_prune(body, _schema())
    assert defaulted["spec"] == schema_defaults_prune(defaulted, _schema())["spec"]
    assert set(body["spec"]) <= set(defaulted["spec"]), "example has fields the CRD would prune"
    jsonschema.Draft4Validator(
        {k: v for k, v in _schema().items() if k != "properties"}
        | {"properties": {"spec": _schema()["properties"]["spec"]}}
    ).validate({"spec": defaulted["spec"]})
    body["metadata"].update(namespace="default", uid="uid-1", generation=1)
    parse_service(body)


def test_examples_cover_unified_cpu_pd_rdma_eagle_and_moe_ep():
    cfgs = {}
    for path in glob.glob(str(ROOT / "examples" / "*.yaml")):
        body = yaml.safe_load(Path(path).read_text())
        body["metadata"].update(namespace="default", uid="u", generation=1)
        cfgs[Path(path).name] = parse_service(body)
    assert any(
        c.unified and c.model.kind == "builtin" and "nvidia.com/gpu" not in str(c.spec.decode.resources)
        for c in cfgs.values()
    )
    assert any(
        not c.unified
        and c.spec.kv_transfer.backend == "mooncake"
        and c.spec.kv_transfer.rdma_devices
        and "Llama-3.1-8B" in c.spec.model.uri
        for c in cfgs.values()
    )
    assert any(c.spec.decode.speculative and c.spec.decode.speculative.algorithm == "eagle" for c in cfgs.values())
    assert any(c.spec.decode.expert_parallel_size > 1 for c in cfgs.values())

"""Metric names: one list (kvship.common.metrics_names), exported by the worker, the only names HPAs may use."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvship.common import metrics_names
from kvship.common.events import KVTransferFinished
from kvship.engine.metrics import EngineMetrics
from kvship.operator.builders import Images, build_children
from kvship.operator.spec import SpecError, parse_service

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(glob.glob(str(ROOT / "examples" / "*.yaml")))
IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
STATS = {"running": 3, "waiting": 1, "total_slots": 100, "free_slots": 40, "cache_hit_rate": 0.5}
STATS["step_phase_s"] = {"launch": 0.25}  # a worker with --enable-step-timing: its phase counter too


def exported_series() -> set[str]:
    """Sample names a worker's /metrics really serves (after one finished request)."""
    m = EngineMetrics("m", lambda: STATS, lambda: {0: [3, 1]})  # a MoE worker: its expert-load series too
    m.observe_tokens(2, 1.0, None, None, 0.5)
    m.observe_finished("stop", 5, 1, 0.7)
    # a PD worker's KV-transfer series (labelled: they appear once a transfer has been observed)
    m.observe_kv_transfer(KVTransferFinished("r1", "decode", "tcp", True, bytes=4096, seconds=0.01))
    m.observe_kv_transfer(KVTransferFinished("r2", "decode", "tcp", False, reason="timeout"))
    return {s.name for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def test_worker_exports_exactly_the_listed_metrics():
    series = exported_series()
    for name in metrics_names.GAUGES + metrics_names.COUNTERS:
        assert name in series, f"{name} is listed but the worker does not export it"
    for name in metrics_names.HISTOGRAMS:
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= series, name
    base = {re.sub(r"_(bucket|sum|count)$", "", s) for s in series if not s.endswith("_created")}
    unlisted = {s for s in base if s.startswith("kvship:")} - set(metrics_names.WORKER_METRICS)
    assert not unlisted, f"exported but not in kvship.common.metrics_names: {sorted(unlisted)}"


def _hpa_metrics(objs: list[dict]) -> list[str]:
    return [
        m["pods"]["metric"]["name"]
        for o in objs
        if o.get("kind") == "HorizontalPodAutoscaler"
        for m in o["spec"]["metrics"]
        if m["type"] == "Pods"
    ]


def _spec_metrics(body: dict) -> list[str]:
    spec = body.get("spec") or {}
    return [
        spec[role]["autoscaling"]["metric"]
        for role in ("prefill", "decode", "router")
        if isinstance(spec.get(role), dict)
        and spec[role].get("autoscaling", {}).get("metric") not in (None, "cpu", "memory")
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_every_metric_an_example_hpa_names_is_exported(path):
    body = yaml.safe_load(Path(path).read_text())
    body.setdefault("metadata", {}).update(namespace="ml", uid="u-1")
    named = _spec_metrics(body) + _hpa_metrics(build_children(parse_service(body), IMAGES))
    series = exported_series()
    for name in named:
        assert name in series and name in metrics_names.GAUGES, f"{Path(path).name}: HPA on {name}, never exported"


def test_the_pd_example_autoscales_decode_on_running_requests():
    body = yaml.safe_load((ROOT / "examples" / "pd-llama-3.1-8b-mooncake.yaml").read_text())
    assert body["spec"]["decode"]["autoscaling"]["metric"] == metrics_names.NUM_RUNNING_REQS


def test_a_kvship_metric_no_worker_exports_is_refused_with_the_field():
    body = {
        "metadata": {"name": "svc", "namespace": "ml", "uid": "u"},
        "spec": {
            "model": {"uri": "builtin:smollm2"},
            "decode": {"autoscaling": {"maxReplicas": 3, "metric": "kvship_num_running_requests", "target": "8"}},
        },
    }
    with pytest.raises(SpecError, match=r"spec\.decode\.autoscaling\.metric: kvship_num_running_requests is not"):
        parse_service(body)
    body["spec"]["decode"]["autoscaling"]["metric"] = "DCGM_FI_DEV_GPU_UTIL"  # another exporter's: allowed
    parse_service(body)


def test_docs_chart_and_crd_name_only_exported_metrics():
    files = [*glob.glob(str(ROOT / "docs" / "*.md")), str(ROOT / "README.md"), *EXAMPLES]
    files += glob.glob(str(ROOT / "charts" / "**" / "*.*"), recursive=True) + [
        str(ROOT / "crds" / "inferenceservices.kvship.io.yaml")
    ]
    exported = {re.sub(r"_(bucket|sum|count)$", "", s) for s in exported_series()}
    for f in files:
        text = Path(f).read_text()
        assert "kvship_num_running_requests" not in text, f
        for name in re.findall(r"kvship:[a-z_]+[a-z]", text):
            series = re.sub(r"_(bucket|sum|count)$", "", name)  # a histogram's own series (histogram_quantile)
            assert series in exported, f"{f} names {name}, which no worker exports"

"""The Grafana dashboard shipped with the chart (charts/kvship-operator/dashboards/kvship.json): it parses, and
every series it queries is one the router or a worker exports (their real registries, rendered)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kube_emulator import find_tool

from kvship.common import metrics_names
from kvship.engine.metrics import EngineMetrics
from kvship.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "charts" / "kvship-operator" / "dashboards" / "kvship.json"
_SERIES = re.compile(r"\b(kvship(?:_router_|:)[a-z0-9_:]+)")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def exported_names() -> set[str]:
    """Every series name (suffixes included) the router's and a worker's registries render."""
    names = set()
    for registry in (RouterMetrics().registry, EngineMetrics("m", lambda: {}).registry):
        for family in registry.collect():
            names |= {sample.name for sample in family.samples} | {family.name}
    names |= set(metrics_names.GAUGES) | set(metrics_names.MOE_METRICS)  # scrape-time gauges (worker stats)
    return names


def test_dashboard_parses_and_queries_only_exported_series():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    assert len(exprs) >= 20
    queried = {name for e in exprs for name in _SERIES.findall(e)}
    known = exported_names()
    missing = {
        n for n in queried if n not in known and not any(n.endswith(s) and n[: -len(s)] in known for s in _SUFFIXES)
    }
    assert not missing, f"the dashboard queries series nothing exports: {sorted(missing)}"
    # the router's series of issue 36 are on it
    for name in (
        "kvship_router_pd_selective_total",
        "kvship_router_session_moves_total",
        "kvship:kv_transfer_bytes_sum",
    ):
        assert name in queried


def test_a_series_nothing_exports_would_be_caught():
    known = exported_names()
    assert "kvship_router_requests" in known and "kvship:kv_transfer_throughput_gbps" in known
    assert "kvship_router_no_such_series_total" not in known


@pytest.mark.skipif(find_tool("helm") is None, reason="helm not installed: run .ci/install-k8s-tools.sh")
def test_chart_ships_the_dashboard_configmap_with_the_sidecar_label_only_when_enabled():
    import subprocess

    import yaml

    def render(*sets: str) -> list[dict]:
        args = [find_tool("helm"), "template", "kvship", str(ROOT / "charts" / "kvship-operator"), "-n", "mon"]
        for s in sets:
            args += ["--set", s]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]

    assert render() == []
    (cm,) = render("grafanaDashboard.enabled=true")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvship.json"]) == json.loads(DASHBOARD.read_text())

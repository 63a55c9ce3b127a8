"""``kvship router`` flags: the contract shared with the operator (docs: /work/briefs/ROUTER_CLI.md)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from router_fixtures import REPO, router_process, start_double

from kvship.app.cli import build_parser, main
from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)

CONTRACT_ARGS = [
    "router",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--policy",
    "power_of_two",
    "--cache-threshold",
    "0.4",
    "--balance-abs-threshold",
    "16",
    "--balance-rel-threshold",
    "1.2",
    "--max-tree-size",
    "5000",
    "--pd",
    "--prefill",
    "http://p0:30000",
    "http://p1:30000",
    "--decode",
    "http://d0:30000",
    "--prefill-policy",
    "cache_aware",
    "--decode-policy",
    "shortest_queue",
    "--service-discovery",
    "--namespace",
    "llm",
    "--service-discovery-port",
    "31000",
    "--prefill-selector",
    "app=kvship",
    "role=prefill",
    "--decode-selector",
    "app=kvship",
    "role=decode",
    "--kubeconfig",
    "/tmp/kc",
    "--health-check-interval",
    "7",
    "--health-check-timeout",
    "3",
    "--health-failure-threshold",
    "4",
    "--health-success-threshold",
    "2",
    "--circuit-failure-threshold",
    "6",
    "--circuit-cooldown",
    "12",
    "--max-retries",
    "3",
    "--retry-backoff-base",
    "0.1",
    "--retry-backoff-max",
    "2",
    "--request-timeout",
    "60",
    "--rate-limit-rps",
    "50",
    "--rate-limit-burst",
    "10",
    "--rate-limit-queue-size",
    "20",
    "--rate-limit-queue-timeout",
    "5",
    "--api-key",
    "k",
    "--max-request-bytes",
    "1024",
    "--log-level",
    "debug",
]


def parse(argv: list[str]) -> RouterConfig:
    return RouterConfig.from_cli_args(build_parser(argv).parse_args(argv))


def test_every_contract_flag_parses_into_the_router_config():
    c = parse(CONTRACT_ARGS)
    c.validate()
    assert (
        c.host,
        c.port,
        c.policy,
        c.cache_threshold,
        c.balance_abs_threshold,
        c.balance_rel_threshold,
        c.max_tree_size,
    ) == ("0.0.0.0", 8000, "power_of_two", 0.4, 16, 1.2, 5000)
    assert c.pd and c.prefill == ["http://p0:30000", "http://p1:30000"] and c.decode == ["http://d0:30000"]
    assert (c.resolved_prefill_policy, c.resolved_decode_policy) == ("cache_aware", "shortest_queue")
    assert c.service_discovery and c.namespace == "llm" and c.service_discovery_port == 31000
    assert c.prefill_selector_labels == {"app": "kvship", "role": "prefill"}
    assert c.decode_selector_labels == {"app": "kvship", "role": "decode"} and c.kubeconfig == "/tmp/kc"
    assert (
        c.health_check_interval,
        c.health_check_timeout,
        c.health_failure_threshold,
        c.health_success_threshold,
    ) == (7, 3, 4, 2)
    assert (c.circuit_failure_threshold, c.circuit_cooldown) == (6, 12)
    assert (c.max_retries, c.retry_backoff_base, c.retry_backoff_max, c.request_timeout) == (3, 0.1, 2, 60)
    assert (c.rate_limit_rps, c.rate_limit_burst, c.rate_limit_queue_size, c.rate_limit_queue_timeout) == (
        50,
        10,
        20,
        5,
    )
    assert (c.api_key, c.max_request_bytes, c.log_level) == ("k", 1024, "debug")


def test_defaults_match_the_contract():
    c = parse(["router"])
    assert (
        c.host,
        c.port,
        c.policy,
        c.cache_threshold,
        c.balance_abs_threshold,
        c.balance_rel_threshold,
        c.max_tree_size,
    ) == ("0.0.0.0", 8000, "cache_aware", 0.5, 32, 1.5, 1_000_000)
    assert (
        c.health_check_interval,
        c.health_check_timeout,
        c.health_failure_threshold,
        c.health_success_threshold,
        c.circuit_failure_threshold,
        c.circuit_cooldown,
    ) == (5, 2, 3, 1, 5, 30)
    assert (c.max_retries, c.retry_backoff_base, c.retry_backoff_max, c.request_timeout) == (2, 0.05, 1.0, 600)
    assert (c.rate_limit_rps, c.rate_limit_queue_size, c.rate_limit_queue_timeout) == (0, 100, 30)
    assert c.max_request_bytes == 8388608 and c.service_discovery_port == 30000 and c.log_level == "info"


def test_api_key_comes_from_the_environment_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv("KVSHIP_API_KEY", "from-env")
    assert parse(["router"]).api_key == "from-env"
    assert parse(["router", "--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["router", "--pd", "--worker-urls", "http://a:1"], "--pd uses --prefill/--decode"),
        (["router", "--prefill", "http://a:1"], "need --pd"),
        (["router", "--service-discovery"], "needs --selector"),
        (["router", "--selector", "novalue"], "expected key=value"),
        (["router", "--worker-urls", "a:1"], "http://"),
        (["router", "--cache-threshold", "2"], "--cache-threshold"),
        (["router", "--policy", "fastest"], "invalid choice"),
    ],
)
def test_inconsistent_flags_exit_with_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_kvship_router_never_imports_torch():
    code = (
        "import sys; from kvship.app.cli import build_parser; "
        "from kvship.router.config import RouterConfig; "
        "a = build_parser(['router', '--worker-urls', 'http://127.0.0.1:1']).parse_args(['router', '--worker-urls', "
        "'http://127.0.0.1:1']); from kvship.router.app import create_app; "
        "import kvship.router.discovery, kvship.router.pd; "
        "create_app(RouterConfig.from_cli_args(a)); "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_kvship_router_process_serves_requests_from_its_flags():
    with start_double() as w:
        with router_process(
            ["--worker-urls", w.url, "--policy", "round_robin", "--api-key", "abc", "--debug-headers"]
        ) as (url, _):
            r = httpx.post(url + "/generate", json={"text": "x"}, headers={"authorization": "Bearer abc"})
            denied = httpx.post(url + "/generate", json={"text": "x"})
    assert r.status_code == 200 and r.headers["x-kvship-worker"] == w.url
    assert denied.status_code == 401

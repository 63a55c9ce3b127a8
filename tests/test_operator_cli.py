"""`kvship operator`: flags map onto OperatorConfig, bad combinations are refused before kopf starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvship.app.cli import build_parser
from kvship.operator.config import OperatorConfig


def config_of(*argv: str) -> OperatorConfig:
    args = build_parser(["operator", *argv]).parse_args(["operator", *argv])
    return OperatorConfig.from_cli_args(args)


def test_defaults_watch_only_the_operators_own_namespace_with_liveness_on_8080():
    cfg = config_of()
    cfg.validate()
    assert not cfg.clusterwide and cfg.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert cfg.with_namespace_default("kvship-system").namespace == ["kvship-system"]
    assert cfg.with_namespace_default(None).namespace == ["default"]
    assert config_of("--namespace", "ml").with_namespace_default("kvship-system").namespace == ["ml"]
    wide = config_of("--all-namespaces")
    assert wide.clusterwide and wide.with_namespace_default("kvship-system").namespace == []


def test_namespaces_and_images_come_from_flags():
    cfg = config_of(
        "--namespace",
        "ml",
        "dev",
        "--worker-image",
        "r/w:1",
        "--router-image",
        "r/r:1",
        "--liveness-port",
        "0",
        "--kubeconfig",
        "/k",
    )
    cfg.validate()
    assert (cfg.namespace, cfg.clusterwide, cfg.liveness_endpoint) == (["ml", "dev"], False, None)
    assert (cfg.worker_image, cfg.router_image, cfg.kubeconfig) == ("r/w:1", "r/r:1", "/k")


@pytest.mark.parametrize(
    "argv,flag",
    [
        (("--all-namespaces", "--namespace", "x"), "--all-namespaces"),
        (("--resync-interval", "0"), "--resync-interval"),
        (("--worker-image", ""), "--worker-image"),
    ],
)
def test_inconsistent_flags_are_refused_with_the_flag_named(argv, flag):
    with pytest.raises(ValueError, match=flag):
        config_of(*argv).validate()


def test_cli_exits_2_with_a_message_instead_of_starting():
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "operator", "--all-namespaces", "--namespace", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert out.returncode == 2 and "mutually exclusive" in out.stderr

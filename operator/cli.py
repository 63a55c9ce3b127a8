"""``kvship operator``: run the InferenceService operator (kopf), or print its CRD.

    kvship operator                      # watches its own namespace (service account / kubeconfig context)
    kvship operator --kubeconfig ~/.kube/config --namespace ml
    kvship operator --all-namespaces --worker-image REG/worker:TAG --router-image REG/router:TAG
    kvship operator --print-crd | kubectl apply -f -

Imports neither torch nor the engine runtime: the operator image is slim.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvship.operator.config import OperatorConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "operator",
        allow_abbrev=False,
        help="run the Kubernetes operator",
        description="Run the kvship operator: InferenceService -> prefill/decode/router "
        "Deployments, Services, RBAC, autoscalers.",
    )
    OperatorConfig.add_cli_args(parser)
    parser.add_argument("--print-crd", action="store_true", help="print the InferenceService CRD YAML and exit")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    if args.print_crd:
        from kvship.operator.crd import render_crd_yaml

        sys.stdout.write(render_crd_yaml())
        return 0
    config = OperatorConfig.from_cli_args(args)
    try:
        config.validate()
    except ValueError as e:
        print(f"kvship operator: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.log_level != "debug":  # one line per API call is debug detail
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    return run(config)


def run(config: OperatorConfig) -> int:
    """Run kopf with the operator's handlers until SIGINT/SIGTERM."""
    import kopf

    from kvship.operator.handlers import register
    from kvship.operator.kube import load_auth

    if not config.operator_namespace or (not config.clusterwide and not config.namespace):
        own = load_auth(config.kubeconfig).default_namespace
        config = config.with_namespace_default(own).with_operator_namespace_default(own)
    registry = kopf.OperatorRegistry()
    register(registry, config)
    logging.getLogger(__name__).info(
        "kvship operator watching %s", "all namespaces" if config.clusterwide else ", ".join(config.namespace)
    )
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=config.clusterwide,
        namespaces=() if config.clusterwide else tuple(config.namespace),
        liveness_endpoint=config.liveness_endpoint,
    )
    return 0

"""``kvship router``: parse flags into ``RouterConfig`` and serve the router with uvicorn.

SIGTERM / SIGINT shut down gracefully: stop accepting, let in-flight requests
and streams finish for up to ``--shutdown-timeout`` seconds, then stop the
health checker and discovery.  Never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from kvship.router.config import RouterConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router",
        allow_abbrev=False,  # `--api-k` must not mean --api-key (docs/operator.md, extraArgs)
        help="run the OpenAI-compatible router",
        description="Route OpenAI-compatible and native requests to kvship workers.",
    )
    RouterConfig.add_cli_args(parser)
    parser.set_defaults(func=run, _router_parser=parser)
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run(args: argparse.Namespace) -> int:
    config = RouterConfig.from_cli_args(args)
    try:
        config.validate()
    except ValueError as e:
        args._router_parser.error(str(e))
    setup_logging(config.log_level)
    import uvicorn

    from kvship.router.app import create_app

    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            timeout_graceful_shutdown=int(config.shutdown_timeout) if config.shutdown_timeout else None,
            timeout_keep_alive=75,
            log_config=None,
        )
    )
    # uvicorn drains, restores the handlers it found, then re-raises the signal it caught: make that a
    # clean exit (status 0) instead of death by SIGTERM once the drain is done.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stopped_by_signal)
    server.run()
    return 0 if server.started else 1


def _stopped_by_signal(signum: int, _frame) -> None:
    logging.getLogger(__name__).info("router stopped by signal %d after draining", signum)

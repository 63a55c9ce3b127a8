"""``kvship serve``: run one worker (HTTP server + model loop).

Every flag comes from ``ServerArgs`` (``kvship serve --help``); the API key
may also come from ``KVSHIP_API_KEY`` (pods get it from a Secret, never on the
command line).  The worker's role (``--mode``) picks its scheduler through
``kvship.app.roles.scheduler_for_mode``; the engine itself knows no role.

Exit status: 0 after SIGINT/SIGTERM, 2 for invalid settings (argparse style),
1 when the model or the role's scheduler cannot be set up.  The process logs
to stderr at ``--log-level``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kvship.common.envs import ENV
from kvship.engine.config import ServerArgs

logger = logging.getLogger("kvship.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log records of every kvship module (and uvicorn's) to stderr at ``level``."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr, force=True
    )
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="run a worker (unified, prefill or decode)",
        description="Serve a model over HTTP (OpenAI-compatible /v1 API and SGLang-style /generate). "
        "Without --model-path, the embedded SmolLM2-135M-Instruct is served.",
    )
    ServerArgs.add_cli_args(parser)
    parser.set_defaults(func=run)
    return parser


def server_args_from_cli(args: argparse.Namespace) -> ServerArgs:
    """``ServerArgs`` from the parsed flags, the API key filled from ``KVSHIP_API_KEY`` when not given."""
    server_args = ServerArgs.from_cli_args(args)
    env_key = ENV.API_KEY
    if server_args.api_key is None and env_key:
        server_args = dataclasses.replace(server_args, api_key=env_key)
    return server_args


def run(args: argparse.Namespace) -> int:
    server_args = server_args_from_cli(args)
    setup_logging(server_args.log_level)
    try:
        server_args.validate()
    except ValueError as e:
        logger.error("invalid settings: %s", e)
        return 2
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.engine import Engine
    from kvship.engine.http_server import serve_engine

    try:
        engine = Engine(server_args, scheduler_factory=scheduler_for_mode(server_args.mode))
        return serve_engine(engine, server_args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        logger.error("cannot start the server: %s", e)
        return 1

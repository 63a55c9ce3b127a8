"""``kvship serve``: run one worker (HTTP server + model loop).

Every flag comes from ``ServerArgs`` (``kvship serve --help``).  The process
logs to stderr at ``--log-level``; it exits 0 after SIGINT/SIGTERM, 2 for
invalid settings (argparse style) and 1 when the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from kvship.engine.config import ServerArgs

logger = logging.getLogger("kvship.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log records of every kvship module (and uvicorn's) to stderr at ``level``."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr,
                        force=True)
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="run a worker (unified, prefill or decode)",
        description="Serve a model over HTTP (OpenAI-compatible /v1 API and SGLang-style /generate). "
                    "Without --model-path, the embedded SmolLM2-135M-Instruct is served.")
    ServerArgs.add_cli_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    server_args = ServerArgs.from_cli_args(args)
    if server_args.api_key is None and os.environ.get("KVSHIP_API_KEY"):
        # pods get the key from a Secret through the environment, never on the command line
        server_args = dataclasses.replace(server_args, api_key=os.environ["KVSHIP_API_KEY"])
    setup_logging(server_args.log_level)
    try:
        server_args.validate()
    except ValueError as e:
        logger.error("invalid settings: %s", e)
        return 2
    from kvship.engine.http_server import launch_server

    try:
        return launch_server(server_args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        logger.error("cannot start the server: %s", e)
        return 1

"""The ``kvship`` console script: one subcommand per process kind.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
(registering its flags and ``set_defaults(func=...)``); modules are imported
only when their subcommand is asked for, so ``kvship router`` never imports
torch and ``kvship operator`` never imports the engine.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "serve": ("kvship.app.serve", "run a worker (unified, prefill or decode)"),
    "router": ("kvship.router.cli", "run the OpenAI-compatible router"),
    "local": ("kvship.app.local", "run router + prefill + decode workers on this machine"),
    "operator": ("kvship.operator.cli", "run the Kubernetes operator"),
    "mooncake-master": ("kvship.app.mooncake_master", "run the Mooncake Store master of the shared KV tier"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvship", description="kvship: PD-disaggregated LLM serving", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name, help=help_text)
            continue
        if wanted is None:
            sub.add_parser(name, help=help_text)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            parser.error(f"subcommand '{name}' is unavailable: {e}")
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

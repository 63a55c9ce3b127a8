"""``kvship serve``: run one worker (HTTP server + model loop).

Every flag comes from ``ServerArgs`` (``kvship serve --help``); the API key
may also come from ``KVSHIP_API_KEY`` (pods get it from a Secret, never on the
command line).  The worker's role (``--mode``) picks its scheduler through
``kvship.app.roles.scheduler_for_mode``; the engine itself knows no role.

``--tp-size N`` > 1 (any mode) or ``--pp-size N`` > 1 (unified): the worker's ``Topology``
(``kvship.engine.distributed``) is built first from ``--nnodes``,
``--node-rank`` and ``--dist-init-addr`` (or torchrun's environment); on node
0 this process is rank 0 (HTTP, tokenizer) and spawns the node's other ranks
(``run_multi_rank``); on another node it runs ranks only (``kvship.app.node``).
A rank that dies makes the worker exit 1 (docs/parallel.md).  In PD every rank
runs its own KV transfer layer (rank r of a prefill worker binds
``--disaggregation-bootstrap-port`` + r).

Exit status: 0 after SIGINT/SIGTERM, 2 for invalid settings (argparse style; a bad topology too),
1 when the model or the role's scheduler cannot be set up (or a
tensor-parallel rank died).  The process logs
to stderr at ``--log-level``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from typing import Optional

from kvship.common.envs import ENV
from kvship.engine.config import ServerArgs
from kvship.engine.distributed.topology import Topology

logger = logging.getLogger("kvship.serve")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, tag: str = "") -> None:
    """Log records of every kvship module (and uvicorn's) to stderr at ``level`` (``tag`` after the logger name)."""
    fmt = LOG_FORMAT if not tag else LOG_FORMAT.replace("%(name)s", f"%(name)s[{tag}]")
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr, force=True)
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        allow_abbrev=False,  # `--hos` must not mean --host (docs/operator.md, extraArgs)
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
        topology = Topology.from_server_args(server_args)
        if server_args.mode in ("prefill", "decode"):  # fail before the model loads (docs/pd.md, KV plane auth)
            from kvship.engine.disagg.auth import load_kv_secret

            load_kv_secret(server_args.kv_transfer_secret_file, server_args.kv_transfer_insecure)
    except ValueError as e:
        logger.error("invalid settings: %s", e)
        return 2
    if topology.world_size > 1:
        return run_multi_rank(server_args, topology)
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.engine import Engine
    from kvship.engine.http_server import serve_engine

    sock = listen_or_none(server_args)
    if sock is None:
        return 1
    try:
        engine = Engine(server_args, scheduler_factory=scheduler_for_mode(server_args.mode))
        return serve_engine(engine, server_args, sock=sock)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        logger.error("cannot start the server: %s", e)
        return 1
    finally:
        sock.close()


def listen_or_none(server_args: ServerArgs) -> Optional[socket.socket]:
    """The worker's HTTP socket (``bind_http_socket``), or None after logging why it cannot be had."""
    from kvship.engine.http_server import bind_http_socket

    try:
        return bind_http_socket(server_args)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", server_args.host, server_args.port, e)
        return None


def check_tensor_parallel(server_args: ServerArgs, topology: Optional[Topology] = None) -> None:
    """ValueError when ``--tp-size`` / ``--pp-size`` cannot work with this model and these settings (before any rank starts)."""
    topology = topology or Topology.from_server_args(server_args)
    from kvship.engine.model_config import ModelConfig, parse_dtype
    from kvship.engine.model_runner import resolve_model_path
    from kvship.engine.parallel.ep import check_expert_parallel
    from kvship.engine.parallel.layers import check_tp_divisible

    mc = ModelConfig.from_pretrained(
        resolve_model_path(server_args.model_path),
        dtype=parse_dtype(server_args.resolved_dtype),
        context_length=server_args.context_length,
        quantization=server_args.quantization,
    )
    check_tp_divisible(mc, server_args.tp_size)
    if server_args.pp_size > 1:  # every stage gets at least one layer; a partition must sum to the model's
        from kvship.engine.distributed.pipeline import stage_layers

        stage_layers(mc.num_hidden_layers, server_args.pp_size, server_args.resolved_pp_layer_partition)
    check_expert_parallel(mc, server_args.tp_size, server_args.ep_size, server_args.ep_dispatch)
    if server_args.ep_num_redundant_experts:  # EPLB: E + R slots spread evenly (docs/parallel.md)
        from kvship.engine.parallel.eplb import check_eplb

        if mc.moe is None:
            raise ValueError(f"--ep-num-redundant-experts needs a Mixture-of-Experts model; {mc.architecture} has none")
        check_eplb(mc.moe.num_experts, server_args.ep_num_redundant_experts, server_args.ep_size, server_args.tp_size)
    if server_args.speculative_algorithm == "draft" and server_args.mode != "prefill":
        # the draft model is sharded like the target (docs/speculative.md, "Tensor parallelism")
        draft = ModelConfig.from_pretrained(
            server_args.speculative_draft_model_path, dtype=parse_dtype(server_args.resolved_dtype)
        )
        try:
            check_tp_divisible(draft, server_args.tp_size)
        except ValueError as e:
            raise ValueError(f"--speculative-draft-model-path (sharded like the target): {e}") from None
    if server_args.resolved_device == "cuda":
        import torch

        need = server_args.base_gpu_id + topology.ranks_per_node
        if torch.cuda.device_count() < need:
            raise ValueError(
                f"{topology.ranks_per_node} ranks on this node from --base-gpu-id {server_args.base_gpu_id} need "
                f"{need} GPUs, {torch.cuda.device_count()} visible"
            )


def run_multi_rank(server_args: ServerArgs, topology: Topology) -> int:
    """A worker of several ranks: the leader (node 0 rank 0: HTTP, tokenizer) spawns its node's other ranks; a
    node other than 0 runs ranks only (``kvship.app.node``); under torchrun this process is one rank."""
    from kvship.app.roles import scheduler_for_mode
    from kvship.common.ports import free_port
    from kvship.engine.distributed.groups import init_method
    from kvship.engine.distributed.launch import RankProcesses, join, watch_launcher
    from kvship.engine.engine import Engine
    from kvship.engine.http_server import serve_engine

    try:
        check_tensor_parallel(server_args, topology)
    except (FileNotFoundError, ValueError) as e:
        logger.error("cannot start the server: %s", e)
        return 1
    if topology.torchrun:  # every process is a rank of torchrun's agent: it goes when the agent goes
        watch_launcher()
    if not topology.is_leader:
        if topology.torchrun:  # this process is the rank
            return _rank_body(topology.rank, server_args, topology, init_method(topology))
        from kvship.app.node import run_node

        return run_node(server_args, topology, _rank_main)
    sock = listen_or_none(server_args)  # (the ranks are spawned, not forked: they do not inherit it)
    if sock is None:
        return 1
    url = init_method(topology, fallback_port=free_port())
    ranks = RankProcesses({}) if topology.torchrun else RankProcesses.start(_rank_main, server_args, topology, url)
    starting = ranks.exit_on_failure_while_starting()
    try:
        groups = join(server_args, topology, url)
        engine = Engine(server_args, scheduler_factory=scheduler_for_mode(server_args.mode), groups=groups)
        starting.set()

        def monitor() -> Optional[str]:
            if engine.failure is not None:
                return ranks.failure() or f"the model loop of rank 0 died ({engine.failure})"
            return ranks.failure()

        return serve_engine(engine, server_args, monitor=monitor, sock=sock)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        logger.error("cannot start the server: %s", e)
        return 1
    finally:
        starting.set()
        ranks.stop()
        sock.close()


def _rank_body(rank: int, server_args: ServerArgs, topology: Topology, url: str) -> int:
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.distributed.launch import join, run_rank

    try:
        return run_rank(server_args, join(server_args, topology, url), scheduler_for_mode(server_args.mode))
    except Exception as e:  # noqa: BLE001 - report any startup failure, then exit non-zero
        logger.error("tensor-parallel rank %d cannot start: %s: %s", rank, type(e).__name__, e)
        return 1


def _rank_main(rank: int, server_args: ServerArgs, topology: Topology, url: str) -> None:
    """Entry of a spawned rank process; exits with its status."""
    import os

    setup_logging(server_args.log_level, tag=f"tp{rank}")
    code = _rank_body(rank, server_args, topology, url)
    logging.shutdown()
    os._exit(code)

"""What ``extraArgs`` may say: parsed like the worker / router parse them, refused by meaning, not spelling.

An ``extraArgs`` list is appended to the argv the operator builds, and argparse lets a later flag override an
earlier one, so a list that sets an operator-owned setting would replace the operator's value (the address a
worker binds, its API key, the KV-transfer secret, the router's selectors...).  Each list is therefore parsed
with ``allow_abbrev=False`` against the real flag set of the process it goes to (the worker's from
:data:`kvship.operator.worker_flags.WORKER_FLAGS`, the router's from ``RouterConfig``) and refused when

* it names a flag the process does not have, or an abbreviation of one (``--hos``, ``--api-k``), or is
  malformed (a flag without its value, a stray positional);
* any flag it sets has an operator-owned destination, whatever the spelling: ``--host=0.0.0.0``,
  ``--no-x`` of an owned ``--x``, each is the setting it names (docs/operator.md, "What an InferenceService
  author can do").
"""

from __future__ import annotations

import argparse
import re
from functools import lru_cache
from typing import Optional

from kvship.operator.worker_flags import WORKER_FLAGS, add_table_arguments, flag_table

# Settings the operator derives from the spec (or keeps to itself) for `kvship serve`.
WORKER_OWNED = frozenset(
    {
        "host",
        "port",
        "mode",
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "api_key",
        "dtype",
        "kv_cache_dtype",
        "quantization",
        "context_length",
        "attention_backend",
        "mem_fraction_static",
        "cuda_graph_max_bs",
        "tp_size",
        "pp_size",
        "ep_size",
        "disaggregation_bootstrap_port",
        "disaggregation_transfer_backend",
        "disaggregation_ib_device",
        "speculative_algorithm",
        "speculative_draft_model_path",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "kv_transfer_secret_file",
        # the shared KV tier's store: the volume is mounted, the master run, by the operator (spec.hicache)
        "hicache_storage",
        "hicache_storage_path",
        "hicache_storage_master",
        "hicache_storage_metadata",
        "kv_transfer_insecure",
        # a worker spanning nodes is a group the operator starts as one (docs/parallel.md); a pod alone cannot be one
        "nnodes",
        "node_rank",
        "dist_init_addr",
    }
)
# ... and for `kvship router`.
ROUTER_OWNED = frozenset(
    {
        "host",
        "port",
        "api_key",
        "api_keys_file",
        "admin_api_key",
        "worker_api_key",
        "worker_urls",
        "worker_allow_cidrs",
        "worker_allow_hosts",
        "pd",
        "prefill",
        "decode",
        "service_discovery",
        "selector",
        "prefill_selector",
        "decode_selector",
        "namespace",
        "service_discovery_port",
        "kubeconfig",
        "policy",
        "prefill_policy",
        "decode_policy",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
    }
)
# Any credential or authentication switch, including ones added after this list was written.
AUTH_DEST = re.compile(r"api_key|secret|insecure|token_file|password")

# The spec field to use instead, where there is one.
FIELD_OF = {
    "mode": "prefill.replicas (0 = unified)",
    "model_path": "model.uri",
    "served_model_name": "model.servedName",
    "dtype": "model.dtype",
    "kv_cache_dtype": "engine.kvCacheDtype (or <role>.kvCacheDtype)",
    "quantization": "engine.quantization (or <role>.quantization)",
    "context_length": "model.contextLength",
    "attention_backend": "engine.attentionBackend",
    "mem_fraction_static": "engine.memFractionStatic",
    "cuda_graph_max_bs": "engine.cudaGraphMaxBatchSize",
    "tp_size": "<role>.tensorParallelSize",
    "pp_size": "<role>.pipelineParallelSize",
    "ep_size": "<role>.expertParallelSize",
    "disaggregation_bootstrap_port": "kvTransfer.bootstrapPort",
    "disaggregation_transfer_backend": "kvTransfer.backend",
    "disaggregation_ib_device": "kvTransfer.rdmaDevices",
    "speculative_algorithm": "decode.speculative",
    "speculative_draft_model_path": "decode.speculative.draftModel",
    "speculative_num_steps": "decode.speculative.numSteps",
    "speculative_eagle_topk": "decode.speculative.topk",
    "speculative_num_draft_tokens": "decode.speculative.numDraftTokens",
    "hicache_storage": "hicache.storage",
    "hicache_storage_path": "hicache.volumeClaim (storage file)",
    "hicache_storage_master": "hicache.mooncakeMaster (storage mooncake)",
    "hicache_storage_metadata": "hicache.storage (mooncake: the workers' P2P handshake)",
    "policy": "router.policy",
    "prefill_policy": "router.prefillPolicy",
    "decode_policy": "router.decodePolicy",
    "cache_threshold": "router.cacheThreshold",
    "balance_abs_threshold": "router.balanceAbsThreshold",
    "balance_rel_threshold": "router.balanceRelThreshold",
}


class _Refusal(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, never abbreviates, and records only the flags given."""

    def __init__(self) -> None:
        super().__init__(prog="extraArgs", allow_abbrev=False, add_help=False, argument_default=argparse.SUPPRESS)

    def error(self, message: str):  # type: ignore[override]
        raise _Refusal(message)


@lru_cache(maxsize=4)
def _parser(table: tuple) -> _StrictParser:
    parser = _StrictParser()
    add_table_arguments(parser, table)
    return parser


@lru_cache(maxsize=1)
def router_flag_table() -> tuple:
    """``kvship router``'s flags (RouterConfig loads without torch or the engine)."""
    from kvship.router.config import RouterConfig

    parser = argparse.ArgumentParser(allow_abbrev=False)
    RouterConfig.add_cli_args(parser)
    return flag_table(parser)


def worker_args_errors(path: str, args: list[str]) -> list[str]:
    """Problems of a worker ``extraArgs`` list (``path``: its field, e.g. ``spec.engine.extraArgs``)."""
    return _errors(path, args, WORKER_FLAGS, WORKER_OWNED, "kvship serve")


def router_args_errors(path: str, args: list[str]) -> list[str]:
    """Problems of ``spec.router.extraArgs``."""
    return _errors(path, args, router_flag_table(), ROUTER_OWNED, "kvship router")


def _owned(dest: str, owned: frozenset[str]) -> bool:
    return dest in owned or AUTH_DEST.search(dest) is not None


def _errors(path: str, args: list[str], table: tuple, owned: frozenset[str], program: str) -> list[str]:
    if not args:
        return []
    try:
        given = vars(_parser(table).parse_args(list(args)))
    except _Refusal as e:
        return [f"{path}: {e} (flags of `{program}`, spelled in full, one argument per item)"]
    dest_of = {opt: dest for options, dest, _ in table for opt in options}
    errors = []
    for i, arg in enumerate(args):
        dest: Optional[str] = dest_of.get(arg.split("=", 1)[0]) if arg.startswith("--") else None
        if dest is not None and dest in given and _owned(dest, owned):
            where = FIELD_OF.get(dest)
            hint = f"use spec.{where}" if where else "it cannot be changed"
            errors.append(f"{path}[{i}]: {arg.split('=', 1)[0]} is set by the operator; {hint}")
    return errors

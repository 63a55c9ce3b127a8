"""The flags of ``kvship serve`` as the operator knows them, without importing the engine.

The operator image has no torch and never imports ``kvship.engine`` (tests/test_layering.py), yet it must
parse ``extraArgs`` against the worker's real flag set (docs/operator.md, "What an InferenceService author can
do").  :data:`WORKER_FLAGS` is that flag set, generated from ``ServerArgs``' parser by
``python -m kvship.operator.worker_flags --write``; tests/test_operator_spec.py fails while it differs from the
engine's (after a flag is added to ``ServerArgs``, run the command).

Each entry is ``(option strings, dest, kind)``: ``kind`` is ``value`` (one argument), ``list`` (zero or more),
``some`` (one or more) or ``switch`` (``--x`` / ``--no-x``, no argument).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

KINDS = ("value", "list", "some", "switch")

# BEGIN GENERATED (python -m kvship.operator.worker_flags --write)
# fmt: off
WORKER_FLAGS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("--model-path",), "model_path", "value"),
    (("--tokenizer-path",), "tokenizer_path", "value"),
    (("--served-model-name",), "served_model_name", "value"),
    (("--load-format",), "load_format", "value"),
    (("--dtype",), "dtype", "value"),
    (("--kv-cache-dtype",), "kv_cache_dtype", "value"),
    (("--quantization",), "quantization", "value"),
    (("--context-length",), "context_length", "value"),
    (("--trust-remote-code", "--no-trust-remote-code"), "trust_remote_code", "switch"),
    (("--seed",), "seed", "value"),
    (("--host",), "host", "value"),
    (("--port",), "port", "value"),
    (("--api-key",), "api_key", "value"),
    (("--log-level",), "log_level", "value"),
    (("--otlp-traces-endpoint",), "otlp_traces_endpoint", "value"),
    (("--otlp-traces-sample-ratio",), "otlp_traces_sample_ratio", "value"),
    (("--max-request-bytes",), "max_request_bytes", "value"),
    (("--shutdown-timeout",), "shutdown_timeout", "value"),
    (("--max-chat-template-output-chars",), "max_chat_template_output_chars", "value"),
    (("--chat-template-timeout",), "chat_template_timeout", "value"),
    (("--tool-call-parser",), "tool_call_parser", "value"),
    (("--reasoning-parser",), "reasoning_parser", "value"),
    (("--max-grammar-bytes",), "max_grammar_bytes", "value"),
    (("--max-schema-depth",), "max_schema_depth", "value"),
    (("--grammar-compile-timeout",), "grammar_compile_timeout", "value"),
    (("--grammar-compile-processes",), "grammar_compile_processes", "value"),
    (("--device",), "device", "value"),
    (("--mem-fraction-static",), "mem_fraction_static", "value"),
    (("--max-total-tokens",), "max_total_tokens", "value"),
    (("--max-running-requests",), "max_running_requests", "value"),
    (("--max-queued-requests",), "max_queued_requests", "value"),
    (("--page-size",), "page_size", "value"),
    (("--chunked-prefill-size",), "chunked_prefill_size", "value"),
    (("--max-prefill-tokens",), "max_prefill_tokens", "value"),
    (("--decode-interleave",), "decode_interleave", "value"),
    (("--enable-mixed-chunk", "--no-enable-mixed-chunk"), "enable_mixed_chunk", "switch"),
    (("--disable-radix-cache", "--no-disable-radix-cache"), "disable_radix_cache", "switch"),
    (("--hicache-size-gb",), "hicache_size_gb", "value"),
    (("--enable-kv-events", "--no-enable-kv-events"), "enable_kv_events", "switch"),
    (("--hicache-ratio",), "hicache_ratio", "value"),
    (("--hicache-write-policy",), "hicache_write_policy", "value"),
    (("--hicache-io-backend",), "hicache_io_backend", "value"),
    (("--hicache-storage",), "hicache_storage", "value"),
    (("--hicache-storage-path",), "hicache_storage_path", "value"),
    (("--hicache-storage-master",), "hicache_storage_master", "value"),
    (("--hicache-storage-metadata",), "hicache_storage_metadata", "value"),
    (("--hicache-storage-size-gb",), "hicache_storage_size_gb", "value"),
    (("--hicache-storage-bandwidth-mb",), "hicache_storage_bandwidth_mb", "value"),
    (("--hicache-storage-prefetch-mb",), "hicache_storage_prefetch_mb", "value"),
    (("--schedule-policy",), "schedule_policy", "value"),
    (("--tp-size",), "tp_size", "value"),
    (("--pp-size",), "pp_size", "value"),
    (("--pp-layer-partition",), "pp_layer_partition", "value"),
    (("--base-gpu-id",), "base_gpu_id", "value"),
    (("--dist-timeout",), "dist_timeout", "value"),
    (("--nnodes",), "nnodes", "value"),
    (("--node-rank",), "node_rank", "value"),
    (("--dist-init-addr",), "dist_init_addr", "value"),
    (("--dist-init-timeout",), "dist_init_timeout", "value"),
    (("--ep-size",), "ep_size", "value"),
    (("--ep-dispatch",), "ep_dispatch", "value"),
    (("--enable-two-batch-overlap", "--no-enable-two-batch-overlap"), "enable_two_batch_overlap", "switch"),
    (("--ep-num-redundant-experts",), "ep_num_redundant_experts", "value"),
    (("--eplb-rebalance-interval",), "eplb_rebalance_interval", "value"),
    (("--speculative-algorithm",), "speculative_algorithm", "value"),
    (("--speculative-draft-model-path",), "speculative_draft_model_path", "value"),
    (("--speculative-num-steps",), "speculative_num_steps", "value"),
    (("--speculative-num-draft-tokens",), "speculative_num_draft_tokens", "value"),
    (("--speculative-eagle-topk",), "speculative_eagle_topk", "value"),
    (("--attention-backend",), "attention_backend", "value"),
    (("--sampling-backend",), "sampling_backend", "value"),
    (("--disable-cuda-graph", "--no-disable-cuda-graph"), "disable_cuda_graph", "switch"),
    (("--cuda-graph-max-bs",), "cuda_graph_max_bs", "value"),
    (("--cuda-graph-bs",), "cuda_graph_bs", "list"),
    (("--prefill-graph-max-tokens",), "prefill_graph_max_tokens", "value"),
    (("--disable-overlap-schedule", "--no-disable-overlap-schedule"), "disable_overlap_schedule", "switch"),
    (("--enable-step-timing", "--no-enable-step-timing"), "enable_step_timing", "switch"),
    (("--num-threads",), "num_threads", "value"),
    (("--mode",), "mode", "value"),
    (("--revision",), "revision", "value"),
    (("--disaggregation-bootstrap-port",), "disaggregation_bootstrap_port", "value"),
    (("--disaggregation-transfer-backend",), "disaggregation_transfer_backend", "value"),
    (("--disaggregation-ib-device",), "disaggregation_ib_device", "value"),
    (("--disaggregation-bootstrap-timeout",), "disaggregation_bootstrap_timeout", "value"),
    (("--disaggregation-waiting-timeout",), "disaggregation_waiting_timeout", "value"),
    (("--disaggregation-prefill-wait-for-room", "--no-disaggregation-prefill-wait-for-room"), "disaggregation_prefill_wait_for_room", "switch"),
    (("--disaggregation-layerwise", "--no-disaggregation-layerwise"), "disaggregation_layerwise", "switch"),
    (("--disaggregation-layerwise-min-tokens",), "disaggregation_layerwise_min_tokens", "value"),
    (("--disaggregation-layerwise-writes",), "disaggregation_layerwise_writes", "value"),
    (("--kv-transfer-checksum", "--no-kv-transfer-checksum"), "kv_transfer_checksum", "switch"),
    (("--kv-transfer-secret-file",), "kv_transfer_secret_file", "value"),
    (("--kv-transfer-insecure", "--no-kv-transfer-insecure"), "kv_transfer_insecure", "switch"),
)
# fmt: on
# END GENERATED


def flag_table(parser: argparse.ArgumentParser) -> tuple[tuple[tuple[str, ...], str, str], ...]:
    """The ``(option strings, dest, kind)`` table of a parser built by kvship.common.cli_args (help excluded)."""
    out = []
    for action in parser._actions:  # argparse exposes no public list of a parser's actions
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            kind = "switch"
        elif action.nargs is None:
            kind = "value"
        elif action.nargs == "*":
            kind = "list"
        elif action.nargs == "+":
            kind = "some"
        else:
            raise ValueError(f"{action.option_strings}: nargs {action.nargs!r} is not one of the kinds {KINDS}")
        out.append((tuple(action.option_strings), action.dest, kind))
    return tuple(out)


def add_table_arguments(parser: argparse.ArgumentParser, table: tuple[tuple[tuple[str, ...], str, str], ...]) -> None:
    """Add the flags of ``table`` to ``parser`` (values kept as strings: the worker checks them itself)."""
    for options, dest, kind in table:
        if kind == "switch":
            parser.add_argument(*options, dest=dest, action="store_true")
        elif kind == "value":
            parser.add_argument(*options, dest=dest)
        else:
            parser.add_argument(*options, dest=dest, nargs="*" if kind == "list" else "+")


def engine_flag_table() -> tuple[tuple[tuple[str, ...], str, str], ...]:
    """The table of the engine's own ``kvship serve`` parser (imports the engine's config: tests and --write only)."""
    from kvship.engine.config import ServerArgs

    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return flag_table(parser)


def render(table: tuple[tuple[tuple[str, ...], str, str], ...]) -> str:
    lines = ["WORKER_FLAGS: tuple[tuple[tuple[str, ...], str, str], ...] = ("]
    for options, dest, kind in table:
        opts = ", ".join(f'"{o}"' for o in options) + ("," if len(options) == 1 else "")
        lines.append(f'    (({opts}), "{dest}", "{kind}"),')
    return "\n".join(lines + [")"])


def main(argv: list[str]) -> int:
    path = Path(__file__)
    text = path.read_text()
    new = re.sub(
        r"(# BEGIN GENERATED[^\n]*\n# fmt: off\n).*?(\n# fmt: on\n# END GENERATED)",
        lambda m: m.group(1) + render(engine_flag_table()) + m.group(2),
        text,
        count=1,
        flags=re.S,
    )
    if "--write" in argv:
        path.write_text(new)
        return 0
    if new != text:
        print(f"{path} is stale: run python -m kvship.operator.worker_flags --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))

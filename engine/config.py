"""Frozen configuration dataclasses and the argparse built from them.

Every CLI flag maps 1:1 to a dataclass field (``--max-running-requests`` ->
``max_running_requests``); the field's ``help`` metadata is the flag's help
text, so ``kvship serve --help`` documents every field.  Derived values are
properties; per-rank copies are made with ``dataclasses.replace``.

``ServerArgs`` is the worker's config (unified / prefill / decode).  The
argparse helpers live in :mod:`kvship.common.cli_args`, shared with the
router, the operator and ``kvship local``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from kvship.common.cli_args import add_dataclass_arguments, dataclass_from_namespace, opt
from kvship.engine.attention.backend_choice import FLASHINFER_HEAD_DIMS, auto_attention_backend

ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
TRANSFER_BACKENDS = ("tcp", "mooncake", "nixl")


# the one line every refusal of speculation over pipeline stages prints (here and in decode/spec/worker.py)
PP_SPEC_ALGORITHMS_LINE = (
    "--pp-size > 1 runs --speculative-algorithm ngram only (draft, eagle and eagle3 over pipeline stages are not "
    'built yet; docs/speculative.md, "Pipeline parallelism")'
)


@dataclass(frozen=True)
class ServerArgs:
    """Configuration of one worker process (``kvship serve``)."""

    # Model
    model_path: Optional[str] = opt(
        None, "Hugging Face folder, .gguf file, or omitted for the embedded SmolLM2-135M-Instruct"
    )
    tokenizer_path: Optional[str] = opt(None, "Tokenizer folder if it differs from --model-path")
    served_model_name: Optional[str] = opt(None, "Model name reported by /v1/models and accepted in requests")
    load_format: str = opt("auto", "Weight format", choices=("auto", "safetensors", "gguf", "dummy"))
    dtype: str = opt(
        "auto",
        "Compute dtype (auto: bfloat16 on CUDA, float32 on CPU)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    kv_cache_dtype: str = opt(
        "auto",
        "KV cache dtype (auto = compute dtype); fp8_e4m3 stores K/V as float8 e4m3 with per-layer k/v scales "
        "from the checkpoint (else 1.0), about twice the tokens per byte (docs/quantization.md)",
        choices=("auto", "float32", "bfloat16", "float16", "fp8_e4m3"),
    )
    quantization: Optional[str] = opt(
        None,
        "Weight quantization method (default: config.json's quantization_config.quant_method, else unquantized); "
        "an unsupported method is refused at startup (docs/quantization.md)",
    )
    context_length: Optional[int] = opt(None, "Maximum context length (default: the model's)")
    trust_remote_code: bool = opt(False, "Allow custom code from the model folder (tokenizer only)")
    seed: int = opt(0, "Random seed for dummy weights and unseeded sampling")

    # HTTP
    host: str = opt("127.0.0.1", "Address the HTTP server binds")
    port: int = opt(30000, "HTTP port")
    api_key: Optional[str] = opt(
        None, "Require 'Authorization: Bearer <key>' on every route but /health (env: KVSHIP_API_KEY)"
    )
    log_level: str = opt("info", "Log level", choices=("debug", "info", "warning", "error"))
    # OpenTelemetry (docs/observability.md)
    otlp_traces_endpoint: Optional[str] = opt(
        None,
        "Export request traces over OTLP to this collector: http(s)://host:4318 for OTLP/HTTP, grpc://host:4317 "
        "(plaintext) or grpcs://host:4317 (TLS) for OTLP/gRPC; off if unset",
    )
    otlp_traces_sample_ratio: float = opt(
        1.0, "Fraction of new traces kept (a request whose traceparent is sampled is always traced)"
    )
    max_request_bytes: int = opt(8 * 1024 * 1024, "Largest accepted request body in bytes (413 above)")
    shutdown_timeout: float = opt(
        30.0,
        "Seconds SIGTERM/SIGINT waits for in-flight requests and streams before closing them (under a pod's "
        'terminationGracePeriodSeconds: docs/operator.md, "How a replica leaves")',
    )

    # Request pre-processing limits (docs/api.md, "Chat templates" and "Structured output")
    max_chat_template_output_chars: int = opt(
        4 * 1024 * 1024, "Largest chat prompt a chat template may render, in characters (413 above)"
    )
    chat_template_timeout: float = opt(2.0, "Seconds a chat template may take to render one request (400 after)")
    # Chat output parsing (docs/api.md, "Tool calling" and "Reasoning")
    tool_call_parser: Optional[str] = opt(
        None,
        "Read the model's tool-call markup into message.tool_calls under tool_choice auto (auto: the family the "
        "chat template names; default: calls stay text)",
        choices=(None, "auto", "hermes", "qwen25", "llama3", "mistral", "deepseekv3"),
    )
    reasoning_parser: Optional[str] = opt(
        None,
        "Split <think>...</think> into message.reasoning_content (default: the thinking stays in content)",
        choices=(None, "qwen3", "deepseek-r1"),
    )
    max_grammar_bytes: int = opt(32768, "Largest json_schema / regex / ebnf text in bytes (400 above)")
    max_schema_depth: int = opt(32, "Deepest nesting of objects and arrays in a JSON schema (400 above)")
    grammar_compile_timeout: float = opt(
        10.0, "Seconds a grammar may take to compile (in a compile process that is killed after; 400)"
    )
    grammar_compile_processes: int = opt(
        4, "Processes that compile grammars (each compile that times out holds one until it is killed)"
    )

    # Device and memory
    device: str = opt("auto", "Where the model runs", choices=("auto", "cpu", "cuda"))
    mem_fraction_static: float = opt(0.85, "CUDA: fraction of GPU memory for weights + KV cache")
    max_total_tokens: Optional[int] = opt(
        None,
        "KV pool size in tokens (CPU default: what fits in 2 GiB, at most 65536; CUDA default: from --mem-fraction-static)",
    )
    max_running_requests: int = opt(64, "Most requests in the running batch")
    max_queued_requests: int = opt(1024, "Most waiting requests before new ones get 503")
    page_size: int = opt(1, "KV cache page size in tokens")
    chunked_prefill_size: int = opt(2048, "Most prompt tokens computed in one extend step (-1 disables chunking)")
    max_prefill_tokens: int = opt(8192, "Most new tokens in one prefill batch")
    decode_interleave: int = opt(
        0,
        "While requests are decoding, at most this many extend (prefill) steps run in a row before one decode "
        "step (0: an extend whenever a waiting request fits, decode waits; 1 bounds a running request's token "
        "gap to about one --chunked-prefill-size step; docs/architecture.md)",
    )
    enable_mixed_chunk: bool = opt(
        False,
        "Running requests decode inside each extend (prefill) step: one new token each, beside the prompt chunk, "
        "so a long prefill no longer stalls them (a unified worker without speculative decoding or pipeline "
        "stages; requests with a grammar, penalties or a seed decode in their own steps; docs/architecture.md)",
    )
    disable_radix_cache: bool = opt(False, "Disable prefix caching")
    hicache_size_gb: float = opt(
        0.0,
        "Host-memory KV tier in GiB (pinned on CUDA): prefix pages evicted from the GPU pool move there and a "
        "prefix hit on them is loaded back (0: off; docs/cache.md)",
    )
    enable_kv_events: bool = opt(
        False,
        "Publish the prefix cache's stored/removed pages (hash chain, tier) at /kv_events and "
        "/kv_events/snapshot (worker key; docs/cache.md)",
    )
    hicache_ratio: float = opt(
        0.0, "Host-memory KV tier as a multiple of the GPU KV pool's tokens (0: off; or use --hicache-size-gb)"
    )
    hicache_write_policy: str = opt(
        "write_back",
        "Host KV tier: write_back copies a page to host memory when it is evicted from the GPU pool; "
        "write_through copies it when it is cached (a later GPU eviction is free; host copies of everything "
        "cached). Needs --hicache-size-gb / --hicache-ratio (docs/cache.md)",
        choices=("write_back", "write_through"),
    )
    hicache_io_backend: str = opt(
        "auto",
        "Host KV tier copies: kernel (one page-gather kernel per layer reads / writes the pinned host pool in "
        "place; no copy thread), dma (the same copies by the GPU's copy engines, one batched call per layer; no "
        "SMs taken, but driver time per run of consecutive pages: for pools whose pages come in long runs; CUDA "
        "runtime >= 12.8), copy (a copy thread gathers on the host and copies through a staging "
        "buffer); auto = kernel on CUDA, copy elsewhere (docs/cache.md)",
        choices=("auto", "kernel", "dma", "copy"),
    )
    hicache_storage: str = opt(
        "none",
        "Shared KV tier: pages evicted from the last local tier are written to it and a prefix match that goes "
        "past the local tiers reads them back, on any worker of the same model (docs/cache.md)",
        choices=("none", "file", "mooncake"),
    )
    hicache_storage_path: Optional[str] = opt(None, "--hicache-storage file: the directory (a shared volume)")
    hicache_storage_master: Optional[str] = opt(
        None, "--hicache-storage mooncake: the mooncake_master RPC address HOST:PORT"
    )
    hicache_storage_metadata: Optional[str] = opt(
        None,
        "--hicache-storage mooncake: the metadata service URL (default: http://<master host>:8080/metadata, the "
        "master's --enable_http_metadata_server)",
    )
    hicache_storage_size_gb: float = opt(
        4.0,
        "--hicache-storage: file: the directory's size cap in GiB (oldest pages deleted first); mooncake: the "
        "memory this worker contributes to the store",
    )
    hicache_storage_bandwidth_mb: float = opt(
        0.0, "--hicache-storage: MiB/s cap on reads and (separately) writes; over it pages are recomputed (0: no cap)"
    )
    hicache_storage_prefetch_mb: float = opt(
        256.0,
        "--hicache-storage: MiB of host memory for pages read ahead from the store while their requests wait "
        "(0: read at admission only)",
    )
    schedule_policy: str = opt(
        "lpm", "Waiting-queue order: lpm = longest prefix match first, fcfs", choices=("lpm", "fcfs")
    )

    # Parallelism
    tp_size: int = opt(1, "Tensor-parallel size: rank processes this worker spans (one GPU each on CUDA; gloo on CPU)")
    pp_size: int = opt(
        1,
        "Pipeline-parallel size: the model's layers split into this many stages, each --tp-size ranks wide "
        '(world = tp x pp rank processes; docs/parallel.md, "Pipeline parallelism")',
    )
    pp_layer_partition: Optional[str] = opt(
        None,
        "Layers per pipeline stage as a,b,... (one count per stage, summing to the model's layers; "
        "default: an even split, the first stages taking the remainder)",
    )
    base_gpu_id: int = opt(
        0, "CUDA: the node's first GPU (the rank of local index r on a node runs on cuda:<base + r>)"
    )
    dist_timeout: float = opt(
        300.0, "Seconds a tensor-parallel collective waits for a rank before the worker gives up and exits"
    )
    nnodes: int = opt(1, "Nodes (hosts) this worker's ranks span; every node runs `kvship serve` with its --node-rank")
    node_rank: int = opt(0, "This node's index in 0..--nnodes-1; node 0 serves HTTP, the others run ranks only")
    dist_init_addr: Optional[str] = opt(
        None,
        "host:port of node 0's rendezvous (torch.distributed TCP store), reachable from every node; "
        "needed with --nnodes > 1 (one node: a free local port)",
    )
    dist_init_timeout: float = opt(
        60.0, "Seconds a node other than 0 waits for --dist-init-addr to accept a connection before it exits"
    )
    ep_size: int = opt(
        1,
        "Expert parallelism (MoE models): split each MoE layer's experts N ways over the --tp-size ranks "
        "(N divides --tp-size; each expert's width is split the remaining tp/N ways)",
    )
    ep_dispatch: str = opt(
        "all_reduce",
        "How a MoE layer of a --tp-size > 1 worker combines its ranks' experts: all_reduce (CUDA-graph safe), "
        "static (tokens sent to their experts' ranks in fixed-capacity buffers, counts on the device: CUDA-graph "
        "safe) or all_to_all (host-read counts; graphs all-reduce); static and all_to_all need --ep-size = --tp-size",
        choices=("all_reduce", "static", "all_to_all"),
    )
    enable_two_batch_overlap: bool = opt(
        False,
        "MoE layers of an --ep-size > 1 worker split a step's tokens in two micro-batches and overlap one's "
        "communication with the other's expert compute (eager steps; --ep-dispatch all_reduce or static)",
    )
    ep_num_redundant_experts: int = opt(
        0,
        'EPLB (docs/parallel.md, "Expert load balancing"): R extra expert slots per MoE layer holding copies of '
        "hot experts; E + R must divide by --ep-size (needs --ep-size = --tp-size > 1)",
    )
    eplb_rebalance_interval: int = opt(
        0,
        "EPLB: every N forward steps recompute the placement from the expert load and move weights between "
        "ranks (0: the initial placement only)",
    )

    # Speculative decoding (decode/spec; unified and decode workers)
    speculative_algorithm: Optional[str] = opt(
        None,
        "Speculative decoding: eagle / eagle3 (an EAGLE draft head), ngram (prompt lookup, no extra model) or "
        "draft (a smaller model); default off",
        choices=(None, "eagle", "eagle3", "ngram", "draft"),
    )
    speculative_draft_model_path: Optional[str] = opt(
        None, "The draft model (draft) or EAGLE head checkpoint folder (eagle, eagle3)"
    )
    speculative_num_steps: Optional[int] = opt(
        None, "Draft depth: EAGLE draft forwards per round (default 5) or the draft model's chain length (default 4)"
    )
    speculative_num_draft_tokens: Optional[int] = opt(
        None,
        "Draft tokens verified per round (ngram default 8, draft = steps); eagle/eagle3 count the root as "
        "SGLang does (default 8 = root + 7 drafts; steps + 1 with topk 1)",
    )
    speculative_eagle_topk: Optional[int] = opt(
        None, "Branches per draft node (eagle default 4; ngram default 1: a chain; draft: 1)"
    )

    # Kernels
    attention_backend: str = opt(
        "auto",
        "Attention backend (auto, on CUDA: flashinfer when installed and the model's head_dim is one of "
        f"{'/'.join(map(str, FLASHINFER_HEAD_DIMS))} (the only ones flashinfer takes), else triton; triton for "
        "DeepSeek (MLA) models; torch_native elsewhere)",
        choices=("auto",) + ATTENTION_BACKENDS,
    )
    sampling_backend: str = opt("auto", "Sampling kernels", choices=("auto", "torch", "flashinfer"))
    disable_cuda_graph: bool = opt(False, "Run decode eagerly (no CUDA graphs)")
    cuda_graph_max_bs: int = opt(160, "Largest decode batch captured in a CUDA graph")
    cuda_graph_bs: list[int] = opt(
        [], "Decode batch sizes to capture (default: 1,2,4,8,16,24,32,... up to --cuda-graph-max-bs)"
    )
    prefill_graph_max_tokens: int = opt(
        2048,
        "CUDA: prefill forwards of up to this many tokens replay piecewise CUDA graphs (all but attention; "
        'docs/gpu.md, "Prefill graphs"); 0 = eager',
    )
    disable_overlap_schedule: bool = opt(False, "Do not overlap CPU scheduling with GPU work")
    enable_step_timing: bool = opt(
        False,
        "Time the scheduler's steps by phase (host seconds of recv / schedule / launch / sample / process / flush / "
        "end_step, recv including its idle wait) and report the totals in /get_server_info (step_phase_s, "
        "step_phase_calls) and /metrics (kvship:scheduler_phase_seconds_total); docs/observability.md",
    )
    num_threads: Optional[int] = opt(None, "CPU: torch intra-op threads (default: torch's choice)")

    # Role
    mode: str = opt("unified", "Worker role", choices=("unified", "prefill", "decode"))
    revision: Optional[str] = opt(
        None,
        "Revision this worker reports in /get_server_info (the router pairs PD workers within one revision; "
        "docs/router.md); default: the worker's model fingerprint",
    )
    disaggregation_bootstrap_port: int = opt(8998, "Prefill: port of the bootstrap endpoint")
    disaggregation_transfer_backend: str = opt("tcp", "KV transfer backend", choices=TRANSFER_BACKENDS)
    disaggregation_ib_device: Optional[str] = opt(None, "RDMA device(s) for mooncake, e.g. mlx5_0")
    disaggregation_bootstrap_timeout: float = opt(300.0, "Seconds a request may wait for its peer to bootstrap")
    disaggregation_waiting_timeout: float = opt(300.0, "Seconds decode waits for KV once bootstrapped")
    disaggregation_prefill_wait_for_room: bool = opt(
        False,
        "Prefill: compute a prompt only once decode registered its room (no prefill compute or KV for rooms "
        "decode cannot take yet; adds decode's registration to the time to first token)",
    )
    disaggregation_layerwise: bool = opt(
        True,
        "Prefill: when decode registered the room before a prompt's last chunk computes, write each layer's KV "
        "while later layers compute (docs/pd.md, 'Layer-wise transfer'); off: the whole prompt after the forward",
    )
    disaggregation_layerwise_min_tokens: int = opt(
        256,
        "Prefill: prompts shorter than this send their KV whole after the forward, not layer-wise (a short "
        "forward gains less from the early layers than the per-layer sends cost it; docs/pd.md)",
    )
    disaggregation_layerwise_writes: int = opt(
        4,
        "Prefill: a layer-wise send writes the layers in about this many groups (0 = one write per stored layer)",
    )
    kv_transfer_checksum: bool = opt(False, "Checksum each request's KV on prefill and verify on decode")
    kv_transfer_secret_file: Optional[str] = opt(
        None,
        "Prefill/decode: file holding the KV transfer secret shared by the service's prefill and decode workers "
        "(>= 16 bytes; else env KVSHIP_KV_TRANSFER_SECRET); docs/pd.md, KV plane authentication",
    )
    kv_transfer_insecure: bool = opt(
        False,
        "Turns KV-plane authentication off; for measurement and trusted single-host setups only (both workers of "
        "a pair must agree)",
    )

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except Exception:  # pragma: no cover - torch is a dependency
            return "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device == "cuda" else "float32"

    @property
    def resolved_kv_dtype(self) -> str:
        return self.resolved_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_attention_backend(self, head_dim: int) -> str:
        """The backend ``--attention-backend`` names for a (non-MLA) model of ``head_dim``: the flag itself
        unless it is ``auto`` (``kvship.engine.attention.backend_choice.auto_attention_backend``: FlashInfer
        only for the head dims its kernels take)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        import importlib.util

        device = self.resolved_device
        return auto_attention_backend(
            device,
            head_dim,
            flashinfer_available=device == "cuda" and importlib.util.find_spec("flashinfer") is not None,
            triton_available=device == "cuda" and importlib.util.find_spec("triton") is not None,
        )

    @property
    def speculative_shape(self) -> tuple[int, int, int]:
        """(steps, topk, draft nodes per round below the root) of ``--speculative-algorithm``.

        Defaults (docs/speculative.md): eagle / eagle3 5 steps, top-4, 8 verified tokens counting
        the root (SGLang's convention; with top-1 the default is steps + 1); draft a chain of
        ``steps`` (4) tokens; ngram 8 tokens, a chain.  Raises ``ValueError`` on a combination that
        cannot be drafted.
        """
        algo = self.speculative_algorithm
        steps, topk, tokens = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if algo in ("eagle", "eagle3"):
            steps = 5 if steps is None else steps
            topk = (
                (1 if tokens is not None and steps is not None and tokens == steps + 1 else 4) if topk is None else topk
            )
            if tokens is None:
                tokens = steps + 1 if topk == 1 else 8
            if tokens < 2:
                raise ValueError(
                    f"--speculative-algorithm {algo}: --speculative-num-draft-tokens counts the root, need >= 2"
                )
            reachable = topk + (steps - 1) * topk * topk  # candidates a draft of steps x topk offers
            if tokens - 1 > reachable:
                raise ValueError(
                    f"--speculative-algorithm {algo}: {tokens} draft tokens (root included) need more than the "
                    f"{reachable} candidates of {steps} steps x top-{topk}; lower --speculative-num-draft-tokens "
                    "or raise --speculative-num-steps / --speculative-eagle-topk"
                )
            return steps, topk, tokens - 1
        if algo == "draft":
            if topk not in (None, 1):
                raise ValueError("--speculative-algorithm draft drafts a chain: --speculative-eagle-topk must be 1")
            n = tokens if tokens is not None else (steps if steps is not None else 4)
            if steps is not None and steps != n:
                raise ValueError(
                    "--speculative-algorithm draft drafts a chain: --speculative-num-steps and "
                    "--speculative-num-draft-tokens must agree"
                )
            return n, 1, n
        if algo == "ngram":
            if steps is not None:
                raise ValueError("--speculative-num-steps goes with eagle, eagle3 or draft (ngram looks drafts up)")
            n = 8 if tokens is None else tokens
            return n, 1 if topk is None else topk, n
        raise ValueError(f"unknown --speculative-algorithm {algo!r}")

    @property
    def resolved_pp_layer_partition(self) -> Optional[tuple[int, ...]]:
        """``--pp-layer-partition`` as layer counts, one per stage (None: the even split); ValueError when it is
        not ``--pp-size`` positive integers (whether they sum to the model's layers is checked at load)."""
        if self.pp_layer_partition is None:
            return None
        try:
            counts = tuple(int(x) for x in self.pp_layer_partition.split(","))
        except ValueError:
            raise ValueError(
                f"--pp-layer-partition must be comma-separated layer counts, got '{self.pp_layer_partition}'"
            ) from None
        if len(counts) != self.pp_size or min(counts) < 1:
            raise ValueError(
                f"--pp-layer-partition {self.pp_layer_partition} must give {self.pp_size} positive layer counts "
                f"(one per --pp-size stage)"
            )
        return counts

    @property
    def resolved_cuda_graph_bs(self) -> list[int]:
        if self.cuda_graph_bs:
            return sorted(set(b for b in self.cuda_graph_bs if b <= self.cuda_graph_max_bs))
        sizes = [1, 2, 4, 8] + list(range(16, 257, 8))
        return [b for b in sizes if b <= self.cuda_graph_max_bs]

    def validate(self) -> None:
        """Raise ValueError with a clear message for inconsistent settings."""
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.decode_interleave < 0:
            raise ValueError(f"--decode-interleave must be >= 0, got {self.decode_interleave}")
        if self.enable_mixed_chunk:  # decode rows ride in a unified worker's own extend steps only
            other = [
                name
                for name, on in (
                    (f"--mode {self.mode}", self.mode != "unified"),
                    ("--speculative-algorithm", bool(self.speculative_algorithm)),
                    (f"--pp-size {self.pp_size}", self.pp_size > 1),
                )
                if on
            ]
            if other:
                raise ValueError(
                    f"--enable-mixed-chunk works on a unified worker without speculative decoding or pipeline "
                    f"stages; this one has {', '.join(other)}"
                )
        if not 0.0 <= self.otlp_traces_sample_ratio <= 1.0:
            raise ValueError("--otlp-traces-sample-ratio must be in [0, 1]")
        if self.otlp_traces_endpoint:
            from kvship.common.trace_export import otlp_target

            otlp_target(self.otlp_traces_endpoint)  # ValueError naming the flag: http(s):// or grpc(s):// only
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0 seconds")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.disaggregation_layerwise_writes < 0:
            raise ValueError("--disaggregation-layerwise-writes must be >= 0")
        if self.disaggregation_layerwise_min_tokens < 0:
            raise ValueError("--disaggregation-layerwise-min-tokens must be >= 0")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError("--prefill-graph-max-tokens must be >= 0 (0: prefill runs eagerly)")
        if self.hicache_size_gb < 0 or self.hicache_ratio < 0:
            raise ValueError("--hicache-size-gb and --hicache-ratio must be >= 0")
        if self.hicache_size_gb and self.hicache_ratio:
            raise ValueError("give --hicache-size-gb or --hicache-ratio, not both")
        if (self.hicache_size_gb or self.hicache_ratio) and self.disable_radix_cache:
            raise ValueError("the host KV tier (--hicache-size-gb / --hicache-ratio) needs the radix cache")
        if self.hicache_write_policy not in ("write_back", "write_through"):
            raise ValueError(
                f"--hicache-write-policy must be write_back or write_through, not {self.hicache_write_policy!r}"
            )
        if self.hicache_write_policy == "write_through" and not (self.hicache_size_gb or self.hicache_ratio):
            raise ValueError(
                "--hicache-write-policy write_through needs the host KV tier (--hicache-size-gb or --hicache-ratio)"
            )
        if self.hicache_storage != "none":
            if self.disable_radix_cache:
                raise ValueError("--hicache-storage needs the radix cache")
            if self.hicache_storage == "file" and not self.hicache_storage_path:
                raise ValueError("--hicache-storage file needs --hicache-storage-path (a directory)")
            if self.hicache_storage == "mooncake" and not self.hicache_storage_master:
                raise ValueError("--hicache-storage mooncake needs --hicache-storage-master HOST:PORT")
            if self.hicache_storage_size_gb <= 0 or self.hicache_storage_bandwidth_mb < 0:
                raise ValueError("--hicache-storage-size-gb must be > 0 and --hicache-storage-bandwidth-mb >= 0")
            if self.hicache_storage_prefetch_mb < 0:
                raise ValueError("--hicache-storage-prefetch-mb must be >= 0 (0: no read-ahead)")
        if self.enable_kv_events and self.disable_radix_cache:
            raise ValueError("--enable-kv-events needs the radix cache (it publishes what the cache holds)")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be -1 or >= --page-size")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("--context-length must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(
                f"--ep-size {self.ep_size} must divide --tp-size ({self.tp_size}): "
                "experts are split over the tensor-parallel ranks"
            )
        if self.enable_two_batch_overlap and self.ep_dispatch == "all_to_all":
            raise ValueError("--enable-two-batch-overlap works with --ep-dispatch all_reduce or static")
        if self.ep_num_redundant_experts < 0 or self.eplb_rebalance_interval < 0:
            raise ValueError("--ep-num-redundant-experts and --eplb-rebalance-interval must be >= 0")
        if self.ep_num_redundant_experts and not (self.ep_size > 1 and self.ep_size == self.tp_size):
            raise ValueError(
                f"--ep-num-redundant-experts needs --ep-size equal to --tp-size and > 1 "
                f"(got --ep-size {self.ep_size}, --tp-size {self.tp_size})"
            )
        if self.pp_size < 1:
            raise ValueError("--pp-size must be >= 1")
        self.resolved_pp_layer_partition  # raises on a malformed --pp-layer-partition
        if self.pp_size > 1 and self.mode == "decode":
            raise ValueError(
                f"--pp-size {self.pp_size} runs in --mode unified or prefill: a pipeline-parallel decode worker is "
                'not built yet (a PP prefill feeds a TP decode; docs/parallel.md, "PD with pipeline parallelism")'
            )
        if self.pp_size > 1 and self.speculative_algorithm not in (None, "ngram"):
            raise ValueError(f"{PP_SPEC_ALGORITHMS_LINE}, got --speculative-algorithm {self.speculative_algorithm}")
        if self.speculative_algorithm is None and (
            self.speculative_num_draft_tokens is not None
            or self.speculative_eagle_topk is not None
            or self.speculative_num_steps is not None
        ):
            raise ValueError(
                "--speculative-num-steps / --speculative-num-draft-tokens / --speculative-eagle-topk "
                "need --speculative-algorithm"
            )
        if self.speculative_num_draft_tokens is not None and not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError("--speculative-num-draft-tokens must be in 1..64")
        if self.speculative_eagle_topk is not None and not 1 <= self.speculative_eagle_topk <= 8:
            raise ValueError("--speculative-eagle-topk must be in 1..8")
        if self.speculative_num_steps is not None and not 1 <= self.speculative_num_steps <= 16:
            raise ValueError("--speculative-num-steps must be in 1..16")
        needs_model = self.speculative_algorithm in ("draft", "eagle", "eagle3")
        if (self.speculative_draft_model_path is not None) != needs_model:
            raise ValueError(
                "--speculative-draft-model-path goes with --speculative-algorithm draft, eagle or eagle3 "
                "(and only with them)"
            )
        if self.speculative_algorithm is not None:
            self.speculative_shape  # raises on an inconsistent steps / topk / draft-token combination
        # a prefill worker never drafts: it computes the prompt's EAGLE features (docs/speculative.md, "PD"),
        # and its page size must match the decode worker's anyway; any --tp-size drafts ("Tensor parallelism")
        drafts = self.speculative_algorithm is not None and self.mode != "prefill"
        if drafts and self.page_size != 1:
            raise ValueError("speculative decoding needs --page-size 1 (accepted draft slots are remapped one by one)")

        if self.max_chat_template_output_chars < 1 or self.chat_template_timeout <= 0:
            raise ValueError("--max-chat-template-output-chars must be >= 1 and --chat-template-timeout > 0")
        if self.max_grammar_bytes < 1 or self.max_schema_depth < 1:
            raise ValueError("--max-grammar-bytes and --max-schema-depth must be >= 1")
        if self.grammar_compile_timeout <= 0 or self.grammar_compile_processes < 1:
            raise ValueError("--grammar-compile-timeout must be > 0 and --grammar-compile-processes >= 1")
        if self.base_gpu_id < 0:
            raise ValueError("--base-gpu-id must be >= 0")
        if self.dist_timeout <= 0 or self.dist_init_timeout <= 0:
            raise ValueError("--dist-timeout and --dist-init-timeout must be > 0")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return dataclass_from_namespace(cls, ns)
